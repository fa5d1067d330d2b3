"""Ingest (driver side): photo folders -> Delta tables, with nothing lost, decoding only
what changed.

The images root ``<images>/<label>/**/<file>`` is listed on the executors
(:mod:`flowers_job.data.listing`), each new or changed file is read and decoded there
(:func:`~flowers_job.data.images.normalize_image`), and two Delta tables under
``<output_dir>/tables`` are brought up to date (:mod:`flowers_job.data.tables`):

- ``images``: every photo that decoded (path, label, label_index, image, width, height,
  split, row_id, content_sha256, num_bytes, mtime_ns, notes), partitioned by ``split``
  (``train``, ``val`` picks the best epoch and early-stops, ``test`` is held out of both and
  scored once at the end);
- ``quarantine``: every other entry under the root, with ``reason_code`` and ``reason``
  (undecodable files, and hidden, linked, misplaced or special entries that are never read).

Every entry of the listing ends in exactly one of ``images`` and ``quarantine``; set-level
problems (no label folder, a label without images, too many bad files, counted over the
whole table after the change) stop ingest before anything is written. Neither the listing
nor any image passes through the driver: it collects only counts per label and reason.

**Incremental.** A re-run compares the listing with what the tables hold (``relative_path``,
``num_bytes``, ``mtime_ns``) and decodes only new and changed files; it MERGEs them into
both tables and deletes the rows of files that are gone (:func:`~flowers_job.data.tables.
merge_table`). An entry that now decodes leaves quarantine and one that no longer does
enters it. Entries refused at listing (links, special files, hidden names) are never
opened, so their verdicts are re-derived on every run at no cost. A full rebuild (both
tables overwritten, every file decoded) happens on the first run, after a change of the
ingest settings or of the label folders (every ``label_index`` would change), after an
interrupted ingest, and with ``data.full_ingest`` (``--full``).

The split is a pure function of the photo's bytes and ``split_seed`` (a SHA-256 hash), so
a photo lands in the same split on every run whatever the partitioning, an unchanged photo
never moves between splits, and byte-identical duplicates always share a split (no leakage
between train, val and test).

Consistency: each table's Delta commit carries, in its ``userMetadata``, a fingerprint of
the listing (relative path, kind, size and modification time of every entry) and of the
ingest settings, plus the ``run_id`` of the ingest that wrote it. The two tables form one
ingest only if their latest commits carry the same fingerprint and run id
(:func:`~flowers_job.data.tables.tables_mismatch`); each run that writes commits to both,
so an interrupted run leaves tables that training refuses and that the next ingest
rebuilds. Re-running on unchanged input writes nothing.

Retention: after an ingest that writes, both tables are vacuumed
(:func:`flowers_job.data.retention.vacuum_tables`).

Test-only fault injection: ``FLOWERS_JOB_INGEST_FAULT=pause_after:<table>`` stops ingest
right after that table is written, so that a test can kill it there
(:func:`flowers_job.faults.ingest_pause`).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from flowers_job import faults
from flowers_job.config import JobConfig
from flowers_job.data.files import (
    DECODED_SCHEMA,
    decode_partitions,
    digest,
    hash_sums,
    list_files,
    listing_key,
)
from flowers_job.data.listing import LISTING_REASONS, label_folders
from flowers_job.data.tables import (
    PARTITION_COLUMNS,
    TABLE_NAMES,
    TABLE_SCHEMAS,
    latest_commit,
    merge_table,
    tables_mismatch,
    write_table,
)

__all__ = ["INGEST_FORMAT_VERSION", "IngestError", "IngestReport", "check_images_root", "ingest"]

log = logging.getLogger(__name__)

INGEST_FORMAT_VERSION = 4
"""Bump when the table layout or the image normalisation changes: forces a full rebuild.
4: ``images`` partitioned by ``split``, no split tables, ``mtime_ns`` stored."""
FILES_PER_PARTITION = 512
"""Decode tasks get about this many files each (~12 MB of stored JPEGs at 256 px)."""
STAGING_MAX_AGE_SECONDS = 6 * 3600.0
"""An incremental ingest's staging folder (``tables/_staging-<run>``) this old belongs to a
run that was stopped: no ingest of this job's scale decodes its changes for 6 hours."""
OLD_SPLIT_TABLES = ("train", "val", "test")
"""The split tables of layout 3 and earlier (full copies of ``images``), removed after the
first rebuild in layout 4."""


class IngestError(RuntimeError):
    """The input as a whole cannot be ingested; nothing was written."""


