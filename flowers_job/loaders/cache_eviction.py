"""The loader cache bounded: when a run's entries are ready, entries are evicted least-recently-used
first while the cache holds more than ``cache.max_bytes``, except this run's and any that a live
driver reads (its lease in ``users/``). A reader writes its lease before it reads the marker; the
evictor removes the marker, looks at the leases again, and puts the marker back if a reader came
meanwhile, so an entry is never removed under a reader (on either store). A writer's folder whose
driver is dead (killed with SIGKILL, say) is swept at the next start
(:func:`sweep_orphaned_caches`), with what each loader left on this host
(:meth:`~flowers_job.loaders.base.Loader.sweep`). Before a split is written to a disk, its free
space is checked against the split's size (:func:`check_cache_space`).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

from flowers_job.loaders.cache_marker import (
    ENTRIES,
    ENTRY_FILE,
    entry_info,
    entry_segments,
    read_json,
    referenced_segments,
)
from flowers_job.loaders.cache_sweep import owner_alive
from flowers_job.location import Location

__all__ = ["LAST_USED", "USERS", "evict", "remove_entry", "users_alive"]

log = logging.getLogger(__name__)

LAST_USED = "last_used"
USERS = "users"


def users_alive(entry: Location, skip: str) -> list[str]:
    """The runs other than ``skip`` whose drivers read ``entry`` and still run
    (:func:`~flowers_job.loaders.cache_sweep.owner_alive`); the leases of dead ones are removed."""
    alive = []
    for f in (entry / USERS).glob("*.json"):
        name = f.name.removesuffix(".json")
        if name == skip:
            continue
        owner = read_json(f)
        if not isinstance(owner, dict):
            continue
        if owner_alive(owner):
            alive.append(name)
        else:
            with contextlib.suppress(OSError):
                f.unlink()  # a reader that died: it no longer holds the entry
    return alive


def remove_entry(entry: Location, info: dict[str, Any], run_id: str) -> bool:
    """Unpublish ``entry`` (its marker first, so that it is never read half removed), then
    delete the data folders of its segments that no other published marker reads (an entry
    that grew from it keeps reading them); unless a reader leased it meanwhile: then the
    marker is put back. A concurrent writer's folder is its own and is never removed here.

    Returns:
        Whether the entry was removed.
    """
    marker = entry / ENTRY_FILE
    try:
        saved = marker.read_bytes()
        marker.unlink()
    except OSError:
        return False
    if users_alive(entry, run_id):  # a reader leased it between our look and the unlink
        marker.create_bytes(saved)
        return False
    if info.get("data") is None:  # layout 2: the whole folder was the entry
        with contextlib.suppress(OSError):
            entry.rmtree()
        return True
    root = entry.parent.parent
    still = referenced_segments(root)
    for owner, data in entry_segments(info):
        if (owner, data) not in still:
            with contextlib.suppress(OSError):
                (root / ENTRIES / owner / data).rmtree()
    with contextlib.suppress(OSError):
        (entry / LAST_USED).unlink(missing_ok=True)
    if entry.is_local:
        for leftover in (entry / USERS, entry):
            with contextlib.suppress(OSError):
                leftover.local_path.rmdir()  # empty unless a writer is at work
    return True


def evict(root: Location | Path | str, max_bytes: int, keep: set[str], run_id: str) -> list[str]:
    """Evict entries under ``root`` least-recently-used first until they hold at most
    ``max_bytes``; never those named in ``keep`` nor those a live driver reads.

    Returns:
        The names of the entries removed.
    """
    root = Location.of(root)
    entries = []
    for entry in (root / ENTRIES).iterdir():
        info = entry_info(entry)
        if info is None:
            continue
        try:
            used = (entry / LAST_USED).mtime()
        except OSError:
            used = 0.0
        entries.append((used, entry, info, int(info.get("bytes", 0))))
    total = sum(e[3] for e in entries)
    removed = []
    for _, entry, info, size in sorted(entries, key=lambda e: e[0]):
        if total <= max_bytes:
            break
        if entry.name in keep or users_alive(entry, run_id):
            continue
        log.info(
            "evicting loader cache entry %s (%.1f MiB, least recently used): the cache holds "
            "%.1f MiB, more than cache.max_bytes=%d",
            entry.name,
            size / 2**20,
            total / 2**20,
            max_bytes,
        )
        if remove_entry(entry, info, run_id):
            total -= size
            removed.append(entry.name)
    return removed
