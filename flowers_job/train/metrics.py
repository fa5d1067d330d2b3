"""What a pass over a shard adds up, and the checks that every row was read once.

:class:`Sums` is the one accumulator of training, evaluation and test scoring: the loss
summed over images, the correct predictions, the valid rows, their row checksum and every
row read (padding included). After a pass, :func:`check_shard` compares one rank's sums with
the driver's plan, and :func:`check_totals` the all-reduced sums with the split: together
they prove that every rank read its planned rows and that all ranks together read every row
of the split exactly once (no row dropped or read twice).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flowers_job.errors import ShardError
from flowers_job.loaders.base import ShardPlan
from flowers_job.runtime.process_group import DistContext, all_reduce_sum, all_reduce_sum_int64

__all__ = ["PassSums", "Sums", "check_shard", "check_totals", "reduce_sums", "row_checksum"]


@dataclass(frozen=True)
class PassSums:
    """What one pass over a shard (or, all-reduced, over a split) adds up.

    Attributes:
        loss_sum: the loss summed over the valid rows (nats; float64).
        correct: valid rows predicted right.
        rows: valid rows (padding excluded).
        checksum: int64 sum of the valid rows' ``row_id`` modulo 2**64
            (:data:`~flowers_job.loaders.base.CHECKSUM_MODULUS`).
        read: every row read, padding included.
    """

    loss_sum: float
    correct: int
    rows: int
    checksum: int
    read: int

    def counts(self) -> list[int]:
        """``[correct, rows, checksum, read]``: the integer part, all-reduced as int64."""
        return [self.correct, self.rows, self.checksum, self.read]


def row_checksum(row_id: torch.Tensor) -> torch.Tensor:
    """The int64 sum of ``row_id`` (int64 ``[B]``): a scalar int64 tensor, wrapped modulo
    2**64 as int64 additions are (two's complement), never through a float."""
    return row_id.to(torch.int64).sum(dtype=torch.int64)


class Sums:
    """Running sums of one pass over a shard, all on ``device``: the step adds to them
    without waiting for the device (no ``.item()``, ``.cpu()`` or ``int(tensor)``), and
    they are read once, in :meth:`values` (once per pass, or per mid-epoch checkpoint).

    ``loss_sum`` is float64; ``correct``, ``rows``, ``checksum`` and ``read`` are int64
    (the checksum wraps modulo 2**64 on any device, as int64 additions do).
    """

    def __init__(self, device: torch.device, start: PassSums | None = None) -> None:
        """Zero sums, or, resuming a pass from a mid-epoch checkpoint, ``start``'s."""
        s = start or PassSums(0.0, 0, 0, 0, 0)
        self.device = device
        self.loss_sum = torch.tensor(s.loss_sum, dtype=torch.float64, device=device)
        self.counts = torch.tensor(s.counts(), dtype=torch.int64, device=device)

    def add(
        self,
        y: torch.Tensor,
        logits: torch.Tensor,
        loss: torch.Tensor,
        valid: torch.Tensor,
        row_id: torch.Tensor,
    ) -> None:
        """Add one batch's valid rows, on the device (no host sync).

        Args:
            y: int64 ``[B]`` labels; logits: ``[B, C]``; loss: the batch's mean loss over its
                valid rows (scalar); valid: bool ``[B]``; all on the device.
            row_id: int64 ``[B]``, on the device (copied there if not).
        """
        ids = row_id.to(self.device, non_blocking=True).to(torch.int64)
        n = valid.sum(dtype=torch.int64)
        self.loss_sum += loss.detach().double() * n
        correct = ((logits.detach().argmax(1) == y) & valid).sum(dtype=torch.int64)
        checksum = row_checksum(ids * valid)
        read = torch.full_like(n, valid.numel())
        self.counts += torch.stack([correct, n, checksum, read])

    def values(self) -> PassSums:
        """The sums as Python numbers (the all-reduce's input): one read from the device."""
        correct, rows, checksum, read = self.counts.tolist()
        return PassSums(float(self.loss_sum), correct, rows, checksum, read)


def reduce_sums(parts: Sequence[PassSums], ctx: DistContext) -> list[PassSums]:
    """Each of ``parts`` summed over all ranks: the loss sums in one float64 all-reduce, the
    counts and checksums in one int64 all-reduce (checksums wrap modulo 2**64, exactly as
    on the driver). A collective: every rank calls it with as many parts."""
    losses = all_reduce_sum([p.loss_sum for p in parts], ctx)
    counts = all_reduce_sum_int64([c for p in parts for c in p.counts()], ctx)
    return [PassSums(loss, *counts[4 * i : 4 * i + 4]) for i, loss in enumerate(losses)]


def check_shard(split: str, plan: ShardPlan, rank: int, sums: PassSums) -> None:
    """This rank's rows against the plan: how many it read (padding included), and, when a
    rank reads the same rows every epoch (``plan.checksum_per_shard``), their count and
    checksum.

    Raises:
        ShardError: naming the rank, the split, what was read and what the plan expects.
    """
    rows, checksum, read = sums.rows, sums.checksum, sums.read
    expected = plan.checksum_per_shard[rank] if plan.checksum_per_shard is not None else None
    if read != plan.rows_per_shard[rank] or (
        expected is not None and (rows != read or checksum != expected)
    ):
        raise ShardError(
            f"rank {rank}: the {split} shard read {read} rows ({rows} valid, checksum "
            f"{checksum}); the plan expects {plan.rows_per_shard[rank]} rows"
            + (f" (checksum {expected})" if expected is not None else "")
        )


def check_totals(split: str, plan: ShardPlan, totals: PassSums) -> None:
    """All ranks together read every row of the split exactly once: the all-reduced count of
    valid rows and their checksum equal the split's. The same on every rank, so every rank
    raises together (no hang).

    Raises:
        ShardError: a row was dropped or read twice this epoch.
    """
    rows, checksum = totals.rows, totals.checksum
    if rows != plan.dataset_size or checksum != plan.checksum:
        raise ShardError(
            f"the ranks read {rows} valid {split} rows (checksum {checksum}) this epoch; the "
            f"split has {plan.dataset_size} (checksum {plan.checksum}): a row was dropped or "
            "read twice"
        )
