"""What a pass over a shard adds up, and the checks that every row was read once.

:class:`Sums` is the one accumulator of training, evaluation and test scoring: the loss
summed over images, the correct predictions, the valid rows, their row checksum and every
row read (padding included). After a pass, :func:`check_shard` compares one rank's sums with
the driver's plan, and :func:`check_totals` the all-reduced sums with the split: together
they prove that every rank read its planned rows and that all ranks together read every row
of the split exactly once (no row dropped or read twice).
"""

from __future__ import annotations

import torch

from flowers_job.errors import ShardError
from flowers_job.loaders.base import CHECKSUM_MODULUS, ShardPlan

__all__ = ["SUMS", "Sums", "check_shard", "check_totals"]

SUMS = 5
"""Entries of :meth:`Sums.values`: ``[loss_sum, correct, rows, row_checksum, rows_read]``."""


class Sums:
    """Running sums of one pass over a shard.

    ``loss_sum`` (float64) and ``correct`` (int64) stay on ``device`` and are read once, in
    :meth:`values`; ``rows``, ``checksum`` and ``read`` are Python ints.
    """

    def __init__(self, device: torch.device) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        self.rows = self.checksum = self.read = 0

    def add(
        self,
        y: torch.Tensor,
        logits: torch.Tensor,
        loss: torch.Tensor,
        valid: torch.Tensor,
        row_id: torch.Tensor,
    ) -> None:
        """Add one batch's valid rows.

        Args:
            y: int64 ``[B]`` labels; logits: ``[B, C]``; loss: the batch's mean loss over its
                valid rows (scalar); valid: bool ``[B]``; all on the device.
            row_id: int64 ``[B]``, on the host.
        """
        keep = valid.cpu()
        n = int(keep.sum())
        self.loss_sum += loss.detach().double() * n
        self.correct += ((logits.detach().argmax(1) == y) & valid).sum()
        self.rows += n
        self.checksum += int((row_id % CHECKSUM_MODULUS)[keep].sum())
        self.read += len(y)

    def values(self) -> list[float]:
        """``[loss_sum, correct, rows, row_checksum, rows_read]`` as floats (the all-reduce's
        input)."""
        return [
            float(self.loss_sum),
            float(self.correct),
            float(self.rows),
            float(self.checksum),
            float(self.read),
        ]


def check_shard(split: str, plan: ShardPlan, rank: int, sums: list[float]) -> None:
    """This rank's rows against the plan: how many it read (padding included), and, when a
    rank reads the same rows every epoch (``plan.checksum_per_shard``), their count and
    checksum.

    Raises:
        ShardError: naming the rank, the split, what was read and what the plan expects.
    """
    rows, checksum, read = int(sums[2]), int(sums[3]), int(sums[4])
    expected = plan.checksum_per_shard[rank] if plan.checksum_per_shard is not None else None
    if read != plan.rows_per_shard[rank] or (
        expected is not None and (rows != read or checksum != expected)
    ):
        raise ShardError(
            f"rank {rank}: the {split} shard read {read} rows ({rows} valid, checksum "
            f"{checksum}); the plan expects {plan.rows_per_shard[rank]} rows"
            + (f" (checksum {expected})" if expected is not None else "")
        )


def check_totals(split: str, plan: ShardPlan, totals: list[float]) -> None:
    """All ranks together read every row of the split exactly once: the all-reduced count of
    valid rows and their checksum equal the split's. The same on every rank, so every rank
    raises together (no hang).

    Raises:
        ShardError: a row was dropped or read twice this epoch.
    """
    rows, checksum = int(totals[2]), int(totals[3])
    if rows != plan.dataset_size or checksum != plan.checksum:
        raise ShardError(
            f"the ranks read {rows} valid {split} rows (checksum {checksum}) this epoch; the "
            f"split has {plan.dataset_size} (checksum {plan.checksum}): a row was dropped or "
            "read twice"
        )
