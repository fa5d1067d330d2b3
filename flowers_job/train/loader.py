"""Worker side: the loader boundary. One rank's part of a split, as ``steps_per_epoch`` batches.

:func:`open_loader` gives the training loop a :class:`ShardLoader` whatever wrote the
cache; the loop never asks which one it has. Every batch is a dict of tensors:

- ``image``: uint8 ``[B, 3, S, S]``, decoded and augmented (train); the training loop
  normalises it on the device (:class:`DeviceNormalize`), so a quarter of float32's bytes
  goes through the loader, the pinned buffer and the host-to-device copy;
- ``label_index``: int64 ``[B]``; ``row_id``: int64 ``[B]``;
- ``valid``: bool ``[B]``: False for padding rows, which count in no loss, metric or checksum.

Two implementations:

- :class:`PetastormShardLoader` (``data.loader=petastorm``): Petastorm reads shard ``rank``
  of ``world_size`` (row groups ``i % world_size == rank``) from the per-run Parquet cache; a
  ``TransformSpec`` decodes and augments in the loader; the batches are re-cut to the sizes
  of :meth:`ShardPlan.batch_sizes`. Petastorm's ``BatchedDataLoader`` assembles batches
  from whole row groups as arrays (its row-by-row ``DataLoader`` is not used). No padding:
  every ``valid`` is True.
- :class:`StreamingShardLoader` (``data.loader=streaming``): Mosaic ``StreamingDataset`` and
  ``StreamingDataLoader`` over the MDS shards; Streaming splits (and, for training,
  shuffles) the whole split across the ranks every epoch, and each rank gets the same
  number of rows, padding rows included (see :mod:`flowers_job.data.mds`).

Shuffling is a function of ``(seed, epoch)`` for both, so an epoch run again after a
resume reads the same rows in the same order.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

import numpy as np
import pandas as pd
import torch
from PIL import Image

from flowers_job.data.images import eval_pixels, train_pixels
from flowers_job.data.shards import ShardPlan
from flowers_job.processes import at_driver_death

__all__ = [
    "DecodeTransform",
    "DeviceNormalize",
    "PetastormShardLoader",
    "ShardError",
    "ShardLoader",
    "StreamingShardLoader",
    "open_loader",
    "rebatch",
    "shard_batches",
]

Batch = dict[str, torch.Tensor]


class ShardError(RuntimeError):
    """A shard yielded a different number of rows than the driver's plan."""


class DecodeTransform:
    """Stored JPEG bytes -> uint8 ``[3, S, S]`` tensors: :meth:`decode` for one image (the
    Streaming loader), ``__call__`` for a pandas batch (Petastorm's ``TransformSpec``).

    Training: random resized crop and flip (:func:`~flowers_job.data.images.train_pixels`);
    evaluation: resize and centre crop (:func:`~flowers_job.data.images.eval_pixels`). Not
    normalised: see :class:`DeviceNormalize`. A picklable class (not a closure) so that
    Petastorm's 'process' reader pool and DataLoader worker processes can ship it.
    """

    def __init__(self, train: bool, image_size: int, resize_size: int) -> None:
        self.train = train
        self.image_size = image_size
        self.resize_size = resize_size
        self._tf: Callable[[Image.Image], torch.Tensor] | None = None

    def warm_up(self) -> DecodeTransform:
        """Build the torchvision transform now (its first use imports torchvision, ~2 s),
        so that the first timed epoch does not pay for it. Returns ``self``."""
        if self._tf is None:
            self._tf = (
                train_pixels(self.image_size)
                if self.train
                else eval_pixels(self.image_size, self.resize_size)
            )
        return self

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tf": None}  # rebuilt where it is used

    def decode(self, content: bytes) -> torch.Tensor:
        """One stored JPEG -> uint8 ``[3, S, S]``, augmented (train), contiguous."""
        tf = self.warm_up()._tf
        assert tf is not None
        with Image.open(io.BytesIO(content)) as img:
            return tf(img.convert("RGB")).contiguous()

    def __call__(self, pdf: pd.DataFrame) -> pd.DataFrame:
        images = [
            np.ascontiguousarray(self.decode(content).numpy())  # STACK.md trap 10
            for content in pdf["image"]
        ]
        pdf = pdf.copy()
        pdf["image"] = images
        return pdf

    def spec(self):  # type: ignore[no-untyped-def]
        """The Petastorm ``TransformSpec`` that applies this transform."""
        from petastorm import TransformSpec

        shape = (3, self.image_size, self.image_size)
        return TransformSpec(self, edit_fields=[("image", np.uint8, shape, False)])


