"""The rank's input stage: a loader's host batches -> batches on the device, ahead of the step.

:class:`DeviceReader` wraps a :class:`~flowers_job.loaders.base.ShardReader`. On a GPU a
background thread reads the next ``prefetch`` batches, pins them, copies them to the device
on its own CUDA stream (``non_blocking=True``) and, when the loader delivers undecoded JPEGs,
decodes and augments them there (:class:`~flowers_job.vision.batch_decode.BatchDecoder`); the
step's stream waits on an event, never the host. This is PyTorch's own advice for input
pipelines ("Performance Tuning Guide": pinned memory, asynchronous copies, overlapping data
loading with compute) and what NVIDIA DALI's pipelines do. On a CPU rank (or with
``prefetch`` 0) the same stages run in the step's thread, in order.

Every output batch has every tensor on the device: ``image`` uint8 ``[B, 3, S, S]``,
``label_index`` int64 ``[B]``, ``row_id`` int64 ``[B]``, ``valid`` bool ``[B]``, so that the
step's sums (:class:`~flowers_job.train.metrics.Sums`) stay on the device too.

The reader's :meth:`~flowers_job.loaders.base.ShardReader.position` is taken when a batch
leaves the loader and handed out with that batch: a mid-epoch checkpoint records the
position of the last batch the *step* took, not of the batches read ahead. The background
thread is used on CUDA ranks only: the loaders' augmentation draws swap torch's global CPU
generator (:class:`~flowers_job.loaders.position.LoaderRng`), which a CPU rank's dropout
draws from at the same time, while a GPU rank's dropout draws from the CUDA generator.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from flowers_job.errors import ShardError
from flowers_job.vision.batch_decode import JPEG_KEY, LENGTH_KEY, BatchDecoder, step_seed

if TYPE_CHECKING:
    from flowers_job.loaders.base import Batch, ShardReader
    from flowers_job.loaders.position import EpochStart

__all__ = ["READ_AHEAD_TIMEOUT_SECONDS", "DeviceReader", "decodes_on_device"]

READ_AHEAD_TIMEOUT_SECONDS = 600.0
"""The longest the step waits for the background thread's next batch (s): a loader stuck
for this long fails the rank with a :class:`~flowers_job.errors.ShardError` instead of
hanging it (``distributed.timeout_seconds``' default: the peers give up as late)."""

_DONE = object()


def decodes_on_device(decode_device: str, device: torch.device) -> bool:
    """``data.decode_device`` (``decode_device``): True when the rank decodes whole batches
    on ``device`` ('device', or 'auto' on a GPU); False when the loader decodes (Pillow)."""
    return decode_device == "device" or (decode_device == "auto" and device.type == "cuda")


class DeviceReader:
    """A :class:`~flowers_job.loaders.base.ShardReader` whose batches are on ``device``.

    Args:
        reader: the loader's reader of this rank's shard.
        device: the rank's device.
        decoder: decodes undecoded batches (``jpeg``/``jpeg_length``); None when the loader
            decodes.
        seed, shard: with the epoch and step, the seed of each step's augmentation draws
            (:func:`~flowers_job.vision.batch_decode.step_seed`).
        prefetch: batches read ahead by the background thread (CUDA only); 0: none.
    """

    def __init__(
        self,
        reader: ShardReader,
        device: torch.device,
        decoder: BatchDecoder | None = None,
        *,
        seed: int = 0,
        shard: int = 0,
        prefetch: int = 0,
    ) -> None:
        self.reader, self.device, self.decoder = reader, device, decoder
        self.seed, self.shard = seed, shard
        self.prefetch = prefetch if device.type == "cuda" else 0
        self._position: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self.reader.steps_per_epoch

    def position(self) -> dict[str, Any]:
        """The loader's position after the last batch this reader handed out."""
        return self._position if self._position is not None else self.reader.position()

    def close(self) -> None:
        self._halt()
        self.reader.close()

    def epoch(self, epoch: int, start: EpochStart | None = None) -> Iterator[Batch]:
        """The reader's batches of ``epoch`` (from ``start``), on the device."""
        self._halt()
        self._position = None
        first = start.step if start is not None else 0
        if self.prefetch <= 0:
            for step, batch in enumerate(self.reader.epoch(epoch, start), first):
                yield self._to_device(batch, epoch, step, None)
            return
        yield from self._read_ahead(epoch, start, first)

    # ---------------------------------------------------------------- the stages

    def _to_device(
        self, batch: Batch, epoch: int, step: int, consumer: torch.cuda.Stream | None
    ) -> Batch:
        """One host batch on the device: pinned, copied asynchronously, decoded there;
        ``consumer``: the step's stream, when this runs on another."""
        cuda = self.device.type == "cuda"
        jpeg, length = batch.pop(JPEG_KEY, None), batch.pop(LENGTH_KEY, None)
        out = {
            k: (v.pin_memory() if cuda and not v.is_pinned() else v).to(
                self.device, non_blocking=True
            )
            for k, v in batch.items()
        }
        if jpeg is not None:
            if self.decoder is None or length is None:
                raise ShardError("the loader delivered undecoded JPEGs and no decoder is set")
            generator = torch.Generator().manual_seed(step_seed(self.seed, epoch, self.shard, step))
            out["image"] = self.decoder(jpeg, length, generator)
        if consumer is not None:
            for v in out.values():  # the step's stream uses them: keep them alive for it
                v.record_stream(consumer)
        return out

    def _read_ahead(self, epoch: int, start: EpochStart | None, first: int) -> Iterator[Batch]:
        """The batches from the background thread, ``prefetch`` ahead."""
        items: queue.Queue[Any] = queue.Queue(maxsize=self.prefetch)
        stream = torch.cuda.Stream(self.device)
        consumer = torch.cuda.current_stream(self.device)
        stop = self._stop = threading.Event()

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    items.put(item, timeout=0.5)
                    return True
                except queue.Full:
                    continue
            return False

        def work() -> None:
            try:
                with torch.cuda.device(self.device), torch.cuda.stream(stream):
                    for step, batch in enumerate(self.reader.epoch(epoch, start), first):
                        position = self.reader.position()
                        out = self._to_device(batch, epoch, step, consumer)
                        done = torch.cuda.Event()
                        done.record(stream)
                        if not put((out, done, position)):
                            return
                put(_DONE)
            except BaseException as exc:  # handed to the step's thread, which raises it
                put(exc)

        self._thread = thread = threading.Thread(
            target=work, name=f"flowers-feed-{self.shard}", daemon=True
        )
        thread.start()
        try:
            while True:
                try:
                    item = items.get(timeout=READ_AHEAD_TIMEOUT_SECONDS)
                except queue.Empty:
                    raise ShardError(
                        f"shard {self.shard}: no batch from the loader in "
                        f"{READ_AHEAD_TIMEOUT_SECONDS:.0f} s (epoch {epoch})"
                    ) from None
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                out, done, position = item
                consumer.wait_event(done)
                self._position = position
                yield out
        finally:
            self._halt()

    def _halt(self) -> None:
        """Stop the background thread (an epoch ended or was abandoned)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=READ_AHEAD_TIMEOUT_SECONDS)
            self._thread = None
