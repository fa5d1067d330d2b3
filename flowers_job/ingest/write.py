"""Ingest's writes (driver side): decode on the executors, check the set, and write both
tables in full or apply the changes (:mod:`flowers_job.ingest.job` decides which)."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from flowers_job.cluster.connect import default_parallelism
from flowers_job.config import DataConfig, JobConfig
from flowers_job.errors import IngestError
from flowers_job.ingest.counts import TableCounts, split_counts
from flowers_job.ingest.old_layout import own_old_split_tables, remove_old_split_tables
from flowers_job.ingest.splits import full_splits, incremental_splits
from flowers_job.location import Location
from flowers_job.photos.files import DECODED_SCHEMA, decode_partitions
from flowers_job.photos.listing import LISTING_REASONS, images_root
from flowers_job.photos.verdicts import SKIPPED_REASONS
from flowers_job.runtime.hooks import hook
from flowers_job.tables.delta_tables import (
    IMAGES_PROPERTIES,
    PARTITION_COLUMNS,
    TABLE_PROPERTIES,
    TABLE_SCHEMAS,
    delete_then_append,
    ensure_properties,
    merge_changes,
    merge_table,
    null_safe_differs,
    read_table_metadata,
    write_table,
)
from flowers_job.tables.table_ref import TableRef
from flowers_job.vision.limits import ImageLimits

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


@dataclass(frozen=True)
class Changes:
    """What one ingest wrote (counts for the report)."""

    mode: str
    files_decoded: int = 0
    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    quarantined: int = 0
    counts: TableCounts | None = None
    """The tables' rows after this ingest; None: read them (:mod:`flowers_job.ingest.counts`)."""


