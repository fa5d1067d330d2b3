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
for up to an hour right after that table is written, so that a test can kill it there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from flowers_job.config import JobConfig
from flowers_job.data.images import ImageRejected, normalize_image
from flowers_job.data.listing import label_folders, list_entry, read_listed_file

__all__ = [
    "INGEST_FAULT_ENV",
    "INGEST_FORMAT_VERSION",
    "SPLITS",
    "TABLE_NAMES",
    "TABLE_SCHEMAS",
    "IngestError",
    "IngestReport",
    "ingest",
    "max_file_bytes",
    "read_table_metadata",
    "tables_mismatch",
]

log = logging.getLogger(__name__)

INGEST_FORMAT_VERSION = 3
"""Bump when the table layout or the image normalisation changes: forces a re-ingest."""
TABLE_NAMES = ("images", "train", "val", "test", "quarantine")
SPLITS = ("train", "val", "test")
INGEST_FAULT_ENV = "FLOWERS_JOB_INGEST_FAULT"
"""Test only: ``pause_after:<table>`` pauses ingest after writing ``<table>`` (module doc)."""
FILES_PER_PARTITION = 512
"""Decode tasks get about this many files each (~12 MB of stored JPEGs at 256 px)."""
_META_KEY = "flowers_job"

_IMAGE_COLUMNS = T.StructType(
    [
        T.StructField("row_id", T.LongType()),
        T.StructField("path", T.StringType()),
        T.StructField("relative_path", T.StringType()),
        T.StructField("label", T.StringType()),
        T.StructField("label_index", T.IntegerType()),
        T.StructField("split", T.StringType()),
        T.StructField("image", T.BinaryType()),
        T.StructField("width", T.IntegerType()),
        T.StructField("height", T.IntegerType()),
        T.StructField("content_sha256", T.StringType()),
        T.StructField("num_bytes", T.LongType()),
        T.StructField("notes", T.StringType()),
    ]
)
TABLE_SCHEMAS: dict[str, T.StructType] = {
    "images": _IMAGE_COLUMNS,
    "train": _IMAGE_COLUMNS,
    "val": _IMAGE_COLUMNS,
    "test": _IMAGE_COLUMNS,
    "quarantine": T.StructType(
        [
            T.StructField("path", T.StringType()),
            T.StructField("relative_path", T.StringType()),
            T.StructField("label", T.StringType()),
            T.StructField("reason_code", T.StringType()),
            T.StructField("reason", T.StringType()),
            T.StructField("num_bytes", T.LongType()),
            T.StructField("content_sha256", T.StringType()),
        ]
    ),
}
"""Columns and types of each table (nullability aside): what training expects to read."""

