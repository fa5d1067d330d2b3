"""The defaults' sweep: job time against accuracy for a few settings, on all the photos.

Each configuration is a whole ``flowers-job run`` from a fresh output directory (ingest at
its image size included), one after the other on the same machine. For each: the job's
wall time, its seconds per epoch, the epochs it ran (early stopping may end it before
``train.epochs``), its best epoch and its validation accuracy and loss there (the weights it
keeps and registers). The defaults in ``flowers_job/config.py`` are the most accurate
configuration whose job time stays within about 5 minutes on the 2-core CI machine.

    .venv/bin/python benchmarks/sweep.py --work-dir /tmp/bench-sweep \\
        --report output/benchmarks/sweep.json
    .venv/bin/python benchmarks/sweep.py --only frozen-224-e5   # one configuration

About 20 minutes on 2 cores with the default grid.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import write_report

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PHOTOS = REPO.parent / "shared/data/flower_photos"

GRID: dict[str, list[str]] = {
    "frozen-224-e5": ["data.image_size=224", "train.epochs=5"],
    "frozen-224-e10": ["data.image_size=224", "train.epochs=10"],
    "frozen-192-e8": ["data.image_size=192", "train.epochs=8"],
    "frozen-224-b64-e8": [
        "data.image_size=224",
        "train.epochs=8",
        "train.per_device_batch_size=64",
    ],
    "unfrozen-160-e3": [
        "data.image_size=160",
        "train.epochs=3",
        "model.freeze_backbone=false",
        "train.base_learning_rate=0.0003",
    ],
    "unfrozen-160-e6": [
        "data.image_size=160",
        "train.epochs=6",
        "model.freeze_backbone=false",
        "train.base_learning_rate=0.0003",
    ],
    "unfrozen-192-e4": [
        "data.image_size=192",
        "train.epochs=4",
        "model.freeze_backbone=false",
        "train.base_learning_rate=0.0003",
    ],
}
"""Name -> ``--set`` overrides of the job's defaults (``frozen``: only the head trains)."""


def run_one(photos: Path, out: Path, settings: list[str], timeout: float) -> dict[str, Any]:
    """One ``flowers-job run``; the row of the table.

    Raises:
        subprocess.CalledProcessError: the job failed; subprocess.TimeoutExpired.
    """
    shutil.rmtree(out, ignore_errors=True)
    cmd = [str(Path(sys.executable).parent / "flowers-job"), "run", "--images", str(photos)]
    cmd += ["--output-dir", str(out)]
    for item in settings:
        cmd += ["--set", item]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, timeout=timeout, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    summary = json.loads((out / "summary.json").read_text())
    return {
        "settings": settings,
        "wall_seconds": wall,
        "seconds_per_epoch": summary["seconds_per_epoch"],
        "epochs_completed": summary["epochs_completed"],
        "stop_reason": summary["stop_reason"],
        "best_epoch": summary["best_epoch"],
        "val_accuracy": summary["val_accuracy"],
        "val_loss": summary["val_loss"],
        "train_images_per_second": [h["train_images_per_second"] for h in summary["history"]],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--photos", type=Path, default=DEFAULT_PHOTOS)
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "bench-sweep")
    p.add_argument("--only", action="append", choices=sorted(GRID), help="run these only")
    p.add_argument("--report", type=Path, help="write the results as JSON here")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    args = p.parse_args(argv)

    rows: dict[str, dict[str, Any]] = {}
    print("| configuration | job wall | s/epoch | epochs (stop) | best epoch | val accuracy |")
    print("|---|---|---|---|---|---|")
    for name in args.only or list(GRID):
        row = rows[name] = run_one(args.photos, args.work_dir / name, GRID[name], args.timeout)
        print(
            f"| {name} | {row['wall_seconds']:.0f} s | {row['seconds_per_epoch']:.1f} | "
            f"{row['epochs_completed']} ({row['stop_reason']}) | {row['best_epoch']} | "
            f"{row['val_accuracy']:.4f} |",
            flush=True,
        )
        shutil.rmtree(args.work_dir / name, ignore_errors=True)
    report = {"date": time.strftime("%Y-%m-%d"), "runs": rows}
    write_report(report, args.report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
