"""The benchmarks' common ending: print the results as one JSON line, and keep them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(report: dict[str, Any], path: Path | None) -> None:
    """Print ``report`` as one JSON line and, with ``path``, write it there indented
    (parent folders created)."""
    print(json.dumps(report))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), which every number of a benchmark names:
    machines of one kind differ up to 3x from one session to the next."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def machine_facts(*packages: str) -> dict[str, Any]:
    """Date, the CPU's model name, usable cores, load averages at the start, the Python
    version and the installed versions of ``packages``, for a benchmark's JSON."""
    import datetime as dt
    import os
    import sys
    from importlib import metadata

    return {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "nproc": len(os.sched_getaffinity(0)),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": sys.version.split()[0],
        **{name: metadata.version(name) for name in packages},
    }