@dataclass(frozen=True)
class IngestReport:
    """What ingest found and wrote.

    Attributes:
        files: entries listed under the images root (files, links, special files); also
            ``files_listed``.
        images_rows / train_rows / val_rows / test_rows / quarantined_rows: row counts of
            the tables after this ingest; ``images_rows + quarantined_rows == files``.
        quarantine_reasons: quarantined entries per ``reason_code``.
        label_names: sorted labels; a label's index is its position here.
        tables: table name -> path.
        fingerprint: hash of the listing (path, kind, size, modification time of every
            entry) and the ingest settings.
        written: False when the tables were already up to date and nothing was written.
        mode: ``unchanged``, ``incremental`` or ``full`` (and why, for a full rebuild:
            ``full: <reason>``).
        files_listed: entries listed; files_decoded: files read and decoded by this run.
        rows_inserted / rows_updated / rows_deleted: changes to ``images`` (for a full
            rebuild: every row inserted, the previous table's rows deleted).
        rows_quarantined: entries this run put into quarantine or whose verdict changed.
        seconds: wall time of the ingest (s).
    """

    files: int
    images_rows: int
    train_rows: int
    val_rows: int
    test_rows: int
    quarantined_rows: int
    quarantine_reasons: dict[str, int]
    label_names: list[str]
    tables: dict[str, str]
    fingerprint: str
    written: bool
    mode: str = "unchanged"
    files_listed: int = 0
    files_decoded: int = 0
    rows_inserted: int = 0
    rows_updated: int = 0
    rows_deleted: int = 0
    rows_quarantined: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class _Changes:
    """What one ingest wrote (counts for the report)."""

    mode: str
    files_decoded: int = 0
    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    quarantined: int = 0


def _settings(cfg: JobConfig) -> dict[str, object]:
    d = cfg.data
    return {
        "format": INGEST_FORMAT_VERSION,
        "stored_short_side": d.stored_short_side,
        "jpeg_quality": d.jpeg_quality,
        "val_fraction": d.val_fraction,
        "test_fraction": d.test_fraction,
        "split_seed": d.split_seed,
        "extensions": sorted(e.lower() for e in d.extensions),
        "max_image_pixels": d.max_image_pixels,
    }


def check_images_root(cfg: JobConfig) -> tuple[str, list[str], list[str]]:
    """Check ``data.images`` before any Spark work: a directory with label folders.

    Returns:
        ``(real_root, labels, others)``: the root's real path, its label folders (sorted;
        a label's index is its position) and its other top-level entries
        (:func:`~flowers_job.data.listing.label_folders`).

    Raises:
        IngestError: ``data.images`` unset, not a directory, unreadable, or without a label
            folder (naming the path and what was found).
    """
    if cfg.data.images is None:
        raise IngestError("data.images: not set (use --images DIR)")
    root = Path(cfg.data.images)
    if not root.is_dir():
        raise IngestError(f"data.images: {root} is not a directory")
    real_root = os.path.realpath(root)
    try:
        labels, others = label_folders(real_root)
    except OSError as exc:
        raise IngestError(f"data.images: cannot list {root}: {exc}") from None
    if not labels:
        found = f" (found only {others[:10]}, which are not label folders)" if others else ""
        raise IngestError(
            f"data.images: {root} has no label folders{found}; expected <images>/<label>/<file>"
            " with label folder names not starting with '.' or '_'"
        )
    return real_root, labels, others


