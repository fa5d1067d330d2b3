"""Prepare (driver side): Delta tables -> a per-run loader cache and a shard plan per split.

Each split is read from its Delta table, repartitioned to ``num_partitions`` (a
multiple of ``world_size``; the guides use ``2 x devices``) and materialised into a per-run
cache directory that is removed when the run ends: by Petastorm's ``make_spark_converter``
(``data.loader=petastorm``) or as Mosaic Streaming MDS shards (``data.loader=streaming``,
:mod:`flowers_job.data.mds`).

Petastorm shards by row group: shard ``r`` of ``world_size`` reads the row groups
whose index ``i`` satisfies ``i % world_size == r`` (petastorm ``Reader._partition_row_groups``).
The driver reads the Parquet footers, computes each shard's exact row count and a row
checksum, and fixes ``steps_per_epoch`` so that every rank runs the same number of
steps and reads every row of its shard once per epoch (see :class:`ShardPlan`).

The cache's life: Petastorm removes its caches only at normal interpreter exit
(STACK.md trap 7). Here each run writes into its own ``run-<id>`` folder holding an
``owner.json`` (host, pid, start time of the driver); it is removed when the run ends,
however it ends, and a folder whose driver is dead (killed with SIGKILL, say) is swept
at the next start (:func:`sweep_orphaned_caches`). Before each split is written, the
free space of the cache's file system is checked against the size of the Delta table
(:func:`check_cache_space`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from flowers_job.config import JobConfig
from flowers_job.data.ingest import (
    SPLITS,
    TABLE_NAMES,
    TABLE_SCHEMAS,
    read_table_metadata,
    tables_mismatch,
)
from flowers_job.data.shards import DataError, ShardPlan, plan_shards, quiet_petastorm
from flowers_job.data.stack import resolve_loader
from flowers_job.processes import driver_identity, process_alive

if TYPE_CHECKING:
    from petastorm.spark import SparkDatasetConverter

__all__ = [
    "DataError",
    "PreparedData",
    "ShardPlan",
    "cache_bytes_needed",
    "check_cache_space",
    "lineage",
    "make_cache",
    "prepare_data",
    "split_digest",
    "sweep_orphaned_caches",
    "table_versions",
]

log = logging.getLogger(__name__)

LOADER_COLUMNS = ("row_id", "image", "label_index")
_CACHE_CONF = "petastorm.spark.converter.parentCacheDirUrl"
OWNER_FILE = "owner.json"
ORPHAN_AGE_SECONDS = 7 * 24 * 3600.0
"""A cache folder of a driver on another host is swept once it is this old (seconds): its
driver cannot be checked from here, and no training run lasts a week."""
CACHE_SPACE_FACTOR = 1.1
CACHE_SPACE_HEADROOM_BYTES = 1 << 20
"""A split's cache needs ``table size x 1.1 + 1 MiB``: the images are JPEG in both the Delta
table and the uncompressed cache, plus Parquet footers and Hadoop's .crc files."""


@dataclass
class PreparedData:
    """The per-run caches and plans. ``train``/``val``/``test`` are sent to the workers as
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


def _check_tables(spark: SparkSession, cfg: JobConfig) -> list[str]:
    """Check that the five tables are one complete ingest that training can read.

    Runs before any Petastorm cache is written. Checks, in order: every table is a
    flowers_job Delta table; all five come from the same ingest run (:func:`tables_mismatch`);
    each has the expected columns and types; ``images`` and the three splits have rows; and
    the labels in the splits are the ``label_names`` recorded at ingest, with their
    recorded indices.

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
    for name in ("images", *SPLITS):
        if tables[name].isEmpty():
            raise DataError(
                f"the {name} table {paths[name]} is empty; training needs rows in images, "
                "train, val and test: add photos (or change data.val_fraction or "
                "data.test_fraction) and ingest again"
            )
    meta = metas["images"]
    assert meta is not None
    label_names = [str(x) for x in meta["label_names"]]  # type: ignore[attr-defined]
    _check_labels([tables[s] for s in SPLITS], label_names, cfg.paths.tables_dir)
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


