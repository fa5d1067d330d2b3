"""Checkpoints inside an epoch: when to take one (decided once, the same on every rank),
what each rank puts in it, and where a resumed epoch continues.

A checkpoint inside epoch ``e`` after ``step`` steps (``step.pt``,
:data:`~flowers_job.train.checkpoint.STEP_CHECKPOINT_NAME`) holds, besides what an epoch's
checkpoint holds, one :class:`EpochPosition` per rank: its running sums of the epoch
(:class:`~flowers_job.train.metrics.PassSums`), its reader's position
(:meth:`~flowers_job.loaders.base.ShardReader.position`), its random state (dropout draws
from torch's generators; the loader has a stream of its own,
:class:`~flowers_job.loaders.position.LoaderRng`) and the seconds the epoch had trained. A
resume at the same world size continues each rank from its own position: the rows left,
in the same batches and with the same augmentation, so that the epoch's two parts
together read every row once, pass the row checks of an uninterrupted epoch, and give its
metrics (tests/faults/test_restart.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from flowers_job.config import TrainConfig
from flowers_job.loaders.base import ShardReader
from flowers_job.loaders.position import EpochStart
from flowers_job.runtime.process_group import DistContext, all_gather_object, broadcast_flag
from flowers_job.train.metrics import PassSums

__all__ = [
    "CHECK_EVERY_STEPS",
    "CheckpointClock",
    "EpochPosition",
    "gather_positions",
    "restore_rng",
    "rng_state",
]

log = logging.getLogger("flowers_job.train")

CHECK_EVERY_STEPS = 16
"""With ``train.checkpoint_every_seconds``, rank 0 reads its clock and broadcasts the
decision every this many steps: one small collective (and host sync) per 16 steps, never
one per step; the interval is overshot by at most 16 steps' time."""


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's torch random state: the CPU generator's and, on CUDA, the device's
    (uint8 tensors)."""
    return {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    """Put back what :func:`rng_state` returned."""
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


@dataclass(frozen=True)
class EpochPosition:
    """One rank's place in an interrupted epoch (plain data in the checkpoint).

    Attributes:
        epoch: the epoch (1-based); step: training steps every rank had taken in it.
        sums: this rank's running sums of the epoch so far.
        loader: its reader's :meth:`~flowers_job.loaders.base.ShardReader.position`.
        rng: its :func:`rng_state`.
        train_seconds: seconds the epoch had trained (added to the resumed part's).
    """

    epoch: int
    step: int
    sums: PassSums
    loader: dict[str, Any]
    rng: dict[str, Any]
    train_seconds: float

    def start(self) -> EpochStart:
        """Where this rank's reader continues."""
        return EpochStart(self.step, self.loader)

    @classmethod
    def from_checkpoint(cls, saved: dict[str, Any], shard: int) -> EpochPosition:
        """The position of the rank that reads ``shard`` in a ``step.pt`` checkpoint
        (:func:`gather_positions`)."""
        mine = saved["positions"][shard]
        return cls(
            epoch=int(saved["epoch"]),
            step=int(saved["step"]),
            sums=PassSums(**mine["sums"]),
            loader=mine["loader"],
            rng=mine["rng"],
            train_seconds=float(saved["train_seconds"]),
        )


def gather_positions(
    ctx: DistContext, shard: int, sums: PassSums, reader: ShardReader
) -> list[dict[str, Any]]:
    """Every rank's sums, reader position and random state, in the order of the shards they
    read (:class:`~flowers_job.runtime.layout.HostLayout`: a rank placed on another host after a
    restart continues the shard, not the rank), on every rank (a collective: all ranks call
    it at the same step)."""
    mine = {
        "shard": shard,
        "sums": asdict(sums),
        "loader": reader.position(),
        "rng": rng_state(ctx.device),
    }
    return sorted(all_gather_object(mine, ctx), key=lambda p: int(p["shard"]))


class CheckpointClock:
    """Decides, the same way on every rank, after which steps of an epoch to checkpoint.

    ``train.checkpoint_every_steps``: after every that many steps (no collective).
    ``train.checkpoint_every_seconds``: every :data:`CHECK_EVERY_STEPS` steps, rank 0 asks
    whether that long has passed since the last checkpoint (or since training began) and
    broadcasts the answer. Never after an epoch's last step: the epoch's own checkpoint
    follows it.
    """

    def __init__(self, train: TrainConfig, ctx: DistContext, steps_per_epoch: int) -> None:
        self.every_steps = train.checkpoint_every_steps
        self.every_seconds = train.checkpoint_every_seconds
        self.ctx, self.steps_per_epoch = ctx, steps_per_epoch
        self.last = time.monotonic()

    def reset(self) -> None:
        """A checkpoint was just written."""
        self.last = time.monotonic()

    def due(self, step: int) -> bool:
        """Whether to checkpoint after ``step`` (1-based) steps of the epoch. A collective
        every :data:`CHECK_EVERY_STEPS` steps when ``checkpoint_every_seconds`` is set."""
        if step >= self.steps_per_epoch:
            return False
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        if self.every_seconds is None or step % CHECK_EVERY_STEPS:
            return False
        late = self.ctx.is_main and time.monotonic() - self.last >= self.every_seconds
        return broadcast_flag(late, self.ctx)
