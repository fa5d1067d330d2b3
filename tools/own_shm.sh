#!/bin/sh
# Run "$@" in a new mount namespace with its own /dev/shm (an empty 8 GB tmpfs), so that
# the POSIX shared memory it and its children make (Mosaic Streaming's) is theirs alone and
# goes with them. Root only. `make test` runs the DBR suite this way beside the local one.
exec unshare --mount --propagation private \
    sh -c 'mount -t tmpfs -o size=8g tmpfs /dev/shm && exec "$@"' own_shm "$@"