def _check_labels(splits: list[DataFrame], label_names: list[str], where: Path) -> None:
    """Raise ``DataError`` if the (label, label_index) pairs in the split tables differ from
    ``label_names`` (a label's index is its position), naming both label sets."""
    pairs = {
        (r["label"], r["label_index"])
        for df in splits
        for r in df.select("label", "label_index").distinct().limit(10_000).collect()
    }
    found = sorted({str(label) for label, _ in pairs})
    if found != sorted(label_names):
        raise DataError(
            f"the labels in the split tables under {where}, {found}, differ from the "
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
            f"label_index in the split tables under {where} does not match the "
            f"label_names recorded at ingest, {label_names}: {', '.join(wrong)}; run "
            "`flowers-job ingest` again"
        )


def _local_dir(url: str) -> Path | None:
    parsed = urlparse(url)
    return Path(parsed.path) if parsed.scheme in ("file", "") else None


def sweep_orphaned_caches(cache_parent_url: str) -> list[Path]:
    """Remove the ``run-*`` cache folders whose driver is dead; local file systems only.

    A folder is orphaned when its ``owner.json`` names a driver on this host that no
    longer exists, or a driver elsewhere that started more than :data:`ORPHAN_AGE_SECONDS`
    ago. Folders without ``owner.json`` are not ours and are left alone.

    Returns:
        The folders removed.
    """
    parent = _local_dir(cache_parent_url)
    if parent is None or not parent.is_dir():
        return []
    removed = []
    for folder in sorted(parent.glob("run-*")):
        try:
            owner = json.loads((folder / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        here = owner.get("host") == socket.gethostname()
        dead = (
            not process_alive(owner)
            if here
            else time.time() - float(owner.get("create_time", 0.0)) > ORPHAN_AGE_SECONDS
        )
        if dead:
            log.warning(
                "removing the Petastorm cache %s of a run that was killed (driver pid %s on %s)",
                folder,
                owner.get("pid"),
                owner.get("host"),
            )
            shutil.rmtree(folder, ignore_errors=True)
            if here:
                from flowers_job.data.mds import remove_streaming_state

                remove_streaming_state(folder)  # a killed run's Streaming shared memory
            removed.append(folder)
    return removed


def cache_bytes_needed(spark: SparkSession, table: Path) -> int:
    """Bytes the Petastorm cache of the Delta table at ``table`` needs (an upper estimate).

    ``sizeInBytes`` of ``DESCRIBE DETAIL`` x :data:`CACHE_SPACE_FACTOR` +
    :data:`CACHE_SPACE_HEADROOM_BYTES`.
    """
    from delta.tables import DeltaTable

    row = DeltaTable.forPath(spark, str(table)).detail().select("sizeInBytes").first()
    size = int(row["sizeInBytes"]) if row is not None else 0
    return math.ceil(size * CACHE_SPACE_FACTOR) + CACHE_SPACE_HEADROOM_BYTES


def check_cache_space(cache_dir_url: str, needed_bytes: int, what: str) -> None:
    """Fail before writing when the cache's file system has less than ``needed_bytes`` free.

    Raises:
        DataError: not enough space; names the directory, the bytes needed and free.
    """
    folder = _local_dir(cache_dir_url)
    if folder is None:
        return  # object stores and DBFS report no meaningful free space
    free = shutil.disk_usage(folder).free
    if free < needed_bytes:
        raise DataError(
            f"no space for the loader cache of {what} in {folder}: needs about "
            f"{needed_bytes / 2**20:.1f} MiB, {free / 2**20:.1f} MiB free; free some space or "
            "set paths.petastorm_cache_url to a larger volume"
        )


def make_cache(df: DataFrame, cache_dir_url: str, what: str) -> SparkDatasetConverter:
    """Materialise ``df`` with Petastorm's ``make_spark_converter`` under ``cache_dir_url``
    (which must be the session's ``petastorm.spark.converter.parentCacheDirUrl``).

    Row groups of at most ~32 MB, one file per partition, no compression: the images are
    JPEG already.

    Raises:
        DataError: the volume filled up during the write ("No space left on device"); names
            the directory. The caller removes the partial cache (:func:`prepare_data` does).
    """
    from petastorm.spark import make_spark_converter

    try:
        return make_spark_converter(df, compression_codec="uncompressed")
    except Exception as exc:
        if "No space left on device" in str(exc):
            folder = _local_dir(cache_dir_url) or cache_dir_url
            raise DataError(
                f"no space left for the loader cache of {what} in {folder}; free some space "
                "or set paths.petastorm_cache_url to a larger volume"
            ) from exc
        raise


def _petastorm_plan(
    spark: SparkSession, df: DataFrame, cache_url: str, cfg: JobConfig, split: str
) -> tuple[ShardPlan, SparkDatasetConverter]:
    """Materialise ``df`` with Petastorm and plan its shards (row group ``i`` -> rank
    ``i % world_size``)."""
    converter = make_cache(df, cache_url, f"the {split} table")
    if len(converter) == 0:
        raise DataError(f"the {split} table {cfg.paths.table(split)} is empty")
    file_urls = sorted(converter.file_urls)  # part-00000, ...: the same order on every run
    rows, checksum, steps = plan_shards(
        file_urls,
        cfg.world_size,
        cfg.train.per_device_batch_size,
        full_batches=split == "train",
        split=split,
    )
    log.info(
        "%s: %d rows in %d partitions, rows per shard %s, %d steps per epoch",
        split,
        len(converter),
        cfg.num_partitions,
        rows,
        steps,
    )
    plan = ShardPlan(
        loader="petastorm",
        cache_dir_url=converter.cache_dir_url,
        dataset_size=len(converter),
        checksum=sum(checksum),
        rows_per_shard=rows,
        checksum_per_shard=checksum,
        steps_per_epoch=steps,
        per_device_batch_size=cfg.train.per_device_batch_size,
        file_urls=file_urls,
    )
    return plan, converter


def _streaming_plan(df: DataFrame, cache_url: str, cfg: JobConfig, split: str) -> ShardPlan:
    """Write ``df`` as Mosaic Streaming MDS shards under the run's cache and plan them."""
    from flowers_job.data.mds import write_mds

    folder = _local_dir(cache_url)
    if folder is None:
        raise DataError(
            f"paths.petastorm_cache_url: {cache_url} is not a local or mounted path; "
            "data.loader=streaming writes its MDS shards to a file:// URL (a FUSE mount such as "
            "/Volumes or /dbfs on Databricks)"
        )
    return write_mds(
        df,
        folder / f"mds-{split}",
        world_size=cfg.world_size,
        num_partitions=cfg.num_partitions,
        per_device_batch_size=cfg.train.per_device_batch_size,
        full_batches=split == "train",
        split=split,
    )


def table_versions(spark: SparkSession, cfg: JobConfig) -> dict[str, int]:
    """The latest Delta version of each of the job's tables (``TABLE_NAMES``): the version
    this run reads (``versionAsOf``) and records as its lineage."""
    from delta.tables import DeltaTable

    versions = {}
    for name in TABLE_NAMES:
        row = DeltaTable.forPath(spark, str(cfg.paths.table(name))).history(1).first()
        assert row is not None
        versions[name] = int(row["version"])
    return versions


def split_digest(df: DataFrame, label_names: list[str]) -> str:
    """A digest (SHA-256 hex) of the set of ``(content_sha256, label)`` pairs of a split table,
    and of ``label_names``: equal digests mean the same photos with the same labels, however
    the table was partitioned or re-written. Two models' test scores are comparable only on
    splits with the same digest (the ``champion`` rule, :mod:`flowers_job.promotion`)."""
    row = df.agg(
        F.count(F.lit(1)).alias("n"),
        F.sum(F.xxhash64("content_sha256", "label").cast("decimal(38,0)")).alias("a"),
        F.sum(F.xxhash64("label", "content_sha256").cast("decimal(38,0)")).alias("b"),
    ).first()
    assert row is not None
    text = json.dumps(
        {"n": int(row["n"]), "a": str(row["a"]), "b": str(row["b"]), "labels": label_names},
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def lineage(
    spark: SparkSession, cfg: JobConfig, versions: dict[str, int], label_names: list[str]
) -> dict[str, object]:
    """What a run reads, for its MLflow run (rank 0 logs it; :mod:`flowers_job.tracking`).

    Returns:
        ``{"tables": {name: {"path", "version"}}, "ingest_fingerprint": str,
        "test_split_digest": str}``.
    """
    meta = read_table_metadata(spark, cfg.paths.table("images")) or {}
    test = (
        spark.read.format("delta")
        .option("versionAsOf", versions["test"])
        .load(str(cfg.paths.table("test")))
    )
    return {
        "tables": {
            name: {"path": str(cfg.paths.table(name)), "version": version}
            for name, version in versions.items()
        },
        "ingest_fingerprint": str(meta.get("fingerprint", "")),
        "test_split_digest": split_digest(test, label_names),
    }


def example_images(spark: SparkSession, cfg: JobConfig, n: int = 2) -> list[bytes]:
    """Up to ``n`` stored images of the val table (the smallest ``row_id`` first): the
    registered model's input example. Bytes of re-encoded JPEGs, a few kB each."""
    rows = (
        spark.read.format("delta")
        .load(str(cfg.paths.table("val")))
        .orderBy("row_id")
        .select("image")
        .limit(n)
        .collect()
    )
    return [bytes(r["image"]) for r in rows]


@contextmanager
def prepare_data(spark: SparkSession, cfg: JobConfig) -> Iterator[PreparedData]:
    """Materialise the train, val and test splits for the configured loader; remove the cache
    on exit.

    The loader is ``cfg.data.loader``, resolved by :func:`flowers_job.data.stack.resolve_loader`
    ('auto' becomes the one that runs here). Each split is read from its Delta table,
    at the Delta version recorded in :attr:`PreparedData.lineage`, repartitioned to
    ``num_partitions`` and written into this run's cache folder: Petastorm's Parquet files,
    or Streaming's MDS shards.

    Yields:
        :class:`PreparedData` with one :class:`ShardPlan` per split.

    Raises:
        DataError: missing or inconsistent tables, an empty split, unworkable shards, or no
            space for the cache (naming the directory; nothing of the cache is left).
        ConfigError: ``data.loader`` cannot run on this stack.
    """
    cfg = resolve_loader(cfg)
    loader = cfg.data.loader
    if loader == "petastorm":
        quiet_petastorm()
    label_names = _check_tables(spark, cfg)
    versions = table_versions(spark, cfg)
    num_partitions = cfg.num_partitions
    sweep_orphaned_caches(cfg.paths.cache_parent_url)
    cache_url = f"{cfg.paths.cache_parent_url}/run-{uuid.uuid4().hex[:12]}"
    local_cache = _local_dir(cache_url)
    if local_cache is not None:
        local_cache.mkdir(parents=True)
        (local_cache / OWNER_FILE).write_text(json.dumps(driver_identity()))
    spark.conf.set(_CACHE_CONF, cache_url)
    converters = []
    try:
        plans = {}
        for split in SPLITS:
            df = (
                spark.read.format("delta")
                .option("versionAsOf", versions[split])
                .load(str(cfg.paths.table(split)))
                .select(*LOADER_COLUMNS)
                .withColumn("label_index", F.col("label_index").cast("long"))
            )
            check_cache_space(
                cache_url, cache_bytes_needed(spark, cfg.paths.table(split)), f"the {split} table"
            )
            if loader == "petastorm":
                plans[split], converter = _petastorm_plan(
                    spark, df.repartition(num_partitions), cache_url, cfg, split
                )
                converters.append(converter)
            else:
                plans[split] = _streaming_plan(df, cache_url, cfg, split)
        yield PreparedData(
            plans["train"],
            plans["val"],
            plans["test"],
            num_partitions,
            label_names,
            cache_url,
            example_images(spark, cfg),
            lineage(spark, cfg, versions, label_names),
        )
    finally:
        for converter in converters:
            try:
                converter.delete()
            except OSError as exc:  # pragma: no cover - best effort, the rmtree follows
                log.warning("could not delete Petastorm cache %s: %s", converter.cache_dir_url, exc)
        if local_cache is not None:
            if loader == "streaming":
                from flowers_job.data.mds import remove_streaming_state

                remove_streaming_state(local_cache)
            if local_cache.exists():
                shutil.rmtree(local_cache, ignore_errors=True)
