"""What ingest and predict share: list a folder of photos on the executors, read and decode
each file there, and fingerprint a set of rows whatever its order.

- :func:`list_files`: the entries under a root as a DataFrame (:data:`LISTING_SCHEMA`),
  walked on the executors, each top-level entry in several tasks that share out its entries
  (:mod:`flowers_job.photos.listing`);
- :func:`decode_partitions`: the ``mapInPandas`` function that reads and decodes a partition
  of the listing into :data:`DECODED_SCHEMA`, one output row per entry: an image, or a
  ``reason_code`` and ``reason`` (never a dropped row);
- :func:`hash_sums` and :func:`digest`: an order-independent fingerprint of a DataFrame's
  rows (the ingest fingerprint of a listing, the digest of a split).

Neither the listing nor any image passes through the driver.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, replace
from typing import Any

import pandas as pd
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from flowers_job.cluster.connect import default_parallelism
from flowers_job.cluster.python_workers import prepare_worker
from flowers_job.location import is_remote
from flowers_job.photos.listing import list_entry, read_listed_file
from flowers_job.photos.object_listing import ObjectStoreError
from flowers_job.vision.images import normalize_image
from flowers_job.vision.limits import ImageLimits, ImageRejected

__all__ = [
    "DECODED_SCHEMA",
    "LISTING_SCHEMA",
    "decode_partitions",
    "digest",
    "hash_sums",
    "list_files",
    "listing_key",
    "listing_shards",
    "max_file_bytes",
]

LISTING_SCHEMA = T.StructType(
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
"""One row per entry under the root (:class:`~flowers_job.photos.listing.ListedFile`)."""

DECODED_SCHEMA = T.StructType(
    [
        T.StructField("source_path", T.StringType(), False),
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
        T.StructField("mtime_ns", T.LongType(), True),
    ]
)
"""One row per listed entry after :func:`decode_partitions`: ``image`` (a normalised JPEG),
or a ``reason_code`` and ``reason``; ``mtime_ns`` is the listing's, passed on when the
input has it."""

_LISTING_ROWS_PER_FRAME = 4096
MAX_LISTING_TASKS = 1024
"""Most Spark tasks of a listing, whatever the cluster's size (several units per task)."""


def max_file_bytes(max_pixels: int, limit: int | None = None) -> int:
    """Largest file (bytes) ingest reads: ``limit`` (``data.max_file_bytes``), and never more
    than can hold an image of ``max_pixels`` pixels: 8 bytes per pixel (16-bit RGBA,
    uncompressed) plus 1 MiB of metadata. Larger files are quarantined as
    ``file_too_large`` from their listed size, without being read."""
    most = 8 * max_pixels + 2**20
    return most if limit is None else min(most, limit)


