"""Ingest (driver side): photo folders -> Delta tables, with nothing lost, decoding only
what changed.

The images root (a directory or an object-store prefix) is listed on the executors
(:mod:`flowers_job.photos.listing`), each new or changed file is read and decoded there
(:func:`~flowers_job.vision.images.normalize_image`), and the ``images`` and ``quarantine``
tables are brought up to date (:mod:`flowers_job.ingest.write`): every entry ends in exactly
one of them, set-level problems stop ingest before anything is written, and an unchanged
input writes nothing. Why it works this way (listing, the stratified split, incremental and
idempotent commits, retention): docs/architecture.md, "Design decisions".
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession

from flowers_job.config import JobConfig
from flowers_job.ingest.counts import TableCounts, scan_counts
from flowers_job.ingest.splits import Resplit
from flowers_job.ingest.write import (
    Changes,
    IngestError,
    sweep_staging,
    write_full,
    write_incremental,
)
from flowers_job.photos.files import (
    digest,
    hash_sums,
    list_files,
    listing_key,
)
from flowers_job.photos.listing import images_root, label_folders, listing_units
from flowers_job.photos.verdicts import SKIPPED_REASONS
from flowers_job.tables.delta_tables import (
    TABLE_NAMES,
    latest_commit,
    tables_mismatch,
)
from flowers_job.tables.table_ref import TableRef, ensure_schema, table_ref

__all__ = ["INGEST_FORMAT_VERSION", "IngestError", "IngestReport", "check_images_root", "ingest"]

log = logging.getLogger(__name__)

INGEST_FORMAT_VERSION = 6
"""Bump when the table layout or the image normalisation changes: forces a full rebuild.
4: ``images`` partitioned by ``split``, no split tables, ``mtime_ns`` stored.
5: deletion vectors on both tables; the source file's URI in ``source_path`` (was ``path``;
:data:`~flowers_job.tables.delta_tables.TABLE_PROPERTIES` says why).
6: the split stratified per class (module docstring)."""


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
        tables: table name -> path, or catalog name (``main.flowers.images``).
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
        hidden_skipped: hidden entries (``hidden_path``), in quarantine but skipped: not
            counted towards ``data.max_bad_fraction``.
        split_counts: images per label and split (``{"daisy": {"train": 445, ...}}``).
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
    hidden_skipped: int = 0
    split_counts: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


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
    """Check ``data.images`` before any Spark work: a directory, or an object-store prefix
    (``s3a://bucket/photos``), with label folders.

    Returns:
        ``(root, labels, others)``: the root's real path, or its URI
        (:func:`~flowers_job.photos.listing.images_root`), its label folders (sorted; a
        label's index is its position) and its other top-level entries
        (:func:`~flowers_job.photos.listing.label_folders`).

    Raises:
        IngestError: ``data.images`` unset, not a directory, unreadable, or without a label
            folder (naming the path and what was found); for an object store, also no key
            under the prefix, and a LIST that fails (no such bucket, credentials, network:
            the store's error, which never holds credentials).
    """
    if cfg.data.images is None:
        raise IngestError("data.images: not set (use --images DIR)")
    if isinstance(cfg.data.images, str):  # an object-store URI (DataConfig.images)
        root = real_root = images_root(cfg.data.images)
        try:
            labels, others = label_folders(real_root)
        except FileNotFoundError:
            raise IngestError(f"data.images: {root}: no object under this prefix") from None
        except (OSError, ValueError) as exc:
            raise IngestError(
                f"data.images: cannot list {root}: {exc} (check the bucket, the endpoint and "
                "the credentials: AWS_* in the environment, ~/.aws, or the instance's role)"
            ) from None
    else:
        path = Path(cfg.data.images)
        root = str(path)
        if not path.is_dir():
            raise IngestError(f"data.images: {root} is not a directory")
        real_root = images_root(path)
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
    root = cfg.data.images
    real_root, labels, others = check_images_root(cfg)
    settings = _settings(cfg)
    tables = {name: table_ref(cfg, name) for name in TABLE_NAMES}
    sweep_staging(cfg.paths.tables_dir)
    ensure_schema(spark, cfg)

    t0 = time.perf_counter()
    # The tables' last commits are read while the executors list: the first Delta command of
    # a session costs seconds of the driver's (3.8 s of 5.5 s at 30x).
    history = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingest-history")
    commits_read = history.submit(
        lambda: {name: latest_commit(spark, p) for name, p in tables.items()}
    )
    history.shutdown(wait=False)
    units = listing_units(real_root, labels, others)
    listing = list_files(spark, real_root, labels, units).persist(StorageLevel.DISK_ONLY)
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
        commits = commits_read.result()
        metas = {name: None if c is None else c[1] for name, c in commits.items()}
        stored = metas["images"] or {}
        full = _full_rebuild_reason(cfg, metas, settings, labels)
        if full is None and stored.get("fingerprint") == fingerprint:
            log.info("tables are up to date with %s (fingerprint %s…)", root, fingerprint[:12])
            changes = Changes(
                "unchanged", counts=TableCounts.from_meta(stored.get("counts"), n_files)
            )
        else:
            meta: dict[str, object] = {
                "fingerprint": fingerprint,
                "run_id": uuid.uuid4().hex,
                "label_names": labels,
                "settings": settings,
            }
            changes = _write(spark, cfg, listing, labels, tables, meta, n_files, full)
    finally:
        listing.unpersist()
    if changes.mode != "unchanged":
        from flowers_job.ingest.retention import vacuum_tables

        vacuum_tables(spark, cfg)
    return _report(spark, cfg, tables, n_files, fingerprint, labels, changes, start)


# Arguments: ingest's state (session, settings, listing, labels, tables, metadata), passed as is
# between its steps.
def _write(  # noqa: PLR0913
    spark: SparkSession,
    cfg: JobConfig,
    listing: DataFrame,
    labels: list[str],
    tables: dict[str, TableRef],
    meta: dict[str, object],
    n_files: int,
    full: str | None,
) -> Changes:
    """Both tables rewritten (``full``: why) or the changes applied; an incremental ingest
    that cannot keep every class in every split becomes a full one (:class:`Resplit`)."""
    if full is not None:
        log.info("full ingest: %s", full)
        return write_full(spark, cfg, listing, labels, tables, meta, n_files, full)
    try:
        return write_incremental(spark, cfg, listing, labels, tables, meta, n_files)
    except Resplit as exc:
        why = f"the split per class needs it: {exc}"
        log.info("full ingest: %s", why)
        return write_full(spark, cfg, listing, labels, tables, meta, n_files, why)


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
    mismatch = tables_mismatch(metas, allow_partial=True)
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


# Arguments: ingest's state (session, settings, listing, labels, tables, metadata), passed as is
# between its steps.
def _report(  # noqa: PLR0913
    spark: SparkSession,
    cfg: JobConfig,
    tables: dict[str, TableRef],
    n_files: int,
    fingerprint: str,
    labels: list[str],
    changes: Changes,
    start: float,
) -> IngestReport:
    """The report, with the row counts of the tables as they are now: those this ingest
    computed before its commits, or found in the latest commit's metadata
    (:mod:`flowers_job.ingest.counts`); read from the tables only when neither has them."""
    counts = changes.counts or scan_counts(spark, tables)
    reasons = counts.quarantine
    hidden = sum(reasons.get(code, 0) for code in SKIPPED_REASONS)
    if hidden:
        log.info(
            "%d hidden files skipped (in quarantine as hidden_path, not counted towards "
            "data.max_bad_fraction)",
            hidden,
        )
    return IngestReport(
        files=n_files,
        images_rows=counts.images_rows,
        train_rows=counts.split_rows("train"),
        val_rows=counts.split_rows("val"),
        test_rows=counts.split_rows("test"),
        quarantined_rows=counts.quarantined_rows,
        quarantine_reasons=reasons,
        label_names=labels,
        tables={name: t.describe() for name, t in tables.items()},
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
        hidden_skipped=hidden,
        split_counts=counts.splits,
    )
