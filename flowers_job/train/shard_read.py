"""Read a split through the loader boundary on every rank, without a model.

:func:`read_shards` is a TorchDistributor training function like
:func:`flowers_job.train.rank.train_worker`, but it only reads: each rank opens its
loader exactly as training does and iterates the requested epochs. Rank 0 gathers what every
rank read and returns it (broadcast, so every rank returns the same value:
docs/known-issues.md, "Spark").
The tests use it to check the shard invariants of both loaders with real processes, and
``benchmarks/loaders.py`` to time them.
"""

from __future__ import annotations

import resource
import time
from typing import Any

import torch
import torch.distributed as dist

from flowers_job.config import JobConfig
from flowers_job.loaders.base import Loader
from flowers_job.runtime.process_group import (
    DistContext,
    broadcast_object,
    describe_hosts,
    init_distributed,
    shutdown_distributed,
)
from flowers_job.train.device_prefetch import DeviceReader, decodes_on_device
from flowers_job.vision.batch_decode import BatchDecoder
from flowers_job.vision.decode_transform import DecodeTransform

__all__ = ["read_shards"]


def read_shards(job: dict[str, Any]) -> dict[str, Any]:
    """Read ``job["epochs"]`` epochs of ``job["plan"]`` on every rank.

    Args:
        job: ``plan`` (:meth:`~flowers_job.loaders.base.ShardPlan.to_dict`), ``loader``
            (the loader class that wrote it, :func:`flowers_job.loaders.resolve_loader`), ``epochs`` (1-based epoch numbers, in the
            order to read them), ``shuffle``, ``seed``, ``config`` (a
            ``JobConfig.model_dump(mode="json")``: the image size and the loaders' settings)
            and ``timeout_seconds`` (process-group timeout).

    Returns:
        ``{"row_ids": [rank][epoch_index] -> row ids read (valid rows, in order),
        "padding": [rank][epoch_index] -> padding rows read, "steps": [rank][epoch_index] ->
        batches, "seconds": [rank][epoch_index] -> seconds the epoch took, "rows_read":
        [rank][epoch_index] -> rows read including padding, "image_shapes": [rank][epoch_index]
        -> the set of the batches' ``image`` shapes after the step's input stage,
        "peak_rss_bytes": [rank] -> the rank's peak resident set size}``, identical on every
        rank. The batches go through the training input stage
        (:class:`~flowers_job.train.device_prefetch.DeviceReader`), decoded where
        ``data.decode_device`` says.
    """
    ctx = init_distributed(use_gpu=False, timeout_seconds=float(job.get("timeout_seconds", 300)))
    try:
        reader = _open(job, ctx)
        try:
            mine = _read_epochs(reader, [int(e) for e in job["epochs"]])
        finally:
            reader.close()
        mine["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # type: ignore[assignment]
        gathered: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine)
        result = {key: [g[key] for g in gathered] for key in mine}
        return dict(broadcast_object(result, ctx))
    finally:
        shutdown_distributed()


def _open(job: dict[str, Any], ctx: DistContext) -> DeviceReader:
    """This rank's reader of ``job["plan"]``, opened as training opens it
    (:func:`~flowers_job.train.state.open_reader`)."""
    loader: type[Loader] = job["loader"]
    plan = loader.plan_type(**job["plan"])
    cfg = JobConfig.model_validate(job["config"])
    train, size, resize = bool(job["shuffle"]), cfg.data.image_size, cfg.data.stored_short_side
    on_device = decodes_on_device(cfg.data.decode_device, ctx.device)
    tf = DecodeTransform(train, size, resize, undecoded=on_device).warm_up()
    layout = describe_hosts(ctx)
    loader.check_layout(layout)
    reader = loader.open(
        plan,
        tf,
        rank=layout.shard,
        world_size=ctx.world_size,
        num_nodes=layout.num_nodes,
        shuffle=train,
        seed=int(job["seed"]),
        settings=cfg.loaders,
        workers=cfg.data.loader_workers,
    )
    decoder = BatchDecoder(train, size, resize, ctx.device) if on_device else None
    return DeviceReader(reader, ctx.device, decoder, seed=int(job["seed"]), shard=layout.shard)


def _read_epochs(reader: DeviceReader, epochs: list[int]) -> dict[str, list[Any]]:
    """What this rank read in each of ``epochs``: row ids, padding, steps, rows, seconds,
    image shapes."""
    mine: dict[str, list[Any]] = {
        "row_ids": [],
        "padding": [],
        "steps": [],
        "seconds": [],
        "rows_read": [],
        "image_shapes": [],
    }
    for epoch in epochs:
        t0 = time.perf_counter()
        ids: list[int] = []
        shapes: set[tuple[int, ...]] = set()
        padding = steps = read = 0
        for batch in reader.epoch(epoch):
            valid = batch["valid"].cpu()
            ids.extend(batch["row_id"].cpu()[valid].tolist())
            shapes.add((*batch["image"].shape[1:], batch["image"].dtype == torch.uint8))
            padding += int((~valid).sum())
            read += len(valid)
            steps += 1
        mine["row_ids"].append(ids)
        mine["padding"].append(padding)
        mine["steps"].append(steps)
        mine["rows_read"].append(read)
        mine["image_shapes"].append(sorted(shapes))
        mine["seconds"].append(time.perf_counter() - t0)
    return mine
