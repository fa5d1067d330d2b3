"""One rank's rows of one epoch, in order: a pure function of the split's files, the seed
and the epoch, the same on every rank and after every restart.

The split's live rows, file after file (training: the files in an order drawn anew each
epoch), form one sequence; rank ``r`` takes the ``r``-th of ``world_size`` contiguous,
balanced ranges of it (:func:`shard_ranges`), so that every row is read by one rank, once,
and each file by one or two ranks. Training then shuffles each run of ``window``
consecutive rows of a rank's range: rows of neighbouring files mix, and a rank holds no
more than a window's stored images at once (the file-order shuffle plus a bounded buffer
of tf.data's ``shuffle(buffer_size)`` and Petastorm's shuffling queue, without their
reservoir's memory of earlier files).
"""

from __future__ import annotations

import itertools

import numpy as np

__all__ = ["RankRows", "batch_seed", "rank_rows", "shard_ranges"]


def shard_ranges(rows: int, world_size: int) -> list[tuple[int, int]]:
    """``world_size`` contiguous ``[start, stop)`` ranges covering ``range(rows)``, their
    lengths differing by at most one (the first ``rows % world_size`` are one longer)."""
    q, r = divmod(rows, world_size)
    bounds = [0]
    for rank in range(world_size):
        bounds.append(bounds[-1] + q + (rank < r))
    return list(itertools.pairwise(bounds))


def _generator(*key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([k % 2**63 for k in key]))


def batch_seed(seed: int, epoch: int, rank: int, step: int) -> int:
    """The torch seed of rank ``rank``'s augmentation at ``step`` of ``epoch``: the same
    pixels whichever process decodes the step, and after a restart inside the epoch."""
    return int(_generator(seed, epoch, rank, step).integers(2**63))


class RankRows:
    """A rank's rows of one epoch: ``file`` and ``row`` (int64 ``[n]``: the file's index in
    the plan's order, and the row's position among that file's live rows), in the order the
    rank reads them."""

    def __init__(self, file: np.ndarray, row: np.ndarray) -> None:
        self.file = file
        self.row = row

    def __len__(self) -> int:
        return len(self.file)


def rank_rows(
    file_rows: list[int],
    span: tuple[int, int],
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    window: int,
) -> RankRows:
    """The rows of ``span`` (a :func:`shard_ranges` range) in this epoch's order.

    Args:
        file_rows: live rows of each of the split's files, in the plan's order.
        span: ``[start, stop)`` of the epoch's sequence of rows that this rank reads.
        seed: the run's seed; with ``epoch`` it draws the file order and the windows.
        epoch: 1-based.
        shuffle: training's order (the files drawn, each window shuffled); else the files
            and their rows in the plan's order.
        window: rows shuffled together (``loaders.delta.shuffle_window_rows``).

    Returns:
        :class:`RankRows` of ``span[1] - span[0]`` rows.

    Raises:
        ValueError: ``span`` is not inside ``[0, sum(file_rows)]``, or ``window`` < 1.
    """
    start, stop = span
    counts = np.asarray(file_rows, dtype=np.int64)
    if not 0 <= start <= stop <= int(counts.sum()) or window < 1:
        raise ValueError(f"span {span} of {int(counts.sum())} rows, window {window}")
    order = _generator(seed, epoch).permutation(len(counts)) if shuffle else np.arange(len(counts))
    ends = np.cumsum(counts[order])
    begins = ends - counts[order]
    first = int(np.searchsorted(ends, start, side="right"))
    last = int(np.searchsorted(begins, stop, side="left"))
    files, rows = [], []
    for i in range(first, last):
        lo, hi = max(start, int(begins[i])), min(stop, int(ends[i]))
        if hi > lo:
            files.append(np.full(hi - lo, order[i], dtype=np.int64))
            rows.append(np.arange(lo - int(begins[i]), hi - int(begins[i]), dtype=np.int64))
    file = np.concatenate(files) if files else np.zeros(0, dtype=np.int64)
    row = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    if shuffle:
        rng = _generator(seed, epoch, start)
        for w in range(0, len(file), window):
            perm = w + rng.permutation(min(window, len(file) - w))
            file[w : w + len(perm)], row[w : w + len(perm)] = file[perm], row[perm]
    return RankRows(file, row)
