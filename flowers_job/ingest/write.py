"""Ingest's writes (driver side): decode on the executors, check the set, and write both
tables in full or MERGE the changes (:mod:`flowers_job.ingest.job` decides which)."""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
import time
from dataclasses import dataclass

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from flowers_job.config import JobConfig
from flowers_job.errors import IngestError
from flowers_job.photos.files import DECODED_SCHEMA, decode_partitions
from flowers_job.photos.listing import LISTING_REASONS, images_root
from flowers_job.runtime.hooks import hook
from flowers_job.tables.delta_tables import (
    PARTITION_COLUMNS,
    TABLE_PROPERTIES,
    TABLE_SCHEMAS,
    merge_table,
    write_table,
)
from flowers_job.tables.table_ref import TableRef

__all__ = [
    "FILES_PER_PARTITION",
    "Changes",
    "IngestError",
    "sweep_staging",
    "write_full",
    "write_incremental",
]

log = logging.getLogger(__name__)

FILES_PER_PARTITION = 512
"""Decode tasks get about this many files each (~12 MB of stored JPEGs at 256 px)."""
STAGING_MAX_AGE_SECONDS = 6 * 3600.0
"""An incremental ingest's staging folder (``tables/_staging-<run>``) this old belongs to a
run that was stopped: no ingest of this job's scale decodes its changes for 6 hours. (Under
``<output_dir>/tables`` with catalog tables too: plain Parquet files, no table.)"""
OLD_SPLIT_TABLES = ("train", "val", "test")
"""The split tables of layout 3 and earlier (full copies of ``images``), removed after the
first rebuild in layout 4."""


@dataclass(frozen=True)
class Changes:
    """What one ingest wrote (counts for the report)."""

    mode: str
    files_decoded: int = 0
    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    quarantined: int = 0


def _check_after(cfg: JobConfig, after: DataFrame, labels: list[str], n_files: int) -> None:
    """The set-level checks on the tables as they would be after this ingest: one row per
    listed entry (``label``, ``reason_code``, ``relative_path``, ``reason``).

    Raises:
        IngestError: a label without a decodable image, or too many bad files.
    """
    stats = after.groupBy("label", "reason_code").count().collect()
    total = sum(int(r["count"]) for r in stats)
    if total != n_files:  # pragma: no cover - one row per listed entry, by construction
        raise IngestError(
            f"{n_files} entries listed but {total} accounted for; nothing was written"
        )
    bad_by_reason: dict[str, int] = {}
    good_labels = set()
    for r in stats:
        if r["reason_code"] is None:
            good_labels.add(r["label"])
        else:
            bad_by_reason[r["reason_code"]] = bad_by_reason.get(r["reason_code"], 0) + r["count"]
    no_image = [label for label in labels if label not in good_labels]
    if no_image:
        raise IngestError(
            f"data.images: label folder(s) {no_image} under {cfg.data.images} contain no "
            "decodable image; nothing was written"
        )
    bad = sum(bad_by_reason.values())
    limit = cfg.data.max_bad_fraction
    if bad / total > limit:
        examples = (
            after.where(F.col("reason_code").isNotNull())
            .select("relative_path", "reason")
            .orderBy("relative_path")
            .limit(3)
            .collect()
        )
        raise IngestError(
            f"{bad} of {total} files under {cfg.data.images} ({bad / total:.1%}) would be "
            f"quarantined, more than data.max_bad_fraction={limit}: "
            + ", ".join(f"{code} {n}" for code, n in sorted(bad_by_reason.items()))
            + "; e.g. "
            + "; ".join(f"{r['relative_path']}: {r['reason']}" for r in examples)
            + ". Nothing was written: fix or remove the files, or raise data.max_bad_fraction "
            "(the quarantine table then lists every one with its reason)"
        )


