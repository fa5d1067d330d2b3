"""The Delta loader's rank side: one rank's batches read from the table's own files.

The rank reads the log at the plan's version (:mod:`flowers_job.loaders.delta.log`), checks
that the split's live rows are the ones the driver counted, and takes its rows of the
epoch (:func:`~flowers_job.loaders.delta.order.rank_rows`). Its files are read whole, in the
order it first needs them, one ahead in a thread, each once per epoch and dropped after
its last row; only the ``row_id``, ``image`` and ``label_index`` columns are read, the
deletion vector's dead rows dropped. The main process gathers each step's stored images;
the step is decoded (and, for training, augmented) in ``data.loader_workers`` processes or
in the rank itself, seeded by ``(seed, epoch, rank, step)``
(:func:`~flowers_job.loaders.delta.order.batch_seed`): whichever process decodes it, and
after a restart inside the epoch, a step has the same pixels. A restart inside an epoch
skips the steps before it without reading them.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from flowers_job.errors import ShardError
from flowers_job.loaders.delta.log import SplitFile, open_table, split_files
from flowers_job.loaders.delta.order import RankRows, batch_seed, rank_rows, shard_ranges
from flowers_job.location import filesystem
from flowers_job.vision.batch_decode import JPEG_KEY, LENGTH_KEY, pad_jpegs

if TYPE_CHECKING:
    import pyarrow as pa

    from flowers_job.config.data import DeltaConfig
    from flowers_job.loaders.base import Batch
    from flowers_job.loaders.delta.version_plan import DeltaPlan
    from flowers_job.loaders.position import EpochStart
    from flowers_job.vision.decode_transform import DecodeTransform

__all__ = ["COLUMNS", "DeltaReader"]

COLUMNS = ["row_id", "image", "label_index"]
"""The columns a rank reads of the table's files."""


def _read_file(file: SplitFile) -> pa.Table:
    """``file``'s live rows (:data:`COLUMNS`), in stored order."""
    import pyarrow.parquet as pq

    fs, path = filesystem(file.url)
    table = pq.read_table(path, columns=COLUMNS, filesystem=fs)
    if len(table) != file.rows:
        raise ShardError(f"{file.url} holds {len(table)} rows, its add action {file.rows}")
    return table if file.keep is None else table.filter(file.keep)


class _Files:
    """The files a rank's epoch reads, loaded in the order of first need, one ahead in a
    thread, and dropped after their last row."""

    def __init__(self, files: list[SplitFile], order: np.ndarray) -> None:
        self.files = files
        firsts = np.unique(order, return_index=True)
        self.queue = [int(f) for f in firsts[0][np.argsort(firsts[1])]]
        last = np.zeros(len(files), dtype=np.int64)
        np.maximum.at(last, order, np.arange(len(order)))
        self.last = last
        self.loaded: dict[int, Future[pa.Table]] = {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="delta-read")

    def _load_next(self) -> None:
        if self.queue:
            f = self.queue.pop(0)
            self.loaded[f] = self.pool.submit(_read_file, self.files[f])

    def get(self, f: int) -> pa.Table:
        while f not in self.loaded:
            self._load_next()
        if all(future.done() for future in self.loaded.values()):
            self._load_next()  # one ahead
        return self.loaded[f].result()

    def drop_before(self, position: int) -> None:
        """Forget the files whose last row is before ``position`` of the epoch's order."""
        for f in [f for f in self.loaded if self.last[f] < position]:
            del self.loaded[f]

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.loaded.clear()


def _steps(
    rows: RankRows, files: list[SplitFile], sizes: list[int], first: int
) -> Iterator[dict[str, Any]]:
    """Each step's stored rows from ``first`` on: ``step``, ``images`` (bytes), and int64
    ``row_id``, ``label_index`` and bool ``valid`` arrays; the rows past ``rows`` (the
    plan's padding, where ``sum(sizes)`` exceeds them) are copies of a real row with
    ``valid`` False."""
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    skipped = min(int(bounds[first]), len(rows))  # a restart's earlier steps: never read
    reads = _Files(files, rows.file[skipped:]) if len(rows) > skipped else None
    try:
        for step in range(first, len(sizes)):
            a, b = int(bounds[step]), int(bounds[step + 1])
            real = max(0, min(b, len(rows)) - a)
            images: list[bytes] = []
            ids = np.zeros(b - a, dtype=np.int64)
            labels = np.zeros(b - a, dtype=np.int64)
            if real and reads is not None:
                file, row = rows.file[a : a + real], rows.row[a : a + real]
                images = [b""] * real
                for f in np.unique(file):
                    at = np.flatnonzero(file == f)
                    taken = reads.get(int(f)).take(row[at])
                    for i, content in zip(at, taken.column("image").to_pylist(), strict=True):
                        images[i] = content
                    ids[at] = taken.column("row_id").to_numpy()
                    labels[at] = taken.column("label_index").to_numpy()
                reads.drop_before(b - skipped)
            pads = b - a - real
            if pads:  # padding: the epoch's first row again, masked out
                filler = _first_row(rows, files, reads)
                images += [filler[0]] * pads
                ids[real:], labels[real:] = filler[1], filler[2]
            valid = np.arange(b - a) < real
            yield {
                "step": step,
                "images": images,
                "row_id": ids,
                "label_index": labels,
                "valid": valid,
            }
    finally:
        if reads is not None:
            reads.close()


