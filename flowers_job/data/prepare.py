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
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from flowers_job.config import JobConfig
from flowers_job.data.ingest import TABLE_NAMES, read_table_metadata
from flowers_job.data.shards import DataError, ShardPlan, plan_shards, quiet_petastorm

__all__ = ["DataError", "PreparedData", "ShardPlan", "prepare_data"]

log = logging.getLogger(__name__)

LOADER_COLUMNS = ("row_id", "image", "label_index")
_CACHE_CONF = "petastorm.spark.converter.parentCacheDirUrl"


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
        parsed = urlparse(cache_url)
        if parsed.scheme in ("file", "") and Path(parsed.path).exists():
            shutil.rmtree(parsed.path, ignore_errors=True)
