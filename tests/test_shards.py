"""Repartitioning and Petastorm shards, read with real Petastorm readers in this process.

Every rank must run the same number of steps and, over all ranks, read every row
exactly once per epoch. Both loaders, with real processes: ``test_loaders.py``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from pyspark.sql import SparkSession

from flowers_job.config import load_config
from flowers_job.data.images import DecodeTransform
from flowers_job.data.prepare import prepare_data
from flowers_job.errors import DataError, ShardError
from flowers_job.loaders.petastorm import PetastormPlan, plan_shards, rebatch, shard_batches

from .conftest import loader_skip_reason

pytestmark = pytest.mark.timeout(600)
_PETASTORM = loader_skip_reason("petastorm")
petastorm_only = pytest.mark.skipif(_PETASTORM is not None, reason=str(_PETASTORM))


def _read_epoch(
    plan, rank: int, world_size: int, shuffle: bool, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    tf = DecodeTransform(shuffle, 32, 37)
    return list(
        shard_batches(
            plan, rank, world_size, tf, shuffle=shuffle, seed=seed, shuffle_buffer_rows=16
        )
    )


@petastorm_only
@pytest.mark.parametrize(("world_size", "per_process", "batch"), [(2, 2, 8), (3, 1, 5), (2, 3, 4)])
def test_shards_are_disjoint_cover_every_row_and_run_equal_steps(
    spark: SparkSession, tables: Path, world_size: int, per_process: int, batch: int
) -> None:
    cfg = load_config(
        None,
        [
            "data.image_size=32",
            "data.loader=petastorm",
            f"distributed.num_processes={world_size}",
            f"data.partitions_per_process={per_process}",
            f"train.per_device_batch_size={batch}",
        ],
        **{"paths.output_dir": tables},
    )
    with prepare_data(spark, cfg) as data:
        assert data.num_partitions == world_size * per_process
        assert isinstance(data.train, PetastormPlan)
        assert len(data.train.file_urls) == data.num_partitions  # one file per partition
        expected = {
            r["row_id"]: r["label_index"]
            for r in spark.read.format("delta").load(str(cfg.paths.table("train"))).collect()
        }
        assert data.train.dataset_size == len(expected)
        seen: list[int] = []
        steps = []
        for rank in range(world_size):
            batches = _read_epoch(data.train, rank, world_size, shuffle=True, seed=rank)
            steps.append(len(batches))
            for b in batches:
                assert b["image"].shape[1:] == (3, 32, 32) and b["image"].dtype == torch.uint8
                assert 0 < len(b["label_index"]) <= batch
                for rid, lab in zip(b["row_id"].tolist(), b["label_index"].tolist(), strict=True):
                    assert expected[rid] == lab
                seen.extend(b["row_id"].tolist())
        assert steps == [data.train.steps_per_epoch] * world_size
        assert sorted(seen) == sorted(expected)  # disjoint and complete: each row exactly once
        cache = Path(data.cache_dir_url.removeprefix("file://"))
        assert cache.is_dir()
    assert not cache.exists()  # the per-run cache is removed when the run ends


@petastorm_only
def test_every_epoch_reads_the_same_rows_in_a_new_order(spark: SparkSession, tables: Path) -> None:
    cfg = load_config(
        None,
        ["data.image_size=32", "data.loader=petastorm", "train.per_device_batch_size=4"],
        **{"paths.output_dir": tables},
    )
    with prepare_data(spark, cfg) as data:
        a = [
            i
            for b in _read_epoch(data.train, 0, 2, shuffle=True, seed=1)
            for i in b["row_id"].tolist()
        ]
        b = [
            i
            for b in _read_epoch(data.train, 0, 2, shuffle=True, seed=2)
            for i in b["row_id"].tolist()
        ]
        v = [i for b in _read_epoch(data.val, 1, 2, shuffle=False) for i in b["row_id"].tolist()]
    assert sorted(a) == sorted(b) and a != b
    assert len(v) == data.val.rows_per_shard[1]


def test_rebatch_cuts_exact_sizes_and_detects_short_or_long_shards() -> None:
    stream = [{"label_index": torch.arange(i, i + n)} for i, n in ((0, 4), (4, 4), (8, 3))]
    out = list(rebatch(stream, [4, 4, 3]))
    assert [len(b["label_index"]) for b in out] == [4, 4, 3]
    assert torch.cat([b["label_index"] for b in out]).tolist() == list(range(11))
    out = list(rebatch(stream, [3, 3, 3, 2]))
    assert [len(b["label_index"]) for b in out] == [3, 3, 3, 2]
    with pytest.raises(ShardError, match="ended after 11 rows"):
        list(rebatch(stream, [4, 4, 4]))
    with pytest.raises(ShardError, match="holds 11 rows"):
        list(rebatch(stream, [4, 4]))


def _parquet_files(folder: Path, row_groups: list[int]) -> list[str]:
    """One real Parquet file per row group, ``row_id`` numbered from 0, as ``file://`` URLs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    urls, start = [], 0
    for i, n in enumerate(row_groups):
        path = folder / f"part-{i:05d}.parquet"
        pq.write_table(pa.table({"row_id": pa.array(range(start, start + n), pa.int64())}), path)
        urls.append(path.resolve().as_uri())
        start += n
    return urls


@petastorm_only
def test_a_train_shard_smaller_than_one_batch_is_refused_with_the_sizes(tmp_path: Path) -> None:
    """Read by Petastorm's own row-group listing: shard 0 holds 5 rows, shard 1 holds 3."""
    urls = _parquet_files(tmp_path, [5, 3])
    with pytest.raises(DataError) as err:
        plan_shards(urls, 2, 4, full_batches=True)
    message = str(err.value)
    for part in ("train.per_device_batch_size=4", "global batch size 8", "world_size 2", "[5, 3]"):
        assert part in message
    assert "<= 3" in message  # what would work
    # Validation has no optimizer step: a shard smaller than a batch is evaluated as it is.
    assert plan_shards(urls, 2, 4) == ([5, 3], [0 + 1 + 2 + 3 + 4, 5 + 6 + 7], 2)
    assert plan_shards(urls, 2, 3, full_batches=True)[2] == 2  # every shard holds a batch


def test_training_refuses_too_large_a_batch_before_any_worker_starts(
    spark: SparkSession, tables: Path, loader: str
) -> None:
    """The real path: Delta -> the loader's cache -> shard plan, then no TorchDistributor."""
    import mlflow

    from flowers_job.pipeline import run_training

    cfg = load_config(
        None,
        [
            "data.image_size=32",
            f"data.loader={loader}",
            "train.per_device_batch_size=64",
            "train.epochs=1",
        ],
        **{"paths.output_dir": tables},
    )
    t0 = time.perf_counter()
    with pytest.raises(DataError, match=r"train\.per_device_batch_size=64 \(global batch size 128"):
        run_training(spark, cfg)
    print(f"batch larger than a shard: DataError after {time.perf_counter() - t0:.1f} s")
    assert not cfg.paths.checkpoint_dir.exists()  # no rank ever ran
    client = mlflow.MlflowClient(tracking_uri=cfg.tracking_uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment_name)
    assert experiment is not None and not client.search_runs([experiment.experiment_id])
    assert not list((tables / "loader_cache").glob("run-*"))  # cache removed
