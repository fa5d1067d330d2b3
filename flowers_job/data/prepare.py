"""Prepare (driver side): Delta tables -> repartitioned Petastorm caches and a shard plan.

Each split is read from its Delta table, repartitioned to ``num_partitions`` (a
multiple of ``world_size``; the guides use ``2 x devices``) and materialised by
Petastorm's ``make_spark_converter`` into a per-run cache directory that is removed
when the run ends.

Petastorm shards by row group: shard ``r`` of ``world_size`` reads the row groups
whose index ``i`` satisfies ``i % world_size == r`` (petastorm ``Reader._partition_row_groups``).
The driver reads the Parquet footers, computes each shard's exact row count and a row
checksum, and fixes ``steps_per_epoch`` so that every rank runs the same number of
steps and reads every row of its shard once per epoch (see :class:`ShardPlan`).
"""

from __future__ import annotations

import logging
import math
import shutil
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from flowers_job.config import JobConfig
from flowers_job.data.ingest import TABLE_NAMES, read_table_metadata

__all__ = [
    "CHECKSUM_MODULUS",
    "DataError",
    "PreparedData",
    "ShardPlan",
    "plan_shards",
    "prepare_data",
]

log = logging.getLogger(__name__)

CHECKSUM_MODULUS = 2**31
"""Row checksum = sum of ``row_id mod 2**31``: exact in float64 up to 2**22 rows per shard."""
LOADER_COLUMNS = ("row_id", "image", "label_index")
_CACHE_CONF = "petastorm.spark.converter.parentCacheDirUrl"


class DataError(RuntimeError):
    """The tables cannot be trained on as they are (missing, inconsistent, too small)."""


@dataclass(frozen=True)
class ShardPlan:
    """How one split is read by ``world_size`` ranks. Plain data: it is sent to the workers.

    Attributes:
        cache_dir_url: Petastorm cache directory of this split (``file://`` URL).
        file_urls: Parquet files of the cache, in Petastorm's order.
        dataset_size: rows in the split.
        rows_per_shard: rows read by each rank per epoch (index = rank).
        checksum_per_shard: sum of ``row_id mod CHECKSUM_MODULUS`` over each shard's rows.
        steps_per_epoch: batches per epoch, the same on every rank:
            ``max_r ceil(rows_per_shard[r] / per_device_batch_size)``. Rank ``r`` splits its
            rows into that many batches of ``floor`` or ``ceil(rows_r / steps_per_epoch)``
            rows, so no rank pads, drops or repeats a row.
        per_device_batch_size: nominal images per rank per step (the largest batch).
    """

    cache_dir_url: str
    file_urls: list[str]
    dataset_size: int
    rows_per_shard: list[int]
    checksum_per_shard: list[int]
    steps_per_epoch: int
    per_device_batch_size: int

    def batch_sizes(self, rank: int) -> list[int]:
        """Per-step batch sizes of ``rank``: ``steps_per_epoch`` numbers summing to its rows."""
        q, r = divmod(self.rows_per_shard[rank], self.steps_per_epoch)
        return [q + 1] * r + [q] * (self.steps_per_epoch - r)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardPlan:
        return cls(**d)


def _local_path(url: str) -> str:
    parsed = urlparse(url)
    return parsed.path if parsed.scheme in ("file", "") else url


def plan_shards(
    file_urls: list[str], world_size: int, per_device_batch_size: int
) -> tuple[list[int], list[int], int]:
    """Rows and row checksum per Petastorm shard, and the common steps per epoch.

    Uses Petastorm's own row-group listing (``load_row_groups``) and its shard rule
    (row group ``i`` goes to shard ``i % world_size``).

    Returns:
        ``(rows_per_shard, checksum_per_shard, steps_per_epoch)``.

    Raises:
        DataError: fewer row groups than ranks, or shards so uneven that the smallest cannot
            fill ``steps_per_epoch`` batches.
    """
    import pyarrow.parquet as pq
    from petastorm.etl.dataset_metadata import load_row_groups
    from petastorm.fs_utils import get_filesystem_and_path_or_paths

    fs, paths = get_filesystem_and_path_or_paths(file_urls)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # pyarrow's legacy dataset API
        dataset = pq.ParquetDataset(paths, filesystem=fs, validate_schema=False)
        pieces = load_row_groups(dataset)
    if len(pieces) < world_size:
        raise DataError(
            f"{len(pieces)} Parquet row groups for {world_size} ranks: Petastorm needs at least "
            "one row group per rank; raise data.partitions_per_process"
        )
    rows = [0] * world_size
    checksum = [0] * world_size
    for i, piece in enumerate(pieces):
        with fs.open(piece.path, "rb") as f:
            table = pq.ParquetFile(f).read_row_group(piece.row_group, columns=["row_id"])
        ids = table.column("row_id").to_pylist()
        rows[i % world_size] += len(ids)
        checksum[i % world_size] += sum(x % CHECKSUM_MODULUS for x in ids)
    steps = max(math.ceil(n / per_device_batch_size) for n in rows)
    if min(rows) < steps:
        raise DataError(
            f"uneven shards {rows}: the smallest cannot fill {steps} steps of at most "
            f"{per_device_batch_size} images; raise data.partitions_per_process or "
            "lower train.per_device_batch_size"
        )
    return rows, checksum, steps


