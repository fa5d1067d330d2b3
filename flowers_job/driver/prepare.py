"""Prepare (driver side): the ``images`` table -> the loader cache and a shard plan per split.

Each split is read from ``images`` at the Delta version that was checked
(:func:`~flowers_job.tables.delta_tables.checked_tables`) and recorded in the run's lineage, and
handed to the configured loader (``data.loader``, resolved by
:func:`flowers_job.loaders.resolve_loader`), which writes it into the loader cache and plans
how ``world_size`` ranks read it (:class:`~flowers_job.loaders.base.ShardPlan`). The cache
keeps one entry per (images version, split, loader, settings) and a later run on the same
version reuses it (:mod:`flowers_job.loaders.cache_dir`). A loader whose ranks read the table
itself (``data.loader=delta``) gets no cache: each split is counted and planned, nothing is
written. Which loader it is does not matter here: see :mod:`flowers_job.loaders`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from flowers_job.config import JobConfig
from flowers_job.errors import DataError
from flowers_job.loaders.base import SEGMENT_COLUMN, Loader, Sharding, ShardPlan
from flowers_job.loaders.cache_dir import LoaderCache, loader_cache
from flowers_job.loaders.cache_growth import Changes
from flowers_job.loaders.cache_space import cache_bytes_needed
from flowers_job.photos.files import digest, hash_sums
from flowers_job.tables.delta_tables import (
    SPLITS,
    TABLE_NAMES,
    CheckedTables,
    checked_tables,
    split_frame,
)
from flowers_job.tables.table_ref import TableRef, table_ref

__all__ = [
    "LOADER_COLUMNS",
    "DataError",
    "PreparedData",
    "check_resume",
    "example_images",
    "lineage",
    "prepare_data",
    "split_changes",
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
    """What the run was trained and scored on (:func:`lineage`): each table's path or
    catalog name and the Delta version read, each split's, the ingest fingerprint and the
    test split's digest."""
    loader: type[Loader]
    """The loader that wrote the plans' caches and reads them on the ranks (resolved once,
    :func:`flowers_job.loaders.resolve_loader`); the ranks' job carries it."""
    loader_cache: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Split -> how its loader cache was got (:class:`~flowers_job.loaders.cache_dir.CacheUse`):
    ``entry``, ``reused``, ``bytes_written``, ``seconds``, ``waited_seconds``."""
    embeddings: dict[str, Any] | None = None
    """With ``embeddings.enabled``: what bringing the ``embeddings`` table in step did
    (:func:`~flowers_job.driver.embedding_data.embedding_plans`); the train and val plans
    then read it."""


def split_digest(df: DataFrame, label_names: list[str]) -> str:
    """A digest (SHA-256 hex) of the set of ``(content_sha256, label)`` pairs of a split table,
    and of ``label_names``: equal digests mean the same photos with the same labels, however
    the table was partitioned or re-written. Two models' test scores are comparable only on
    splits with the same digest (the ``champion`` rule, :mod:`flowers_job.driver.promotion`)."""
    return digest(hash_sums(df, ["content_sha256", "label"]), labels=label_names)


def lineage(
    spark: SparkSession, tables: dict[str, TableRef], checked: CheckedTables
) -> dict[str, object]:
    """What a run reads, for its MLflow run (rank 0 logs it; :mod:`flowers_job.tracking.mlflow_run`):
    the checked tables (:func:`~flowers_job.tables.delta_tables.checked_tables`).

    Returns:
        ``{"tables": {name: {"path" | "name", "version"}}, "splits": {split: {"path" |
        "name", "version", "split"}}, "ingest_fingerprint": str, "test_split_digest":
        str}``; a path table is named by ``path``, a catalog table by ``name``
        (``main.flowers.images``: :meth:`~flowers_job.tables.table_ref.TableRef.lineage`);
        a split is the ``images`` table's rows with that ``split`` at that version.
    """
    images = tables["images"]
    version = checked.versions["images"]
    test = split_frame(spark, images, version, "test")
    return {
        "tables": {
            name: {**tables[name].lineage(), "version": v} for name, v in checked.versions.items()
        },
        "splits": {
            split: {**images.lineage(), "version": version, "split": split} for split in SPLITS
        },
        "ingest_fingerprint": str(checked.meta.get("fingerprint", "")),
        "test_split_digest": split_digest(test, checked.label_names),
    }


def check_resume(cfg: JobConfig, data: PreparedData) -> None:
    """With ``train.resume``, before the ranks start: refuse a checkpoint that the ranks
    would refuse (another model, image size, trained layers, labels or optimizer:
    :func:`~flowers_job.train.resume.check_resumable`), or one of other data than
    ``data`` (:func:`~flowers_job.train.resume.check_same_data`). Each of ``last.pt`` (or
    the generation before it) and ``step.pt`` that can be read here is checked; one that
    cannot is left to rank 0, which reads it again and fails with its error.

    Raises:
        ConfigError: naming the setting, or what changed in the data (old -> new).
    """
    if not cfg.train.resume:
        return
    from flowers_job.train.checkpoint import (
        CHECKPOINT_NAME,
        STEP_CHECKPOINT_NAME,
        data_identity,
        load_checkpoint,
    )
    from flowers_job.train.resume import check_resumable, check_same_data

    splits = {"train": data.train, "val": data.val, "test": data.test}
    now = data_identity(data.lineage, {k: (p.dataset_size, p.checksum) for k, p in splits.items()})
    for name in (CHECKPOINT_NAME, STEP_CHECKPOINT_NAME):
        try:
            saved = load_checkpoint(cfg.paths.checkpoint_dir, name=name)
        except (RuntimeError, OSError) as exc:
            log.warning("--resume: not checked on the driver (%s); rank 0 reads it again", exc)
            continue
        if saved is not None:
            check_resumable(saved, cfg, data.label_names)
            check_same_data(saved, now, cfg)


def example_images(spark: SparkSession, images: TableRef, version: int, n: int = 2) -> list[bytes]:
    """Up to ``n`` stored images of the val split at Delta ``version`` of ``images`` (the
    smallest ``row_id`` first): the registered model's input example. Bytes of re-encoded
    JPEGs, a few kB each. The smallest ids are found on the ``row_id`` column alone, then
    only their images are read."""
    val = split_frame(spark, images, version, "val")
    ids = [int(r["row_id"]) for r in val.select("row_id").orderBy("row_id").limit(n).collect()]
    rows = val.where(F.col("row_id").isin(ids)).orderBy("row_id").select("image").collect()
    return [bytes(r["image"]) for r in rows]


def _loader_rows(df: DataFrame, version: int) -> DataFrame:
    """The loader's columns of rows of ``images``, with the segment a cache written at
    ``version`` puts them in (:data:`~flowers_job.loaders.base.SEGMENT_COLUMN`)."""
    return (
        df.select(*LOADER_COLUMNS)
        .withColumn("label_index", F.col("label_index").cast("long"))
        .withColumn(SEGMENT_COLUMN, F.lit(version).cast("long"))
    )


def _split(spark: SparkSession, images: TableRef, split: str, version: int) -> DataFrame:
    """The loader's columns of ``split`` at Delta ``version`` of ``images``."""
    return _loader_rows(split_frame(spark, images, version, split), version)