def ingest(spark: SparkSession, cfg: JobConfig) -> IngestReport:
    """List the images root, decode new and changed files on the executors, and bring the
    Delta tables up to date (module docstring).

    Returns:
        An :class:`IngestReport` with the row counts of the tables after this ingest and
        what it changed.

    Raises:
        IngestError: no images root, no label folder, a label folder with no file or no
            decodable image, or more than ``data.max_bad_fraction`` of the entries
            quarantined after the change (the message counts them per reason and names
            examples). Raised before any table is written.
    """
    start = time.perf_counter()
    root = Path(str(cfg.data.images))
    real_root, labels, others = check_images_root(cfg)
    settings = _settings(cfg)
    tables = {name: cfg.paths.table(name) for name in TABLE_NAMES}
    _sweep_staging(cfg)

    t0 = time.perf_counter()
    listing = list_files(spark, real_root, labels, labels + others).persist(StorageLevel.DISK_ONLY)
    try:
        groups = hash_sums(listing, listing_key(), by=("label", "reason_code"))
        fingerprint = digest(groups, settings=settings)
        n_files = sum(int(g["n"]) for g in groups)
        log.info("listed %d entries in %.1f s", n_files, time.perf_counter() - t0)
        readable = {g["label"] for g in groups if g["reason_code"] is None}
        no_files = [label for label in labels if label not in readable]
        if no_files:
            raise IngestError(
                f"data.images: label folder(s) {no_files} under {root} have no file that could "
                "be an image (hidden names, links to directories or outside the root, and "
                "special files do not count); every label needs at least one image"
            )
        commits = {name: latest_commit(spark, p) for name, p in tables.items()}
        metas = {name: None if c is None else c[1] for name, c in commits.items()}
        stored = metas["images"] or {}
        full = _full_rebuild_reason(cfg, metas, settings, labels)
        if full is None and stored.get("fingerprint") == fingerprint:
            log.info("tables are up to date with %s (fingerprint %s…)", root, fingerprint[:12])
            changes = _Changes("unchanged")
        else:
            meta: dict[str, object] = {
                "fingerprint": fingerprint,
                "run_id": uuid.uuid4().hex,
                "label_names": labels,
                "settings": settings,
            }
            if full is not None:
                log.info("full ingest: %s", full)
                changes = _full(spark, cfg, listing, labels, tables, meta, n_files, full)
            else:
                changes = _incremental(spark, cfg, listing, labels, tables, meta, n_files)
    finally:
        listing.unpersist()
    if changes.mode != "unchanged":
        from flowers_job.data.retention import vacuum_tables

        vacuum_tables(spark, cfg)
    return _report(spark, cfg, tables, n_files, fingerprint, labels, changes, start)


def _full_rebuild_reason(
    cfg: JobConfig,
    metas: dict[str, dict[str, object] | None],
    settings: dict[str, object],
    labels: list[str],
) -> str | None:
    """Why this ingest must decode everything and overwrite both tables; None when an
    incremental MERGE is enough."""
    if cfg.data.full_ingest:
        return "data.full_ingest is set (--full)"
    mismatch = tables_mismatch(metas)
    if mismatch is not None:
        if all(m is None for m in metas.values()):
            return "no tables yet"
        return f"the tables are not one complete ingest ({mismatch})"
    stored = metas["images"] or {}
    if stored.get("settings") != settings:
        return f"the ingest settings changed (stored {stored.get('settings')}, now {settings})"
    if list(stored.get("label_names") or []) != labels:  # type: ignore[call-overload]
        return f"the label folders changed (stored {stored.get('label_names')}, now {labels})"
    return None


def _report(
    spark: SparkSession,
    cfg: JobConfig,
    tables: dict[str, Path],
    n_files: int,
    fingerprint: str,
    labels: list[str],
    changes: _Changes,
    start: float,
) -> IngestReport:
    """The row counts of the tables as they are now (Delta's file statistics and the split
    partitions: no image is read)."""
    images = spark.read.format("delta").load(str(tables["images"]))
    per_split = {r["split"]: int(r["count"]) for r in images.groupBy("split").count().collect()}
    q = spark.read.format("delta").load(str(tables["quarantine"]))
    reasons = {
        r["reason_code"]: int(r["count"]) for r in q.groupBy("reason_code").count().collect()
    }
    commit = latest_commit(spark, tables["images"])
    stored = (commit[1] if commit else None) or {}
    label_names = [str(x) for x in stored.get("label_names", labels)]  # type: ignore[attr-defined]
    return IngestReport(
        files=n_files,
        images_rows=sum(per_split.values()),
        train_rows=per_split.get("train", 0),
        val_rows=per_split.get("val", 0),
        test_rows=per_split.get("test", 0),
        quarantined_rows=sum(reasons.values()),
        quarantine_reasons=reasons,
        label_names=label_names,
        tables={name: str(p) for name, p in tables.items()},
        fingerprint=fingerprint,
        written=changes.mode != "unchanged",
        mode=changes.mode,
        files_listed=n_files,
        files_decoded=changes.files_decoded,
        rows_inserted=changes.inserted,
        rows_updated=changes.updated,
        rows_deleted=changes.deleted,
        rows_quarantined=changes.quarantined,
        seconds=round(time.perf_counter() - start, 3),
    )


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
    root = os.path.realpath(str(d.images))
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


def _full(
    spark: SparkSession,
    cfg: JobConfig,
    listing: DataFrame,
    labels: list[str],
    tables: dict[str, Path],
    meta: dict[str, object],
    n_files: int,
    why: str,
) -> _Changes:
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
        write_table(spark, _conform(quarantine, "quarantine"), tables["quarantine"], meta)
        faults.ingest_pause("quarantine")
        write_table(
            spark,
            _conform(images, "images"),
            tables["images"],
            meta,
            partition_by=PARTITION_COLUMNS["images"],
        )
        faults.ingest_pause("images")
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
    return _Changes(
        mode=f"full: {why}",
        files_decoded=n_files,
        inserted=counts.get(True, 0),
        deleted=before,
        quarantined=counts.get(False, 0),
    )


