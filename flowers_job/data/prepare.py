"""Prepare (driver side): Delta tables -> this run's loader cache and a shard plan per split.

Each split is read from its Delta table, at the Delta version recorded in the run's lineage,
and handed to the configured loader (``data.loader``, resolved by
:func:`flowers_job.loaders.resolve_loader`), which writes it into the run's cache folder
(:func:`flowers_job.data.cache.run_cache`) and plans how ``world_size`` ranks read it
(:class:`~flowers_job.loaders.base.ShardPlan`). The cache is removed when the run ends,
however it ends. Which loader it is does not matter here: see :mod:`flowers_job.loaders`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from flowers_job.config import JobConfig
from flowers_job.data.cache import cache_bytes_needed, check_cache_space, run_cache
from flowers_job.data.files import digest, hash_sums
from flowers_job.data.tables import SPLITS, CheckedTables, checked_tables
from flowers_job.errors import DataError
from flowers_job.loaders import loader_class
from flowers_job.loaders.base import ShardPlan

__all__ = [
    "LOADER_COLUMNS",
    "DataError",
    "PreparedData",
    "example_images",
    "lineage",
    "prepare_data",
    "split_digest",
]

log = logging.getLogger(__name__)

LOADER_COLUMNS = ("row_id", "image", "label_index")
"""The columns a loader writes: ``row_id`` long, ``image`` binary, ``label_index`` long."""


@dataclass
class PreparedData:
    """The per-run cache and plans. ``train``/``val``/``test`` are sent to the ranks as
    dicts."""

    train: ShardPlan
    val: ShardPlan
    test: ShardPlan
    num_partitions: int
    label_names: list[str]
    cache_dir_url: str
    example_images: list[bytes]
    """A few stored val images: the registered model's input example."""
    lineage: dict[str, object]
    """What the run was trained and scored on (:func:`lineage`): each table's path and the
    Delta version read, the ingest fingerprint and the test split's digest."""


def split_digest(df: DataFrame, label_names: list[str]) -> str:
    """A digest (SHA-256 hex) of the set of ``(content_sha256, label)`` pairs of a split table,
    and of ``label_names``: equal digests mean the same photos with the same labels, however
    the table was partitioned or re-written. Two models' test scores are comparable only on
    splits with the same digest (the ``champion`` rule, :mod:`flowers_job.promotion`)."""
    return digest(hash_sums(df, ["content_sha256", "label"]), labels=label_names)


def lineage(spark: SparkSession, cfg: JobConfig, checked: CheckedTables) -> dict[str, object]:
    """What a run reads, for its MLflow run (rank 0 logs it; :mod:`flowers_job.tracking`):
    the checked tables (:func:`~flowers_job.data.tables.checked_tables`).

    Returns:
        ``{"tables": {name: {"path", "version"}}, "ingest_fingerprint": str,
        "test_split_digest": str}``.
    """
    test = (
        spark.read.format("delta")
        .option("versionAsOf", checked.versions["test"])
        .load(str(cfg.paths.table("test")))
    )
    return {
        "tables": {
            name: {"path": str(cfg.paths.table(name)), "version": version}
            for name, version in checked.versions.items()
        },
        "ingest_fingerprint": str(checked.meta.get("fingerprint", "")),
        "test_split_digest": split_digest(test, checked.label_names),
    }


def example_images(spark: SparkSession, cfg: JobConfig, version: int, n: int = 2) -> list[bytes]:
    """Up to ``n`` stored images of the val table at Delta ``version`` (the smallest
    ``row_id`` first): the registered model's input example. Bytes of re-encoded JPEGs, a
    few kB each."""
    rows = (
        spark.read.format("delta")
        .option("versionAsOf", version)
        .load(str(cfg.paths.table("val")))
        .orderBy("row_id")
        .select("image")
        .limit(n)
        .collect()
    )
    return [bytes(r["image"]) for r in rows]


def _split(spark: SparkSession, cfg: JobConfig, split: str, version: int) -> DataFrame:
    """The loader's columns of ``split`` at Delta ``version``."""
    return (
        spark.read.format("delta")
        .option("versionAsOf", version)
        .load(str(cfg.paths.table(split)))
        .select(*LOADER_COLUMNS)
        .withColumn("label_index", F.col("label_index").cast("long"))
    )


@contextmanager
def prepare_data(spark: SparkSession, cfg: JobConfig) -> Iterator[PreparedData]:
    """Write the train, val and test splits into this run's loader cache; remove it on exit.

    ``cfg.data.loader`` must be resolved already (:func:`flowers_job.loaders.resolve_loader`:
    the pipeline does it once, before Spark starts).

    Yields:
        :class:`PreparedData` with one :class:`~flowers_job.loaders.base.ShardPlan` per split.

    Raises:
        DataError: missing or inconsistent tables, an empty split, unworkable shards, or no
            space for the cache (naming the directory; nothing of the cache is left).
        ValueError: ``data.loader`` is 'auto' (unresolved) or not a registered loader.
    """
    if cfg.data.loader == "auto":
        raise ValueError(
            "prepare_data: data.loader is 'auto'; resolve it first with "
            "flowers_job.loaders.resolve_loader (the pipeline's preflight does)"
        )
    loader = loader_class(cfg.data.loader)(cfg)
    checked = checked_tables(spark, cfg)
    versions = checked.versions
    with run_cache(cfg.paths.cache_parent_url) as (cache_url, folder):
        try:
            plans = {}
            for split in SPLITS:
                check_cache_space(
                    cache_url,
                    cache_bytes_needed(spark, cfg.paths.table(split)),
                    f"the {split} table",
                )
                plans[split] = loader.write(
                    spark, _split(spark, cfg, split, versions[split]), cache_url, split
                )
            yield PreparedData(
                plans["train"],
                plans["val"],
                plans["test"],
                cfg.num_partitions,
                checked.label_names,
                cache_url,
                example_images(spark, cfg, versions["val"]),
                lineage(spark, cfg, checked),
            )
        finally:
            loader.release(folder)