def _first_row(
    rows: RankRows, files: list[SplitFile], reads: _Files | None
) -> tuple[bytes, int, int]:
    """A row to copy as padding: this rank's first, else the split's first live row."""
    if len(rows) and reads is not None:
        t = _read_file(files[int(rows.file[0])]).slice(int(rows.row[0]), 1)
    else:
        live = next(f for f in files if f.live_rows)
        t = _read_file(live).slice(0, 1)
    return (
        t.column("image")[0].as_py(),
        t.column("row_id")[0].as_py(),
        t.column("label_index")[0].as_py(),
    )


class _DecodeSteps:
    """A map-style dataset whose "index" is a step's stored rows (:func:`_steps`): the
    step decoded, seeded by :func:`~flowers_job.loaders.delta.order.batch_seed`. Picklable,
    for DataLoader worker processes."""

    def __init__(self, transform: DecodeTransform, seed: int, epoch: int, rank: int) -> None:
        self.transform, self.seed, self.epoch, self.rank = transform, seed, epoch, rank

    def __getitem__(self, rows: dict[str, Any]) -> Batch:
        import torch

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(batch_seed(self.seed, self.epoch, self.rank, rows["step"]))
            if self.transform.undecoded:
                jpeg, length = pad_jpegs(rows["images"], self.transform.jpeg_width)
                images = {JPEG_KEY: torch.from_numpy(jpeg), LENGTH_KEY: torch.from_numpy(length)}
            else:
                images = {"image": torch.stack([self.transform.decode(c) for c in rows["images"]])}
        return {
            **images,
            "label_index": torch.from_numpy(rows["label_index"]),
            "row_id": torch.from_numpy(rows["row_id"]),
            "valid": torch.from_numpy(rows["valid"]),
        }


class DeltaReader:
    """One rank's reader of a :class:`~flowers_job.loaders.delta.table_loader.DeltaPlan`.

    Raises (when built):
        DataError: delta-rs cannot read the table at the plan's version.
        ShardError: the split's live rows at that version are not the planned ones.
    """

    # Arguments: Loader.open's, handed on.
    def __init__(  # noqa: PLR0913
        self,
        plan: DeltaPlan,
        transform: DecodeTransform,
        *,
        rank: int,
        shuffle: bool,
        seed: int,
        settings: DeltaConfig,
        workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        self.plan, self.transform, self.rank = plan, transform, rank
        self.shuffle, self.seed, self.settings = shuffle, seed, settings
        self.workers, self.pin_memory = workers, pin_memory
        self.steps_per_epoch = plan.steps_per_epoch
        table = open_table(plan.cache_dir_url, plan.version)
        self.files = split_files(table, plan.cache_dir_url, plan.split)
        live = sum(f.live_rows for f in self.files)
        if live != plan.dataset_size:
            raise ShardError(
                f"rank {rank}: the {plan.split} split of {plan.cache_dir_url} at version "
                f"{plan.version} holds {live} live rows in delta-rs's reading of its log, "
                f"{plan.dataset_size} in Spark's"
            )
        world_size = len(plan.rows_per_shard)
        self.span = shard_ranges(plan.dataset_size, world_size)[rank]
        self._step = 0

    def epoch(self, epoch: int, start: EpochStart | None = None) -> Iterator[Batch]:
        """This rank's batches of ``epoch`` (:meth:`ShardReader.epoch`); from a mid-epoch
        ``start``, the steps after it, the steps before it not read."""
        import torch
        from torch.utils.data import DataLoader

        rows = rank_rows(
            [f.live_rows for f in self.files],
            self.span,
            seed=self.seed,
            epoch=epoch,
            shuffle=self.shuffle,
            window=self.settings.shuffle_window_rows,
        )
        sizes = self.plan.batch_sizes(self.rank)
        first = start.step if start is not None else 0
        if first > len(sizes):
            raise ShardError(f"rank {self.rank}: a restart at step {first} of {len(sizes)}")
        loader: DataLoader[Batch] = DataLoader(
            _DecodeSteps(self.transform, self.seed, epoch, self.rank),  # type: ignore[arg-type]
            sampler=_steps(rows, self.files, sizes, first),
            batch_size=None,
            num_workers=self.workers,
            prefetch_factor=self.settings.prefetch_batches if self.workers else None,
            pin_memory=self.pin_memory,
            # its own generator: DataLoader draws a base seed, which must not shift the model's
            generator=torch.Generator().manual_seed(self.seed),
        )
        self._step = first
        for batch in loader:
            self._step += 1
            yield batch
        if self._step != self.steps_per_epoch:
            raise ShardError(
                f"rank {self.rank}: the Delta reader yielded {self._step - first} batches from "
                f"step {first}, the plan expects {self.steps_per_epoch}"
            )

    def position(self) -> dict[str, Any]:
        """The steps this epoch has yielded: all that a restart needs (the order and the
        pixels are functions of the seed, the epoch, the rank and the step)."""
        return {"step": self._step}

    def close(self) -> None:
        """Nothing outlives an epoch: its files' reads end with it."""
        return None