class DeviceNormalize:
    """uint8 images -> the model's float32 input, on the device: ``(x / 255 - mean) / std``.

    The loaders deliver uint8 ``[B, 3, S, S]`` (a quarter of float32's bytes through the
    loader, the pinned buffer and the host-to-device copy); this runs on the batch once it
    is on ``device`` (one fused multiply-add per pixel, on the GPU when there is one).

    Input: uint8 ``[B, 3, S, S]`` on any device. Output: float32 ``[B, 3, S, S]`` on
    ``device``, channels-last.
    """

    def __init__(
        self, mean: tuple[float, ...], std: tuple[float, ...], device: torch.device
    ) -> None:
        self.device = device
        scale = torch.tensor([1.0 / (255.0 * s) for s in std], dtype=torch.float32)
        shift = torch.tensor([m / s for m, s in zip(mean, std, strict=True)], dtype=torch.float32)
        self.scale = scale.view(1, -1, 1, 1).to(device)
        self.neg_shift = (-shift).view(1, -1, 1, 1).to(device)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(self.device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        return torch.addcmul(self.neg_shift, x.float(), self.scale)


def rebatch(batches: Iterable[Batch], sizes: list[int]) -> Iterator[Batch]:
    """Re-cut a stream of batches into batches of exactly ``sizes``. A batch that holds the
    next batch's rows is sliced (views, no copy); only batches spanning two incoming ones
    are concatenated.

    Raises:
        ShardError: the stream holds fewer or more rows than ``sum(sizes)``.
    """
    it = iter(batches)
    pending: list[Batch] = []
    have = 0
    seen = 0
    for size in sizes:
        while have < size:
            try:
                b = next(it)
            except StopIteration:
                raise ShardError(
                    f"shard ended after {seen + have} rows, the plan expects {sum(sizes)}"
                ) from None
            pending.append(b)
            have += len(b["label_index"])
        if len(pending) == 1:  # the batch arrived whole (or larger): views, no copy
            merged = pending[0]
        else:
            merged = {k: torch.cat([p[k] for p in pending]) for k in pending[0]}
        yield {k: v[:size] for k, v in merged.items()}
        rest = {k: v[size:] for k, v in merged.items()}
        have -= size
        seen += size
        pending = [rest] if have else []
    extra = have + sum(len(b["label_index"]) for b in it)
    if extra:
        raise ShardError(f"shard holds {seen + extra} rows, the plan expects {sum(sizes)}")


def shard_batches(
    plan: ShardPlan,
    rank: int,
    world_size: int,
    transform: DecodeTransform,
    *,
    shuffle: bool,
    seed: int,
    reader_pool_type: str = "dummy",
    shuffle_buffer_rows: int = 0,
    workers_count: int = 1,
) -> Iterator[Batch]:
    """One epoch of this rank's shard: ``plan.steps_per_epoch`` batches.

    Each batch: ``image`` uint8 ``[B, 3, S, S]``, ``label_index`` int64 ``[B]``,
    ``row_id`` int64 ``[B]``, with ``B`` from ``plan.batch_sizes(rank)``. Petastorm's
    ``BatchedDataLoader`` assembles them from whole row groups (array slices and one gather
    when shuffling, no per-row Python); ``workers_count`` decoding processes with
    ``reader_pool_type='process'`` (the 'dummy' pool decodes in this thread).

    Raises:
        ShardError: the shard yielded a different number of rows than planned (for
            example Petastorm's thread pool ending a shard early, STACK.md trap 1).
    """
    from petastorm.pytorch import BatchedDataLoader
    from petastorm.spark.spark_dataset_converter import SparkDatasetConverter

    converter = SparkDatasetConverter(plan.cache_dir_url, plan.file_urls, plan.dataset_size)
    with converter.make_torch_dataloader(
        batch_size=plan.per_device_batch_size,
        num_epochs=1,
        cur_shard=rank,
        shard_count=world_size,
        transform_spec=transform.spec(),
        data_loader_fn=BatchedDataLoader,
        reader_pool_type=reader_pool_type,
        workers_count=max(1, workers_count),
        shuffling_queue_capacity=shuffle_buffer_rows if shuffle else 0,
        shuffle_row_groups=shuffle,
        shuffle_rows=shuffle,
        seed=seed,
    ) as loader:
        yield from rebatch(loader, plan.batch_sizes(rank))


class ShardLoader(Protocol):
    """What the training loop sees of a loader: one iterator of batches per epoch."""

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch, the same on every rank."""
        ...

    def epoch(self, epoch: int) -> Iterator[Batch]:
        """This rank's batches of ``epoch`` (1-based): exactly ``steps_per_epoch`` of them.

        Raises:
            ShardError: the loader yielded more or fewer batches or rows than planned.
        """
        ...

    def close(self) -> None:
        """Release the loader's resources (processes, shared memory)."""
        ...


def _epoch_seed(seed: int, epoch: int, rank: int) -> int:
    return (seed * 1_000_003 + epoch * 1_009 + rank) % 2**32


@dataclass
class PetastormShardLoader:
    """Petastorm: shard ``rank`` of ``world_size``, re-cut to the plan's batch sizes.

    Shuffling (``shuffle=True``): row groups and rows within them are shuffled by
    Petastorm with ``seed + epoch``; its shuffling buffer and the augmentation draw from
    torch's global generator, which is seeded from ``(seed, epoch, rank)`` before each
    epoch, so the order of an epoch is the same whenever it is run (with the 'dummy' reader
    pool). ``pin_memory`` (CUDA): each batch is copied into page-locked memory, so that the
    host-to-device copy can run asynchronously (``non_blocking=True``).
    """

    plan: ShardPlan
    rank: int
    world_size: int
    transform: DecodeTransform
    shuffle: bool
    seed: int
    reader_pool_type: str = "dummy"
    shuffle_buffer_rows: int = 0
    workers_count: int = 1
    pin_memory: bool = False

    @property
    def steps_per_epoch(self) -> int:
        return self.plan.steps_per_epoch

    def epoch(self, epoch: int) -> Iterator[Batch]:
        torch.manual_seed(_epoch_seed(self.seed, epoch, self.rank))  # shuffling and augmentation
        for batch in shard_batches(
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
        ):
            batch["valid"] = torch.ones(len(batch["row_id"]), dtype=torch.bool)
            yield {k: v.pin_memory() for k, v in batch.items()} if self.pin_memory else batch

    def close(self) -> None:
        pass


class StreamingShardLoader:
    """Mosaic Streaming: ``StreamingDataset`` + ``StreamingDataLoader`` over the MDS shards.

    Built once per split and process (building it is a collective: every rank builds the
    same datasets in the same order). Streaming partitions the epoch's sample ids over the
    ranks (``partition_algo='orig'``); with the driver's padding every rank gets
    ``rows_per_shard[rank]`` rows and no sample is repeated. The epoch is set through
    Streaming's own resume state (``load_state_dict``) before each pass, so its shuffle
    (``py1e``, seeded by ``shuffle_seed + epoch``) is a function of ``(seed, epoch)``.
    ``StreamingDataset`` reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``
    from the environment (:func:`flowers_job.distributed.describe_hosts`).
    """

    def __init__(
        self,
        plan: ShardPlan,
        transform: DecodeTransform,
        *,
        shuffle: bool,
        seed: int,
        num_nodes: int,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        pin_memory: bool = False,
    ) -> None:
        from streaming import StreamingDataLoader

        self.plan, self.steps_per_epoch, self.seed = plan, plan.steps_per_epoch, seed
        self.num_nodes = num_nodes
        self.dataset = _decoding_dataset(
            local=str(_local_path(plan.cache_dir_url)),
            transform=transform,
            batch_size=plan.per_device_batch_size,
            shuffle=shuffle,
            shuffle_seed=seed,
            num_canonical_nodes=num_nodes,
        )
        at_driver_death(self._release)  # os._exit skips atexit: no shared memory left
        self.loader = StreamingDataLoader(
            self.dataset,
            batch_size=plan.per_device_batch_size,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            pin_memory=pin_memory,
            persistent_workers=False,
            drop_last=False,
        )

    def epoch(self, epoch: int) -> Iterator[Batch]:
        self.dataset.load_state_dict(
            {
                "epoch": epoch - 1,
                "sample_in_epoch": 0,
                "num_canonical_nodes": self.num_nodes,
                "shuffle_seed": self.seed,
                "initial_physical_nodes": self.num_nodes,
            }
        )
        steps = 0
        for batch in self.loader:
            steps += 1
            if steps > self.steps_per_epoch:
                raise ShardError(
                    f"Streaming yielded more than the planned {self.steps_per_epoch} batches"
                )
            yield {
                "image": batch["image"],
                "label_index": batch["label_index"].long(),
                "row_id": batch["row_id"].long(),
                "valid": batch["valid"].bool(),
            }
        if steps != self.steps_per_epoch:
            raise ShardError(
                f"Streaming yielded {steps} batches, the plan expects {self.steps_per_epoch}"
            )

    def close(self) -> None:
        """Remove the lock files Streaming leaves in the temp dir: it never removes them, and
        every later run on the host then skips their prefix. Its shared-memory blocks go
        with Streaming's own ``atexit`` handlers when the process exits."""
        from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK

        prefix = getattr(self.dataset, "_shm_prefix_int", None)
        if prefix is None:
            return
        for name in (BARRIER_FILELOCK, CACHE_FILELOCK):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(tempfile.gettempdir(), f"{prefix:06}_{name}"))

    def _release(self) -> None:
        """The watchdog's cleanup: ``os._exit`` skips the ``atexit`` handlers, so unlink
        Streaming's shared-memory blocks here, then remove the lock files."""
        from multiprocessing import shared_memory

        from streaming.base.constant import SHM_TO_CLEAN

        prefix = getattr(self.dataset, "_shm_prefix_int", None)
        for name in SHM_TO_CLEAN if prefix is not None else ():
            with contextlib.suppress(OSError, ValueError):
                block = shared_memory.SharedMemory(f"{prefix:06}_{name}")
                block.close()
                block.unlink()
        self.close()