_LISTING = T.StructType(
    [
        T.StructField("relative_path", T.StringType(), False),
        T.StructField("label", T.StringType(), True),
        T.StructField("kind", T.StringType(), False),
        T.StructField("num_bytes", T.LongType(), True),
        T.StructField("mtime_ns", T.LongType(), True),
        T.StructField("reason_code", T.StringType(), True),
        T.StructField("reason", T.StringType(), True),
    ]
)
_DECODED = T.StructType(
    [
        T.StructField("path", T.StringType(), False),
        T.StructField("relative_path", T.StringType(), False),
        T.StructField("label", T.StringType(), True),
        T.StructField("num_bytes", T.LongType(), True),
        T.StructField("content_sha256", T.StringType(), True),
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


def max_file_bytes(max_pixels: int) -> int:
    """Largest file (bytes) that can hold an image of ``max_pixels`` pixels: 8 bytes per
    pixel (16-bit RGBA, uncompressed) plus 1 MiB of metadata. Larger files are quarantined
    as ``file_too_large`` without being read."""
    return 8 * max_pixels + 2**20


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


def _list_partitions(
    root: str, labels: list[str]
) -> Callable[[Iterable[pd.DataFrame]], Iterator[pd.DataFrame]]:
    """The ``mapInPandas`` function that lists top-level entries (``name`` as bytes)."""
    label_set = frozenset(labels)
    columns = [f.name for f in _LISTING.fields]

    def walk(batches: Iterable[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        for pdf in batches:
            for name in pdf["name"]:
                chunk: list[dict[str, Any]] = []
                for entry in list_entry(root, os.fsdecode(bytes(name)), label_set):
                    chunk.append(asdict(entry))
                    if len(chunk) == 4096:
                        yield pd.DataFrame(chunk, columns=columns)
                        chunk = []
                if chunk:
                    yield pd.DataFrame(chunk, columns=columns)

    return walk


def _list_files(spark: SparkSession, root: str, labels: list[str], names: list[str]) -> DataFrame:
    """The listing of ``root`` as a DataFrame (schema ``_LISTING``), walked on the executors."""
    units = spark.createDataFrame([(os.fsencode(n),) for n in names], "name binary")
    return units.mapInPandas(_list_partitions(root, labels), schema=_LISTING)


def _summarise_listing(listing: DataFrame) -> list[dict[str, Any]]:
    """Counts and order-independent hash sums per (label, reason_code): a few rows."""
    key = [
        F.col("relative_path"),
        F.col("kind"),
        F.coalesce("num_bytes", F.lit(-1)),
        F.coalesce("mtime_ns", F.lit(-1)),
        F.coalesce("reason_code", F.lit("")),
    ]
    rows = (
        listing.groupBy("label", "reason_code")
        .agg(
            F.count(F.lit(1)).alias("n"),
            F.sum(F.xxhash64(*key).cast("decimal(38,0)")).alias("a"),
            F.sum(F.xxhash64(*reversed(key)).cast("decimal(38,0)")).alias("b"),
        )
        .collect()
    )
    return [r.asDict() for r in rows]


def _fingerprint(groups: list[dict[str, Any]], settings: dict[str, object]) -> str:
    n = sum(int(g["n"]) for g in groups)
    a = sum(int(g["a"]) for g in groups)
    b = sum(int(g["b"]) for g in groups)
    text = json.dumps({"n": n, "a": str(a), "b": str(b), "settings": settings}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _decode_partitions(
    root: str, short_side: int, quality: int, max_pixels: int, extensions: tuple[str, ...]
) -> Callable[[Iterable[pd.DataFrame]], Iterator[pd.DataFrame]]:
    """The ``mapInPandas`` function that reads and decodes a partition of the listing.

    One output row per input row: entries with a listing ``reason_code``, an unsupported
    extension or more than :func:`max_file_bytes` are passed on unread.
    """
    exts = {e.lower().lstrip(".") for e in extensions}
    too_large = max_file_bytes(max_pixels)
    columns = [f.name for f in _DECODED.fields]

    def one(rec: Any) -> dict[str, Any]:
        num_bytes = None if pd.isna(rec.num_bytes) else int(rec.num_bytes)
        row: dict[str, Any] = dict.fromkeys(columns)
        row.update(
            path=f"file:{root}/{rec.relative_path}",
            relative_path=rec.relative_path,
            label=rec.label,
            num_bytes=num_bytes,
        )
        if isinstance(rec.reason_code, str):  # refused at listing: never opened
            row.update(reason_code=rec.reason_code, reason=rec.reason)
            return row
        ext = rec.relative_path.rsplit(".", 1)[-1].lower() if "." in rec.relative_path else ""
        try:
            if ext not in exts:
                raise ImageRejected(
                    "unsupported_extension",
                    f"extension {ext!r} is not one of data.extensions {sorted(exts)}; not read",
                )
            if num_bytes is not None and num_bytes > too_large:
                raise ImageRejected(
                    "file_too_large",
                    f"{num_bytes} bytes, more than any image within data.max_image_pixels="
                    f"{max_pixels} can take ({too_large} bytes); not read",
                )
            content = read_listed_file(root, rec.relative_path)
            row.update(num_bytes=len(content), content_sha256=hashlib.sha256(content).hexdigest())
            out = normalize_image(
                content, short_side=short_side, quality=quality, max_pixels=max_pixels
            )
            row.update(image=out.jpeg, width=out.width, height=out.height, notes=out.notes)
        except ImageRejected as exc:
            row.update(reason_code=exc.code, reason=exc.message)
        except Exception as exc:
            row.update(reason_code="decode_error", reason=f"{type(exc).__name__}: {exc}")
        return row

    def decode(batches: Iterable[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        for pdf in batches:
            yield pd.DataFrame([one(rec) for rec in pdf.itertuples(index=False)], columns=columns)

    return decode


def read_table_metadata(spark: SparkSession, path: Path) -> dict[str, object] | None:
    """The flowers_job metadata stored in the latest commit of the Delta table at ``path``.

    Returns:
        The metadata dict (``fingerprint``, ``run_id``, ``label_names``, ``settings``), or
        None if there is no Delta table there or its latest commit is not flowers_job's.
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


def tables_mismatch(metas: Mapping[str, Mapping[str, object] | None]) -> str | None:
    """Why the tables' latest commits are not one complete ingest; None when they are.

    One ingest writes all five tables with the same fingerprint and ``run_id``, so equal
    pairs mean that one run wrote every table and no other run wrote any since.

    Args:
        metas: table name -> :func:`read_table_metadata`.

    Returns:
        None, or a description naming each table's fingerprint and run.
    """
    missing = sorted(name for name, meta in metas.items() if meta is None)
    if missing:
        return f"no flowers_job commit in {missing}"
    runs = {name: (str(m.get("fingerprint")), str(m.get("run_id"))) for name, m in metas.items()}  # type: ignore[union-attr]
    if len(set(runs.values())) == 1:
        return None
    return "; ".join(f"{name}: fingerprint {fp[:12]} run {run}" for name, (fp, run) in runs.items())


def _write(spark: SparkSession, df: DataFrame, path: Path, meta: dict[str, object]) -> None:
    """Overwrite the Delta table at ``path`` with ``df``, committing ``meta``.

    Delta skips the commit of an empty overwrite of an empty table (for example a clean
    quarantine), which would leave the previous run's metadata in place; that is switched off
    for the write, and the commit is checked.

    Raises:
        IngestError: the latest commit does not carry ``meta['run_id']``.
    """
    skip_empty = "spark.databricks.delta.skipRecordingEmptyCommits"
    before = spark.conf.get(skip_empty, None)
    spark.conf.set(skip_empty, "false")
    try:
        (
            df.write.format("delta")
            .mode("overwrite")
            .option("overwriteSchema", "true")
            .option("userMetadata", json.dumps({_META_KEY: meta}, sort_keys=True))
            .save(str(path))
        )
    finally:
        if before is None:
            spark.conf.unset(skip_empty)
        else:
            spark.conf.set(skip_empty, before)
    if (read_table_metadata(spark, path) or {}).get("run_id") != meta["run_id"]:
        raise IngestError(f"the commit to {path} does not carry this ingest's metadata")


def _fault_point(table: str) -> None:
    """Test only: pause after writing ``table`` if ``FLOWERS_JOB_INGEST_FAULT`` says so."""
    if os.environ.get(INGEST_FAULT_ENV) == f"pause_after:{table}":
        log.warning("%s: ingest paused after writing the %s table", INGEST_FAULT_ENV, table)
        time.sleep(3600)


def _count(spark: SparkSession, path: Path) -> int:
    return int(spark.read.format("delta").load(str(path)).count())


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
    settings = _settings(cfg)
    tables = {name: cfg.paths.table(name) for name in TABLE_NAMES}

    t0 = time.perf_counter()
    listing = _list_files(spark, real_root, labels, labels + others).persist(StorageLevel.DISK_ONLY)
    try:
        groups = _summarise_listing(listing)
        fingerprint = _fingerprint(groups, settings)
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
            _decode_partitions(
                root, d.stored_short_side, d.jpeg_quality, d.max_image_pixels, d.extensions
            ),
            schema=_DECODED,
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
        _write(spark, _conform(quarantine, "quarantine"), tables["quarantine"], meta)
        _fault_point("quarantine")
        _write(spark, _conform(images, "images"), tables["images"], meta)
        _fault_point("images")
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
            _write(spark, written.where(F.col("split") == split), tables[split], meta)
            _fault_point(split)
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
