"""The recipes' sweep: job time against accuracy for a few settings, on all the photos.

Each configuration is a whole ``flowers-job run`` from a fresh output directory (ingest at
its image size included), one after the other on the same machine. For each: the job's
own time (``job_seconds`` of its summary), its seconds per epoch, the epochs it ran (early
stopping may end it before ``train.epochs``), its best epoch and its validation accuracy
there (the weights it keeps and registers), the test accuracy of those weights (scored once,
at the end), and MLPerf Training's time to quality: the training seconds until the test
accuracy first reaches 0.90, from the test split scored after every epoch (``scored_run.py``:
the benchmark's own pass on every rank, logged, read by nothing in the job).
The machine's mean load average during each run is in the table: the machine may be shared,
and a load above 2 (its cores) slows a run.

The grid covers the fine-tuning trade-off: the frozen default, the same with the recipe's
cosine schedule, the bigger frozen backbones (Lite1, Lite2 at their native resolutions), the fine-tuning
preset before the recipe, and ``configs/finetune.yaml``, alone, with layer-wise decay and
an EMA, and with another seed.

    .venv/bin/python benchmarks/sweep.py --work-dir /tmp/bench-sweep \\
        --report output/benchmarks/sweep.json
    .venv/bin/python benchmarks/sweep.py --only finetune.yaml   # one configuration

About 85 minutes on a quiet 2-core machine with the default grid (2026-11-26).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import machine_facts, write_report

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PHOTOS = REPO.parent / "shared/data/flower_photos"

FROZEN = ["train.epochs=5"]
TUNED = ["model.freeze_backbone=false"]
RECIPE = [
    "train.lr_schedule=cosine",
    "train.warmup_epochs=1",
    "train.decay_norm_and_bias=false",
    "train.weight_decay=0.02",
]
FINETUNE = REPO / "configs" / "finetune.yaml"

GRID: dict[str, tuple[Path | None, list[str]]] = {
    # the default job, then the same with the recipe's schedule (within 1.1x its time?)
    "frozen-lite0-224-e5": (None, FROZEN),
    # configs/finetune.yaml as it is in the repo
    "finetune.yaml": (FINETUNE, []),
    "frozen-lite0-224-e5-cosine": (None, [*FROZEN, *RECIPE]),
    # the bigger backbones frozen, each at its native resolution (240, 260 px)
    "frozen-lite1-240-e5": (None, [*FROZEN, "model.architecture=efficientnet_lite1"]),
    "frozen-lite2-260-e5": (None, [*FROZEN, "model.architecture=efficientnet_lite2"]),
    # the fine-tuning preset before the recipe (constant rate, one group)
    "tuned-lite0-160-e6-constant": (
        None,
        [*TUNED, "data.image_size=160", "train.epochs=6", "train.base_learning_rate=0.0003"],
    ),
    # configs/finetune.yaml with layer-wise decay and an EMA of the weights
    "finetune.yaml-layer-decay-ema": (FINETUNE, ["train.layer_decay=0.9", "train.ema_decay=0.98"]),
    # configs/finetune.yaml with another seed (initialisation of the head, shuffles, draws):
    # the spread of one recipe's test accuracy
    "finetune.yaml-seed1": (FINETUNE, ["train.seed=1"]),
}
"""Name -> (a ``--config`` file or None, ``--set`` overrides of it or of the defaults).
Every run is ``flowers-job run`` through ``scored_run.py`` (the test split scored after
each epoch, read by nothing in the job) for the time to 0.90 test accuracy."""

QUALITY = 0.90
"""The test accuracy of the time-to-quality column (MLPerf Training's measure)."""


class LoadSampler:
    """The machine's 1-minute load average, sampled every ``interval`` seconds in a thread
    while a run lasts: its mean says how much of the 2 cores the run had."""

    def __init__(self, interval: float = 15.0) -> None:
        self.interval, self.samples = interval, [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval + 5)

    @property
    def mean(self) -> float:
        return sum(self.samples) / len(self.samples)


def time_to_quality(history: list[dict[str, Any]], quality: float) -> tuple[float, int] | None:
    """MLPerf Training's time to quality from a run's per-epoch history: the training
    seconds (``epoch_seconds``: train + validation, summed from the first epoch; start-up,
    ingest and the benchmark's own test passes left out, as MLPerf leaves out
    initialisation) until the end of the first epoch whose ``benchmark_test_accuracy``
    reaches ``quality``, and that epoch; None if no epoch reached it."""
    seconds = 0.0
    for row in history:
        seconds += row["epoch_seconds"]
        if row.get("benchmark_test_accuracy", 0.0) >= quality:
            return seconds, int(row["epoch"])
    return None


def run_one(
    photos: Path, out: Path, config: Path | None, settings: list[str], timeout: float
) -> dict[str, Any]:
    """One ``flowers-job run``; the row of the table.

    Raises:
        subprocess.CalledProcessError: the job failed; subprocess.TimeoutExpired.
    """
    shutil.rmtree(out, ignore_errors=True)
    # flowers-job, with the test split scored after every epoch (scored_run.py)
    cmd = [sys.executable, str(Path(__file__).with_name("scored_run.py"))]
    cmd += ["run", "--images", str(photos)]
    cmd += ["--output-dir", str(out)]
    if config is not None:
        cmd += ["--config", str(config)]
    for item in settings:
        cmd += ["--set", item]
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    with LoadSampler() as load:
        subprocess.run(cmd, check=True, timeout=timeout, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    summary = json.loads((out / "summary.json").read_text())
    reached = time_to_quality(summary["history"], QUALITY)
    return {
        "config": str(config.relative_to(REPO)) if config is not None else None,
        "settings": settings,
        "started": started,
        "wall_seconds": wall,
        "job_seconds": summary["job_seconds"],
        "benchmark_test_seconds": sum(
            h.get("benchmark_test_seconds", 0.0) for h in summary["history"]
        ),
        "seconds_per_epoch": summary["seconds_per_epoch"],
        "epochs_completed": summary["epochs_completed"],
        "stop_reason": summary["stop_reason"],
        "best_epoch": summary["best_epoch"],
        "val_accuracy": summary["val_accuracy"],
        "val_loss": summary["val_loss"],
        "test_accuracy": summary["test_accuracy"],
        "seconds_to_quality": reached[0] if reached else None,
        "epoch_to_quality": reached[1] if reached else None,
        "benchmark_test_accuracy": [h.get("benchmark_test_accuracy") for h in summary["history"]],
        "val_accuracy_per_epoch": [h["val_accuracy"] for h in summary["history"]],
        "train_images_per_second": [h["train_images_per_second"] for h in summary["history"]],
        "mean_load": load.mean,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--photos", type=Path, default=DEFAULT_PHOTOS)
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "bench-sweep")
    p.add_argument("--only", action="append", choices=sorted(GRID), help="run these only")
    p.add_argument("--report", type=Path, help="write the results as JSON here")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    args = p.parse_args(argv)
    facts = machine_facts("torch")

    rows: dict[str, dict[str, Any]] = {}
    print(
        "| configuration | job time (without the benchmark's test passes) | s/epoch | epochs (stop) | best epoch | val accuracy | "
        f"test accuracy | training s to {QUALITY:.2f} test (epoch) | mean load |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.only or list(GRID):
        config, settings = GRID[name]
        try:
            row = rows[name] = run_one(
                args.photos, args.work_dir / name, config, settings, args.timeout
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            # one failed or slow configuration ends its row, not the sweep
            rows[name] = {"config": str(config), "settings": settings, "error": str(exc)}
            print(f"| {name} | failed: {type(exc).__name__} |", flush=True)
            write_report({**facts, "runs": rows}, args.report)
            continue
        ttq = (
            f"{row['seconds_to_quality']:.0f} s ({row['epoch_to_quality']})"
            if row["seconds_to_quality"] is not None
            else "not reached"
        )
        print(
            f"| {name} | {row['job_seconds']:.0f} s "
            f"({row['job_seconds'] - row['benchmark_test_seconds']:.0f} s) | "
            f"{row['seconds_per_epoch']:.1f} | "
            f"{row['epochs_completed']} ({row['stop_reason']}) | {row['best_epoch']} | "
            f"{row['val_accuracy']:.4f} | {row['test_accuracy']:.4f} | {ttq} | "
            f"{row['mean_load']:.1f} |",
            flush=True,
        )
        shutil.rmtree(args.work_dir / name, ignore_errors=True)
        write_report({**facts, "runs": rows}, args.report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
