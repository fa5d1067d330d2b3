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

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from flowers_job.config import JobConfig
from flowers_job.data.ingest import (
    TABLE_NAMES,
    TABLE_SCHEMAS,
    read_table_metadata,
    tables_mismatch,
)
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
    """Check that the four tables are one complete ingest that training can read.

    Runs before any Petastorm cache is written. Checks, in order: every table is a
    flowers_job Delta table; all four come from the same ingest run (:func:`tables_mismatch`);
    each has the expected columns and types; ``images``, ``train`` and ``val`` have rows; and
    the labels in ``train`` and ``val`` are the ``label_names`` recorded at ingest, with
    their recorded indices.

    Returns:
        The recorded label names; a label's index is its position.

    Raises:
        DataError: naming the table path and the problem (missing tables, tables from
            different ingests, missing/extra/wrongly typed columns, an empty table, or labels
            that differ from the recorded ones, naming both sets).
    """
    paths = {name: cfg.paths.table(name) for name in TABLE_NAMES}
    metas = {name: read_table_metadata(spark, path) for name, path in paths.items()}
    missing = [paths[n] for n, m in metas.items() if m is None]
    if missing:
        raise DataError(
            f"no flowers_job Delta table at {', '.join(map(str, missing))}; run `flowers-job "
            "ingest` (or `run`) first"
        )
    mismatch = tables_mismatch(metas)
    if mismatch:
        raise DataError(
            f"the tables under {cfg.paths.tables_dir} come from different ingests ({mismatch}); "
            "an ingest was interrupted or another one wrote since: run `flowers-job ingest` "
            "again, it rewrites all four"
        )
    tables = {name: spark.read.format("delta").load(str(path)) for name, path in paths.items()}
    for name, df in tables.items():
        _check_schema(name, paths[name], df.schema)
    for name in ("images", "train", "val"):
        if tables[name].isEmpty():
            raise DataError(
                f"the {name} table {paths[name]} is empty; training needs rows in images, "
                "train and val: add photos (or change data.val_fraction) and ingest again"
            )
    meta = metas["images"]
    assert meta is not None
    label_names = [str(x) for x in meta["label_names"]]  # type: ignore[attr-defined]
    _check_labels(tables["train"], tables["val"], label_names, cfg.paths.tables_dir)
    return label_names


def _check_schema(name: str, path: Path, schema: StructType) -> None:
    """Raise ``DataError`` naming the missing, extra and wrongly typed columns of a table."""
    expected = {f.name: f.dataType for f in TABLE_SCHEMAS[name].fields}
    actual = {f.name: f.dataType for f in schema.fields}
    problems = []
    if missing := [c for c in expected if c not in actual]:
        problems.append(f"missing columns {missing}")
    if extra := [c for c in actual if c not in expected]:
        problems.append(f"extra columns {extra}")
    if wrong := [
        f"{c} is {actual[c].simpleString()}, expected {t.simpleString()}"
        for c, t in expected.items()
        if c in actual and actual[c] != t
    ]:
        problems.append("wrong types: " + ", ".join(wrong))
    if problems:
        raise DataError(
            f"the {name} table {path} does not have the expected schema: "
            + "; ".join(problems)
            + "; run `flowers-job ingest` again to rewrite it"
        )


def _check_labels(train: DataFrame, val: DataFrame, label_names: list[str], where: Path) -> None:
    """Raise ``DataError`` if the (label, label_index) pairs in train and val differ from
    ``label_names`` (a label's index is its position), naming both label sets."""
    pairs = {
        (r["label"], r["label_index"])
        for df in (train, val)
        for r in df.select("label", "label_index").distinct().limit(10_000).collect()
    }
    found = sorted({str(label) for label, _ in pairs})
    if found != sorted(label_names):
        raise DataError(
            f"the labels in the train and val tables under {where}, {found}, differ from the "
            f"label_names recorded at ingest, {label_names} (missing "
            f"{sorted(set(label_names) - set(found))}, unexpected "
            f"{sorted(set(found) - set(label_names))}); run `flowers-job ingest` again"
        )
    wrong = sorted(
        f"{label}: {index} (expected {label_names.index(label)})"
        for label, index in pairs
        if index != label_names.index(label)
    )
    if wrong:
        raise DataError(
            f"label_index in the train and val tables under {where} does not match the "
            f"label_names recorded at ingest, {label_names}: {', '.join(wrong)}; run "
            "`flowers-job ingest` again"
        )


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
