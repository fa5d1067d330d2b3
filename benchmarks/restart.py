"""A real fault on the whole job: ``make run`` twice, side by side in one run, the second
with rank 1's process SIGKILLed by hand (``kill -9``) in the middle of an epoch.

The first run is uninterrupted; the second loses rank 1 half-way through epoch ``--epoch``
(the time of the epoch before, halved, after that epoch's line), restarts by itself from
the last checkpoint (``train.max_restarts``, 1 by default) and finishes. Printed and
written to ``--report`` (JSON): both runs' test accuracy and job time, the restart's cause,
the checkpoint it continued, the work lost, the restart's own time, and the difference of
the job times.

    .venv/bin/python benchmarks/restart.py --output-dir /tmp/bench-restart \\
        --report /tmp/restart.json [--epoch 3] [--set train.checkpoint_every_seconds=10]

The photos are ``../shared/data/flower_photos`` (``--images``), ingested once and copied
into each run's own output dir under ``--output-dir``: neither run ingests.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EPOCH_LINE = re.compile(r"epoch (\d+)/\d+ \| .* \| ([\d.]+) s \|")
RANKS_LINE = re.compile(r"(\d+)@[^(]+\([^,]*, [^,]*, pid (\d+)")
RUN_TIMEOUT_SECONDS = 3600


def _make_run(
    out: Path, images: Path, sets: list[str], log: Path, kill_epoch: int | None
) -> dict[str, Any]:
    """``make run`` into ``out``; with ``kill_epoch``, SIGKILL rank 1 half-way through it.
    The summary, with what the killer saw under ``"_kill"``."""
    args = " ".join(f"--set {s}" for s in sets)
    cmd = ["make", "--no-print-directory", "run", f"PHOTOS={images}", f"OUT={out}", f"ARGS={args}"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    seen: dict[str, Any] = {}
    t0 = time.monotonic()
    with log.open("w") as sink:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None
        pids: dict[int, int] = {}
        for line in proc.stdout:
            sink.write(line)
            if "ranks: " in line and not pids:
                pids = {int(r): int(p) for r, p in RANKS_LINE.findall(line)}
            found = EPOCH_LINE.search(line)
            if kill_epoch and found and int(found[1]) == kill_epoch - 1 and "killed_at" not in seen:
                delay = float(found[2]) / 2
                threading.Timer(delay, _kill, (pids[1], seen)).start()
        proc.wait(timeout=RUN_TIMEOUT_SECONDS)
    if proc.returncode != 0:
        raise SystemExit(f"make run into {out} failed (exit {proc.returncode}): see {log}")
    summary = json.loads((out / "summary.json").read_text())
    summary["_wall_seconds"] = time.monotonic() - t0
    summary["_kill"] = seen
    return summary


def _kill(pid: int, seen: dict[str, Any]) -> None:
    os.kill(pid, signal.SIGKILL)  # kill -9
    seen.update(pid=pid, killed_at=time.time())
    print(f"kill -9 {pid} (rank 1)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=Path, default=REPO.parent / "shared/data/flower_photos")
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--epoch", type=int, default=3, help="kill rank 1 in this epoch (>= 2)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    base = args.output_dir
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    # one ingest, copied: both runs find their tables up to date (no ingest time in either)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    ingest = [sys.executable, "-m", "flowers_job", "ingest", "--images", str(args.images)]
    subprocess.run([*ingest, "--output-dir", str(base / "ingest")], check=True, env=env, cwd=REPO)
    for name in ("plain", "killed"):
        shutil.copytree(base / "ingest" / "tables", base / name / "tables")
    plain = _make_run(base / "plain", args.images, args.sets, base / "plain.log", None)
    killed = _make_run(base / "killed", args.images, args.sets, base / "killed.log", args.epoch)
    restarts = killed.get("restart_history", [])
    report = {
        "machine": f"{os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "settings": args.sets,
        "kill": killed["_kill"],
        "restarts": killed.get("restarts"),
        "restart_history": restarts,
        "test_accuracy": {"plain": plain["test_accuracy"], "killed": killed["test_accuracy"]},
        "test_accuracy_difference": killed["test_accuracy"] - plain["test_accuracy"],
        "train_seconds": {"plain": plain["train_seconds"], "killed": killed["train_seconds"]},
        "train_seconds_difference": killed["train_seconds"] - plain["train_seconds"],
        "job_seconds": {"plain": plain["job_seconds"], "killed": killed["job_seconds"]},
        "job_seconds_difference": killed["job_seconds"] - plain["job_seconds"],
        "history_equal": [
            {k: h[k] for k in ("epoch", "train_loss", "val_loss")} for h in plain["history"]
        ]
        == [{k: h[k] for k in ("epoch", "train_loss", "val_loss")} for h in killed["history"]],
    }
    args.report.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
