"""The loader boundary with real processes: both loaders, world sizes 2 and 3.

Each case prepares the train split exactly as training does (Delta -> the loader's cache ->
a shard plan), then reads it on every rank with real TorchDistributor processes (gloo)
through :func:`flowers_job.train.shard_read.read_shards`, the same loader code the training loop
uses. It checks the loaders' guarantees for both loaders: every rank runs the same
number of steps, every row is read exactly once per epoch (and the worker's row-count and
checksum checks catch a dropped or repeated row), a new order every epoch, and the same
order when an epoch is read again from a rebuilt cache (as after ``--resume``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from flowers_job.config import JobConfig, load_config
from flowers_job.driver.prepare import prepare_data
from flowers_job.errors import ShardError
from flowers_job.loaders import resolve_loader
from flowers_job.loaders.base import ShardPlan, wrap_int64
from flowers_job.train.metrics import PassSums, check_shard, check_totals
from tests.support.shards import read_plan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.tier("full")]


def _read(
    plan: ShardPlan, cfg: JobConfig, world_size: int, epochs: list[int], seed: int = 7
) -> dict[str, Any]:
    return read_plan(plan, cfg, world_size, epochs, seed)


def _sums(ids: list[int], read: int) -> PassSums:
    """What a rank's epoch sums look like to the worker's checks."""
    return PassSums(0.0, 0, len(ids), wrap_int64(sum(ids)), read)


def _total(parts: list[PassSums]) -> PassSums:
    """The all-reduced sums of ``parts`` (int64 sums wrap, as the collective's do)."""
    return PassSums(
        sum(p.loss_sum for p in parts),
        sum(p.correct for p in parts),
        sum(p.rows for p in parts),
        wrap_int64(sum(p.checksum for p in parts)),
        sum(p.read for p in parts),
    )


@pytest.mark.parametrize(("world_size", "batch"), [(3, 5)])
def test_every_rank_same_steps_every_row_once_new_order_each_epoch_same_after_resume(
    spark: SparkSession, tables: Path, loader: str, world_size: int, batch: int
) -> None:
    """3 ranks, batches of 5: shards that do not divide evenly. (2 ranks, the default, train
    in every end-to-end and fault test, whose ranks run the same row checks every epoch;
    tests/unit/loaders/test_shards.py checks 2-rank plans.)"""
    cfg: JobConfig = load_config(
        None,
        [
            "data.image_size=32",
            f"data.loader={loader}",
            "loaders.petastorm.shuffle_buffer_rows=16",
            f"distributed.num_processes={world_size}",
            f"train.per_device_batch_size={batch}",
        ],
        **{"paths.output_dir": tables},
    )
    expected = sorted(
        r["row_id"]
        for r in spark.read.format("delta")
        .load(str(cfg.paths.table("images")))
        .where("split = 'train'")
        .collect()
    )
    with prepare_data(spark, *resolve_loader(cfg)) as data:
        plan = data.train
        assert plan.loader == loader and plan.dataset_size == len(expected)
        first = _read(plan, cfg, world_size, epochs=[1, 2])
    for e in range(2):
        # Every rank runs the planned number of steps and reads its planned rows.
        assert [first["steps"][r][e] for r in range(world_size)] == [
            plan.steps_per_epoch
        ] * world_size
        assert [first["rows_read"][r][e] for r in range(world_size)] == plan.rows_per_shard
        # Over all ranks, every row exactly once; padding only as planned (Streaming).
        counts = Counter(i for r in range(world_size) for i in first["row_ids"][r][e])
        assert sorted(counts) == expected and set(counts.values()) == {1}
        assert sum(first["padding"][r][e] for r in range(world_size)) == getattr(
            plan, "padding_rows", 0
        )
        # The worker's own checks pass on what was read.
        sums = [_sums(first["row_ids"][r][e], first["rows_read"][r][e]) for r in range(world_size)]
        for rank in range(world_size):
            check_shard("train", plan, rank, sums[rank])
        check_totals("train", plan, _total(sums))
        # ... and fail when a row is dropped or read twice.
        ids = first["row_ids"][0][e]
        for damaged in (ids[1:], [*ids, ids[0]]):
            bad = [_sums(damaged, len(damaged)), *sums[1:]]
            with pytest.raises(ShardError, match="dropped or read twice"):
                check_totals("train", plan, _total(bad))
            if plan.checksum_per_shard is not None:  # Petastorm: each rank's rows are fixed
                with pytest.raises(ShardError, match="rank 0: the train shard read"):
                    check_shard("train", plan, 0, bad[0])
    order = [[i for r in range(world_size) for i in first["row_ids"][r][e]] for e in range(2)]
    assert order[0] != order[1]  # a new order every epoch
    # A resumed run rebuilds the cache from the same Delta table and reads epoch 2 again.
    with prepare_data(spark, *resolve_loader(cfg)) as data:
        again = _read(data.train, cfg, world_size, epochs=[2])
    assert [again["row_ids"][r][0] for r in range(world_size)] == [
        first["row_ids"][r][1] for r in range(world_size)
    ]


@pytest.mark.parametrize("decode", ["loader", "device"])
def test_loader_workers_decode_ahead_and_every_row_is_read_once(
    spark: SparkSession, tables: Path, loader: str, decode: str
) -> None:
    """``data.loader_workers=2``: reading (and with ``data.decode_device=loader``, decoding)
    moves to 2 processes per rank (Streaming's DataLoader workers; Petastorm's process
    pool), and the invariants hold: the planned steps and rows on every rank, every row
    once per epoch. With ``decode_device=device`` the workers deliver the stored JPEGs
    undecoded and the rank's input stage decodes each batch at once (on the CPU here, the
    module a GPU runs): the same rows, as uint8 ``[3, 32, 32]`` images."""
    cfg: JobConfig = load_config(
        None,
        [
            "data.image_size=32",
            f"data.loader={loader}",
            "data.loader_workers=2",
            f"data.decode_device={decode}",
            "loaders.petastorm.reader_pool_type=process",
            "loaders.petastorm.shuffle_buffer_rows=16",
            "loaders.streaming.prefetch_batches=2",
            "distributed.num_processes=2",
            "train.per_device_batch_size=8",
        ],
        **{"paths.output_dir": tables},
    )
    expected = sorted(
        r["row_id"]
        for r in spark.read.format("delta")
        .load(str(cfg.paths.table("images")))
        .where("split = 'train'")
        .collect()
    )
    with prepare_data(spark, *resolve_loader(cfg)) as data:
        plan = data.train
        result = _read(plan, cfg, 2, epochs=[1])
    assert [result["steps"][r][0] for r in range(2)] == [plan.steps_per_epoch] * 2
    assert [result["rows_read"][r][0] for r in range(2)] == plan.rows_per_shard
    counts = Counter(i for r in range(2) for i in result["row_ids"][r][0])
    assert sorted(counts) == expected and set(counts.values()) == {1}
    assert [result["image_shapes"][r][0] for r in range(2)] == [[(3, 32, 32, True)]] * 2
