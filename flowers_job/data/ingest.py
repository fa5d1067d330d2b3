"""Ingest (driver side): photo folders -> Delta tables, with nothing lost.

The images root ``<images>/<label>/**/<file>`` is listed on the executors, one top-level
entry per task (:mod:`flowers_job.data.listing`), each readable file is read and decoded
there (:func:`~flowers_job.data.images.normalize_image`), and five Delta tables are written
under ``<output_dir>/tables``:

- ``images``: every photo that decoded (path, label, label_index, image, width, height,
  split, row_id, content_sha256, notes);
- ``train``, ``val`` and ``test``: the three splits of ``images`` (``val`` picks the best
  epoch and early-stops; ``test`` is held out of both and scored once at the end);
- ``quarantine``: every other entry under the root, with ``reason_code`` and ``reason``
  (undecodable files, and hidden, linked, misplaced or special entries that are never read).

Every entry of the listing ends in exactly one of ``images`` and ``quarantine``; set-level
problems (no label folder, a label without images, too many bad files) stop ingest before
anything is written. Neither the listing nor any image passes through the driver: it
collects only counts per label and reason.

The split is a pure function of the photo's bytes and ``split_seed`` (a SHA-256 hash), so
a photo lands in the same split on every run whatever the partitioning, and byte-identical
duplicates always share a split (no leakage between train, val and test).

Consistency: each table's Delta commit carries, in its ``userMetadata``, a fingerprint of
the listing (relative path, kind, size and modification time of every entry) and of the
ingest settings, plus the ``run_id`` of the ingest that wrote it. The five tables form one
ingest only if their latest commits carry the same fingerprint and run id
(:func:`tables_mismatch`); each run writes all five, so an interrupted run leaves tables
that training refuses and that the next ingest rewrites. Re-running on unchanged input
writes nothing.

Test-only fault injection: ``FLOWERS_JOB_INGEST_FAULT=pause_after:<table>`` stops ingest
right after that table is written, so that a test can kill it there
(:func:`flowers_job.faults.ingest_pause`).
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
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
from flowers_job.data.listing import label_folders
from flowers_job.data.tables import (
    SPLITS,
    TABLE_NAMES,
    TABLE_SCHEMAS,
    read_table_metadata,
    tables_mismatch,
    write_table,
)

__all__ = ["INGEST_FORMAT_VERSION", "IngestError", "IngestReport", "check_images_root", "ingest"]

log = logging.getLogger(__name__)

INGEST_FORMAT_VERSION = 3
"""Bump when the table layout or the image normalisation changes: forces a re-ingest."""
FILES_PER_PARTITION = 512
"""Decode tasks get about this many files each (~12 MB of stored JPEGs at 256 px)."""


class IngestError(RuntimeError):
    """The input as a whole cannot be ingested; nothing was written."""


@dataclass(frozen=True)
class IngestReport:
    """What ingest found and wrote.

    Attributes:
        files: entries listed under the images root (files, links, special files).
        images_rows / train_rows / val_rows / test_rows / quarantined_rows: table row
            counts;
            ``images_rows + quarantined_rows == files``.
        quarantine_reasons: quarantined entries per ``reason_code``.
        label_names: sorted labels; a label's index is its position here.
        tables: table name -> path.
        fingerprint: hash of the listing (path, kind, size, modification time of every
            entry) and the ingest settings.
        written: False when the tables were already up to date and nothing was written.
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


def _count(spark: SparkSession, path: Path) -> int:
    return int(spark.read.format("delta").load(str(path)).count())


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
    """List the images root, decode on the executors and write the five Delta tables.

    Returns:
        An :class:`IngestReport` with the row counts of the written (or unchanged) tables.

    Raises:
        IngestError: no images root, no label folder, a label folder with no file or no
            decodable image, or more than ``data.max_bad_fraction`` of the entries
            quarantined (the message counts them per reason and names examples). Raised
            before any table is written.
    """
    root = Path(str(cfg.data.images))
    real_root, labels, others = check_images_root(cfg)
    settings = _settings(cfg)
    tables = {name: cfg.paths.table(name) for name in TABLE_NAMES}

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
        metas = {name: read_table_metadata(spark, p) for name, p in tables.items()}
        written = tables_mismatch(metas) is not None or (
            (metas["images"] or {}).get("fingerprint") != fingerprint
        )
        if not written:
            log.info("tables are up to date with %s (fingerprint %s…)", root, fingerprint[:12])
            label_names = [str(x) for x in (metas["images"] or {}).get("label_names", labels)]  # type: ignore[attr-defined]
        else:
            label_names = _ingest_tables(
                spark, cfg, listing, labels, tables, fingerprint, settings, n_files
            )
    finally:
        listing.unpersist()

    counts = {name: _count(spark, p) for name, p in tables.items()}
    q = spark.read.format("delta").load(str(tables["quarantine"]))
    reasons = {
        r["reason_code"]: int(r["count"]) for r in q.groupBy("reason_code").count().collect()
    }
    return IngestReport(
        files=n_files,
        images_rows=counts["images"],
        train_rows=counts["train"],
        val_rows=counts["val"],
        test_rows=counts["test"],
        quarantined_rows=counts["quarantine"],
        quarantine_reasons=reasons,
        label_names=label_names,
        tables={name: str(p) for name, p in tables.items()},
        fingerprint=fingerprint,
        written=written,
    )