def split_changes(
    spark: SparkSession, images: TableRef, split: str, version: int, base: int, rows: int
) -> Changes:
    """``split``'s changes from Delta ``base`` to ``version`` of ``images``: rows compared
    by ``(row_id, content_sha256)``, so that a file rewritten in place is removed and added
    again. Only those two columns of both versions are read for the comparison (Parquet
    column pruning), once; the ids of the added and removed rows reach the driver (a day's
    change: about 1% of the rows). The added rows are then the current version's rows of
    those ids, through a broadcast semi-join that keeps the table scan's partitions: the
    loaders read them twice (count, then write) and need the same partitions both times.

    Raises:
        pyspark.errors.AnalysisException: ``base`` is no longer readable (vacuumed).
    """
    import numpy as np

    keys = ["row_id", "content_sha256"]
    now = split_frame(spark, images, version, split)
    old = split_frame(spark, images, base, split).select(*keys)
    fresh = now.select(*keys).join(old, keys, "left_anti").select("row_id")
    gone = old.join(now.select(*keys), keys, "left_anti").select("row_id")
    added_ids = [int(r["row_id"]) for r in fresh.collect()]
    removed_ids = np.array([int(r["row_id"]) for r in gone.collect()], dtype=np.int64)
    ids = spark.createDataFrame([(i,) for i in added_ids], schema="row_id long")
    added = now.join(ids.hint("broadcast"), "row_id", "left_semi")  # a method Connect has
    return Changes(
        _loader_rows(now, version), _loader_rows(added, version), len(added_ids), removed_ids, rows
    )


@contextmanager
def _plans(cfg: JobConfig, writer: Loader) -> Iterator[LoaderCache | None]:
    """The loader cache ``writer`` writes into, or None for a loader that reads the table
    (:attr:`~flowers_job.loaders.base.Loader.reads_table`), which needs no cache."""
    if writer.reads_table:
        yield None
        return
    with loader_cache(cfg.paths.cache_root, cfg.cache, writer) as cache:
        yield cache


def _table_plan(
    writer: Loader, checked: CheckedTables, location: str, split: str
) -> tuple[ShardPlan, dict[str, Any]]:
    """The plan of ``split`` for a loader that reads the table itself (at ``location``,
    ``DESCRIBE DETAIL``'s, a catalog table's too) at the checked version, from the check's
    counts, and its record in ``loader_cache``: nothing written, no Spark job."""
    t0 = time.perf_counter()
    plan = writer.plan_table(
        checked.split_rows[split],
        checked.split_row_id_sums[split],
        location,
        checked.versions["images"],
        split,
    )
    seconds = round(time.perf_counter() - t0, 3)
    log.info(
        "%s: %d rows read from the table at version %d (no loader cache, 0 bytes written, %.3f s)",
        split,
        checked.split_rows[split],
        checked.versions["images"],
        seconds,
    )
    return plan, {"entry": None, "reused": False, "bytes_written": 0, "seconds": seconds}