def _decode(spark: SparkSession, cfg: JobConfig, entries: DataFrame, n: int) -> DataFrame:
    """Read and decode the listed ``entries`` (about ``n`` of them) on the executors, one
    :data:`DECODED_SCHEMA` row each, with the split, ``label_index`` and ``row_id`` of the
    images. Lazy: the caller persists it."""
    d = cfg.data
    root = images_root(d.images)
    partitions = max(2 * spark.sparkContext.defaultParallelism, math.ceil(n / FILES_PER_PARTITION))
    return (
        entries.select("relative_path", "label", "num_bytes", "mtime_ns", "reason_code", "reason")
        .repartition(partitions, "relative_path")
        .mapInPandas(
            decode_partitions(
                root, d.stored_short_side, d.jpeg_quality, d.max_image_pixels, d.extensions
            ),
            schema=DECODED_SCHEMA,
        )
    )


def _with_image_columns(cfg: JobConfig, decoded: DataFrame, labels: list[str]) -> DataFrame:
    """``decoded`` plus ``label_index``, ``split`` and ``row_id``.

    The split: a hash of (``split_seed``, content) -> uniform ``u`` in [0, 1): ``val`` below
    ``val_fraction``, ``test`` below ``val_fraction + test_fraction``, else ``train``: the same
    photo, the same split, on every run. ``row_id``: xxhash64 of the relative path.
    """
    d = cfg.data
    u = F.conv(
        F.substring(
            F.sha2(F.concat_ws(":", F.lit(str(d.split_seed)), "content_sha256"), 256), 1, 13
        ),
        16,
        10,
    ).cast("double") / float(16**13)
    return (
        decoded.withColumn(
            "label_index", F.array_position(F.array(*map(F.lit, labels)), F.col("label")) - 1
        )
        .withColumn(
            "split",
            F.when(u < d.val_fraction, "val")
            .when(u < d.val_fraction + d.test_fraction, "test")
            .otherwise("train"),
        )
        .withColumn("row_id", F.xxhash64("relative_path"))
    )


def write_full(
    spark: SparkSession,
    cfg: JobConfig,
    listing: DataFrame,
    labels: list[str],
    tables: dict[str, TableRef],
    meta: dict[str, object],
    n_files: int,
    why: str,
) -> Changes:
    """Decode every entry and overwrite both tables."""
    before = _rows_or_zero(spark, tables["images"])
    decoded = _with_image_columns(cfg, _decode(spark, cfg, listing, n_files), labels).persist(
        StorageLevel.DISK_ONLY
    )
    try:
        t0 = time.perf_counter()
        _check_after(cfg, decoded, labels, n_files)
        log.info("decoded %d files in %.1f s", n_files, time.perf_counter() - t0)
        images = decoded.where(F.col("reason_code").isNull())
        quarantine = decoded.where(F.col("reason_code").isNotNull())
        t0 = time.perf_counter()
        write_table(
            spark,
            _conform(quarantine, "quarantine"),
            tables["quarantine"],
            meta,
            properties=TABLE_PROPERTIES,
        )
        hook("ingest_table_written", table="quarantine")
        write_table(
            spark,
            _conform(images, "images"),
            tables["images"],
            meta,
            partition_by=PARTITION_COLUMNS["images"],
            properties=TABLE_PROPERTIES,
        )
        hook("ingest_table_written", table="images")
        counts = {
            bool(r["good"]): int(r["count"])
            for r in decoded.groupBy(F.col("reason_code").isNull().alias("good")).count().collect()
        }
        log.info(
            "wrote 2 Delta tables in %.1f s: %d images, %d quarantined",
            time.perf_counter() - t0,
            counts.get(True, 0),
            counts.get(False, 0),
        )
    finally:
        decoded.unpersist()
    _remove_old_split_tables(cfg)
    return Changes(
        mode=f"full: {why}",
        files_decoded=n_files,
        inserted=counts.get(True, 0),
        deleted=before,
        quarantined=counts.get(False, 0),
    )


