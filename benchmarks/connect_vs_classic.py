"""The whole job on Spark Connect against classic Spark: the same sample, the same
settings, the same machine, one run each, side by side.

Both runs are ``flowers-job run`` as a user runs it, with the Streaming loader in barrier mode
(``distributed.local_mode=false``: the ranks are Spark tasks) on two task slots:

- classic: the CLI's own local Spark (``FLOWERS_SPARK_MASTER=local[2]``), Delta's jar from
  the Ivy cache;
- Connect: a Spark Connect server (spark-submit, ``SparkConnectServer``, ``local[2]``,
  Delta: :func:`tests.support.connect.server_command`) started first and left running, and
  ``flowers-job run --remote sc://127.0.0.1:PORT``. The server's start (a JVM, once per
  cluster in real use) is reported apart, not in the job's time.

Printed and written to ``--report`` (JSON): each run's wall time, ``job_seconds``,
``seconds_per_epoch`` and test accuracy, and the ratios Connect / classic.

    .venv/bin/python benchmarks/connect_vs_classic.py --output-dir /tmp/bench-connect \\
        --report /tmp/connect.json [--per-label 40] [--set train.epochs=2]

The sample is ``--per-label`` photos of each label of ``../shared/data/flower_photos``
(``FLOWERS_PHOTOS`` to read another copy), copied once into ``--output-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.connect import connect_server  # noqa: E402
from tests.support.data import sample_photos  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from report import cpu_model  # noqa: E402

RUN_TIMEOUT_SECONDS = 3600
SETTINGS = [
    "data.loader=streaming",
    "distributed.local_mode=false",
    "distributed.num_processes=2",
    "train.epochs=2",
]


def _run(out: Path, images: Path, sets: list[str], remote: str | None) -> dict[str, Any]:
    """``flowers-job run`` into ``out`` (``--remote`` when given); its summary and wall time."""
    cmd = [sys.executable, "-m", "flowers_job", "run", "--images", str(images)]
    cmd += ["--output-dir", str(out), *[a for s in sets for a in ("--set", s)]]
    if remote:
        cmd += ["--remote", remote]
    env = {**os.environ, "FLOWERS_SPARK_MASTER": "local[2]"}
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS, env=env, check=False
    )
    wall = time.monotonic() - t0
    (out.parent / f"{out.name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "wall_seconds": round(wall, 1),
        "job_seconds": round(float(summary["job_seconds"]), 1),
        "seconds_per_epoch": summary.get("seconds_per_epoch"),
        "test_accuracy": summary["test_accuracy"],
        "val_accuracy": summary["val_accuracy"],
        "train_rows": summary["train_rows"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-label", type=int, default=40, help="photos per label (sample)")
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--report", type=Path)
    parser.add_argument("--set", dest="sets", action="append", default=[])
    args = parser.parse_args()
    base = args.output_dir
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    photos = sample_photos(base / "photos", per_label=args.per_label)
    sets = [*SETTINGS, *args.sets]
    classic = _run(base / "classic", photos, sets, None)
    t0 = time.monotonic()
    with connect_server(base, master="local[2]", driver_memory="4g") as server:
        server_start = time.monotonic() - t0
        connect = _run(base / "connect", photos, sets, server.url)
    report = {
        "photos": args.per_label * 5,
        "settings": sets,
        "cpu": cpu_model(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "classic": classic,
        "connect": connect,
        "connect_server_start_seconds": round(server_start, 1),
        "ratio_wall": round(connect["wall_seconds"] / classic["wall_seconds"], 3),
        "ratio_job_seconds": round(connect["job_seconds"] / classic["job_seconds"], 3),
    }
    print(json.dumps(report, indent=2))
    if args.report:
        args.report.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
