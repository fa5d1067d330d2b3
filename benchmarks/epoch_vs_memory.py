"""Epoch vs in-memory: the job's training epoch against the limit of the same model.

Runs, side by side in one run on the same machine:

1. ``limit`` (before): :mod:`inmemory`, the hand-written DDP loop over tensors already in
   memory, with the job's model, ranks, threads per rank, per_device_batch_size and image
   size (glibc tuned as the job's ranks are);
2. ``job``: the whole job (``flowers-job run``, default settings unless ``--set``) on the
   photos, from a fresh output directory: ingest, shard, TorchDistributor, the real
   loaders;
3. ``limit`` (after) again: the mean of the two brackets the job, so a drift of the machine
   shows as a difference between them.

The job's training images/s per epoch is ``train_images_per_second`` from its summary
(training images of all ranks / the epoch's training seconds: decode, augmentation,
loader, forward, backward, optimizer). The ratio reported is the job's steady-state
epochs (2 and later: epoch 1 also starts the loaders' readers) against the limit; epoch 1
and the whole-epoch rate (train + validation images / epoch seconds) are reported too.

    .venv/bin/python benchmarks/epoch_vs_memory.py --output-dir /tmp/bench-epoch \\
        --report output/benchmarks/epoch_vs_memory.json

About 5 minutes on 2 cores with the defaults (a 3-epoch job on all 3,670 photos).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import inmemory
from report import write_report

REPO = Path(__file__).resolve().parents[1]


def run_job(photos: Path, output_dir: Path, settings: list[str], timeout: float) -> dict[str, Any]:
    """``flowers-job run`` in a subprocess; its summary.json.

    Raises:
        subprocess.CalledProcessError: the job failed; subprocess.TimeoutExpired: it ran
        longer than ``timeout`` seconds.
    """
    shutil.rmtree(output_dir, ignore_errors=True)
    cmd = [
        str(Path(sys.executable).parent / "flowers-job"),
        "run",
        "--images",
        str(photos),
        "--output-dir",
        str(output_dir),
    ]
    for item in settings:
        cmd += ["--set", item]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, timeout=timeout, stdout=subprocess.DEVNULL)
    summary: dict[str, Any] = json.loads((output_dir / "summary.json").read_text())
    summary["wall_seconds"] = time.perf_counter() - t0
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--photos", type=Path, default=inmemory.DEFAULT_PHOTOS)
    p.add_argument("--output-dir", type=Path, default=Path(tempfile.gettempdir()) / "bench-epoch")
    p.add_argument("--epochs", type=int, default=3, help="epochs of the job (default 3)")
    p.add_argument("--set", action="append", default=[], help="more job settings KEY=VALUE")
    p.add_argument("--count", type=int, default=1024, help="photos the limit loop holds")
    p.add_argument("--steps", type=int, default=40, help="timed steps per rank of the limit")
    p.add_argument("--report", type=Path, help="write the results as JSON here")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per job run")
    args = p.parse_args(argv)

    settings = [f"train.epochs={args.epochs}", *args.set]
    from flowers_job.config import load_config

    cfg = load_config(
        None, settings, **{"data.images": args.photos, "paths.output_dir": args.output_dir}
    )
    ranks = cfg.world_size
    threads = max(1, (os.cpu_count() or 1) // ranks)
    batch, size = cfg.train.per_device_batch_size, cfg.data.image_size

    with tempfile.TemporaryDirectory() as tmp:
        data = inmemory.decode_to_file(args.photos, args.count, size, Path(tmp) / "data.pt")

        def limit() -> dict[str, Any]:
            return inmemory.run(
                data,
                ranks=ranks,
                threads=threads,
                steps=args.steps,
                warmup=3,
                batch_size=batch,
                freeze_backbone=cfg.model.freeze_backbone,
            )

        before = limit()
        summary = run_job(args.photos, args.output_dir, settings, args.timeout)
        after = limit()

    history = summary["history"]
    steady = [h["train_images_per_second"] for h in history[1:]] or [
        history[0]["train_images_per_second"]
    ]
    limit_rate = (before["images_per_second"] + after["images_per_second"]) / 2
    job_rate = statistics.mean(steady)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
        "world_size": ranks,
        "threads_per_rank": threads,
        "per_device_batch_size": batch,
        "image_size": size,
        "freeze_backbone": cfg.model.freeze_backbone,
        "limit_images_per_second": [before["images_per_second"], after["images_per_second"]],
        "job_train_images_per_second": [h["train_images_per_second"] for h in history],
        "job_epoch_images_per_second": [h["images_per_second"] for h in history],
        "job_epoch_seconds": [h["epoch_seconds"] for h in history],
        "job_seconds": summary.get("job_seconds"),
        "job_wall_seconds": summary["wall_seconds"],
        "val_accuracy": summary["val_accuracy"],
        "ratio_steady": job_rate / limit_rate,
        "ratio_epoch1": history[0]["train_images_per_second"] / limit_rate,
        "limit_cpu_user_system_seconds": [
            (r["cpu_user_seconds"], r["cpu_system_seconds"]) for r in (before, after)
        ],
    }
    print(
        "| run | images/s |\n|---|---|\n"
        + f"| limit (in-memory loop), before / after | {before['images_per_second']:.1f} / "
        f"{after['images_per_second']:.1f} |\n"
        + f"| job, training, epoch 1 | {history[0]['train_images_per_second']:.1f} |\n"
        + f"| job, training, epochs 2+ (mean) | {job_rate:.1f} |\n"
        + f"| job, whole epoch (train + val), mean | "
        f"{statistics.mean(h['images_per_second'] for h in history):.1f} |\n"
        + f"\nratio job / limit: {result['ratio_steady']:.2f} (epochs 2+), "
        f"{result['ratio_epoch1']:.2f} (epoch 1)"
    )
    write_report(result, args.report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
