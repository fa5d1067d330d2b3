"""Repartitioning and Petastorm shards, read with real Petastorm readers in this process.

Every rank must run the same number of steps and, over all ranks, read every row
exactly once per epoch; shards stay within a row of each other however uneven the input
partitions are, and the row checksums stay exact at any size. Both loaders, with real
processes: ``unit/loaders/test_loaders.py``.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterable, Iterator
from dataclasses import replace
from functools import reduce
from pathlib import Path

import pytest
import torch
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from flowers_job.config import load_config
from flowers_job.driver.prepare import prepare_data
from flowers_job.errors import DataError, ShardError
from flowers_job.loaders import resolve_loader
from flowers_job.loaders.base import Sharding, ShardPlan, rebatch, row_stats, wrap_int64
from flowers_job.loaders.petastorm.balanced import cache_partitions
from flowers_job.loaders.petastorm.loader import PetastormLoader
from flowers_job.loaders.petastorm.plan import PetastormPlan, footer_rows, plan_shards
from flowers_job.loaders.petastorm.reader import shard_batches
from flowers_job.location import Location
from flowers_job.train.metrics import PassSums, check_shard, check_totals
from flowers_job.vision.decode_transform import DecodeTransform
from tests.support.data import loader_skip_reason

pytestmark = [pytest.mark.timeout(600), pytest.mark.tier("gate")]
_PETASTORM = loader_skip_reason("petastorm")
petastorm_only = pytest.mark.skipif(_PETASTORM is not None, reason=str(_PETASTORM))
_STREAMING = loader_skip_reason("streaming")


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
    with prepare_data(spark, *resolve_loader(cfg)) as data:
        assert data.num_partitions == world_size * per_process
        assert isinstance(data.train, PetastormPlan)
        assert len(data.train.file_urls) == data.num_partitions  # one file per partition
        expected = {
            r["row_id"]: r["label_index"]
            for r in spark.read.format("delta")
            .load(str(cfg.paths.table("images")))
            .where("split = 'train'")
            .collect()
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
    assert cache.is_dir()  # the cache entry stays for the next run on this version
    assert not list((tables / "loader_cache").glob("run-*"))  # the staging folder does not


@petastorm_only
def test_every_epoch_reads_the_same_rows_in_a_new_order(spark: SparkSession, tables: Path) -> None:
    cfg = load_config(
        None,
        ["data.image_size=32", "data.loader=petastorm", "train.per_device_batch_size=4"],
        **{"paths.output_dir": tables},
    )
    with prepare_data(spark, *resolve_loader(cfg)) as data:
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


def _parquet_files(folder: Path, row_groups: list[int]) -> tuple[list[str], list[tuple[int, int]]]:
    """One real Parquet file per row group, ``row_id`` numbered from 0, as ``file://`` URLs,
    and each file's ``(rows, checksum)``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    urls, sums, start = [], [], 0
    for i, n in enumerate(row_groups):
        path = folder / f"part-{i:05d}.parquet"
        pq.write_table(pa.table({"row_id": pa.array(range(start, start + n), pa.int64())}), path)
        urls.append(path.resolve().as_uri())
        sums.append((n, sum(range(start, start + n))))
        start += n
    return urls, sums


@petastorm_only
def test_a_train_shard_smaller_than_one_batch_is_refused_with_the_sizes(tmp_path: Path) -> None:
    """Read by Petastorm's own row-group listing: shard 0 holds 5 rows, shard 1 holds 3."""
    urls, sums = _parquet_files(tmp_path, [5, 3])
    with pytest.raises(DataError) as err:
        plan_shards(urls, sums, 2, 4, full_batches=True)
    message = str(err.value)
    for part in ("train.per_device_batch_size=4", "global batch size 8", "world_size 2", "[5, 3]"):
        assert part in message
    assert "<= 3" in message  # what would work
    # Validation has no optimizer step: a shard smaller than a batch is evaluated as it is.
    assert plan_shards(urls, sums, 2, 4) == ([5, 3], [0 + 1 + 2 + 3 + 4, 5 + 6 + 7], 2)
    assert plan_shards(urls, sums, 2, 3, full_batches=True)[2] == 2  # every shard holds a batch


