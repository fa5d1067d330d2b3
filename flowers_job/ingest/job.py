"""Ingest (driver side): photo folders -> Delta tables, with nothing lost, decoding only
what changed.

The images root ``<images>/<label>/**/<file>``, a directory or an object-store prefix
(``s3a://bucket/photos``, read through pyarrow: :mod:`flowers_job.photos.object_listing`), is
listed on the executors (:mod:`flowers_job.photos.listing`), each new or changed file is read
and decoded there (:func:`~flowers_job.vision.images.normalize_image`), and two Delta tables under
``<output_dir>/tables`` are brought up to date (:mod:`flowers_job.tables.delta_tables`):

- ``images``: every photo that decoded (source_path, label, label_index, image, width, height,
  split, row_id, content_sha256, num_bytes, mtime_ns, notes), partitioned by ``split``
  (``train``, ``val`` picks the best epoch and early-stops, ``test`` is held out of both and
  scored once at the end);
- ``quarantine``: every other entry under the root, with ``reason_code`` and ``reason``
  (undecodable files, and hidden, linked, misplaced or special entries that are never read).

Every entry of the listing ends in exactly one of ``images`` and ``quarantine``; set-level
problems (no label folder, a label without images, too many bad files, counted over the
whole table after the change) stop ingest before anything is written. Neither the listing
nor any image passes through the driver: it collects only counts per label and reason.

The tables are path tables under ``<output_dir>/tables`` by default, or managed tables in a
catalog, by name, with ``tables.schema`` (:mod:`flowers_job.tables.table_ref`): the same
writes, commits, metadata and checks either way.

**Incremental.** A re-run compares the listing with what the tables hold (``relative_path``,
``num_bytes``, ``mtime_ns``) in one outer join that reads no image bytes, written to a
staging folder that the decode, the set-level checks and both MERGEs read instead of the
tables, and decodes only new and changed files. It MERGEs the quarantine's changes
(:func:`~flowers_job.tables.delta_tables.merge_table`), or keeps its commit when none of its
entries changed (named under ``kept`` in the images commit); in ``images`` it deletes the
rows of files that are gone or changed and appends the new rows
(:func:`~flowers_job.tables.delta_tables.delete_then_append`: deletion vectors, no stored
image read). An entry that now decodes leaves quarantine and one that no longer does
enters it. Each commit carries the tables' row counts after it
(:mod:`flowers_job.ingest.counts`), so an unchanged ingest reads neither table. Entries refused at listing (links, special files, hidden names) are never
opened, so their verdicts are re-derived on every run at no cost. A full rebuild (both
tables overwritten, every file decoded) happens on the first run, after a change of the
ingest settings or of the label folders (every ``label_index`` would change), after an
interrupted ingest, and with ``data.full_ingest`` (``--full``).

**The split is stratified per class.** Each photo has a split hash (SHA-256 of
``split_seed`` and its bytes). A full rebuild ranks each class's distinct photos by that
hash: the first ``round(n * val_fraction)`` go to val, the next ``round(n * test_fraction)``
to test (each at least 1, and at least 1 left), the rest to train, so every class is in
every split in proportion (:func:`~flowers_job.ingest.splits.split_quotas`); a class with
fewer than 3 distinct photos stops ingest with an error naming it. An incremental ingest
never moves a stored photo: new photos of a class fill what the class lacks of its quotas
for its new size (val, then test, by the same ranking), the rest go to train; only if a
class would miss a split (its last photo of it is gone and no new one came) is it a full
rebuild instead. So the split is the same whatever the partitioning and an unchanged photo
keeps its split across incremental ingests, but it depends on the order photos arrived in:
a full rebuild (``--full``, changed settings) splits every class afresh and may move
photos. Byte-identical duplicates are one photo, in the class of the first of their labels,
and share a split (no leakage between train, val and test).

**Hidden files** (``.DS_Store``, ``._x.jpg``) are skipped and counted apart: recorded in
quarantine as ``hidden_path``, not counted towards ``data.max_bad_fraction``, and reported
as ``hidden_skipped`` ("N hidden files skipped" in the log).

**Deletion.** A full ingest removes the split tables of an older layout
(``<output_dir>/tables/{train,val,test}``) only when their commits carry ingest's metadata;
another Delta table there stops it before anything is written
(:func:`~flowers_job.ingest.old_layout.own_old_split_tables`).

Consistency: each table's Delta commit carries, in its ``userMetadata``, a fingerprint of
the listing (relative path, kind, size and modification time of every entry) and of the
ingest settings, plus the ``run_id`` of the ingest that wrote it. The two tables form one
ingest only if their latest commits carry the same fingerprint and run id
(:func:`~flowers_job.tables.delta_tables.tables_mismatch`); each run that writes commits to both
(or names the quarantine commit it kept), so an interrupted run leaves tables that training
refuses and that the next ingest rebuilds; one stopped between its DELETE and its append
of ``images`` leaves tables that the next ingest brings up to date incrementally.
Re-running on unchanged input writes nothing.

Retention: after an ingest that writes, both tables are vacuumed
(:func:`flowers_job.ingest.retention.vacuum_tables`).

Test hook: the ``ingest_table_written`` hook point (:mod:`flowers_job.runtime.hooks`) right
after each table is written; the tests' injector pauses there, so that a test can kill
ingest there.
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
    sweep_staging(cfg)
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


def _write(
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


def _report(
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
