"""Launch overhead: TorchDistributor's start-up against plain torchrun, same function.

Every ``TorchDistributor.run`` pays a fixed cost before the first training step and after
the last: it pickles the function, starts ``torchrun``, which starts the ranks, each of which
imports torch and joins the process group, and (barrier mode) runs all that inside a Spark
barrier stage. A short job (a few epochs of a frozen backbone) pays it once per run, so it
matters next to minutes of training. This measures it with a function that does nothing
else: :func:`noop_train` joins a gloo process group, passes one barrier, leaves the group and
returns the world size. Each launcher starts 2 processes on this machine:

- ``local``: ``TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
  .run(noop_train)``: torchrun started from the driver;
- ``barrier``: the same with ``local_mode=False``: one rank per task of a Spark barrier
  stage, on the ``local[2]`` master (2 task slots);
- ``torchrun``: ``python -m torch.distributed.run --standalone --nproc-per-node=2`` of this
  file with ``--worker`` (which calls the same :func:`noop_train`), no Spark;
- ``single``: one process, no launcher: Python start + ``import torch`` +
  ``init_process_group`` (world size 1) + barrier + ``destroy_process_group``: the part of
  every rank's start that no launcher can remove.

The wall time of each is taken from the call to its return. One untimed warm-up call of
each comes first (so that no launcher pays for the first import of torch from a cold page
cache, or the first Python worker of Spark); then the launchers take turns ``--repeats``
times (``local``, ``barrier``, ``torchrun``, ``single``, ``local``, ...) so that drift in the
machine's load falls on all. Reported: median and min of each (seconds), the ratios
``local / torchrun`` and ``barrier / torchrun`` and the overheads ``local - torchrun`` and
``barrier - torchrun`` (of the medians, seconds), and, apart, the SparkSession's start
(``get_spark("launch_overhead", master="local[2]")``, Delta enabled). Run from the
repository root:

    .venv/bin/python benchmarks/launch_overhead.py --output /tmp/bench-launch.json
    # quicker: --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import machine_facts  # noqa: E402

WORLD_SIZE = 2  # processes each launcher starts (the machine has 2 cores, local[2] 2 slots)
PG_TIMEOUT_SECONDS = 120  # init_process_group and barrier limit in noop_train, seconds
LAUNCH_TIMEOUT_SECONDS = 300  # limit on one torchrun/single subprocess, seconds
LAUNCHERS = ("local", "barrier", "torchrun", "single")


def noop_train() -> int:
    """The training function: join the gloo group, one barrier, leave; returns the world size
    (the same on every rank: TorchDistributor's local mode returns whichever rank's value was
    written last: docs/known-issues.md, "Spark").

    Reads the rendezvous from the environment that torchrun sets (``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``); waits at most ``PG_TIMEOUT_SECONDS``.
    """
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=PG_TIMEOUT_SECONDS))
    world_size = dist.get_world_size()
    dist.barrier()
    dist.destroy_process_group()
    return world_size


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for the ``single`` launcher's store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_torchrun() -> None:
    """``torchrun --standalone --nproc-per-node=2`` of this file with ``--worker``.

    Raises:
        subprocess.CalledProcessError: a rank failed; subprocess.TimeoutExpired: it took
        longer than ``LAUNCH_TIMEOUT_SECONDS``.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={WORLD_SIZE}",
        str(Path(__file__).resolve()),
        "--worker",
    ]
    subprocess.run(cmd, check=True, timeout=LAUNCH_TIMEOUT_SECONDS)


def run_single() -> None:
    """One process running this file with ``--worker``, world size 1, no launcher.

    Raises:
        subprocess.CalledProcessError: it failed; subprocess.TimeoutExpired: it took longer
        than ``LAUNCH_TIMEOUT_SECONDS``.
    """
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    subprocess.run(cmd, check=True, env=env, timeout=LAUNCH_TIMEOUT_SECONDS)


def launchers(spark: Any) -> dict[str, Callable[[], None]]:
    """The four launchers, each a call that returns when all its processes have ended.

    Raises (when called):
        RuntimeError: ``TorchDistributor.run`` returned something other than the world size.
    """
    from pyspark.ml.torch.distributor import TorchDistributor

    def distributor(local_mode: bool) -> Callable[[], None]:
        def call() -> None:
            out = TorchDistributor(
                num_processes=WORLD_SIZE, local_mode=local_mode, use_gpu=False
            ).run(noop_train)
            if out != 2:
                raise RuntimeError(f"TorchDistributor.run returned {out!r}, not the world size 2")

        return call

    assert spark is not None  # TorchDistributor uses the active session
    return {
        "local": distributor(True),
        "barrier": distributor(False),
        "torchrun": run_torchrun,
        "single": run_single,
    }