def write_incremental(
    spark: SparkSession,
    cfg: JobConfig,
    listing: DataFrame,
    labels: list[str],
    tables: dict[str, TableRef],
    meta: dict[str, object],
    n_files: int,
) -> Changes:
    """Decode the new and changed files and MERGE them, with the deletions, into both
    tables (module docstring)."""
    t0 = time.perf_counter()
    # Written out, not cached: the first MERGE changes a table these plans read, and Delta's
    # commit refreshes cached plans that read it (a cached ``decoded`` would be recomputed
    # without the rows that MERGE just wrote). The comparison is written too: the decode,
    # the checks and both MERGEs read it instead of the tables.
    staging = cfg.paths.tables_dir / f"_staging-{meta['run_id']}"
    diff_path, decoded_path = staging / "diff", staging / "decoded"
    try:
        # One pass over both tables' key columns; everything below reads this small file.
        _diff(spark, listing, tables).write.parquet(str(diff_path))
        diff = spark.read.parquet(str(diff_path))
        todo = diff.where(F.col("_status") == "todo").drop("_status")
        n_todo = todo.count()
        _with_image_columns(cfg, _decode(spark, cfg, todo, n_todo), labels).write.parquet(
            str(decoded_path)
        )
        decoded = spark.read.parquet(str(decoded_path))
        gone = diff.where(F.col("_status") == "gone").select("relative_path")
        columns = ["relative_path", "label", "reason_code", "reason"]
        after = (
            diff.where(F.col("_status") == "keep")
            .select(*columns)
            .unionByName(decoded.select(*columns))
        )
        _check_after(cfg, after, labels, n_files)
        n_decoded = decoded.where(
            F.col("reason_code").isNull() | ~F.col("reason_code").isin(*LISTING_REASONS)
        ).count()
        log.info("decoded %d new or changed files in %.1f s", n_decoded, time.perf_counter() - t0)
        t0 = time.perf_counter()
        keep = ~F.col("s._gone")
        q = merge_table(
            spark,
            _source(decoded, gone, "quarantine"),
            tables["quarantine"],
            meta,
            keep=keep,
            changed=keep
            & _differs("reason_code", "reason", "num_bytes", "mtime_ns", "content_sha256"),
        )
        hook("ingest_table_written", table="quarantine")
        i = merge_table(
            spark,
            _source(decoded, gone, "images"),
            tables["images"],
            meta,
            keep=keep,
            changed=keep & _differs("content_sha256", "num_bytes", "mtime_ns"),
        )
        hook("ingest_table_written", table="images")
        log.info(
            "merged in %.1f s: images +%d ~%d -%d, quarantine +%d ~%d -%d",
            time.perf_counter() - t0,
            i["inserted"],
            i["updated"],
            i["deleted"],
            q["inserted"],
            q["updated"],
            q["deleted"],
        )
    finally:
        with contextlib.suppress(OSError):
            staging.rmtree()
    return Changes(
        mode="incremental",
        files_decoded=n_decoded,
        inserted=i["inserted"],
        updated=i["updated"],
        deleted=i["deleted"],
        quarantined=q["inserted"] + q["updated"],
    )


DIFF_COLUMNS = ("label", "num_bytes", "mtime_ns", "reason_code", "reason")
"""The columns of an incremental ingest's comparison besides ``relative_path`` and
``_status``: the listing's for entries to decode, the tables' for the others."""