def _local_path(url: str) -> Path:
    parsed = urlparse(url)
    if parsed.scheme not in ("file", ""):
        raise ValueError(f"the loader cache {url} is not a local or mounted path")
    return Path(parsed.path)


def _decoding_dataset(transform: DecodeTransform, **kwargs: Any) -> Any:
    """A ``StreamingDataset`` whose samples come out decoded: ``image`` uint8 ``[3, S, S]``."""
    from streaming import StreamingDataset

    class DecodingDataset(StreamingDataset):
        def get_item(self, sample_id: int, retry: int = 7) -> Any:
            sample = super().get_item(sample_id, retry)
            sample["image"] = transform.decode(sample["image"])
            return sample

    return DecodingDataset(partition_algo="orig", **kwargs)


def open_loader(
    plan: ShardPlan,
    rank: int,
    world_size: int,
    num_nodes: int,
    transform: DecodeTransform,
    *,
    shuffle: bool,
    seed: int,
    data: dict[str, Any],
    pin_memory: bool = False,
) -> ShardLoader:
    """The loader that reads ``plan``'s cache (``plan.loader``), for this rank.

    Args:
        plan: the split's :class:`ShardPlan`, from the driver.
        rank, world_size: this process's place; ``num_nodes``: hosts the ranks run on.
        transform: decodes (and for training augments) one stored image.
        shuffle: a new order every epoch (training) or the stored order (validation).
        seed: the shuffle seed; the order of epoch ``e`` is a function of ``(seed, e)``.
        data: the ``data`` config section as a dict (``reader_pool_type``,
            ``shuffle_buffer_rows`` for Petastorm; ``loader_workers`` for both: Petastorm's
            process pool, Streaming's DataLoader workers; ``prefetch_batches``: batches each
            Streaming worker decodes ahead).
        pin_memory: page-locked batches, for asynchronous copies to a CUDA device.

    Raises:
        ValueError: an unknown ``plan.loader``.
    """
    if plan.loader == "petastorm":
        return PetastormShardLoader(
            plan,
            rank,
            world_size,
            transform,
            shuffle=shuffle,
            seed=seed,
            reader_pool_type=str(data.get("reader_pool_type", "dummy")),
            shuffle_buffer_rows=int(data.get("shuffle_buffer_rows", 0)),
            workers_count=int(data.get("loader_workers", 0)) or 1,
            pin_memory=pin_memory,
        )
    if plan.loader == "streaming":
        return StreamingShardLoader(
            plan,
            transform,
            shuffle=shuffle,
            seed=seed,
            num_nodes=num_nodes,
            num_workers=int(data.get("loader_workers", 0)),
            prefetch_factor=int(data.get("prefetch_batches", 2)),
            pin_memory=pin_memory,
        )
    raise ValueError(f"unknown loader {plan.loader!r} in the shard plan")
