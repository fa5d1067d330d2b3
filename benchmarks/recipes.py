"""Two recipes of the whole job side by side: ``make run`` (the default) against another
configuration, seeds interleaved, each from a fresh output directory, on the same photos and
machine.

Each run is ``make run OUT=<fresh dir> ARGS="[--config C] --set train.seed=S"`` in
``--checkout`` (a fresh clone: its first ``make run`` builds ``.venv`` from the lock file,
which the first run's wall time then includes; ``job_seconds`` does not). Order: default seed
0, other seed 0, default seed 1, ... so that a drift of the machine touches both alike. From
each run's ``summary.json``: the test accuracy (and correct photos), the best epoch's
validation accuracy, the epochs run, ``job_seconds`` (the driver's clock, from its start to
the summary: Spark's start, ingest, embeddings, training, test, MLflow) and the parts of it
the summary names (ingest, embeddings, training).

    .venv/bin/python benchmarks/recipes.py --checkout /work/fresh --work /var/tmp/recipes \\
        --other configs/augmented.yaml --seeds 0 1 2 \\
        --report benchmarks/results/DATE/embeddings/default_vs_augmented.json

About 20 minutes for 3 seeds on 2 cores (a default run about 2.5 minutes, an augmented one
about 3.5). Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

TIMEOUT_SECONDS = 1800
"""Bound on one ``make run`` (the first builds the environment)."""


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _record(summary: dict[str, Any]) -> dict[str, Any]:
    """The numbers of one run's ``summary.json`` this comparison reports."""
    history = summary.get("history") or []
    best = summary.get("best_epoch")
    val = next(
        (h.get("val_accuracy") for h in history if h.get("epoch") == best),
        max((h.get("val_accuracy", 0.0) for h in history), default=None),
    )
    embeddings = summary.get("embeddings") or {}
    return {
        "test_accuracy": summary.get("test_accuracy"),
        "test_correct": round(summary["test_accuracy"] * summary["test_rows"])
        if summary.get("test_accuracy") is not None and summary.get("test_rows")
        else None,
        "test_rows": summary.get("test_rows"),
        "val_accuracy": val,
        "best_epoch": best,
        "epochs_completed": summary.get("epochs_completed"),
        "job_seconds": summary.get("job_seconds"),
        "ingest_seconds": (summary.get("ingest") or {}).get("seconds"),
        "embeddings_seconds": embeddings.get("seconds"),
        "embedded": embeddings.get("embedded"),
        "train_seconds": summary.get("train_seconds"),
        "loader": summary.get("loader"),
        "train_rows": summary.get("train_rows"),
    }


def run_one(checkout: Path, out: Path, args: list[str]) -> dict[str, Any]:
    """One ``make run`` into the fresh ``out``; its record (``rc``, ``wall_seconds`` and
    :func:`_record` of its summary).

    Raises:
        subprocess.TimeoutExpired: the run took more than :data:`TIMEOUT_SECONDS`.
    """
    shutil.rmtree(out, ignore_errors=True)
    cmd = ["make", "--no-print-directory", "run", f"OUT={out}", f"ARGS={' '.join(args)}"]
    t0 = time.perf_counter()
    log = out.parent / f"{out.name}.log"
    with log.open("w") as sink:
        proc = subprocess.run(
            cmd,
            cwd=checkout,
            stdout=sink,
            stderr=subprocess.STDOUT,
            timeout=TIMEOUT_SECONDS,
            check=False,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    wall = time.perf_counter() - t0
    summary_path = out / "summary.json"
    record: dict[str, Any] = {
        "rc": proc.returncode,
        "wall_seconds": round(wall, 1),
        "log": str(log),
    }
    if proc.returncode == 0 and summary_path.exists():
        record |= _record(json.loads(summary_path.read_text()))
    return record


def _mean(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.fmean(values), 4) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", type=Path, required=True, help="the clone to run in")
    parser.add_argument("--work", type=Path, required=True, help="output dirs and logs")
    parser.add_argument("--other", default="configs/augmented.yaml", help="--config of the other")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--report", type=Path, required=True)
    ns = parser.parse_args()
    ns.work.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=ns.checkout,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    recipes = {"default": [], "other": ["--config", ns.other]}
    started = datetime.now(UTC)
    runs = []
    for seed in ns.seeds:
        for name, extra in recipes.items():
            args = [*extra, "--set", f"train.seed={seed}"]
            record = run_one(ns.checkout, ns.work / f"{name}-s{seed}", args)
            runs.append({"recipe": name, "seed": seed, "args": args, **record})
            print(json.dumps(runs[-1]), flush=True)
    by = {name: [r for r in runs if r["recipe"] == name] for name in recipes}
    report = {
        "date": f"{started:%Y-%m-%dT%H:%M:%SZ} to {datetime.now(UTC):%H:%M:%SZ}",
        "cpu": _cpu(),
        "nproc": os.cpu_count(),
        "checkout": str(ns.checkout),
        "commit": commit,
        "other": ns.other,
        "order": "interleaved by seed, each from a fresh output dir (ingest included)",
        "runs": runs,
        "mean": {
            name: {k: _mean(rs, k) for k in ("test_accuracy", "val_accuracy", "job_seconds")}
            for name, rs in by.items()
        },
    }
    ns.report.parent.mkdir(parents=True, exist_ok=True)
    ns.report.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["mean"], indent=1))


if __name__ == "__main__":
    main()
