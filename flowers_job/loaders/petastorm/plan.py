"""Petastorm's shards, planned on the driver from metadata only.

Petastorm shards by row group: shard ``r`` of ``world_size`` reads the row groups whose
index ``i`` satisfies ``i % world_size == r`` (petastorm ``Reader._partition_row_groups``).
The cache holds one row group per file, of ``floor`` or ``ceil(N / num_partitions)`` rows
(:mod:`flowers_job.loaders.petastorm.balanced`), so ranks' shards differ by one row at most.
:func:`plan_shards` takes each shard's rows and int64 row checksum from metadata (footers
via Petastorm's own row-group listing, and each file's checksum as written) and fixes
``steps_per_epoch`` so that every rank runs the same number of steps and reads every row of
its shard once per epoch.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

from flowers_job.errors import DataError
from flowers_job.loaders.base import ShardPlan, check_batch_fits, wrap_int64
from flowers_job.loaders.petastorm.balanced import ROW_GROUP_LIMIT_BYTES, url_path
from flowers_job.loaders.petastorm.pyarrow_fs import legacy_filesystem

__all__ = ["PetastormPlan", "footer_rows", "plan_shards"]


@dataclass(frozen=True)
class PetastormPlan(ShardPlan):
    """A :class:`ShardPlan` plus the cache's Parquet files, in Petastorm's order, the
    bytes of the split's largest image (the row width of undecoded batches), and each
    file's rows and int64 row checksum as written (dead rows included: an appended entry's
    plan subtracts them)."""

    file_urls: list[str] = field(default_factory=list)
    max_image_bytes: int = 0
    file_checksums: list[list[int]] = field(default_factory=list)


def footer_rows(file_urls: list[str]) -> list[int]:
    """Rows of each Parquet file, from its footer.

    Raises:
        DataError: a file holds several row groups (Petastorm would shard it by row group,
            and the per-file checksums would not describe its shards).
    """
    import pyarrow.parquet as pq
    from petastorm.fs_utils import get_filesystem_and_path_or_paths

    fs, paths = get_filesystem_and_path_or_paths(file_urls, filesystem=legacy_filesystem(file_urls))
    rows = []
    for url, path in zip(file_urls, paths, strict=True):
        with fs.open(path, "rb") as f:
            meta = pq.ParquetFile(f).metadata
        if meta.num_row_groups != 1:
            raise DataError(
                f"{url} holds {meta.num_row_groups} Parquet row groups; the Petastorm cache "
                f"writes one per file (parquet.block.size={ROW_GROUP_LIMIT_BYTES}), and "
                "Parquet's writer cuts row groups smaller when the executor's heap is short: "
                "give the executors more memory"
            )
        rows.append(meta.num_rows)
    return rows


def plan_shards(
    file_urls: list[str],
    file_checksums: list[tuple[int, int]],
    world_size: int,
    per_device_batch_size: int,
    *,
    full_batches: bool = False,
    split: str = "train",
) -> tuple[list[int], list[int], int]:
    """Rows and row checksum per Petastorm shard, and the common steps per epoch, from
    metadata only (no row is read here).

    Uses Petastorm's own row-group listing (``load_row_groups``, which reads the footers)
    and its shard rule (row group ``i`` goes to shard ``i % world_size``).

    Args:
        file_urls: the split's Parquet files (``file://`` URLs), one row group each.
        file_checksums: per file, ``(rows, int64 row_id sum mod 2**64)``
            (:attr:`ParquetCache.file_checksums`).
        world_size: number of ranks (shards).
        per_device_batch_size: images per rank per step.
        full_batches: require every shard to hold at least one full batch, as training does
            (:func:`~flowers_job.loaders.base.check_batch_fits`).
        split: the split's name, for messages.

    Returns:
        ``(rows_per_shard, checksum_per_shard, steps_per_epoch)``; checksums are int64.

    Raises:
        DataError: fewer row groups than ranks; a file with several row groups; with
            ``full_batches``, a shard smaller than ``per_device_batch_size``; or shards so
            uneven that the smallest cannot fill ``steps_per_epoch`` batches.
    """
    import pyarrow.parquet as pq
    from petastorm.etl.dataset_metadata import load_row_groups
    from petastorm.fs_utils import get_filesystem_and_path_or_paths

    fs, paths = get_filesystem_and_path_or_paths(file_urls, filesystem=legacy_filesystem(file_urls))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # pyarrow's legacy dataset API
        dataset = pq.ParquetDataset(paths, filesystem=fs, validate_schema=False)
        pieces = load_row_groups(dataset)
    if len(pieces) < world_size:
        raise DataError(
            f"{len(pieces)} Parquet row groups for {world_size} ranks: Petastorm needs at least "
            "one row group per rank; raise data.partitions_per_process"
        )
    by_path = {url_path(p): c for p, c in zip(paths, file_checksums, strict=True)}
    if len(pieces) != len(by_path):
        raise DataError(
            f"{len(pieces)} Parquet row groups in {len(by_path)} files: the shards are planned "
            "from per-file checksums, which needs one row group per file"
        )
    rows = [0] * world_size
    checksum = [0] * world_size
    for i, piece in enumerate(pieces):
        n, s = by_path[url_path(piece.path)]
        rows[i % world_size] += n
        checksum[i % world_size] = wrap_int64(checksum[i % world_size] + s)
    check_batch_fits(rows, per_device_batch_size, world_size, split, full_batches)
    steps = max(math.ceil(n / per_device_batch_size) for n in rows)
    if min(rows) < steps:
        raise DataError(
            f"uneven shards {rows}: the smallest cannot fill {steps} steps of at most "
            f"{per_device_batch_size} images; raise data.partitions_per_process or "
            "lower train.per_device_batch_size"
        )
    return rows, checksum, steps
