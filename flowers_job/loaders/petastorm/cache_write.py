"""The Petastorm cache written on the driver: a split as balanced Parquet (:func:`write_cache`),
or an entry grown by appending (:func:`append_cache`): the older files and the new segment's,
planned together with each file's dead rows subtracted; the ranks drop the deletion list's
dead rows before the re-cut (:func:`~flowers_job.loaders.petastorm.reader.live_rows`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from flowers_job.errors import DataError
from flowers_job.loaders.base import SEGMENT_COLUMN, ShardPlan, wrap_int64
from flowers_job.loaders.petastorm import balanced
from flowers_job.loaders.petastorm.balanced import ParquetCache, row_sums_by_file, url_path
from flowers_job.loaders.petastorm.logs import quiet_petastorm
from flowers_job.loaders.petastorm.plan import PetastormPlan, footer_rows, plan_shards

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from flowers_job.location import Location

__all__ = ["append_cache", "live_file_checksums", "write_balanced", "write_cache"]

log = logging.getLogger(__name__)


def write_balanced(
    spark: SparkSession,
    df: DataFrame,
    out_url: str,
    *,
    world_size: int,
    min_partitions: int,
    what: str,
) -> ParquetCache:
    """:func:`flowers_job.loaders.petastorm.balanced.write_balanced` with this module's
    :func:`footer_rows` (Petastorm's file systems read the footers)."""
    return balanced.write_balanced(
        spark,
        df,
        out_url,
        world_size=world_size,
        min_partitions=min_partitions,
        what=what,
        footer_rows=footer_rows,
    )


# Arguments: Loader.prepare's and Loader.append's arguments, handed on to the writer.
def write_cache(  # noqa: PLR0913
    spark: SparkSession,
    df: DataFrame,
    cache_dir: Location,
    split: str,
    *,
    world_size: int,
    min_partitions: int,
    per_device_batch_size: int,
    source: str,
) -> PetastormPlan:
    """The cache of one split: write ``df`` as balanced Parquet partitions under
    ``<cache_dir>/petastorm-<split>`` (:func:`write_balanced`) and plan its shards from the files'
    metadata (:func:`plan_shards`): row group ``i`` -> rank ``i % world_size``.

    Raises:
        DataError: an empty split, unworkable shards (:func:`plan_shards`), a cache that
            does not hold the rows as written, or the volume filling up during the write
            (naming the directory).
    """
    quiet_petastorm()
    out_url = (cache_dir / f"petastorm-{split}").as_uri()
    t0 = time.perf_counter()
    cache = write_balanced(
        spark,
        df,
        out_url,
        world_size=world_size,
        min_partitions=min_partitions,
        what=f"the {split} split of {source}",
    )
    t1 = time.perf_counter()
    rows, checksum, steps = plan_shards(
        cache.file_urls,
        cache.file_checksums,
        world_size,
        per_device_batch_size,
        full_batches=split == "train",
        split=split,
    )
    log.info(
        "%s: %d rows (%.1f MB of images) in %d partitions, rows per shard %s, "
        "%d steps per epoch; written and summed in %.1f s, planned in %.2f s",
        split,
        cache.rows,
        cache.image_bytes / 1e6,
        len(cache.file_urls),
        rows,
        steps,
        t1 - t0,
        time.perf_counter() - t1,
    )
    return _plan(
        out_url,
        cache.file_urls,
        cache.file_checksums,
        (rows, checksum, steps),
        per_device_batch_size,
        cache.max_image_bytes,
    )


# Arguments: Loader.prepare's and Loader.append's arguments, handed on to the writer.
def append_cache(  # noqa: PLR0913
    spark: SparkSession,
    base: ShardPlan,
    current: DataFrame,
    added: DataFrame,
    deletions: DataFrame,
    cache_dir: Location,
    split: str,
    *,
    world_size: int,
    per_device_batch_size: int,
    source: str,
) -> PetastormPlan:
    """``base``'s files, then ``added`` written as balanced Parquet under
    ``<cache_dir>/petastorm-<split>`` (:func:`write_balanced`, as many files as ranks at least),
    planned together: each file's rows and checksum less its dead rows
    (:func:`live_file_checksums`), Petastorm's shard rule over all files (:func:`plan_shards`). The
    ranks skip the dead rows (:func:`~flowers_job.loaders.base.live_mask`).

    Raises:
        DataError: shards too uneven to plan, or files whose live rows are not
            ``current``'s (count and checksum).
    """
    from flowers_job.loaders.base import row_stats

    assert isinstance(base, PetastormPlan), base
    quiet_petastorm()
    if not base.file_checksums:
        raise DataError("the older entry's plan has no per-file checksums")
    files = list(base.file_urls)
    raw = [(int(c[0]), int(c[1])) for c in base.file_checksums]
    out_url = (cache_dir / f"petastorm-{split}").as_uri()
    max_bytes = base.max_image_bytes
    segment_dirs = list(base.segment_dirs)
    if not added.isEmpty():
        cache = write_balanced(
            spark,
            added,
            out_url,
            world_size=world_size,
            min_partitions=world_size,
            what=f"the rows added to the {split} split of {source}",
        )
        files += cache.file_urls
        raw += cache.file_checksums
        max_bytes = max(max_bytes, cache.max_image_bytes)
        segment_dirs.append(base.cache_dir_url)
    else:
        out_url = base.cache_dir_url
    live = live_file_checksums(spark, files, raw, deletions)
    full = split == "train"
    rows, checksum, steps = plan_shards(
        files, live, world_size, per_device_batch_size, full_batches=full, split=split
    )
    expected = row_stats(current)
    if (sum(rows), wrap_int64(sum(checksum))) != expected:
        raise DataError(
            f"the {split} split's segments hold {sum(rows)} live rows (checksum "
            f"{wrap_int64(sum(checksum))}), the table {expected[0]} ({expected[1]})"
        )
    shards = (rows, checksum, steps)
    return _plan(out_url, files, raw, shards, per_device_batch_size, max_bytes, segment_dirs)


def _plan(
    out_url: str,
    file_urls: list[str],
    file_checksums: list[tuple[int, int]],
    shards: tuple[list[int], list[int], int],
    per_device_batch_size: int,
    max_image_bytes: int,
    segment_dirs: list[str] | None = None,
) -> PetastormPlan:
    """The plan of a cache under ``out_url``: its files and their checksums as written, and
    ``shards``, :func:`plan_shards`' rows and checksum per shard and steps per epoch."""
    rows, checksum, steps = shards
    return PetastormPlan(
        loader="petastorm",
        cache_dir_url=out_url,
        dataset_size=sum(rows),
        checksum=wrap_int64(sum(checksum)),
        rows_per_shard=rows,
        checksum_per_shard=checksum,
        steps_per_epoch=steps,
        per_device_batch_size=per_device_batch_size,
        segment_dirs=list(segment_dirs or []),
        file_urls=list(file_urls),
        max_image_bytes=max_image_bytes,
        file_checksums=[list(c) for c in file_checksums],
    )


def live_file_checksums(
    spark: SparkSession,
    files: list[str],
    written: list[tuple[int, int]],
    deletions: DataFrame,
) -> list[tuple[int, int]]:
    """Each file's rows and int64 ``row_id`` checksum as ``written``, less its dead rows: one
    Spark aggregation of the ``row_id`` and ``segment`` columns of every file against
    ``deletions`` (``row_id``, ``before``: a row of a segment older than ``before`` is dead).

    Returns:
        ``(live rows, live checksum)`` per file, in ``files``' order.
    """
    from pyspark.sql import functions as F

    dead = row_sums_by_file(
        spark.read.parquet(*files)
        .select("row_id", SEGMENT_COLUMN, F.input_file_name().alias("f"))
        .join(deletions, "row_id")
        .where(F.col(SEGMENT_COLUMN) < F.col("before"))
    )
    live = []
    for url, (n, total) in zip(files, written, strict=True):
        dn, ds = dead.get(url_path(url), (0, 0))
        live.append((n - dn, wrap_int64(total - ds)))
    return live
