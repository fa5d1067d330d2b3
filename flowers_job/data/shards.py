"""Shard plans: which rows each rank reads, and how many steps an epoch has.

No Spark here: the driver builds a :class:`ShardPlan` (``flowers_job.data.prepare`` for
Petastorm, ``flowers_job.data.mds`` for Streaming) and the workers read with it
(``flowers_job.train.loader``).

Petastorm shards by row group: shard ``r`` of ``world_size`` reads the row groups whose
index ``i`` satisfies ``i % world_size == r`` (petastorm ``Reader._partition_row_groups``).
:func:`plan_shards` reads the Parquet footers with Petastorm's own row-group listing,
computes each shard's exact row count and a row checksum, and fixes ``steps_per_epoch`` so
that every rank runs the same number of steps and reads every row of its shard once.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "CHECKSUM_MODULUS",
    "DataError",
    "ShardPlan",
    "check_batch_fits",
    "plan_shards",
    "quiet_petastorm",
]

CHECKSUM_MODULUS = 2**31
"""Row checksum = sum of ``row_id mod 2**31``: exact in float64 up to 2**22 rows per shard."""


def quiet_petastorm() -> None:
    """Silence Petastorm's per-reader INFO lines and pyarrow-legacy FutureWarnings, and the
    warning torch gives when ``BatchedDataLoader`` wraps Arrow's read-only arrays (the
    batches are never written to: normalisation makes a new tensor)."""
    for name in ("petastorm", "petastorm.etl.dataset_metadata", "petastorm.reader"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"petastorm(\..*)?")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"pyarrow(\..*)?")
    warnings.filterwarnings(
        "ignore", message="The given NumPy array is not writable", category=UserWarning
    )


class DataError(RuntimeError):
    """The tables cannot be trained on as they are (missing, inconsistent, too small)."""


@dataclass(frozen=True)
class ShardPlan:
    """How one split is read by ``world_size`` ranks. Plain data: it is sent to the workers.

    Attributes:
        loader: 'petastorm' or 'streaming': who wrote the cache and reads it.
        cache_dir_url: the split's cache directory (``file://`` URL): Petastorm's Parquet
            files, or Streaming's MDS shards with their ``index.json``.
        dataset_size: rows in the split.
        checksum: sum of ``row_id mod CHECKSUM_MODULUS`` over every row of the split.
        rows_per_shard: rows each rank reads per epoch (index = rank), padding included.
        checksum_per_shard: per-rank row checksums when a rank reads the same rows every epoch
            (Petastorm); None when the ranks' rows change every epoch (Streaming shuffles the
            whole split across ranks): then only the all-reduced totals are checked.
        steps_per_epoch: batches per epoch, the same on every rank:
            ``max_r ceil(rows_per_shard[r] / per_device_batch_size)``.
        per_device_batch_size: nominal images per rank per step (the largest batch).
        file_urls: Petastorm only: the cache's Parquet files, in Petastorm's order.
        padding_rows: Streaming only: rows appended with ``valid = 0`` so that the written
            count divides by ``world_size`` (masked out of loss, metrics and checksum).
    """

    loader: str
    cache_dir_url: str
    dataset_size: int
    checksum: int
    rows_per_shard: list[int]
    checksum_per_shard: list[int] | None
    steps_per_epoch: int
    per_device_batch_size: int
    file_urls: list[str] = field(default_factory=list)
    padding_rows: int = 0

    def batch_sizes(self, rank: int) -> list[int]:
        """Per-step batch sizes of ``rank``: ``steps_per_epoch`` numbers summing to its rows.

        Rank ``r`` splits its rows into batches of ``floor`` or ``ceil(rows_r /
        steps_per_epoch)`` rows, so no rank pads, drops or repeats a row (Petastorm's re-cut).
        """
        q, r = divmod(self.rows_per_shard[rank], self.steps_per_epoch)
        return [q + 1] * r + [q] * (self.steps_per_epoch - r)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardPlan:
        return cls(**d)


def check_batch_fits(
    rows: list[int], per_device_batch_size: int, world_size: int, split: str, full_batches: bool
) -> None:
    """With ``full_batches``, require every shard to hold at least one full batch.

    A rank with fewer rows than ``per_device_batch_size`` would take smaller optimizer steps
    than configured, every step of every epoch. Validation needs no such thing (its sums are
    exact whatever the batches), so it passes ``full_batches=False``.

    Raises:
        DataError: naming ``train.per_device_batch_size``, the global batch size,
            ``world_size`` and the rows per shard, and the largest batch that would work.
    """
    if full_batches and min(rows) < per_device_batch_size:
        raise DataError(
            f"train.per_device_batch_size={per_device_batch_size} (global batch size "
            f"{per_device_batch_size * world_size} over world_size {world_size}) is larger than "
            f"the smallest {split} shard: rows per shard {rows}; every rank needs at least one "
            f"full batch per epoch: set train.per_device_batch_size <= {min(rows)}, or fewer "
            "distributed.num_processes, or train on more images"
        )


def plan_shards(
    file_urls: list[str],
    world_size: int,
    per_device_batch_size: int,
    *,
    full_batches: bool = False,
    split: str = "train",
) -> tuple[list[int], list[int], int]:
    """Rows and row checksum per Petastorm shard, and the common steps per epoch.

    Uses Petastorm's own row-group listing (``load_row_groups``) and its shard rule
    (row group ``i`` goes to shard ``i % world_size``).

    Args:
        file_urls: the split's Parquet files (``file://`` URLs), in Petastorm's order.
        world_size: number of ranks (shards).
        per_device_batch_size: images per rank per step.
        full_batches: require every shard to hold at least one full batch, as training does:
            a rank with fewer rows than ``per_device_batch_size`` would take smaller optimizer
            steps than configured, every step of every epoch. Validation needs no such thing
            (its sums are exact whatever the batches), so it passes False.
        split: the split's name, for messages.

    Returns:
        ``(rows_per_shard, checksum_per_shard, steps_per_epoch)``.

    Raises:
        DataError: fewer row groups than ranks; with ``full_batches``, a shard smaller than
            ``per_device_batch_size`` (the message names ``train.per_device_batch_size``, the
            global batch size, ``world_size`` and the rows per shard); or shards so uneven
            that the smallest cannot fill ``steps_per_epoch`` batches.
    """
    import pyarrow.parquet as pq
    from petastorm.etl.dataset_metadata import load_row_groups
    from petastorm.fs_utils import get_filesystem_and_path_or_paths

    fs, paths = get_filesystem_and_path_or_paths(file_urls)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # pyarrow's legacy dataset API
        dataset = pq.ParquetDataset(paths, filesystem=fs, validate_schema=False)
        pieces = load_row_groups(dataset)
    if len(pieces) < world_size:
        raise DataError(
            f"{len(pieces)} Parquet row groups for {world_size} ranks: Petastorm needs at least "
            "one row group per rank; raise data.partitions_per_process"
        )
    rows = [0] * world_size
    checksum = [0] * world_size
    for i, piece in enumerate(pieces):
        with fs.open(piece.path, "rb") as f:
            table = pq.ParquetFile(f).read_row_group(piece.row_group, columns=["row_id"])
        ids = table.column("row_id").to_pylist()
        rows[i % world_size] += len(ids)
        checksum[i % world_size] += sum(x % CHECKSUM_MODULUS for x in ids)
    check_batch_fits(rows, per_device_batch_size, world_size, split, full_batches)
    steps = max(math.ceil(n / per_device_batch_size) for n in rows)
    if min(rows) < steps:
        raise DataError(
            f"uneven shards {rows}: the smallest cannot fill {steps} steps of at most "
            f"{per_device_batch_size} images; raise data.partitions_per_process or "
            "lower train.per_device_batch_size"
        )
    return rows, checksum, steps