def _list_partitions(
    root: str, labels: list[str]
) -> Callable[[Iterable[pd.DataFrame]], Iterator[pd.DataFrame]]:
    """The ``mapInPandas`` function that lists units (``name`` as bytes, ``shard``,
    ``shards``: a top-level entry's entries whose :func:`~flowers_job.photos.listing.entry_shard`
    is ``shard``)."""
    label_set = frozenset(labels)
    columns = [f.name for f in LISTING_SCHEMA.fields]

    def walk(batches: Iterable[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        prepare_worker()
        for pdf in batches:
            for name, shard, shards in zip(pdf["name"], pdf["shard"], pdf["shards"], strict=True):
                chunk: list[dict[str, Any]] = []
                unit = (int(shard), int(shards))
                for entry in list_entry(root, os.fsdecode(bytes(name)), label_set, unit):
                    chunk.append(asdict(entry))
                    if len(chunk) == _LISTING_ROWS_PER_FRAME:
                        yield pd.DataFrame(chunk, columns=columns)
                        chunk = []
                if chunk:
                    yield pd.DataFrame(chunk, columns=columns)

    return walk


def listing_shards(spark: SparkSession) -> int:
    """Units each top-level entry is listed in: twice the cluster's task slots
    (``defaultParallelism``: :func:`~flowers_job.cluster.connect.default_parallelism`, on
    classic Spark and Connect), so that one large folder keeps every slot busy and a slow
    unit does not hold up the others."""
    return max(1, 2 * default_parallelism(spark))


def list_files(
    spark: SparkSession,
    root: str,
    labels: list[str],
    names: list[str],
    shards: int | None = None,
) -> DataFrame:
    """The listing of ``root`` as a lazy DataFrame (:data:`LISTING_SCHEMA`), walked on the
    executors: ``shards`` units per top-level entry in ``names``, in as many Spark tasks as
    :func:`listing_shards` (twice the task slots; fewer when there are fewer units, at most
    :data:`MAX_LISTING_TASKS`), each task listing consecutive units.

    Each unit walks its entry's tree but examines (``lstat``, verdict) only the entries
    whose :func:`~flowers_job.photos.listing.entry_shard` is its index, so that the entries
    are spread over every task slot however the tree is laid out (5 label folders, or
    100,000 files in one), and each is reported exactly once. A unit costs a walk of its
    entry's directories (``scandir`` only). A task costs a Python task's start (about 0.1 s,
    after :mod:`flowers_job.cluster.python_workers`), so a listing of 5 label folders takes 4
    tasks of 5 units there, not 20 of one (a third of the time: docs/performance.md).

    An object-store root is listed one unit per top-level prefix, each unit one recursive
    LIST (:mod:`flowers_job.photos.object_listing` says why it is not sharded).

    The units reach the tasks as ``spark.range(len(units), numPartitions=tasks)``, each id
    the index of its unit in a list the function carries (``spark.range`` splits the ids
    into consecutive runs as ``SparkContext.parallelize`` does its list), so the same
    DataFrame API serves classic Spark and Connect (which has no ``parallelize``).

    Args:
        root: the real path of the images root, or its object-store URI
            (:func:`~flowers_job.photos.listing.images_root`).
        labels: the label folders (:func:`~flowers_job.photos.listing.label_folders`).
        names: every top-level entry to walk (the labels and the others), or the units of
            :func:`~flowers_job.photos.listing.listing_units`.
        shards: units per top-level entry; None: :func:`listing_shards`; always 1 for an
            object-store root.
    """
    k = 1 if is_remote(root) else shards or listing_shards(spark)
    units = [(os.fsencode(n), i, k) for n in names for i in range(k)]
    tasks = min(len(units), listing_shards(spark), MAX_LISTING_TASKS)
    walk = _list_partitions(root, labels)

    def list_units(batches: Iterable[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        frames = (
            pd.DataFrame([units[int(i)] for i in pdf["id"]], columns=["name", "shard", "shards"])
            for pdf in batches
        )
        yield from walk(frames)

    frame = spark.range(len(units), numPartitions=max(1, tasks))
    return frame.mapInPandas(list_units, schema=LISTING_SCHEMA)


def decode_partitions(
    root: str,
    short_side: int,
    quality: int,
    max_pixels: int,
    extensions: tuple[str, ...],
    limits: ImageLimits | None = None,
) -> Callable[[Iterable[pd.DataFrame]], Iterator[pd.DataFrame]]:
    """The ``mapInPandas`` function that reads and decodes a partition of the listing
    (``relative_path, label, num_bytes, reason_code, reason``, optionally ``mtime_ns``) into
    :data:`DECODED_SCHEMA`.

    One output row per input row: entries with a listing ``reason_code``, an unsupported
    extension or more than :func:`max_file_bytes` are passed on unread; a file that does not
    decode gets ``decode_error`` (or :class:`~flowers_job.vision.limits.ImageRejected`'s code).
    ``root`` is a local real path or an object-store URI, read through pyarrow there
    (:func:`~flowers_job.photos.listing.read_listed_file`); an object store that fails for
    another reason than a missing key fails the task
    (:class:`~flowers_job.photos.object_listing.ObjectStoreError`). ``source_path`` is
    ``file:<root>/<relative_path>``, or ``<root URI>/<relative_path>``. Images are
    normalised by :func:`~flowers_job.vision.images.normalize_image` to
    ``short_side`` pixels, JPEG ``quality``, opening only ``limits.formats`` and refusing by
    ``limits`` (:class:`~flowers_job.vision.limits.ImageLimits`: the formats, the aspect
    ratio, the long side, the file size; None: the defaults) with ``max_pixels`` as the
    pixel limit. A file over :func:`max_file_bytes` by its listed size is never read; one
    that grew past it since the listing is refused after the read.
    """
    exts = {e.lower().lstrip(".") for e in extensions}
    limits = replace(limits or ImageLimits(), max_pixels=max_pixels)
    too_large = max_file_bytes(max_pixels, limits.max_file_bytes)
    columns = [f.name for f in DECODED_SCHEMA.fields]
    source = f"{root}/" if is_remote(root) else f"file:{root}/"

    def one(rec: Any) -> dict[str, Any]:
        num_bytes = None if pd.isna(rec.num_bytes) else int(rec.num_bytes)
        mtime = getattr(rec, "mtime_ns", None)
        row: dict[str, Any] = dict.fromkeys(columns)
        row.update(
            source_path=source + rec.relative_path,
            relative_path=rec.relative_path,
            label=rec.label,
            num_bytes=num_bytes,
            mtime_ns=None if mtime is None or pd.isna(mtime) else int(mtime),
        )
        if isinstance(rec.reason_code, str):  # refused at listing: never opened
            row.update(reason_code=rec.reason_code, reason=rec.reason)
            return row
        try:
            content = _read_checked(root, rec.relative_path, num_bytes, exts, too_large, limits)
            row.update(num_bytes=len(content), content_sha256=hashlib.sha256(content).hexdigest())
            out = normalize_image(content, short_side=short_side, quality=quality, limits=limits)
            row.update(image=out.jpeg, width=out.width, height=out.height, notes=out.notes)
        except ImageRejected as exc:
            row.update(reason_code=exc.code, reason=exc.message)
        except ObjectStoreError:
            raise  # the store, not this photo: the task fails and is retried
        except Exception as exc:
            row.update(reason_code="decode_error", reason=f"{type(exc).__name__}: {exc}")
        return row

    def decode(batches: Iterable[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        prepare_worker()
        for pdf in batches:
            yield pd.DataFrame([one(rec) for rec in pdf.itertuples(index=False)], columns=columns)

    return decode


def _read_checked(
    root: str,
    relative_path: str,
    num_bytes: int | None,
    exts: set[str],
    too_large: int,
    limits: ImageLimits,
) -> bytes:
    """The bytes of a listed file, read only when its extension is one of ``exts`` and its
    listed size (``num_bytes``) at most ``too_large``; at most one byte past the limit is
    read, so that a file that grew since the listing costs no more memory than the limit.

    Raises:
        ImageRejected: ``unsupported_extension`` or ``file_too_large`` (before the read, or
            after it for a file that grew).
    """
    ext = relative_path.rsplit(".", 1)[-1].lower() if "." in relative_path else ""
    if ext not in exts:
        raise ImageRejected(
            "unsupported_extension",
            f"extension {ext!r} is not one of data.extensions {sorted(exts)}; not read",
        )
    if num_bytes is not None and num_bytes > too_large:
        raise ImageRejected("file_too_large", _too_large(num_bytes, too_large, limits))
    content = read_listed_file(root, relative_path, max_bytes=too_large)
    if len(content) > too_large:  # grew since the listing
        grew = "; it grew since the listing, and was read no further"
        raise ImageRejected(
            "file_too_large", _too_large(len(content), too_large, limits, grew, at_least=True)
        )
    return content


def _too_large(
    num_bytes: int,
    too_large: int,
    limits: ImageLimits,
    tail: str = "; not read",
    at_least: bool = False,
) -> str:
    """The reason of ``file_too_large``, naming the setting that decided it (``at_least``:
    ``num_bytes`` is what was read before stopping, not the file's size)."""
    size = f"at least {num_bytes}" if at_least else str(num_bytes)
    if too_large == limits.max_file_bytes:
        return f"{size} bytes, more than data.max_file_bytes={too_large}{tail}"
    return (
        f"{size} bytes, more than any image within data.max_image_pixels="
        f"{limits.max_pixels} can take ({too_large} bytes){tail}"
    )


def listing_key() -> list[Column]:
    """What identifies a listed entry in the ingest fingerprint: its path, kind, size,
    modification time and listing reason."""
    return [
        F.col("relative_path"),
        F.col("kind"),
        F.coalesce("num_bytes", F.lit(-1)),
        F.coalesce("mtime_ns", F.lit(-1)),
        F.coalesce("reason_code", F.lit("")),
    ]


def hash_sums(
    df: DataFrame, key: Sequence[Column | str], by: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Row count and two order-independent hash sums of ``key`` per group of ``by``.

    ``a`` sums ``xxhash64(*key)`` and ``b`` ``xxhash64(*reversed(key))``, as exact
    ``decimal(38,0)`` sums: the same rows give the same sums however they are partitioned
    or ordered, and one changed row changes both. One Spark aggregation; only the groups
    (a few rows) reach the driver.

    Returns:
        ``[{**group, "n": int, "a": int, "b": int}]``, one dict per group (one in all
        without ``by``; an empty DataFrame gives ``n = a = b = 0``).
    """
    sums = [
        F.count(F.lit(1)).alias("n"),
        F.sum(F.xxhash64(*key).cast("decimal(38,0)")).alias("a"),
        F.sum(F.xxhash64(*reversed(key)).cast("decimal(38,0)")).alias("b"),
    ]
    rows = df.groupBy(*by).agg(*sums).collect() if by else [df.agg(*sums).first()]
    return [
        {**r.asDict(), "n": int(r["n"] or 0), "a": int(r["a"] or 0), "b": int(r["b"] or 0)}
        for r in rows
        if r is not None
    ]


def digest(groups: Iterable[Mapping[str, Any]], **context: object) -> str:
    """SHA-256 hex of the summed :func:`hash_sums` groups and ``context`` (JSON-able values,
    e.g. the ingest settings or the label names): equal digests mean the same set of rows
    under the same context."""
    groups = list(groups)
    text = json.dumps(
        {
            "n": sum(int(g["n"]) for g in groups),
            "a": str(sum(int(g["a"]) for g in groups)),
            "b": str(sum(int(g["b"]) for g in groups)),
            **context,
        },
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()