def _incremental(
    spark: SparkSession,
    cfg: JobConfig,
    listing: DataFrame,
    labels: list[str],
    tables: dict[str, Path],
    meta: dict[str, object],
    n_files: int,
) -> _Changes:
    """Decode the new and changed files and MERGE them, with the deletions, into both
    tables (module docstring)."""
    images = spark.read.format("delta").load(str(tables["images"]))
    quarantine = spark.read.format("delta").load(str(tables["quarantine"]))
    key = ["relative_path", "num_bytes", "mtime_ns"]
    # What the tables hold of files that were read: their path, size and time.
    stored = images.select(*key).unionByName(
        quarantine.where(~F.col("reason_code").isin(*LISTING_REASONS)).select(*key)
    )
    readable = listing.where(F.col("reason_code").isNull())
    changed = readable.alias("l").join(
        stored.alias("s"),
        (F.col("l.relative_path") == F.col("s.relative_path"))
        & F.col("l.num_bytes").eqNullSafe(F.col("s.num_bytes"))
        & F.col("l.mtime_ns").eqNullSafe(F.col("s.mtime_ns")),
        "left_anti",
    )
    # Entries refused at listing are never opened: their verdicts come again, at no cost.
    todo = changed.unionByName(listing.where(F.col("reason_code").isNotNull()))
    listed = listing.select("relative_path")
    gone = (
        images.select("relative_path")
        .unionByName(quarantine.select("relative_path"))
        .join(listed, "relative_path", "left_anti")
        .distinct()
    )
    t0 = time.perf_counter()
    n_todo = todo.count()
    # Written out, not cached: the first MERGE changes a table these plans read, and Delta's
    # commit refreshes cached plans that read it (a cached ``decoded`` would be recomputed
    # without the rows that MERGE just wrote).
    staging = cfg.paths.tables_dir / f"_staging-{meta['run_id']}"
    decoded_path, gone_path = staging / "decoded", staging / "gone"
    _with_image_columns(cfg, _decode(spark, cfg, todo, n_todo), labels).write.parquet(
        str(decoded_path)
    )
    gone.write.parquet(str(gone_path))
    decoded = spark.read.parquet(str(decoded_path))
    gone = spark.read.parquet(str(gone_path))
    try:
        touched = decoded.select("relative_path").unionByName(gone)
        none = F.lit(None).cast("string")
        after = (
            images.select("relative_path", "label", none.alias("reason_code"), none.alias("reason"))
            .unionByName(quarantine.select("relative_path", "label", "reason_code", "reason"))
            .join(touched, "relative_path", "left_anti")
            .unionByName(decoded.select("relative_path", "label", "reason_code", "reason"))
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
        faults.ingest_pause("quarantine")
        i = merge_table(
            spark,
            _source(decoded, gone, "images"),
            tables["images"],
            meta,
            keep=keep,
            changed=keep & _differs("content_sha256", "num_bytes", "mtime_ns"),
        )
        faults.ingest_pause("images")
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
        shutil.rmtree(staging, ignore_errors=True)
    return _Changes(
        mode="incremental",
        files_decoded=n_decoded,
        inserted=i["inserted"],
        updated=i["updated"],
        deleted=i["deleted"],
        quarantined=q["inserted"] + q["updated"],
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


def _sweep_staging(cfg: JobConfig) -> None:
    """Remove the staging folders of incremental ingests that were killed (older than
    :data:`STAGING_MAX_AGE_SECONDS`)."""
    for folder in cfg.paths.tables_dir.glob("_staging-*"):
        try:
            old = time.time() - folder.stat().st_mtime > STAGING_MAX_AGE_SECONDS
        except OSError:
            continue
        if old:
            log.info("removing %s, left by an ingest that was stopped", folder)
            shutil.rmtree(folder, ignore_errors=True)


def _rows_or_zero(spark: SparkSession, path: Path) -> int:
    from delta.tables import DeltaTable

    if not DeltaTable.isDeltaTable(spark, str(path)):
        return 0
    return int(spark.read.format("delta").load(str(path)).count())


def _remove_old_split_tables(cfg: JobConfig) -> None:
    """Remove the split tables of layout 3 (full copies of ``images``) once layout 4's
    tables are written: nothing reads them any more."""
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