def _cache_plan(
    spark: SparkSession,
    cache: LoaderCache,
    writer: Loader,
    images: TableRef,
    detail: Any,
    checked: CheckedTables,
    split: str,
) -> tuple[ShardPlan, dict[str, Any]]:
    """``split``'s loader cache entry (reused, grown or written by ``writer``) and plan, at
    the checked version of ``images`` (``detail``: its ``DESCRIBE DETAIL``), and how it was
    got (:class:`~flowers_job.loaders.cache_dir.CacheUse` as a dict)."""
    version = checked.versions["images"]
    size = int(detail["sizeInBytes"] or 0) if detail is not None else 0
    total = sum(checked.split_rows.values())
    fields = {
        "table": images.describe(),
        "table_id": detail["id"] if detail is not None else None,
        "version": version,
        "split": split,
        "loader": writer.name,
        "settings": writer.cache_settings(split),
    }
    rows = checked.split_rows[split]
    plan, use = cache.split(
        spark,
        writer,
        split,
        fields,
        lambda: _split(spark, images, split, version),
        cache_bytes_needed(size, rows / total),
        lambda base: split_changes(spark, images, split, version, base, rows),
    )
    return plan, use.to_dict()


def _embedding_plans(
    spark: SparkSession,
    cfg: JobConfig,
    writer: Loader,
    checked: CheckedTables,
    uses: dict[str, dict[str, Any]],
) -> tuple[dict[str, ShardPlan], dict[str, Any]]:
    """The train and val plans of the ``embeddings`` table, brought in step with ``images``
    at the checked version first (:func:`~flowers_job.driver.embedding_data.embedding_plans`),
    and their records in ``uses`` (nothing written to a loader cache)."""
    from flowers_job.driver.embedding_data import embedding_plans

    plans, embedded = embedding_plans(
        spark, cfg, writer, checked.versions["images"], checked.split_rows
    )
    for split in plans:
        uses[split] = {"entry": None, "reused": False, "bytes_written": 0, "seconds": 0.0}
    return plans, embedded


@contextmanager
def prepare_data(
    spark: SparkSession, cfg: JobConfig, loader: type[Loader]
) -> Iterator[PreparedData]:
    """Get each split's loader cache (reused, or written now by ``loader``) and its shard plan.

    ``cfg`` and ``loader`` are what :func:`flowers_job.loaders.resolve_loader` returned (the
    pipeline resolves the loader once, before Spark starts):
    ``prepare_data(spark, *resolve_loader(cfg))``.

    Yields:
        :class:`PreparedData` with one :class:`~flowers_job.loaders.base.ShardPlan` per split.

    Raises:
        DataError: missing or inconsistent tables, an empty split, unworkable shards, or no
            space for the cache (naming the directory; nothing of a partial write is left).
        ValueError: ``cfg.data.loader`` is not ``loader``'s name ('auto': unresolved).
    """
    if cfg.data.loader != loader.name:
        raise ValueError(
            f"prepare_data: data.loader is {cfg.data.loader!r}, the loader is {loader.name!r}; "
            "pass what flowers_job.loaders.resolve_loader returns (the pipeline's preflight does)"
        )
    checked = checked_tables(spark, cfg)
    version = checked.versions["images"]
    tables = {name: table_ref(cfg, name) for name in TABLE_NAMES}
    images = tables["images"]
    sharding = Sharding(cfg.world_size, cfg.num_partitions, cfg.train.per_device_batch_size)
    writer = loader(sharding, images.describe())
    detail = images.detail(spark)
    embedded: dict[str, Any] | None = None
    with _plans(cfg, writer) as cache:
        plans: dict[str, ShardPlan] = {}
        uses: dict[str, dict[str, Any]] = {}
        if cfg.embeddings.enabled is True:
            plans, embedded = _embedding_plans(spark, cfg, writer, checked, uses)
        for split in SPLITS:
            if split in plans:
                continue
            if cache is None:  # a loader that reads the table
                plans[split], uses[split] = _table_plan(
                    writer, checked, str(detail["location"]), split
                )
                continue
            plans[split], uses[split] = _cache_plan(
                spark, cache, writer, images, detail, checked, split
            )
        yield PreparedData(
            plans["train"],
            plans["val"],
            plans["test"],
            cfg.num_partitions,
            checked.label_names,
            plans["train"].cache_dir_url,
            example_images(spark, images, version),
            lineage(spark, tables, checked),
            loader,
            uses,
            embedded,
        )
