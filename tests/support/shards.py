"""Reading a shard plan on real ranks, as training does: :func:`read_plan` runs
:func:`flowers_job.train.shard_read.read_shards` on local TorchDistributor processes."""

from __future__ import annotations

from typing import Any

from flowers_job.config import JobConfig
from flowers_job.loaders import resolve_loader
from flowers_job.loaders.base import ShardPlan

READ_TIMEOUT_SECONDS = 120
"""Bound on each rank's process group and reads (seconds)."""


def read_plan(
    plan: ShardPlan, cfg: JobConfig, world_size: int, epochs: list[int], seed: int = 7
) -> dict[str, Any]:
    """``read_shards`` on ``world_size`` real local TorchDistributor processes (gloo), with
    ``cfg``'s image size and loader settings, shuffled with ``seed``: what each rank read in
    each of ``epochs`` (:func:`~flowers_job.train.shard_read.read_shards`)."""
    from pyspark.ml.torch.distributor import TorchDistributor

    from flowers_job.train.shard_read import read_shards

    job = {
        "plan": plan.to_dict(),
        "loader": resolve_loader(cfg)[1],
        "epochs": epochs,
        "shuffle": True,
        "seed": seed,
        "config": cfg.model_dump(mode="json"),
        "timeout_seconds": READ_TIMEOUT_SECONDS,
    }
    result = TorchDistributor(num_processes=world_size, local_mode=True, use_gpu=False).run(
        read_shards, job
    )
    assert isinstance(result, dict)
    return result
