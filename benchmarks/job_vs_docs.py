"""Whole job vs the docs' pattern: wall time and accuracy, same photos, same split, same machine.

Runs one after the other, each as its own process (its own Spark JVM), on the same photos:

1. ``job``: ``flowers-job run`` with its defaults (what ``make run`` runs), from a fresh
   output directory;
2. ``docs``: :mod:`docs_pattern`, the Databricks documentation's pattern written plainly
   (binaryFile -> ``make_spark_converter`` -> TorchDistributor -> DDP, frozen
   EfficientNet-Lite0 and a linear head, 2 epochs at 224 px by default), validated on the
   job's own validation photos (``--val-paths``, read from the job's ``val`` Delta table).
   One change to the docs' code: Petastorm's reader pool is 'dummy' (decoding in the rank)
   instead of its default 'thread', with which a rank grew to 10.9 GB resident and the
   kernel's OOM killer ended the run on this 24 GB machine (2026-11-23); the dummy pool is
   also the faster of the two on small samples here, so if anything it flatters the
   baseline (``--docs-reader-pool thread`` runs the docs' default).

Wall time is each process's, from its start to its exit (Spark start-up, ingest or
conversion, training, and for the job MLflow logging and model registration). Accuracy
is each one's validation accuracy on that split (the job: its best epoch, whose weights it
keeps; the docs' pattern: after its last epoch, over the validation rows its step count
reaches). CPU user and system seconds of each (all its processes) show how much of the
CPU went to the kernel.

    .venv/bin/python benchmarks/job_vs_docs.py --work-dir /tmp/bench-docs \\
        --report output/benchmarks/job_vs_docs.json

About 12 minutes on 2 cores (the docs' pattern takes most of it).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from report import write_report  # noqa: E402

REPO = HERE.parent
DEFAULT_PHOTOS = REPO.parent / "shared/data/flower_photos"

_VAL_PATHS = """
import sys
from flowers_job.cluster.session import get_spark
spark = get_spark("val_paths", master="local[2]")
rows = spark.read.format("delta").load(sys.argv[1]).select("path").collect()
open(sys.argv[2], "w").write("\\n".join(r.path for r in rows) + "\\n")
spark.stop()
"""


def timed(cmd: list[str], timeout: float, log: Path) -> tuple[float, float, float]:
    """Run ``cmd`` (its output to ``log``); its ``(wall, CPU user, CPU system)`` seconds, the
    CPU times from ``getrusage(RUSAGE_CHILDREN)``: every descendant process that was waited
    for (the JVM, torchrun, the ranks, Spark's Python workers).

    Raises:
        SystemExit: the command failed; subprocess.TimeoutExpired.
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run(cmd, check=False, timeout=timeout, stdout=out, stderr=out)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[1]} failed (exit {proc.returncode}): see {log}")
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--photos", type=Path, default=DEFAULT_PHOTOS)
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "bench-docs")
    p.add_argument("--set", action="append", default=[], help="job settings KEY=VALUE")
    p.add_argument("--docs-epochs", type=int, default=2)
    p.add_argument(
        "--docs-reader-pool",
        default="dummy",
        choices=("thread", "dummy"),
        help="Petastorm reader pool of the docs' pattern (default dummy: see the docstring)",
    )
    p.add_argument("--report", type=Path, help="write the results as JSON here")
    p.add_argument("--timeout", type=float, default=2400.0, help="seconds per run")
    args = p.parse_args(argv)

    shutil.rmtree(args.work_dir, ignore_errors=True)
    args.work_dir.mkdir(parents=True)
    job_out = args.work_dir / "job"
    bin_dir = Path(sys.executable).parent
    job_cmd = [str(bin_dir / "flowers-job"), "run", "--images", str(args.photos)]
    job_cmd += ["--output-dir", str(job_out)]
    for item in args.set:
        job_cmd += ["--set", item]
    job_seconds, job_user, job_sys = timed(job_cmd, args.timeout, args.work_dir / "job.log")
    job: dict[str, Any] = json.loads((job_out / "summary.json").read_text())

    val_paths = args.work_dir / "val_paths.txt"
    subprocess.run(
        [sys.executable, "-c", _VAL_PATHS, job["tables"]["val"], str(val_paths)],
        check=True,
        timeout=600,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    docs_json = args.work_dir / "docs.json"
    docs_cmd = [sys.executable, str(HERE / "docs_pattern.py"), "--photos", str(args.photos)]
    docs_cmd += ["--val-paths", str(val_paths), "--epochs", str(args.docs_epochs)]
    docs_cmd += ["--reader-pool", args.docs_reader_pool]
    docs_cmd += ["--output", str(docs_json)]
    docs_seconds, docs_user, docs_sys = timed(docs_cmd, args.timeout, args.work_dir / "docs.log")
    docs: dict[str, Any] = json.loads(docs_json.read_text())

    result = {
        "date": time.strftime("%Y-%m-%d"),
        "job_wall_seconds": job_seconds,
        "job_val_accuracy": job["val_accuracy"],
        "job_val_rows": job["val_rows"],
        "job_epochs": job["epochs_completed"],
        "job_best_epoch": job["best_epoch"],
        "job_cpu_user_seconds": job_user,
        "job_cpu_system_seconds": job_sys,
        "job_system_share": job_sys / (job_user + job_sys),
        "docs_wall_seconds": docs_seconds,
        "docs_val_accuracy": docs["val_accuracy"],
        "docs_val_rows_evaluated": docs.get("val_rows_evaluated"),
        "docs_epochs": docs.get("epochs"),
        "docs_cpu_user_seconds": docs_user,
        "docs_cpu_system_seconds": docs_sys,
        "time_ratio": job_seconds / docs_seconds,
        "accuracy_difference": job["val_accuracy"] - docs["val_accuracy"],
    }
    print(
        "| run | wall | val accuracy |\n|---|---|---|\n"
        f"| job (`make run` defaults, {job['epochs_completed']} epochs) | {job_seconds:.0f} s | "
        f"{job['val_accuracy']:.4f} ({job['val_rows']} rows) |\n"
        f"| docs' pattern ({docs.get('epochs')} epochs) | {docs_seconds:.0f} s | "
        f"{docs['val_accuracy']:.4f} ({docs.get('val_rows_evaluated')} rows) |\n"
        f"\njob / docs wall time: {result['time_ratio']:.2f}; CPU user / system: job "
        f"{job_user:.0f} / {job_sys:.0f} s ({result['job_system_share']:.1%} system), docs "
        f"{docs_user:.0f} / {docs_sys:.0f} s"
    )
    write_report(result, args.report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
