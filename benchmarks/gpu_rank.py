"""The rank side on one CUDA device: NCCL, mixed precision, channels-last, pinned batches.

The job's own rank-side code (:mod:`flowers_job.train`) on a GPU, over a real Mosaic
Streaming reader, without Spark on the GPU machine: the driver's part runs here first, on
the CPU machine, and its output travels to the GPU machine with the code.

1. ``prepare DIR`` (any machine with the local stack): ingests ``--per-label`` real photos
   per label with local Spark and writes the three splits' Streaming caches exactly as a
   run does (:func:`flowers_job.driver.prepare.prepare_data`), then copies them to
   ``DIR/mds/<split>`` with their plans and the configuration (``DIR/job.json``).
2. ``run DIR`` (the GPU machine: torch, no Spark): one rank, a real NCCL process group of one,
   :func:`~flowers_job.train.state.build_state` (the pretrained model on ``cuda:0``,
   channels-last, DDP, AMP as ``train.amp=auto`` picks it), the Streaming readers
   (:func:`~flowers_job.train.state.open_readers`, pinned memory), ``--epochs`` of
   :func:`~flowers_job.train.loop.run_epoch` (every row checked against the plan, sums
   all-reduced), a broadcast of the stop decision
   (:func:`~flowers_job.runtime.process_group.broadcast_object`), then the test split scored once
   (:func:`~flowers_job.train.evaluate.evaluate_test`, an all-gather). No MLflow: rank 0's
   tracking is the one part of the rank side it leaves out.

Prints one JSON line (and writes it with ``--output``): the device, the AMP dtype, per
epoch the train and validation images/s and accuracies, and the test accuracy. Run from the
repository root:

    .venv/bin/python benchmarks/gpu_rank.py prepare /tmp/gpu-job --per-label 160
    python3 benchmarks/gpu_rank.py run /tmp/gpu-job --epochs 3 [--finetune] [--workers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from report import write_report  # noqa: E402

SPLITS = ("train", "val", "test")


def prepare(out: Path, photos: Path, per_label: int, image_size: int) -> None:
    """Ingest a sample of ``photos`` and write its Streaming caches and plans under ``out``."""
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import sample_photos

    from flowers_job.cluster.session import get_spark
    from flowers_job.config import load_config
    from flowers_job.driver.prepare import prepare_data
    from flowers_job.ingest.job import ingest
    from flowers_job.loaders import resolve_loader

    os.environ.setdefault("FLOWERS_PHOTOS", str(photos))
    shutil.rmtree(out, ignore_errors=True)
    work = out / "work"
    images = sample_photos(work / "photos", per_label=per_label)
    cfg, loader = resolve_loader(
        load_config(
            None,
            [
                f"data.image_size={image_size}",
                "data.loader=streaming",
                "distributed.num_processes=1",
            ],
            **{"data.images": images, "paths.output_dir": work / "out"},
        )
    )
    spark = get_spark("gpu_rank_prepare", master="local[2]")
    ingest(spark, cfg)
    plans = {}
    with prepare_data(spark, cfg, loader) as data:
        for split in SPLITS:
            plan = getattr(data, split).to_dict()
            src = Path(plan["cache_dir_url"].removeprefix("file://"))
            shutil.copytree(src, out / "mds" / split)
            plan["cache_dir_url"] = f"mds/{split}"  # relative to DIR; `run` makes it a URL
            plans[split] = plan
        job = {
            "config": cfg.model_dump(mode="json"),
            "plans": plans,
            "label_names": data.label_names,
        }
    spark.stop()
    (out / "job.json").write_text(json.dumps(job, indent=1))
    shutil.rmtree(work)
    print(f"prepared {out}: " + ", ".join(f"{s} {plans[s]['dataset_size']} rows" for s in SPLITS))


def _single_rank_env() -> None:
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29517",
    }.items():
        os.environ.setdefault(key, value)


def run(job_dir: Path, epochs: int, finetune: bool, workers: int) -> dict[str, Any]:
    """One NCCL rank on ``cuda:0`` trains ``epochs`` and scores the test split once."""
    import torch

    from flowers_job.config import JobConfig
    from flowers_job.loaders import resolve_loader
    from flowers_job.runtime.process_group import (
        broadcast_object,
        gather_ranks,
        init_distributed,
        shutdown_distributed,
    )
    from flowers_job.train.early_stopping import Decision
    from flowers_job.train.evaluate import evaluate_test
    from flowers_job.train.loop import run_epoch
    from flowers_job.train.state import Plans, build_state, open_readers

    job = json.loads((job_dir / "job.json").read_text())
    config = job["config"]
    config["model"]["freeze_backbone"] = not finetune
    config["data"]["loader_workers"] = workers
    config["train"]["epochs"] = epochs
    config["paths"]["output_dir"] = str(job_dir / "out")
    cfg, loader = resolve_loader(JobConfig.model_validate(config))
    plans = {}
    for split in SPLITS:
        plan = dict(job["plans"][split])
        plan["cache_dir_url"] = (job_dir / plan["cache_dir_url"]).resolve().as_uri()
        plans[split] = loader.plan_type(**plan)
    _single_rank_env()
    ctx = init_distributed(use_gpu=True, backend="nccl", timeout_seconds=300)
    try:
        t0 = time.perf_counter()
        state = build_state(cfg, ctx, Plans(**plans, loader=loader), list(job["label_names"]))
        ranks = gather_ranks(ctx)
        ranks[0]["threads"] = torch.get_num_threads()
        open_readers(state, ranks)
        setup_seconds = time.perf_counter() - t0
        history = []
        for epoch in range(1, epochs + 1):
            metrics = run_epoch(state, epoch)
            decision = broadcast_object(Decision(improved=True, stop=False), ctx)
            assert isinstance(decision, Decision) and decision.improved
            history.append({"epoch": epoch, **metrics})
            print(json.dumps(history[-1]), flush=True)
        for reader in (state.train_reader, state.val_reader):
            if reader is not None:
                reader.close()
        test = evaluate_test(state)
        assert test is not None
        return {
            "device": torch.cuda.get_device_name(ctx.device),
            "torch": torch.__version__,
            "backend": ctx.backend,
            "amp_dtype": str(state.amp_dtype),
            "freeze_backbone": cfg.model.freeze_backbone,
            "loader_workers": workers,
            "image_size": cfg.data.image_size,
            "per_device_batch_size": cfg.train.per_device_batch_size,
            "rows": {s: p.dataset_size for s, p in plans.items()},
            "setup_seconds": round(setup_seconds, 1),
            "history": history,
            "test_accuracy": test.metrics()["test_accuracy"],
            "test_images_per_second": test.images_per_second,
            "max_memory_allocated_bytes": torch.cuda.max_memory_allocated(ctx.device),
        }
    finally:
        shutdown_distributed()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="ingest and write the Streaming caches (local Spark)")
    p.add_argument("dir", type=Path)
    p.add_argument("--photos", type=Path, default=REPO.parent / "shared/data/flower_photos")
    p.add_argument("--per-label", type=int, default=160, help="photos per label")
    p.add_argument("--image-size", type=int, default=224, help="data.image_size (px)")
    r = sub.add_parser("run", help="train on one CUDA device (no Spark)")
    r.add_argument("dir", type=Path)
    r.add_argument("--epochs", type=int, default=3)
    r.add_argument("--finetune", action="store_true", help="train the backbone too")
    r.add_argument("--workers", type=int, default=0, help="data.loader_workers")
    r.add_argument("--output", type=Path, help="write the JSON report here too")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(args.dir.resolve(), args.photos.resolve(), args.per_label, args.image_size)
        return 0
    write_report(run(args.dir.resolve(), args.epochs, args.finetune, args.workers), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