def _diff(spark: SparkSession, listing: DataFrame, tables: dict[str, TableRef]) -> DataFrame:
    """The listing against what both tables hold, in one full outer join on
    ``relative_path`` that reads only the tables' small columns (no image bytes).

    One row per path that is listed or stored, with :data:`DIFF_COLUMNS` and ``_status``:

    - ``keep``: a readable file that a table holds with the same ``num_bytes`` and
      ``mtime_ns`` (the stored columns): nothing to do;
    - ``todo``: a new or changed file, a file refused at listing (its verdict comes again, at
      no cost) or one stored with a listing verdict that is now readable (the listing's
      columns): to decode;
    - ``gone``: a stored row whose file is no longer listed (the stored columns): to delete.
    """
    images = tables["images"].read(spark)
    quarantine = tables["quarantine"].read(spark)
    none = F.lit(None).cast("string")
    stored = images.select(
        "relative_path", "label", "num_bytes", "mtime_ns",
        none.alias("reason_code"), none.alias("reason"),
    ).unionByName(quarantine.select("relative_path", *DIFF_COLUMNS))  # fmt: skip
    listed = listing.select("relative_path", *DIFF_COLUMNS, F.lit(True).alias("_listed")).alias("l")
    held = stored.select("relative_path", *DIFF_COLUMNS, F.lit(True).alias("_held")).alias("s")
    same = (
        F.col("_listed").isNotNull()
        & F.col("_held").isNotNull()
        & F.col("l.reason_code").isNull()
        & (F.col("s.reason_code").isNull() | ~F.col("s.reason_code").isin(*LISTING_REASONS))
        & F.col("l.num_bytes").eqNullSafe(F.col("s.num_bytes"))
        & F.col("l.mtime_ns").eqNullSafe(F.col("s.mtime_ns"))
    )
    status = F.when(F.col("_listed").isNull(), "gone").when(same, "keep").otherwise("todo")
    todo = status == "todo"
    return listed.join(held, "relative_path", "full_outer").select(
        "relative_path",
        *[F.when(todo, F.col(f"l.{c}")).otherwise(F.col(f"s.{c}")).alias(c) for c in DIFF_COLUMNS],
        status.alias("_status"),
    )


def _source(decoded: DataFrame, gone: DataFrame, table: str) -> DataFrame:
    """The MERGE source for ``table``: the decoded rows that belong in it (its columns,
    conformed) with ``_gone`` false, and a marker (``relative_path``, ``_gone`` true) for
    every path that must leave it: the files that are gone and the decoded rows that belong
    in the other table. The quarantine's source carries no image bytes."""
    bad = F.col("reason_code").isNotNull()
    mine, other = (bad, ~bad) if table == "quarantine" else (~bad, bad)
    markers = decoded.where(other).select("relative_path").unionByName(gone)
    return (
        _conform(decoded.where(mine), table)
        .withColumn("_gone", F.lit(False))
        .unionByName(markers.withColumn("_gone", F.lit(True)), allowMissingColumns=True)
    )


def _differs(*columns: str) -> Column:
    """True where the target row ``t`` and the source row ``s`` differ in any of
    ``columns`` (NULL-safe)."""
    cond = F.lit(False)
    for c in columns:
        cond = cond | ~F.col(f"t.{c}").eqNullSafe(F.col(f"s.{c}"))
    return cond


def sweep_staging(cfg: JobConfig) -> None:
    """Remove the staging folders of incremental ingests that were killed (older than
    :data:`STAGING_MAX_AGE_SECONDS`)."""
    for folder in cfg.paths.tables_dir.glob("_staging-*"):
        try:  # an object store's folder: the age of its oldest object
            born = folder.mtime() if folder.is_local else min(f.mtime() for f in folder.walk())
            if time.time() - born > STAGING_MAX_AGE_SECONDS:
                log.info("removing %s, left by an ingest that was stopped", folder)
                folder.rmtree()
        except (OSError, ValueError):
            continue


def _rows_or_zero(spark: SparkSession, table: TableRef) -> int:
    if not table.exists(spark):
        return 0
    return int(table.read(spark).count())


def _remove_old_split_tables(cfg: JobConfig) -> None:
    """Remove the split tables of layout 3 (full copies of ``images``) once layout 4's
    tables are written: nothing reads them any more. (Path tables only: catalog tables
    came after layout 4.)"""
    if cfg.tables.in_catalog:
        return
    for name in OLD_SPLIT_TABLES:
        path = cfg.paths.table(name)
        if (path / "_delta_log").is_dir():
            log.info(
                "removing %s: a split table of an older layout (now a partition of images)", path
            )
            shutil.rmtree(path, ignore_errors=True)


def _conform(df: DataFrame, table: str) -> DataFrame:
    """``df`` with exactly the columns and types of :data:`TABLE_SCHEMAS` ``[table]``."""
    return df.select(
        *(F.col(f.name).cast(f.dataType).alias(f.name) for f in TABLE_SCHEMAS[table].fields)
    )
