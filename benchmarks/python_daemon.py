"""Warm Python workers: a Python stage after Spark's idle-worker cleanup, with PySpark's own
daemon against :mod:`flowers_job.cluster.python_daemon`.

Spark kills a Python worker idle for a minute; the next Python stage forks new ones from
the executor's daemon. Each variant runs in its own ``local[2]`` session: a stage of 2
``mapInPandas`` tasks whose function imports ``streaming.base.converters`` (what Mosaic
Streaming's ``dataframe_to_mds`` function imports when it is unpickled in a worker), then
``--idle`` seconds with nothing to do (past the cleanup), then the stage again, ``--repeats``
times. Reported per variant: each stage's wall time (seconds) and its workers' pids (new
pids: the workers were forked again), and the ratio of the median stage after the idle
time, ``preload / plain``.

Then the daemon's own start (``daemon_start``): what it imports before it forks, in a fresh
Python process per try, the two ways in turns, ``--repeats`` + 1 times each: ``plain``
imports every module of ``PRELOAD`` with ``importlib`` (Streaming with its example datasets,
which bring in transformers and scikit-learn), ``job`` is the daemon's ``preload()``
and ``preload_loaders()`` (Streaming through ``import_streaming``). Reported: each try's seconds and peak resident
memory (MiB), the medians, and the ratio ``job / plain`` of the median seconds. Run from the
repository root:

    .venv/bin/python benchmarks/python_daemon.py --output /tmp/bench-daemon.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

DAEMON = "flowers_job.cluster.python_daemon"


def first_import(batches: Any) -> Any:
    """A task that imports what ``dataframe_to_mds``'s function does, then returns its pid."""
    import os

    import streaming.base.converters  # noqa: F401

    for batch in batches:
        yield batch.assign(pid=os.getpid())


def run(variant: str, idle: float, repeats: int) -> dict[str, Any]:
    """Stages of one ``local[2]`` session, ``variant`` ``plain`` or ``preload``."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
    builder = builder.config("spark.ui.showConsoleProgress", "false")
    if variant == "preload":
        builder = builder.config("spark.python.daemon.module", DAEMON)
    spark = builder.getOrCreate()
    try:
        df = spark.range(4).repartition(2)
        stages: list[dict[str, Any]] = []
        seconds: list[float] = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            pids = sorted(
                {r.pid for r in df.mapInPandas(first_import, "id long, pid long").collect()}
            )
            seconds.append(round(time.perf_counter() - t0, 2))
            stages.append({"seconds": seconds[-1], "pids": pids})
            print(variant, i, stages[-1], flush=True)
            if i < repeats:
                time.sleep(idle)
    finally:
        spark.stop()
    return {
        "stages": stages,
        "after_idle_median_s": statistics.median(seconds[1:]),
    }


PRELOAD_WAYS = {
    "plain": "import importlib\n"
    "from flowers_job.cluster.python_daemon import PRELOAD\n"
    "for name in (*PRELOAD, 'streaming.base.converters'): importlib.import_module(name)",
    "job": "from flowers_job.cluster.python_daemon import preload, preload_loaders\n"
    "preload()\npreload_loaders()",
}
"""What each way of ``daemon_start`` runs, after the clock starts."""


def daemon_start(repeats: int) -> dict[str, Any]:
    """The daemon's imports each way (module docstring), in fresh processes, in turns."""
    import subprocess

    timed = (
        "import resource, sys, time\nt0 = time.perf_counter()\n{code}\n"
        "print(time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    tries: dict[str, list[dict[str, float]]] = {way: [] for way in PRELOAD_WAYS}
    for i in range(repeats + 1):
        for way, code in PRELOAD_WAYS.items():
            out = subprocess.run(
                [sys.executable, "-c", timed.format(code=code)],
                capture_output=True,
                text=True,
                check=True,
                timeout=600,
            ).stdout.split()
            tries[way].append(
                {"seconds": round(float(out[-2]), 2), "peak_mib": int(out[-1]) // 1024}
            )
            print("daemon start", way, i, tries[way][-1], flush=True)
    report: dict[str, Any] = {
        way: {
            "tries": t,
            "median_s": statistics.median(x["seconds"] for x in t),
            "median_peak_mib": statistics.median(x["peak_mib"] for x in t),
        }
        for way, t in tries.items()
    }
    report["ratio_job_over_plain"] = round(
        report["job"]["median_s"] / report["plain"]["median_s"], 3
    )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--idle", type=float, default=75.0, help="seconds between stages")
    parser.add_argument("--repeats", type=int, default=2, help="stages after the first")
    parser.add_argument("--output", type=Path)
    parser.add_argument(
        "--daemon-start-only", action="store_true", help="only the daemon's imports, no Spark"
    )
    args = parser.parse_args()
    report: dict[str, Any] = {}
    if not args.daemon_start_only:
        report = {v: run(v, args.idle, args.repeats) for v in ("plain", "preload")}
        report["ratio_preload_over_plain"] = round(
            report["preload"]["after_idle_median_s"] / report["plain"]["after_idle_median_s"], 3
        )
    report["daemon_start"] = daemon_start(args.repeats)
    print(json.dumps(report, indent=2))
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