def measure(calls: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """One untimed warm-up call of each, then ``repeats`` timed rounds of all, in turn.

    Returns:
        Per launcher, the wall seconds of each timed call (``time.perf_counter``).
    """
    for name, call in calls.items():
        t0 = time.perf_counter()
        call()
        print(f"  warm-up {name}: {time.perf_counter() - t0:.2f} s (not counted)", flush=True)
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for repeat in range(repeats):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - t0)
            print(f"  {repeat + 1}/{repeats} {name}: {seconds[name][-1]:.2f} s", flush=True)
    return seconds


def summarize(seconds: dict[str, list[float]]) -> dict[str, Any]:
    """Medians, minima, ratios and overheads of the wall seconds.

    Returns:
        ``launchers``: per launcher ``median_s``, ``min_s``, ``runs_s`` (seconds);
        ``ratio``: ``local/torchrun`` and ``barrier/torchrun`` (of the medians);
        ``overhead_s``: ``local-torchrun`` and ``barrier-torchrun`` (of the medians, seconds).
    """
    per: dict[str, dict[str, Any]] = {
        name: {
            "median_s": round(statistics.median(runs), 3),
            "min_s": round(min(runs), 3),
            "runs_s": [round(s, 3) for s in runs],
        }
        for name, runs in seconds.items()
    }
    base = per["torchrun"]["median_s"]
    return {
        "launchers": per,
        "ratio": {
            f"{n}/torchrun": round(per[n]["median_s"] / base, 2) for n in ("local", "barrier")
        },
        "overhead_s": {
            f"{n}-torchrun": round(per[n]["median_s"] - base, 3) for n in ("local", "barrier")
        },
    }


def format_table(summary: dict[str, Any], session_s: float, master: str) -> str:
    """The summary as a Markdown table (seconds)."""
    what = {
        "local": "TorchDistributor, local_mode=True",
        "barrier": "TorchDistributor, local_mode=False (barrier stage)",
        "torchrun": "torchrun --standalone --nproc-per-node=2",
        "single": "1 process: python + import torch + init_process_group",
    }
    base = summary["launchers"]["torchrun"]["median_s"]
    head = ["launcher", "what", "median s", "min s", "vs torchrun", "overhead s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in summary["launchers"].items():
        cells = [
            name,
            what[name],
            f"{r['median_s']:.2f}",
            f"{r['min_s']:.2f}",
            f"{r['median_s'] / base:.2f}x",
            f"{r['median_s'] - base:+.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(
        f"| session | get_spark({master}), once, not in the above | {session_s:.2f} | | | |"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, :func:`noop_train`); the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=3, help="timed calls of each launcher")
    p.add_argument("--master", default="local[2]", help="Spark master (2 slots for barrier)")
    p.add_argument("--output", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.worker:
        noop_train()
        return 0
    if args.repeats < 1:
        p.error("--repeats must be at least 1")

    from flowers_job.cluster.session import get_spark

    facts = machine_facts("torch", "pyspark")
    print(
        f"{WORLD_SIZE} processes per launcher, {args.repeats} timed rounds after 1 warm-up "
        f"round; {facts['nproc']} cores, load {facts['loadavg_at_start']}",
        flush=True,
    )
    t0 = time.perf_counter()
    spark = get_spark("launch_overhead", master=args.master)
    session_s = time.perf_counter() - t0
    print(f"  SparkSession ({args.master}, Delta): {session_s:.2f} s (not counted)", flush=True)
    try:
        seconds = measure(launchers(spark), args.repeats)
    finally:
        spark.stop()
    facts["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    summary = summarize(seconds)
    table = format_table(summary, session_s, args.master)
    report = {
        "settings": {"repeats": args.repeats, "master": args.master, "world_size": WORLD_SIZE},
        "machine": facts,
        "session_start_s": round(session_s, 3),
        **summary,
        "table": table,
    }
    print()
    print(table)
    print()
    print(json.dumps({k: report[k] for k in ("session_start_s", "ratio", "overhead_s")}))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
        print(f"JSON: {args.output}")
    return 0


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    sys.exit(main())