@dataclass
class PreparedData:
    """The per-run caches and plans. ``train``/``val`` are sent to the workers as dicts."""

    train: ShardPlan
    val: ShardPlan
    num_partitions: int
    label_names: list[str]
    cache_dir_url: str


def _check_tables(spark: SparkSession, cfg: JobConfig) -> list[str]:
    metas = {name: read_table_metadata(spark, cfg.paths.table(name)) for name in TABLE_NAMES}
    missing = [cfg.paths.table(n) for n, m in metas.items() if m is None]
    if missing:
        raise DataError(
            f"no flowers_job Delta table at {', '.join(map(str, missing))}; run `flowers-job "
            "ingest` (or `run`) first"
        )
    fingerprints = {str(m["fingerprint"]) for m in metas.values() if m}
    if len(fingerprints) != 1:
        raise DataError(
            f"the tables under {cfg.paths.tables_dir} come from different ingests (an interrupted "
            "ingest?); run `flowers-job ingest` again"
        )
    meta = metas["images"]
    assert meta is not None
    return [str(x) for x in meta["label_names"]]  # type: ignore[attr-defined]


@contextmanager
def prepare_data(spark: SparkSession, cfg: JobConfig) -> Iterator[PreparedData]:
    """Materialise the train and val splits for Petastorm; remove the cache on exit.

    Yields:
        :class:`PreparedData` with one :class:`ShardPlan` per split.

    Raises:
        DataError: missing or inconsistent tables, an empty split, or unworkable shards.
    """
    from petastorm.spark import make_spark_converter

    from flowers_job.train.loader import quiet_petastorm

    quiet_petastorm()
    label_names = _check_tables(spark, cfg)
    num_partitions = cfg.num_partitions
    cache_url = f"{cfg.paths.cache_parent_url}/run-{uuid.uuid4().hex[:12]}"
    spark.conf.set(_CACHE_CONF, cache_url)
    converters = []
    try:
        plans = {}
        for split in ("train", "val"):
            df = (
                spark.read.format("delta")
                .load(str(cfg.paths.table(split)))
                .select(*LOADER_COLUMNS)
                .withColumn("label_index", F.col("label_index").cast("long"))
                .repartition(num_partitions)
            )
            # Row groups of at most ~32 MB, one file per partition: images are already JPEG,
            # so no compression.
            converter = make_spark_converter(df, compression_codec="uncompressed")
            converters.append(converter)
            if len(converter) == 0:
                raise DataError(f"the {split} table {cfg.paths.table(split)} is empty")
            file_urls = list(converter.file_urls)
            rows, checksum, steps = plan_shards(
                file_urls, cfg.world_size, cfg.train.per_device_batch_size
            )
            plans[split] = ShardPlan(
                cache_dir_url=converter.cache_dir_url,
                file_urls=file_urls,
                dataset_size=len(converter),
                rows_per_shard=rows,
                checksum_per_shard=checksum,
                steps_per_epoch=steps,
                per_device_batch_size=cfg.train.per_device_batch_size,
            )
            log.info(
                "%s: %d rows in %d partitions, rows per shard %s, %d steps per epoch",
                split,
                len(converter),
                num_partitions,
                rows,
                steps,
            )
        yield PreparedData(plans["train"], plans["val"], num_partitions, label_names, cache_url)
    finally:
        for converter in converters:
            try:
                converter.delete()
            except OSError as exc:  # pragma: no cover - best effort, the rmtree follows
                log.warning("could not delete Petastorm cache %s: %s", converter.cache_dir_url, exc)
        local = Path(_local_path(cache_url))
        if urlparse(cache_url).scheme in ("file", "") and local.exists():
            shutil.rmtree(local, ignore_errors=True)