def _check_decoded(
    cfg: JobConfig, decoded: DataFrame, labels: list[str], n_files: int
) -> tuple[int, int]:
    """The set-level checks on the decoded files; ``(total, bad)``.

    Raises:
        IngestError: a label without a decodable image, or too many bad files.
    """
    stats = decoded.groupBy("label", "reason_code").count().collect()
    total = sum(int(r["count"]) for r in stats)
    if total != n_files:  # pragma: no cover - one output row per listed entry, by construction
        raise IngestError(f"{n_files} entries listed but {total} decoded; nothing was written")
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
            decoded.where(F.col("reason_code").isNotNull())
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
    return total, bad


def _ingest_tables(
    spark: SparkSession,
    cfg: JobConfig,
    listing: DataFrame,
    labels: list[str],
    tables: dict[str, Path],
    fingerprint: str,
    settings: dict[str, object],
    n_files: int,
) -> list[str]:
    d = cfg.data
    root = os.path.realpath(str(d.images))
    partitions = max(
        2 * spark.sparkContext.defaultParallelism, math.ceil(n_files / FILES_PER_PARTITION)
    )
    decoded = (
        listing.select("relative_path", "label", "num_bytes", "reason_code", "reason")
        .repartition(partitions, "relative_path")
        .mapInPandas(
            decode_partitions(
                root, d.stored_short_side, d.jpeg_quality, d.max_image_pixels, d.extensions
            ),
            schema=DECODED_SCHEMA,
        )
        .persist(StorageLevel.DISK_ONLY)
    )
    try:
        t0 = time.perf_counter()
        total, bad = _check_decoded(cfg, decoded, labels, n_files)
        log.info("decoded %d files in %.1f s", total, time.perf_counter() - t0)
        meta: dict[str, object] = {
            "fingerprint": fingerprint,
            "run_id": uuid.uuid4().hex,
            "label_names": labels,
            "settings": settings,
        }
        # Hash of (seed, content) -> uniform in [0, 1): same photo, same split, on every run.
        u = F.conv(
            F.substring(
                F.sha2(F.concat_ws(":", F.lit(str(d.split_seed)), "content_sha256"), 256), 1, 13
            ),
            16,
            10,
        ).cast("double") / float(16**13)
        images = (
            decoded.where(F.col("reason_code").isNull())
            .withColumn(
                "label_index",
                F.array_position(F.array(*map(F.lit, labels)), F.col("label")) - 1,
            )
            .withColumn(
                "split",
                F.when(u < d.val_fraction, "val")
                .when(u < d.val_fraction + d.test_fraction, "test")
                .otherwise("train"),
            )
            .withColumn("row_id", F.xxhash64("relative_path"))
        )
        quarantine = decoded.where(F.col("reason_code").isNotNull())
        t0 = time.perf_counter()
        write_table(spark, _conform(quarantine, "quarantine"), tables["quarantine"], meta)
        faults.ingest_pause("quarantine")
        write_table(spark, _conform(images, "images"), tables["images"], meta)
        faults.ingest_pause("images")
        # Derive the splits from exactly the images commit just written.
        from delta.tables import DeltaTable

        version = DeltaTable.forPath(spark, str(tables["images"])).history(1).first()
        assert version is not None
        written = (
            spark.read.format("delta")
            .option("versionAsOf", int(version["version"]))
            .load(str(tables["images"]))
        )
        for split in SPLITS:
            write_table(spark, written.where(F.col("split") == split), tables[split], meta)
            faults.ingest_pause(split)
        log.info(
            "wrote 5 Delta tables in %.1f s: %d images, %d quarantined",
            time.perf_counter() - t0,
            total - bad,
            bad,
        )
        return labels
    finally:
        decoded.unpersist()


def _conform(df: DataFrame, table: str) -> DataFrame:
    """``df`` with exactly the columns and types of :data:`TABLE_SCHEMAS` ``[table]``."""
    return df.select(
        *(F.col(f.name).cast(f.dataType).alias(f.name) for f in TABLE_SCHEMAS[table].fields)
    )
