"""Read a split through the loader boundary on every rank, without a model.

:func:`read_shards` is a TorchDistributor training function like
:func:`flowers_job.train.worker.train_worker`, but it only reads: each rank opens its
loader exactly as training does and iterates the requested epochs. Rank 0 gathers what every
rank read and returns it (broadcast, so every rank returns the same value: STACK.md trap 4).
The tests use it to check the shard invariants of both loaders with real processes, and
``benchmarks/loaders.py`` to time them.
"""

from __future__ import annotations

import resource
import time
from typing import Any

import torch.distributed as dist

from flowers_job.data.shards import ShardPlan
from flowers_job.distributed import (
    broadcast_object,
    describe_hosts,
    init_distributed,
    shutdown_distributed,
)
from flowers_job.train.loader import DecodeTransform, open_loader

__all__ = ["read_shards"]


def read_shards(job: dict[str, Any]) -> dict[str, Any]:
    """Read ``job["epochs"]`` epochs of ``job["plan"]`` on every rank.

    Args:
        job: ``plan`` (:meth:`ShardPlan.to_dict`), ``epochs`` (1-based epoch numbers, in the
            order to read them), ``shuffle``, ``seed``, ``image_size``, ``resize_size``,
            ``data`` (the ``data`` config section as a dict) and
            ``timeout_seconds`` (process-group timeout).

    Returns:
        ``{"row_ids": [rank][epoch_index] -> row ids read (valid rows, in order),
        "padding": [rank][epoch_index] -> padding rows read, "steps": [rank][epoch_index] ->
        batches, "seconds": [rank][epoch_index] -> seconds the epoch took, "rows_read":
        [rank][epoch_index] -> rows read including padding, "peak_rss_bytes": [rank] -> the
        rank's peak resident set size}``, identical on every rank.
    """
    ctx = init_distributed(use_gpu=False, timeout_seconds=float(job.get("timeout_seconds", 300)))
    try:
        plan = ShardPlan.from_dict(job["plan"])
        tf = DecodeTransform(
            bool(job["shuffle"]),
            int(job["image_size"]),
            int(job["resize_size"]),
        ).warm_up()  # every reader starts its first epoch with the transform built
        num_nodes = describe_hosts(ctx) or 1
        loader = open_loader(
            plan,
            ctx.rank,
            ctx.world_size,
            num_nodes,
            tf,
            shuffle=bool(job["shuffle"]),
            seed=int(job["seed"]),
            data=dict(job.get("data", {})),
        )
        mine: dict[str, list[Any]] = {
            "row_ids": [],
            "padding": [],
            "steps": [],
            "seconds": [],
            "rows_read": [],
        }
        try:
            for epoch in job["epochs"]:
                t0 = time.perf_counter()
                ids: list[int] = []
                padding = steps = read = 0
                for batch in loader.epoch(int(epoch)):
                    valid = batch["valid"]
                    ids.extend(batch["row_id"][valid].tolist())
                    padding += int((~valid).sum())
                    read += len(valid)
                    steps += 1
                mine["row_ids"].append(ids)
                mine["padding"].append(padding)
                mine["steps"].append(steps)
                mine["rows_read"].append(read)
                mine["seconds"].append(time.perf_counter() - t0)
        finally:
            loader.close()
        mine["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # type: ignore[assignment]
        gathered: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine)
        result = {key: [g[key] for g in gathered] for key in mine}
        return dict(broadcast_object(result, ctx))
    finally:
        shutdown_distributed()
