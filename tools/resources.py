"""Memory and disk headroom of a CI run: the lowest available memory and free disk seen.

``.ci/run`` starts ``watch`` in the background and prints ``report`` at the end, so that a
run that fails for want of memory or disk says so (tests that fail together in both suites
at once, a package build that stops half way) instead of leaving it to be guessed.

    python3 tools/resources.py watch LOG PATH [PATH ...]   # every 5 s until killed
    python3 tools/resources.py report LOG

``watch`` appends one line per sample: seconds since start, ``MemAvailable`` (bytes, from
``/proc/meminfo``), then free bytes of each PATH's file system (``shutil.disk_usage``).
Paths on the same file system are sampled once.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

INTERVAL = 5.0
"""Seconds between samples."""
GIB = 1024**3


def _mem_available() -> int:
    """``MemAvailable`` of ``/proc/meminfo``, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def watch(log: Path, paths: list[str]) -> None:
    """Sample every ``INTERVAL`` seconds into ``log`` until killed."""
    seen: set[int] = set()
    mounts = []
    for path in paths:
        if os.path.exists(path) and os.stat(path).st_dev not in seen:
            seen.add(os.stat(path).st_dev)
            mounts.append(path)
    start = time.monotonic()
    with log.open("a", encoding="utf-8") as out:
        out.write("# seconds mem_available " + " ".join(mounts) + "\n")
        while True:
            free = [shutil.disk_usage(p).free for p in mounts]
            fields = [f"{time.monotonic() - start:.0f}", str(_mem_available()), *map(str, free)]
            out.write(" ".join(fields) + "\n")
            out.flush()
            time.sleep(INTERVAL)


def report(log: Path) -> None:
    """Print the lowest available memory and the lowest free disk of each file system, with
    when they were seen, and the values at the start."""
    lines = log.read_text(encoding="utf-8").splitlines()
    if len(lines) < 2:
        print("resources: no samples")
        return
    names = ["memory available", *(f"free disk on {p}" for p in lines[0].split()[3:])]
    rows = [[int(float(x)) for x in line.split()] for line in lines[1:] if line.strip()]
    for i, name in enumerate(names, start=1):
        low = min(rows, key=lambda r: r[i])
        print(
            f"resources: {name}: lowest {low[i] / GIB:.1f} GiB at {low[0]} s "
            f"(at the start {rows[0][i] / GIB:.1f} GiB; {len(rows)} samples)"
        )


def main(argv: list[str]) -> None:
    if len(argv) >= 3 and argv[1] == "watch":
        watch(Path(argv[2]), argv[3:])
    elif len(argv) == 3 and argv[1] == "report":
        report(Path(argv[2]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