def _check_after(
    data: DataConfig, after: DataFrame, labels: list[str], n_files: int
) -> dict[str, int]:
    """The set-level checks on the tables as they would be after this ingest: one row per
    listed entry (``label``, ``reason_code``, ``relative_path``, ``reason``).

    Entries with a :data:`~flowers_job.photos.verdicts.SKIPPED_REASONS` code (hidden names:
    ``.DS_Store``, macOS's ``._x.jpg``) are skipped, not bad: they stay in quarantine with
    their reason but count neither in the bad files nor in the total that
    ``data.max_bad_fraction`` is a fraction of.

    Returns:
        The entries that go to quarantine, per ``reason_code`` (hidden ones included).

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
            f"data.images: label folder(s) {no_image} under {data.images} contain no "
            "decodable image; nothing was written"
        )
    reasons = dict(bad_by_reason)
    skipped = sum(bad_by_reason.pop(code, 0) for code in SKIPPED_REASONS)
    considered = total - skipped
    bad = sum(bad_by_reason.values())
    limit = data.max_bad_fraction
    if bad / considered > limit:  # considered > 0: every label has an image
        examples = (
            after.where(
                F.col("reason_code").isNotNull() & ~F.col("reason_code").isin(*SKIPPED_REASONS)
            )
            .select("relative_path", "reason")
            .orderBy("relative_path")
            .limit(3)
            .collect()
        )
        hidden = f" ({skipped} hidden files skipped, not counted)" if skipped else ""
        raise IngestError(
            f"{bad} of {considered} files under {data.images}{hidden} "
            f"({bad / considered:.1%}) would be "
            f"quarantined, more than data.max_bad_fraction={limit}: "
            + ", ".join(f"{code} {n}" for code, n in sorted(bad_by_reason.items()))
            + "; e.g. "
            + "; ".join(f"{r['relative_path']}: {r['reason']}" for r in examples)
            + ". Nothing was written: fix or remove the files, or raise data.max_bad_fraction "
            "(the quarantine table then lists every one with its reason)"
        )
    return reasons


def _decode(spark: SparkSession, data: DataConfig, entries: DataFrame, n: int) -> DataFrame:
    """Read and decode the listed ``entries`` (about ``n`` of them) on the executors, one
    :data:`DECODED_SCHEMA` row each, with the split, ``label_index`` and ``row_id`` of the
    images. Lazy: the caller persists it."""
    d = data
    root = images_root(d.images)
    partitions = max(2 * default_parallelism(spark), math.ceil(n / FILES_PER_PARTITION))
    return (
        entries.select("relative_path", "label", "num_bytes", "mtime_ns", "reason_code", "reason")
        .repartition(partitions, "relative_path")
        .mapInPandas(
            decode_partitions(
                root,
                d.stored_short_side,
                d.jpeg_quality,
                d.max_image_pixels,
                d.extensions,
                limits=ImageLimits.from_data(d),
            ),
            schema=DECODED_SCHEMA,
        )
    )


def _with_image_columns(decoded: DataFrame, labels: list[str]) -> DataFrame:
    """``decoded`` plus ``label_index`` (the label's position in ``labels``) and ``row_id``
    (xxhash64 of the relative path); the split comes after
    (:func:`~flowers_job.ingest.splits.full_splits`,
    :func:`~flowers_job.ingest.splits.incremental_splits`)."""
    return decoded.withColumn(
        "label_index", F.array_position(F.array(*map(F.lit, labels)), F.col("label")) - 1
    ).withColumn("row_id", F.xxhash64("relative_path"))


# Arguments: ingest's state (session, settings, listing, labels, tables, metadata), passed as is
# between its steps.
def write_full(  # noqa: PLR0913
    spark: SparkSession,
    cfg: JobConfig,
    listing: DataFrame,
    labels: list[str],
    tables: dict[str, TableRef],
    meta: dict[str, object],
    n_files: int,
    why: str,
) -> Changes:
    """Decode every entry, split each class in proportion
    (:func:`~flowers_job.ingest.splits.full_splits`) and overwrite both tables; then remove the
    split tables of an older layout that ingest wrote
    (:func:`~flowers_job.ingest.old_layout.own_old_split_tables`, checked first).

    Raises:
        IngestError: as :func:`_check_after`, :func:`~flowers_job.ingest.splits.split_quotas` and
            :func:`~flowers_job.ingest.old_layout.own_old_split_tables`, before any table is
            written.
    """
    old_tables = own_old_split_tables(spark, cfg.paths.tables_dir, cfg.tables.in_catalog)
    before = _rows_or_zero(spark, tables["images"])
    decoded = _with_image_columns(_decode(spark, cfg.data, listing, n_files), labels).persist(
        StorageLevel.DISK_ONLY
    )
    try:
        t0 = time.perf_counter()
        reasons = _check_after(cfg.data, decoded, labels, n_files)
        log.info("decoded %d files in %.1f s", n_files, time.perf_counter() - t0)
        good = decoded.where(F.col("reason_code").isNull())
        images = good.join(full_splits(cfg.data, good), "content_sha256")
        quarantine = decoded.where(F.col("reason_code").isNotNull())
        counts = TableCounts.from_rows(split_counts(images), reasons)
        meta["counts"] = counts.to_meta()
        t0 = time.perf_counter()
        write_table(
            spark,
            _conform(quarantine, "quarantine"),
            tables["quarantine"],
            meta,
            properties=TABLE_PROPERTIES,
        )
        hook("ingest_table_written", table="quarantine")
        _record_changes(spark, tables["images"])
        write_table(
            spark,
            _conform(images, "images"),
            tables["images"],
            meta,
            partition_by=PARTITION_COLUMNS["images"],
            properties=IMAGES_PROPERTIES,
        )
        hook("ingest_table_written", table="images")
        log.info(
            "wrote 2 Delta tables in %.1f s: %d images, %d quarantined",
            time.perf_counter() - t0,
            counts.images_rows,
            counts.quarantined_rows,
        )
    finally:
        decoded.unpersist()
    remove_old_split_tables(old_tables)
    return Changes(
        mode=f"full: {why}",
        files_decoded=n_files,
        inserted=counts.images_rows,
        deleted=before,
        quarantined=counts.quarantined_rows,
        counts=counts,
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
    """Decode the new and changed files and bring both tables up to date with them and the
    deletions: the quarantine by a MERGE (skipped when nothing there changes), ``images`` by
    :func:`_write_images` (:mod:`flowers_job.ingest.job`'s docstring). Stored photos keep
    their split; new ones fill their class's quotas
    (:func:`~flowers_job.ingest.splits.incremental_splits`).

    Raises:
        IngestError: as :func:`_check_after` and
            :func:`~flowers_job.ingest.splits.split_quotas`, before any write.
        Resplit: a class would miss a split unless stored photos moved; nothing written.
    """
    t0 = time.perf_counter()
    # Written out, not cached: the first commit changes a table these plans read, and Delta's
    # commit refreshes cached plans that read it (a cached ``decoded`` would be recomputed
    # without the rows that commit just wrote). The comparison is written too: the decode,
    # the checks and both writes read it instead of the tables.
    staging = cfg.paths.tables_dir / f"_staging-{meta['run_id']}"
    try:
        staged = _stage_changes(spark, cfg, listing, labels, tables, n_files, staging)
        meta["counts"] = staged.counts.to_meta()
        log.info(
            "decoded %d new or changed files in %.1f s",
            staged.n_decoded,
            time.perf_counter() - t0,
        )
        t0 = time.perf_counter()
        q = _merge_quarantine(spark, staged, tables["quarantine"], meta)
        i = _write_images(spark, tables["images"], staged.diff, staged.decoded, staged.gone, meta)
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
        files_decoded=staged.n_decoded,
        inserted=i["inserted"],
        updated=i["updated"],
        deleted=i["deleted"],
        quarantined=q["inserted"] + q["updated"],
        counts=staged.counts,
    )


@dataclass(frozen=True)
class _Staged:
    """An incremental ingest's changes, decoded and split, before any table is written."""

    diff: DataFrame
    """Every listed and stored path with its ``_status``: ``todo``, ``keep`` or ``gone``."""
    decoded: DataFrame
    """The new and changed files, decoded, with their split (quarantined ones without)."""
    gone: DataFrame
    """``relative_path`` of the stored entries no longer listed."""
    n_decoded: int
    counts: TableCounts


def _stage_changes(
    spark: SparkSession,
    cfg: JobConfig,
    listing: DataFrame,
    labels: list[str],
    tables: dict[str, TableRef],
    n_files: int,
    staging: Location,
) -> _Staged:
    """Compare the listing with the tables, decode what is new or changed, check the set as
    it would be after, and split the new photos; each step written under ``staging`` so that
    the writes read files, not the tables they change.

    Raises:
        IngestError: as :func:`_check_after` and
            :func:`~flowers_job.ingest.splits.split_quotas`.
        Resplit: a class would miss a split unless stored photos moved.
    """
    diff_path, decoded_path = staging / "diff", staging / "decoded"
    splits_path = staging / "splits"
    # One pass over both tables' key columns; everything below reads this small file.
    _diff(spark, listing, tables).write.parquet(str(diff_path))
    diff = spark.read.parquet(str(diff_path))
    todo = diff.where(F.col("_status") == "todo").drop("_status")
    n_todo = todo.count()
    _with_image_columns(_decode(spark, cfg.data, todo, n_todo), labels).write.parquet(
        str(decoded_path)
    )
    decoded = spark.read.parquet(str(decoded_path))
    columns = ["relative_path", "label", "reason_code", "reason"]
    after = (
        diff.where(F.col("_status") == "keep")
        .select(*columns)
        .unionByName(decoded.select(*columns))
    )
    reasons = _check_after(cfg.data, after, labels, n_files)
    kept = (
        tables["images"]
        .read(spark)
        .select("relative_path", "label", "content_sha256", "split")
        .join(diff.where(F.col("_status") == "keep").select("relative_path"), "relative_path")
    )
    good = decoded.where(F.col("reason_code").isNull())
    # written out: the images write must not read the table it changes
    incremental_splits(cfg.data, kept, good).write.parquet(str(splits_path))
    decoded = decoded.join(spark.read.parquet(str(splits_path)), "content_sha256", "left")
    n_decoded = decoded.where(
        F.col("reason_code").isNull() | ~F.col("reason_code").isin(*LISTING_REASONS)
    ).count()
    stored = decoded.where(F.col("reason_code").isNull()).select("label", "split")
    counts = TableCounts.from_rows(
        split_counts(kept.select("label", "split").unionByName(stored)), reasons
    )
    gone = diff.where(F.col("_status") == "gone").select("relative_path")
    return _Staged(diff, decoded, gone, n_decoded, counts)


def _merge_quarantine(
    spark: SparkSession, staged: _Staged, quarantine: TableRef, meta: dict[str, object]
) -> dict[str, int]:
    """MERGE the changes into the quarantine table, or, when none of its entries changes,
    keep its commit and name it in ``meta`` (``kept``).

    Returns:
        ``inserted``, ``updated`` and ``deleted`` rows.
    """
    keep = "NOT s._gone"  # SQL text: the same MERGE on classic Spark and Connect
    source = _source(staged.decoded, staged.gone, "quarantine")
    changed = f"{keep} AND (" + null_safe_differs(*QUARANTINE_COMPARED) + ")"
    stored = quarantine.read(spark).select("relative_path", *QUARANTINE_COMPARED)
    if merge_changes(source, stored, keep=keep, changed=changed):
        merged = merge_table(spark, source, quarantine, meta, keep=keep, changed=changed)
        hook("ingest_table_written", table="quarantine")
        return merged
    kept_run = (read_table_metadata(spark, quarantine) or {}).get("run_id")
    meta["kept"] = {"quarantine": kept_run}
    log.info("quarantine: no entry changed, no MERGE (its commit of run %s kept)", kept_run)
    return {"inserted": 0, "updated": 0, "deleted": 0}


QUARANTINE_COMPARED = ("reason_code", "reason", "num_bytes", "mtime_ns", "content_sha256")
"""A quarantined entry is replaced when one of these differs (the MERGE's ``changed``)."""
DIFF_COLUMNS = ("label", "num_bytes", "mtime_ns", "reason_code", "reason")
"""The columns of an incremental ingest's comparison besides ``relative_path`` and
``_status``: the listing's for entries to decode, the tables' for the others."""


MAX_DELETE_PATHS = 50_000
"""An incremental ingest that removes or replaces more ``images`` rows than this MERGEs
them in one commit instead of :func:`~flowers_job.tables.delta_tables.delete_then_append`,
whose paths pass through the driver (about 100 bytes each)."""


def _record_changes(spark: SparkSession, table: TableRef) -> None:
    """Set the :data:`~flowers_job.tables.delta_tables.IMAGES_PROPERTIES` that an existing
    ``images`` lacks (a table written before they were the job's, or changed by hand)
    before ingest writes it, so its change data feed records this write; a new table gets
    them with its first write."""
    if table.exists(spark):
        set_now = ensure_properties(spark, table, IMAGES_PROPERTIES)
        if set_now:
            log.info("images: set the table properties %s before writing it", set_now)


def _write_images(
    spark: SparkSession,
    table: TableRef,
    diff: DataFrame,
    decoded: DataFrame,
    gone: DataFrame,
    meta: dict[str, object],
) -> dict[str, int]:
    """Bring ``images`` up to date (:func:`_record_changes` first): delete the rows of the
    paths it holds that are gone or were decoded again (changed, or now quarantined) and
    append the decoded images (:func:`~flowers_job.tables.delta_tables.delete_then_append`:
    deletion vectors, no stored row read but the paths); past :data:`MAX_DELETE_PATHS` such
    paths, one MERGE.

    Returns:
        ``inserted``, ``updated`` (a path deleted and appended again), ``deleted``, as a
        MERGE's metrics count them.
    """
    _record_changes(spark, table)
    held = diff.where((F.col("_held_in") == "images") & (F.col("_status") != "keep"))
    good = decoded.where(F.col("reason_code").isNull())
    rows = held.select("relative_path").limit(MAX_DELETE_PATHS + 1).collect()
    if len(rows) > MAX_DELETE_PATHS:
        keep = "NOT s._gone"
        return merge_table(
            spark,
            _source(decoded, gone, "images"),
            table,
            meta,
            keep=keep,
            changed=f"{keep} AND ({null_safe_differs('content_sha256', 'num_bytes', 'mtime_ns')})",
        )
    paths = [str(r["relative_path"]) for r in rows]
    # the rows appended, and of them those that replace a deleted one: one aggregation
    flagged = good.join(
        held.select("relative_path", F.lit(1).alias("_replaces")), "relative_path", "left"
    )
    row = flagged.agg(F.count("*").alias("n"), F.count("_replaces").alias("r")).first()
    appended, replaced = (int(row["n"]), int(row["r"])) if row is not None else (0, 0)
    delete_then_append(
        spark,
        table,
        paths,
        _conform(good, "images"),
        meta,
        after_deletes=lambda: hook("ingest_table_written", table="images_deletes"),
    )
    return {"inserted": appended - replaced, "updated": replaced, "deleted": len(paths) - replaced}


def _diff(spark: SparkSession, listing: DataFrame, tables: dict[str, TableRef]) -> DataFrame:
    """The listing against what both tables hold, in one full outer join on
    ``relative_path`` that reads only the tables' small columns (no image bytes).

    One row per path that is listed or stored, with :data:`DIFF_COLUMNS` and ``_status``:

    - ``keep``: a readable file that a table holds with the same ``num_bytes`` and
      ``mtime_ns`` (the stored columns): nothing to do;
    - ``todo``: a new or changed file, a file refused at listing (its verdict comes again, at
      no cost) or one stored with a listing verdict that is now readable (the listing's
      columns): to decode;
    - ``gone``: a stored row whose file is no longer listed (the stored columns): to delete;

    and ``_held_in``: the table that holds the path (``images``, ``quarantine``; null: new).
    """
    images = tables["images"].read(spark)
    quarantine = tables["quarantine"].read(spark)
    none = F.lit(None).cast("string")
    stored = images.select(
        "relative_path", "label", "num_bytes", "mtime_ns",
        none.alias("reason_code"), none.alias("reason"), F.lit("images").alias("_held_in"),
    ).unionByName(
        quarantine.select("relative_path", *DIFF_COLUMNS, F.lit("quarantine").alias("_held_in"))
    )  # fmt: skip
    listed = listing.select("relative_path", *DIFF_COLUMNS, F.lit(True).alias("_listed")).alias("l")
    held = stored.select(
        "relative_path", *DIFF_COLUMNS, "_held_in", F.lit(True).alias("_held")
    ).alias("s")
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
        F.col("s._held_in").alias("_held_in"),
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


def sweep_staging(tables_dir: Location) -> None:
    """Remove the staging folders under ``tables_dir`` of incremental ingests that were
    killed (older than :data:`STAGING_MAX_AGE_SECONDS`)."""
    for folder in tables_dir.glob("_staging-*"):
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


def _conform(df: DataFrame, table: str) -> DataFrame:
    """``df`` with exactly the columns and types of :data:`TABLE_SCHEMAS` ``[table]``."""
    return df.select(
        *(F.col(f.name).cast(f.dataType).alias(f.name) for f in TABLE_SCHEMAS[table].fields)
    )