def test_training_refuses_too_large_a_batch_before_any_worker_starts(
    spark: SparkSession, tables: Path, loader: str
) -> None:
    """The real path: Delta -> the loader's cache -> shard plan, then no TorchDistributor."""
    import mlflow

    from flowers_job.driver.pipeline import run_training

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


def _skewed_split(spark: SparkSession, sizes: list[int], image: bytes) -> DataFrame:
    """A split (``row_id`` = xxhash64, ``image``, ``label_index``) whose Spark partitions hold
    ``sizes`` rows: a union of one single-partition range per size."""
    parts = [spark.range(i * 10**6, i * 10**6 + n, numPartitions=1) for i, n in enumerate(sizes)]
    return reduce(DataFrame.unionByName, parts).select(
        F.xxhash64("id").alias("row_id"),
        F.lit(bytearray(image)).alias("image"),
        (F.col("id") % 5).alias("label_index"),
    )


def _jpeg() -> bytes:
    """A small real JPEG (12 x 10 px), so that Petastorm's readers decode every row."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (12, 10), (200, 30, 90)).save(out, format="JPEG")
    return out.getvalue()


SKEWED = [300, 7, 41, 1]
"""Rows of the input partitions of the skewed split (349 in all)."""


@petastorm_only
@pytest.mark.parametrize("world_size", [2, 3])
def test_petastorm_shards_stay_within_one_row_whatever_the_input_partitions(
    spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, world_size: int
) -> None:
    """Input partitions of 300, 7, 41 and 1 rows, and images worth ~9 cache partitions: the
    cache has more partitions than configured (bytes decide), each of floor or ceil(N/P)
    rows, one row group per file; Petastorm's readers read exactly the planned rows and
    checksum per shard, every row once."""
    from flowers_job.loaders.petastorm import balanced

    jpeg = _jpeg()
    df = _skewed_split(spark, SKEWED, jpeg)
    rows = sum(SKEWED)
    monkeypatch.setattr(balanced, "PARTITION_BYTES", rows * len(jpeg) // 9)
    cfg = load_config(
        None,
        [
            "data.image_size=32",
            "data.loader=petastorm",
            f"distributed.num_processes={world_size}",
            "train.per_device_batch_size=8",
        ],
        **{"paths.output_dir": tmp_path},
    )
    sharding = Sharding(cfg.world_size, cfg.num_partitions, cfg.train.per_device_batch_size)
    plan = PetastormLoader(sharding, "a test frame").write(
        spark, df, Location.of(tmp_path / "cache"), "train"
    )
    assert isinstance(plan, PetastormPlan)
    partitions = cache_partitions(rows * len(jpeg), world_size, cfg.num_partitions)
    assert len(plan.file_urls) == partitions > cfg.num_partitions
    assert footer_rows(plan.file_urls) == [
        rows // partitions + (j < rows % partitions) for j in range(partitions)
    ]
    assert max(plan.rows_per_shard) - min(plan.rows_per_shard) <= 1
    expected = [int(r["row_id"]) for r in df.select("row_id").collect()]
    assert plan.dataset_size == rows and plan.checksum == wrap_int64(sum(expected))
    seen: list[int] = []
    for rank in range(world_size):
        ids = [
            i
            for b in _read_epoch(plan, rank, world_size, shuffle=False)
            for i in b["row_id"].tolist()
        ]
        assert len(ids) == plan.rows_per_shard[rank]
        assert plan.checksum_per_shard is not None
        assert wrap_int64(sum(ids)) == plan.checksum_per_shard[rank]
        seen.extend(ids)
    assert sorted(seen) == sorted(expected)


@pytest.mark.skipif(_STREAMING is not None, reason=str(_STREAMING))
def test_streaming_shards_are_equal_whatever_the_input_partitions(
    spark: SparkSession, tmp_path: Path
) -> None:
    """The same skewed split as MDS for 3 ranks: 349 rows + 2 padding, 117 per rank."""
    from flowers_job.loaders.streaming.streaming_loader import write_mds

    df = _skewed_split(spark, SKEWED, b"\xff" * 64)
    plan = write_mds(
        df,
        tmp_path / "mds-train",
        world_size=3,
        num_partitions=2,
        per_device_batch_size=8,
        full_batches=True,
        split="train",
    )
    assert plan.rows_per_shard == [117, 117, 117] and plan.padding_rows == 2
    expected = [int(r["row_id"]) for r in df.select("row_id").collect()]
    assert plan.dataset_size == 349 and plan.checksum == wrap_int64(sum(expected))


def test_row_checksums_are_exact_at_twenty_million_rows(spark: SparkSession) -> None:
    """20 million ``row_id = xxhash64(id)`` (no images), each Spark partition standing for a
    rank: the driver's Spark checksum equals what the ranks' torch int64 sums, added as the
    int64 all-reduce adds them, give; check_totals passes; a dropped, repeated or swapped
    row is caught. The float64 sums of before passed 2**53 at ~8.4M rows."""
    import pyarrow as pa

    n = 20_000_000
    df = spark.range(n, numPartitions=4).select(F.xxhash64("id").alias("row_id"))
    rows, checksum = row_stats(df)

    def rank_sums(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from flowers_job.train.metrics import row_checksum

        total, count, exact = torch.zeros((), dtype=torch.int64), 0, 0
        for b in batches:
            ids = torch.from_numpy(b.column("row_id").to_numpy())
            total += row_checksum(ids)
            count += len(ids)
            # the exact sum, for the test: high and low 32 bits summed apart (no overflow)
            exact += int((ids >> 32).sum()) * 2**32 + int((ids & 0xFFFFFFFF).sum())
        yield pa.RecordBatch.from_pydict(
            {"rows": [count], "checksum": [int(total)], "exact": [str(exact)]}
        )

    collected = df.mapInArrow(rank_sums, "rows long, checksum long, exact string").collect()
    ranks = [PassSums(0.0, 0, r["rows"], r["checksum"], r["rows"]) for r in collected]
    exact = sum(int(r["exact"]) for r in collected)
    assert len(ranks) == 4
    reduced = torch.tensor([p.counts() for p in ranks], dtype=torch.int64).sum(0)  # as gloo does
    totals = PassSums(0.0, *(int(x) for x in reduced))
    plan = ShardPlan(
        loader="petastorm",
        cache_dir_url="file:///nowhere",
        dataset_size=rows,
        checksum=checksum,
        rows_per_shard=[p.read for p in ranks],
        checksum_per_shard=[p.checksum for p in ranks],
        steps_per_epoch=1,
        per_device_batch_size=1,
    )
    assert rows == n and totals.rows == n
    assert abs(exact) > 2**63 and checksum == wrap_int64(exact)  # the sum wraps: int64 is needed
    for rank, sums in enumerate(ranks):
        check_shard("train", plan, rank, sums)
    check_totals("train", plan, totals)
    first, other = (int(r[0]) for r in spark.range(2).select(F.xxhash64(F.col("id") * n)).collect())
    for rows_read, change in ((n - 1, -first), (n + 1, first), (n, other - first)):
        damaged = replace(totals, rows=rows_read, checksum=wrap_int64(totals.checksum + change))
        with pytest.raises(ShardError, match="dropped or read twice"):
            check_totals("train", plan, damaged)
    with pytest.raises(ShardError, match="rank 0: the train shard read"):
        check_shard(
            "train", plan, 0, replace(ranks[0], checksum=wrap_int64(ranks[0].checksum - first))
        )
