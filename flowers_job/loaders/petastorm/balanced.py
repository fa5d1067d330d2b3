"""Balanced Parquet (driver side): a split written as files of equal rows, one row group each.

Petastorm shards by row group (row group ``i`` -> rank ``i % world_size``), and its own
``make_spark_converter`` cut each partition into row groups of ~32 MB, so a 50 MB partition
gave rank 0 a 32 MB group and rank 1 an 18 MB one, and shards drifted apart as data grew
(36,700 rows: train shards [14353, 11333]). Here Spark writes the cache itself: the number
of partitions grows with the images' bytes (a multiple of ``world_size``, at least the
configured ``num_partitions``, <= ~64 MB each), every partition holds ``floor`` or
``ceil(N / num_partitions)`` rows (:func:`balance`, no global sort), and each is one file
with one row group, uncompressed (the images are JPEG already). The Petastorm loader
(:mod:`flowers_job.loaders.petastorm.cache_write`) writes and plans through it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from flowers_job.errors import DataError
from flowers_job.loaders.base import local_dir, wrap_int64

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "BALANCE_KEY",
    "PARTITION_BYTES",
    "ROW_GROUP_LIMIT_BYTES",
    "ParquetCache",
    "balance",
    "cache_partitions",
    "partition_counts",
    "partition_keys",
    "row_sums_by_file",
    "url_path",
    "write_balanced",
]

PARTITION_BYTES = 64 * 2**20
"""Most image bytes per partition of a Petastorm cache (one Parquet file, one row group): a
rank's reader holds a row group in memory at a time."""
ROW_GROUP_LIMIT_BYTES = 2**30
"""``parquet.block.size`` of the cache's files, far above :data:`PARTITION_BYTES`, so that a
partition is written as one row group (checked in the footers)."""
IMAGE_COLUMN = "image"
"""The column of the stored JPEG bytes."""
BALANCE_KEY = "_flowers_partition_key"
"""Helper column of :func:`balance` (never written)."""


def cache_partitions(image_bytes: int, world_size: int, min_partitions: int) -> int:
    """Partitions (= Parquet files = row groups) of a split's cache: enough that each holds
    about :data:`PARTITION_BYTES` of images or less, at least ``min_partitions``, and a
    multiple of ``world_size`` (so that every rank reads as many files).

    ``cache_partitions(0, 2, 4) == 4``; ``cache_partitions(300 * 2**20, 2, 4) == 6``.
    """
    n = max(min_partitions, math.ceil(image_bytes / PARTITION_BYTES), 1)
    return math.ceil(n / world_size) * world_size


def partition_keys(spark: SparkSession, num_partitions: int) -> list[int]:
    """``keys[j]``: a long whose Spark hash lands in partition ``j`` of ``num_partitions``.

    Spark's ``HashPartitioning`` sends a row to ``pmod(hash(key), num_partitions)``
    (Murmur3, seed 42: ``F.hash``), so ``repartition(num_partitions, key)`` with
    ``key = keys[j]`` puts the row in partition ``j``. Found with a small ``spark.range``
    query (the smallest such long for each ``j``).
    """
    from pyspark.sql import functions as F

    found: dict[int, int] = {}
    span = 64 * num_partitions
    while len(found) < num_partitions:
        rows = (
            spark.range(span)
            .select("id", F.pmod(F.hash("id"), F.lit(num_partitions)).alias("j"))
            .groupBy("j")
            .agg(F.min("id").alias("key"))
            .collect()
        )
        found = {int(r["j"]): int(r["key"]) for r in rows}
        span *= 4
    return [found[j] for j in range(num_partitions)]


def partition_counts(df: DataFrame) -> tuple[list[int], int, int]:
    """Rows of each of ``df``'s partitions (index = ``spark_partition_id``), the bytes of
    its ``image`` column and of its largest image, in one Spark aggregation (a row per
    non-empty partition reaches the driver)."""
    from pyspark.sql import functions as F

    rows = (
        df.select(F.spark_partition_id().alias("p"), F.length("image").alias("b"))
        .groupBy("p")
        .agg(F.count(F.lit(1)).alias("n"), F.sum("b").alias("b"), F.max("b").alias("m"))
        .collect()
    )
    counts = [0] * (max((int(r["p"]) for r in rows), default=-1) + 1)
    for r in rows:
        counts[int(r["p"])] = int(r["n"])
    return (
        counts,
        sum(int(r["b"] or 0) for r in rows),
        max((int(r["m"] or 0) for r in rows), default=0),
    )


def balance(df: DataFrame, counts: list[int], keys: list[int]) -> DataFrame:
    """``df`` in ``len(keys)`` partitions of ``floor`` or ``ceil(N / len(keys))`` rows, with
    no global sort (``N = sum(counts)``).

    Row ``k`` (0-based) of input partition ``p`` gets the global index ``offset[p] + k``
    (``offset``: the running sum of ``counts``, the rows of each input partition, from
    :func:`partition_counts`; ``k`` from ``monotonically_increasing_id``, which keeps the
    partition id in bits 33 and up) and goes to partition ``index mod len(keys)``, through
    the hash of ``keys[target]`` (:func:`partition_keys`). Requires ``df``'s partitions to
    hold ``counts`` rows when read again (true of a table scan or any deterministic plan).
    """
    from pyspark.sql import functions as F

    offsets = [0]
    for n in counts[:-1]:
        offsets.append(offsets[-1] + n)
    pid = F.spark_partition_id()
    position = F.monotonically_increasing_id() - F.shiftleft(pid.cast("long"), 33)
    offset = F.element_at(F.array(*[F.lit(o).cast("long") for o in offsets]), pid + 1)
    target = F.pmod(offset + position, F.lit(len(keys)).cast("long")).cast("int")
    key = F.element_at(F.array(*[F.lit(k).cast("long") for k in keys]), target + 1)
    columns = df.columns
    return df.withColumn(BALANCE_KEY, key).repartition(len(keys), BALANCE_KEY).select(*columns)


