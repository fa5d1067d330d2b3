"""Where a reader is in its epoch, so that an epoch interrupted by a failure continues
from a checkpoint inside it with the batches the uninterrupted epoch would have yielded.

The readers of :mod:`flowers_job.loaders` keep an :class:`EpochCursor`: the loader's own
random stream (:class:`LoaderRng`) and the batches yielded. A mid-epoch checkpoint stores
:meth:`~flowers_job.loaders.base.ShardReader.position` per rank; the resumed epoch starts
from an :class:`EpochStart` (:mod:`flowers_job.train.step_checkpoint`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from flowers_job.errors import ShardError

if TYPE_CHECKING:
    import torch

__all__ = ["CursorReader", "EpochCursor", "EpochStart", "LoaderRng", "epoch_seed"]

T = TypeVar("T")


@dataclass(frozen=True)
class EpochStart:
    """Where a resumed epoch continues: after ``step`` batches of every rank; ``state`` is
    what this rank's reader returned from :meth:`ShardReader.position` then."""

    step: int
    state: dict[str, Any]


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """The seed of rank ``rank``'s loader stream (:class:`LoaderRng`) in ``epoch``: a 32-bit
    function of the three."""
    return (seed * 1_000_003 + epoch * 1_009 + rank) % 2**32


class LoaderRng:
    """The loader's own stream of torch's global generator.

    Augmentation (torchvision) and Petastorm's shuffling buffer (``torch.randperm``) draw
    from torch's global generator, as dropout does. Inside :meth:`run` they draw from this
    stream instead: an epoch's order and augmentation depend on nothing the model does, so
    a reader replayed or restored to a mid-epoch position yields the batches of the
    uninterrupted epoch. Swapping the state (5 KB) costs microseconds per batch."""

    def __init__(self, seed: int) -> None:
        import torch

        self.state: torch.Tensor = torch.Generator().manual_seed(seed).get_state()

    def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` with this stream as torch's global generator state."""
        import torch

        outer = torch.get_rng_state()
        torch.set_rng_state(self.state)
        try:
            return fn()
        finally:
            self.state = torch.get_rng_state()
            torch.set_rng_state(outer)

    def iterate(self, make: Callable[[], Iterable[T]]) -> Iterator[T]:
        """Iterate ``make()``, building the iterator and taking each item inside :meth:`run`."""
        it = self.run(lambda: iter(make()))
        while True:
            try:
                item = self.run(lambda: next(it))
            except StopIteration:
                return
            yield item


class EpochCursor:
    """Where a reader is in its epoch: the loader's random stream (:class:`LoaderRng`,
    seeded by :func:`epoch_seed`) and the batches yielded so far. What
    :meth:`ShardReader.position` returns, and what a mid-epoch :class:`EpochStart` restores
    (:meth:`restore`) or reaches by reading the epoch again from its beginning
    (:meth:`replay`)."""

    def __init__(self, seed: int) -> None:
        self.rng = LoaderRng(seed)
        self.step = 0

    def wrap(self, make: Callable[[], Iterable[T]]) -> Iterator[T]:
        """``make()``'s items, drawn from the loader's stream and counted."""
        for item in self.rng.iterate(make):
            self.step += 1
            yield item

    def position(self) -> dict[str, Any]:
        return {"rng": self.rng.state.clone(), "step": self.step}

    def restore(self, start: EpochStart) -> None:
        """Continue from ``start`` (a reader that can seek: the samples are skipped there)."""
        self.rng.state, self.step = start.state["rng"].clone(), start.step

    def replay(self, batches: Iterator[Any], start: EpochStart, rank: int) -> None:
        """Read and drop ``batches`` up to ``start``; the stream must then be where the
        interrupted epoch's was.

        Raises:
            ShardError: the shard ended before ``start``, or the replay drew other numbers.
        """
        import logging
        import time

        import torch

        t0 = time.perf_counter()
        while self.step < start.step:
            if next(batches, None) is None:
                raise ShardError(f"rank {rank}: the shard ended before step {start.step}")
        logging.getLogger(__name__).info(
            "rank %d: read the epoch's first %d batches again in %.1f s to reach the checkpoint",
            rank,
            start.step,
            time.perf_counter() - t0,
        )
        if not torch.equal(self.rng.state, start.state["rng"]):
            raise ShardError(
                f"rank {rank}: reading {start.step} batches again did not reach the "
                "checkpoint's position (the loader's random stream differs)"
            )


class CursorReader:
    """A reader that keeps its :class:`EpochCursor` (set by its ``epoch``) for
    :meth:`ShardReader.position`."""

    _cursor: EpochCursor | None = None

    def position(self) -> dict[str, Any]:
        assert self._cursor is not None, "position() before epoch()"
        return self._cursor.position()
