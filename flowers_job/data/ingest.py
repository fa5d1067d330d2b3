"""Ingest (driver side): photo folders -> Delta tables, with nothing lost.

``<images>/<label>/**/<file>`` is read with Spark's ``binaryFile`` source, each file
is decoded and normalised on the executors (:func:`~flowers_job.data.images.normalize_image`),
and four Delta tables are written under ``<output_dir>/tables``:

- ``images``: every photo that decoded (path, label, label_index, image, width, height,
  split, row_id, content_sha256, notes);
- ``train`` and ``val``: the two splits of ``images``;
- ``quarantine``: every file that did not decode, with ``reason_code`` and ``reason``.

The split is a pure function of the photo's bytes and ``split_seed`` (a SHA-256 hash), so
a photo lands in the same split on every run whatever the partitioning, and byte-identical
duplicates always share a split (no train/val leakage).

Re-running on unchanged input is a no-op: every table's commit carries a fingerprint of
the input files (relative path, size, modification time) and of the ingest settings; when
all four tables carry the current fingerprint, nothing is written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

import pandas as pd
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from flowers_job.config import JobConfig
from flowers_job.data.images import ImageRejected, normalize_image

__all__ = [
    "INGEST_FORMAT_VERSION",
    "TABLE_NAMES",
    "IngestError",
    "IngestReport",
    "ingest",
    "read_table_metadata",
]

log = logging.getLogger(__name__)

INGEST_FORMAT_VERSION = 1
"""Bump when the table layout or the image normalisation changes: forces a re-ingest."""
TABLE_NAMES = ("images", "train", "val", "quarantine")
_META_KEY = "flowers_job"

_DECODED = T.StructType(
    [
        T.StructField("path", T.StringType(), False),
        T.StructField("relative_path", T.StringType(), False),
        T.StructField("label", T.StringType(), False),
        T.StructField("num_bytes", T.LongType(), False),
        T.StructField("content_sha256", T.StringType(), False),
        T.StructField("ok", T.BooleanType(), False),
        T.StructField("reason_code", T.StringType(), True),
        T.StructField("reason", T.StringType(), True),
        T.StructField("image", T.BinaryType(), True),
        T.StructField("width", T.IntegerType(), True),
        T.StructField("height", T.IntegerType(), True),
        T.StructField("notes", T.StringType(), True),
    ]
)


class IngestError(RuntimeError):
    """The input as a whole cannot be ingested; nothing was written."""


@dataclass(frozen=True)
class IngestReport:
    """What ingest found and wrote.

    Attributes:
        files: candidate files under the label folders.
        images_rows / train_rows / val_rows / quarantined_rows: table row counts.
        quarantine_reasons: quarantined files per ``reason_code``.
        label_names: sorted labels; a label's index is its position here.
        tables: table name -> path.
        fingerprint: hash of the input files (path, size, modification time) and the ingest
            settings.
        written: False when the tables were already up to date and nothing was written.
    """

    files: int
    images_rows: int
    train_rows: int
    val_rows: int
    quarantined_rows: int
    quarantine_reasons: dict[str, int]
    label_names: list[str]
    tables: dict[str, str]
    fingerprint: str
    written: bool
    ignored_top_level_files: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _label_folders(root: Path) -> tuple[list[str], list[str]]:
    """Label folder names (sorted) and the plain files lying directly in ``root``."""
    if not root.is_dir():
        raise IngestError(f"data.images: {root} is not a directory")
    labels, top_files = [], []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False) and not entry.name.startswith((".", "_")):
            labels.append(entry.name)
        elif entry.is_file():
            top_files.append(entry.name)
    if not labels:
        raise IngestError(
            f"data.images: {root} has no label folders; expected <images>/<label>/<file>"
        )
    return labels, top_files


def _settings(cfg: JobConfig) -> dict[str, object]:
    d = cfg.data
    return {
        "format": INGEST_FORMAT_VERSION,
        "stored_short_side": d.stored_short_side,
        "jpeg_quality": d.jpeg_quality,
        "val_fraction": d.val_fraction,
        "split_seed": d.split_seed,
        "extensions": sorted(e.lower() for e in d.extensions),
        "max_image_pixels": d.max_image_pixels,
    }


def _decode_partitions(short_side: int, quality: int, max_pixels: int, extensions: tuple[str, ...]):  # type: ignore[no-untyped-def]
    """The ``mapInPandas`` function that decodes a partition of binaryFile rows."""
    exts = {e.lower().lstrip(".") for e in extensions}

    def decode(batches: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        for pdf in batches:
            rows = []
            for rec in pdf.itertuples(index=False):
                row = {
                    "path": rec.path,
                    "relative_path": rec.relative_path,
                    "label": rec.label,
                    "num_bytes": int(rec.length),
                    "content_sha256": hashlib.sha256(rec.content or b"").hexdigest(),
                    "ok": False,
                    "reason_code": None,
                    "reason": None,
                    "image": None,
                    "width": None,
                    "height": None,
                    "notes": None,
                }
                ext = (
                    rec.relative_path.rsplit(".", 1)[-1].lower() if "." in rec.relative_path else ""
                )
                try:
                    if ext not in exts:
                        raise ImageRejected(
                            "unsupported_extension",
                            f"extension {ext!r} is not one of data.extensions {sorted(exts)}",
                        )
                    out = normalize_image(
                        rec.content or b"",
                        short_side=short_side,
                        quality=quality,
                        max_pixels=max_pixels,
                    )
                    row.update(ok=True, image=out.jpeg, width=out.width, height=out.height)
                    row["notes"] = out.notes
                except ImageRejected as exc:
                    row.update(reason_code=exc.code, reason=exc.message)
                except Exception as exc:
                    row.update(reason_code="decode_error", reason=f"{type(exc).__name__}: {exc}")
                rows.append(row)
            yield pd.DataFrame(rows, columns=[f.name for f in _DECODED.fields])

    return decode


def _read_files(spark: SparkSession, root: Path, labels: list[str]) -> DataFrame:
    """Every file under the label folders: path, relative_path, label, length,
    modificationTime, content.

    Spark's file scan silently skips zero-length files; they are taken from the file
    listing instead and come back with ``length`` 0 and a null ``content`` (quarantined as
    ``empty_file``), so no file is ever dropped.
    """
    base = str(root.resolve())
    scan = spark.read.format("binaryFile").option("recursiveFileLookup", "true").load(base)
    # Spark's path column is "file:/abs/path" (not percent-encoded).
    prefix_len = len(f"file:{base}/")
    scan = scan.withColumn("relative_path", F.expr(f"substring(path, {prefix_len + 1})"))
    listed = [os.path.relpath(unquote(urlparse(uri).path), base) for uri in scan.inputFiles()]
    empty = (
        spark.createDataFrame([(r,) for r in listed], "relative_path string")
        .join(scan.select("relative_path"), "relative_path", "left_anti")
        .select(
            F.concat(F.lit(f"file:{base}/"), "relative_path").alias("path"),
            "relative_path",
            F.lit(0).cast("long").alias("length"),
            F.lit(None).cast("timestamp").alias("modificationTime"),
            F.lit(None).cast("binary").alias("content"),
        )
    )
    columns = ["path", "relative_path", "length", "modificationTime", "content"]
    return (
        scan.select(*columns)
        .unionByName(empty)
        .where(F.instr("relative_path", "/") > 0)  # files inside a label folder
        .withColumn("label", F.substring_index("relative_path", "/", 1))
        .where(F.col("label").isin(labels))
    )


def _fingerprint(files: DataFrame, settings: dict[str, object]) -> tuple[str, int]:
    """Order-independent digest of each file's (relative_path, length, modificationTime) plus
    the ingest settings. Only file metadata is read (binaryFile prunes ``content``), so
    checking whether the tables are up to date costs a listing, not a read of every photo."""
    key = ("relative_path", "length", "modificationTime")
    row = files.select(
        F.count(F.lit(1)).alias("n"),
        F.sum(F.xxhash64(*key).cast("decimal(38,0)")).alias("a"),
        F.sum(F.xxhash64(*reversed(key)).cast("decimal(38,0)")).alias("b"),
    ).first()
    assert row is not None
    n, a, b = int(row["n"]), row["a"], row["b"]
    text = json.dumps({"n": n, "a": str(a), "b": str(b), "settings": settings}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest(), n


def read_table_metadata(spark: SparkSession, path: Path) -> dict[str, object] | None:
    """The flowers_job metadata stored in the latest commit of the Delta table at ``path``.

    Returns:
        The metadata dict, or None if there is no Delta table there or it was not written
        by flowers_job.
    """
    from delta.tables import DeltaTable

    if not DeltaTable.isDeltaTable(spark, str(path)):
        return None
    last = DeltaTable.forPath(spark, str(path)).history(1).select("userMetadata").first()
    if last is None or not last["userMetadata"]:
        return None
    meta = json.loads(last["userMetadata"])
    value = meta.get(_META_KEY) if isinstance(meta, dict) else None
    return value if isinstance(value, dict) else None


def _write(df: DataFrame, path: Path, meta: dict[str, object]) -> None:
    (
        df.write.format("delta")
        .mode("overwrite")
        .option("overwriteSchema", "true")
        .option("userMetadata", json.dumps({_META_KEY: meta}, sort_keys=True))
        .save(str(path))
    )


def _count(spark: SparkSession, path: Path) -> int:
    return int(spark.read.format("delta").load(str(path)).count())


def ingest(spark: SparkSession, cfg: JobConfig) -> IngestReport:
    """Read the photo folders, decode on the executors and write the four Delta tables.

    Returns:
        An :class:`IngestReport` with the row counts of the written (or unchanged) tables.

    Raises:
        IngestError: no images root, no label folder, a label with no decodable image, or
            more than ``data.max_bad_fraction`` of the files quarantined. Raised before any
            table is written.
    """
    if cfg.data.images is None:
        raise IngestError("data.images: not set (use --images DIR)")
    root = Path(cfg.data.images)
    labels, top_files = _label_folders(root)
    if top_files:
        log.info("ignoring %d files at the top of %s (not in a label folder)", len(top_files), root)
    settings = _settings(cfg)
    tables = {name: cfg.paths.table(name) for name in TABLE_NAMES}

    files = _read_files(spark, root, labels)
    t0 = time.perf_counter()
    fingerprint, n_files = _fingerprint(files, settings)
    log.info("listed %d files in %.1f s", n_files, time.perf_counter() - t0)
    if n_files == 0:
        raise IngestError(f"data.images: no files under the label folders of {root}")

    metas = {name: read_table_metadata(spark, p) for name, p in tables.items()}
    written = not all(m is not None and m.get("fingerprint") == fingerprint for m in metas.values())
    if not written:
        log.info("tables are up to date with %s (fingerprint %s…)", root, fingerprint[:12])
        meta = metas["images"] or {}
        label_names = list(meta.get("label_names", labels))  # type: ignore[call-overload]
    else:
        label_names = _ingest_tables(spark, cfg, files, labels, tables, fingerprint, settings)

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
        quarantined_rows=counts["quarantine"],
        quarantine_reasons=reasons,
        label_names=label_names,
        tables={name: str(p) for name, p in tables.items()},
        fingerprint=fingerprint,
        written=written,
        ignored_top_level_files=top_files,
    )


def _ingest_tables(
    spark: SparkSession,
    cfg: JobConfig,
    files: DataFrame,
    labels: list[str],
    tables: dict[str, Path],
    fingerprint: str,
    settings: dict[str, object],
) -> list[str]:
    d = cfg.data
    decoded = (
        files.select("path", "relative_path", "label", "length", "content")
        .mapInPandas(
            _decode_partitions(
                d.stored_short_side, d.jpeg_quality, d.max_image_pixels, d.extensions
            ),
            schema=_DECODED,
        )
        .persist(StorageLevel.DISK_ONLY)
    )
    try:
        t0 = time.perf_counter()
        stats = {
            (r["label"], r["ok"]): int(r["count"])
            for r in decoded.groupBy("label", "ok").count().collect()
        }
        total = sum(stats.values())
        bad = sum(n for (_, ok), n in stats.items() if not ok)
        empty = [lab for lab in labels if stats.get((lab, True), 0) == 0]
        if empty:
            raise IngestError(
                f"data.images: label folder(s) {empty} under {cfg.data.images} contain no "
                "decodable image"
            )
        if bad / total > d.max_bad_fraction:
            raise IngestError(
                f"{bad} of {total} files ({bad / total:.1%}) could not be decoded, more than "
                f"data.max_bad_fraction={d.max_bad_fraction}; see the reasons by running with a "
                "higher limit and reading the quarantine table"
            )
        meta: dict[str, object] = {
            "fingerprint": fingerprint,
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
            decoded.where("ok")
            .withColumn(
                "label_index",
                (F.array_position(F.array(*map(F.lit, labels)), F.col("label")) - 1).cast("int"),
            )
            .withColumn("split", F.when(u < d.val_fraction, "val").otherwise("train"))
            .withColumn("row_id", F.xxhash64("relative_path"))
            .select(
                "row_id",
                "path",
                "relative_path",
                "label",
                "label_index",
                "split",
                "image",
                "width",
                "height",
                "content_sha256",
                "num_bytes",
                "notes",
            )
        )
        quarantine = decoded.where(~F.col("ok")).select(
            "path", "relative_path", "label", "reason_code", "reason", "num_bytes", "content_sha256"
        )
        log.info("decoded %d files in %.1f s", total, time.perf_counter() - t0)
        t0 = time.perf_counter()
        _write(quarantine, tables["quarantine"], meta)
        _write(images, tables["images"], meta)
        written = spark.read.format("delta").load(str(tables["images"]))
        for split in ("train", "val"):
            _write(written.where(F.col("split") == split), tables[split], meta)
        log.info(
            "wrote 4 Delta tables in %.1f s: %d images, %d quarantined",
            time.perf_counter() - t0,
            total - bad,
            bad,
        )
        return labels
    finally:
        decoded.unpersist()
