"""Petastorm on the ranks. :class:`PetastormReader` reads shard ``rank`` of ``world_size``; a
``TransformSpec`` decodes and augments in the loader; Petastorm's ``BatchedDataLoader``
assembles batches from whole row groups as arrays (its row-by-row ``DataLoader`` is not
used), and :func:`rebatch` re-cuts them to :meth:`ShardPlan.batch_sizes`. No padding: every
``valid`` is True.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from flowers_job.errors import ShardError
from flowers_job.loaders.base import SEGMENT_COLUMN, Batch, Deletions, live_mask, rebatch
from flowers_job.loaders.petastorm.cache_files import check_cache_files
from flowers_job.loaders.petastorm.plan import PetastormPlan
from flowers_job.loaders.petastorm.pyarrow_fs import legacy_filesystem
from flowers_job.loaders.position import CursorReader, EpochCursor, EpochStart, epoch_seed

if TYPE_CHECKING:
    from flowers_job.vision.decode_transform import DecodeTransform

__all__ = ["PetastormReader", "live_rows", "shard_batches", "transform_spec"]


def transform_spec(transform: DecodeTransform) -> Any:
    """The Petastorm ``TransformSpec`` that decodes a pandas batch's ``image`` column with
    ``transform``: uint8 ``[3, S, S]`` per row, C-contiguous (docs/known-issues.md,
    "Petastorm"); undecoded, ``jpeg`` uint8 ``[jpeg_width]`` and ``jpeg_length`` int64 rows
    instead of ``image``."""
    from petastorm import TransformSpec

    from flowers_job.vision.batch_decode import JPEG_KEY, LENGTH_KEY

    if transform.undecoded:  # Petastorm stacks rows of one width: the plan's widest image
        width = (transform.jpeg_width,)
        edits = [(JPEG_KEY, np.uint8, width, False), (LENGTH_KEY, np.int64, (), False)]
        return TransformSpec(transform, edit_fields=edits, removed_fields=["image"])
    shape = (3, transform.image_size, transform.image_size)
    return TransformSpec(transform, edit_fields=[("image", np.uint8, shape, False)])


# Arguments: Loader.open's arguments, handed on to the reader.
def shard_batches(  # noqa: PLR0913
    plan: PetastormPlan,
    rank: int,
    world_size: int,
    transform: DecodeTransform,
    *,
    shuffle: bool,
    seed: int,
    reader_pool_type: str = "dummy",
    shuffle_buffer_rows: int = 0,
    workers_count: int = 1,
    deletions: Deletions | None = None,
) -> Iterator[Batch]:
    """One epoch of this rank's shard: ``plan.steps_per_epoch`` batches, without the rows
    of ``deletions`` (an appended entry's dead rows: :func:`live_rows`).

    Each batch: ``image`` uint8 ``[B, 3, S, S]``, ``label_index`` int64 ``[B]``,
    ``row_id`` int64 ``[B]``, with ``B`` from ``plan.batch_sizes(rank)``. Petastorm's
    ``BatchedDataLoader`` assembles them from whole row groups (array slices and one gather
    when shuffling, no per-row Python); ``workers_count`` decoding processes with
    ``reader_pool_type='process'`` (the 'dummy' pool decodes in this thread).

    Raises:
        DataError: the plan names a file that is not its own (:func:`check_cache_files`).
        ShardError: the shard yielded a different number of rows than planned (for
            example Petastorm's thread pool ending a shard early, docs/known-issues.md).
    """
    from petastorm.pytorch import BatchedDataLoader
    from petastorm.spark.spark_dataset_converter import SparkDatasetConverter

    check_cache_files(plan)  # a list of files: Petastorm then unpickles nothing
    converter = SparkDatasetConverter(plan.cache_dir_url, plan.file_urls, plan.dataset_size)
    with converter.make_torch_dataloader(
        batch_size=plan.per_device_batch_size,
        num_epochs=1,
        cur_shard=rank,
        shard_count=world_size,
        transform_spec=transform_spec(transform),
        data_loader_fn=BatchedDataLoader,
        reader_pool_type=reader_pool_type,
        workers_count=max(1, workers_count),
        shuffling_queue_capacity=shuffle_buffer_rows if shuffle else 0,
        shuffle_row_groups=shuffle,
        shuffle_rows=shuffle,
        seed=seed,
        filesystem=legacy_filesystem(plan.file_urls),
    ) as loader:
        yield from rebatch(live_rows(loader, deletions), plan.batch_sizes(rank))


def live_rows(batches: Iterable[Batch], deletions: Deletions | None) -> Iterator[Batch]:
    """``batches`` without their ``segment`` column and without the rows ``deletions``
    marks dead (:func:`~flowers_job.loaders.base.live_mask`); batches left empty are
    dropped.

    Raises:
        ShardError: there are deletions and the cache's rows carry no segment.
    """
    for read in batches:
        segment = read.pop(SEGMENT_COLUMN, None)
        batch = read
        if deletions is not None and len(deletions):
            if segment is None:
                raise ShardError("the cache has a deletion list but its rows no segment column")
            keep = live_mask(read["row_id"], segment, deletions)
            if not bool(keep.all()):
                batch = {k: v[keep] for k, v in read.items()}
        if len(batch["row_id"]):
            yield batch


@dataclass
class PetastormReader(CursorReader):
    """Petastorm: shard ``rank`` of ``world_size``, re-cut to the plan's batch sizes.

    Shuffling (``shuffle=True``): row groups and rows within them are shuffled by
    Petastorm with ``seed + epoch``; its shuffling buffer and the augmentation draw from
    torch's global generator, which is seeded from ``(seed, epoch, rank)`` before each
    epoch, so the order of an epoch is the same whenever it is run (with the 'dummy' reader
    pool). ``pin_memory`` (CUDA): each batch is copied into page-locked memory, so that the
    host-to-device copy can run asynchronously (``non_blocking=True``).
    """

    plan: PetastormPlan
    rank: int
    world_size: int
    transform: DecodeTransform
    shuffle: bool
    seed: int
    reader_pool_type: str = "dummy"
    shuffle_buffer_rows: int = 0
    workers_count: int = 1
    pin_memory: bool = False
    deletions: Deletions | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self.plan.steps_per_epoch

    def epoch(self, epoch: int, start: EpochStart | None = None) -> Iterator[Batch]:
        """The epoch's batches (:meth:`ShardReader.epoch`); from a mid-epoch ``start``, the
        first ``start.step`` batches are read again and dropped (:meth:`EpochCursor.replay`:
        Petastorm cannot seek into a shuffled epoch), which costs their decoding and
        augmentation (benchmarks/README.md)."""
        # the shuffling buffer and the augmentation draw from the loader's own stream
        self._cursor = cursor = EpochCursor(epoch_seed(self.seed, epoch, self.rank))
        batches = cursor.wrap(
            lambda: shard_batches(
                self.plan,
                self.rank,
                self.world_size,
                self.transform,
                shuffle=self.shuffle,
                # Petastorm also orders row groups by the seed: validation keeps one order
                seed=self.seed + epoch if self.shuffle else self.seed,
                reader_pool_type=self.reader_pool_type,
                shuffle_buffer_rows=self.shuffle_buffer_rows,
                workers_count=self.workers_count,
                deletions=self.deletions,
            )
        )
        if start is not None:
            cursor.replay(batches, start, self.rank)
        for batch in batches:
            batch["valid"] = torch.ones(len(batch["row_id"]), dtype=torch.bool)
            yield {k: v.pin_memory() for k, v in batch.items()} if self.pin_memory else batch

    def close(self) -> None:
        pass