@dataclass(frozen=True)
class ParquetCache:
    """What :func:`write_balanced` wrote.

    Attributes:
        file_urls: the Parquet files, sorted (``part-00000``, ...: file ``j`` holds
            partition ``j``), as Petastorm reads them.
        file_checksums: per file (same order), ``(rows, int64 row_id sum mod 2**64)``.
        rows: rows in all files.
        image_bytes: bytes of the ``image`` column.
        max_image_bytes: bytes of the largest image.
    """

    file_urls: list[str]
    file_checksums: list[tuple[int, int]]
    rows: int
    image_bytes: int
    max_image_bytes: int = 0


def write_balanced(
    spark: SparkSession,
    df: DataFrame,
    out_url: str,
    *,
    world_size: int,
    min_partitions: int,
    what: str,
    footer_rows: Callable[[list[str]], list[int]],
) -> ParquetCache:
    """Write ``df`` (``row_id``, ``image``, ``label_index``) to ``out_url`` as Parquet: one
    file per partition, one row group per file, uncompressed (the images are JPEG already).

    The partitions (:func:`cache_partitions`: more as the images' bytes grow) hold
    ``floor`` or ``ceil(rows / partitions)`` rows each (:func:`balance`), whatever the
    sizes of ``df``'s own partitions; with Petastorm's rule (row group ``i`` -> rank
    ``i % world_size``, files in name order) the ranks' rows then differ by one at most.
    Three small Spark jobs besides the write: the rows per input partition, the partition
    keys, and the per-file row counts and checksums (which read only ``row_id``).

    ``footer_rows(file_urls)`` gives each file's rows from its footer, and raises
    ``DataError`` for a file with several row groups (the loader's own file system reads
    them).

    Raises:
        DataError: an empty ``df``; the volume filled up ("No space left on device", naming
            the directory; the caller removes the partial cache); a file with several row
            groups; or files whose rows are not as planned (a ``df`` whose partitions
            changed between two reads).
    """
    from pyspark.sql import functions as F

    counts, image_bytes, max_image_bytes = partition_counts(df)
    rows = sum(counts)
    if rows == 0:
        raise DataError(f"{what} is empty")
    num_partitions = cache_partitions(image_bytes, world_size, min_partitions)
    data = balance(df, counts, partition_keys(spark, num_partitions))
    _write_parquet(data, out_url, what)
    written = spark.read.parquet(out_url)
    file_urls = sorted(written.inputFiles())
    sums = row_sums_by_file(written.select("row_id", F.input_file_name().alias("f")))
    file_checksums = [sums.get(url_path(u), (0, 0)) for u in file_urls]
    per_file = [n for n, _ in file_checksums]
    footers = footer_rows(file_urls)
    q = rows // num_partitions
    if footers != per_file or sum(per_file) != rows or any(n not in (q, q + 1) for n in per_file):
        raise DataError(
            f"the Petastorm cache of {what} under {out_url} holds {per_file} rows per file "
            f"(footers: {footers}), {sum(per_file)} in all; {rows} rows were written as "
            f"{num_partitions} partitions of {q} or {q + 1}: the table's partitions changed "
            "between two reads"
        )
    return ParquetCache(file_urls, file_checksums, rows, image_bytes, max_image_bytes)


def _write_parquet(data: DataFrame, out_url: str, what: str) -> None:
    """``data`` to ``out_url``: Parquet, uncompressed, one row group per file.

    Raises:
        DataError: the volume filled up ("No space left on device"), naming the directory.
    """
    try:
        (
            data.write.option("compression", "uncompressed")
            .option("parquet.block.size", str(ROW_GROUP_LIMIT_BYTES))
            # no min/max of the images in the footer and page headers: 4 copies of an image
            # per page, 8 kB of a 10 kB file of one 2 kB row (parquet-mr 1.13+'s per-column
            # setting; 11,419 -> 3,247 bytes measured)
            .option(f"parquet.column.statistics.enabled#{IMAGE_COLUMN}", "false")
            .parquet(out_url)
        )
    except Exception as exc:
        if "No space left on device" in str(exc):
            folder = local_dir(out_url)
            raise DataError(
                f"no space left for the loader cache of {what} in "
                f"{folder.parent if folder else out_url}; free some space or set "
                "paths.cache_url to a larger volume"
            ) from exc
        raise


def row_sums_by_file(rows: DataFrame) -> dict[str, tuple[int, int]]:
    """Per file of ``rows`` (``row_id``, ``f``: ``input_file_name()``), its rows and the
    int64 sum of their ``row_id`` (mod 2**64), keyed by the file's path (:func:`url_path`):
    one Spark aggregation."""
    from pyspark.sql import functions as F

    return {
        url_path(str(r["f"])): (int(r["n"]), wrap_int64(int(r["s"])))
        for r in rows.groupBy("f")
        .agg(
            F.count(F.lit(1)).alias("n"),
            F.sum(F.col("row_id").cast("decimal(38,0)")).alias("s"),
        )
        .collect()
    }


def url_path(url: str) -> str:
    """The path part of a Hadoop path or URL (``file:/a`` and ``file:///a`` both give ``/a``)."""
    return urlparse(url).path
