"""The Delta loader's rank side: one rank's batches read from the table's own files.

The rank reads the log at the plan's version (:mod:`flowers_job.loaders.delta.log`), checks
that the split's live rows are the ones the driver counted, and takes its rows of the
epoch (:func:`~flowers_job.loaders.delta.order.rank_rows`): a contiguous range of the
split's live rows, file after file, cut into windows that training shuffles inside. So a
window needs consecutive rows of each of its files, and each file's rows are needed in
increasing order: every file is read once per epoch, forward, a record batch at a time
from the row group that holds its first row needed, its column chunks streamed through a
small buffer, the deletion vector's dead rows dropped; only the ``row_id``, ``image`` and
``label_index`` columns are read. A rank holds the window it reads from and the next one
(read ahead in a thread), whatever the size of the table's files and row groups. The main process gathers each step's stored images;
the step is decoded (and, for training, augmented) in ``data.loader_workers`` processes or
in the rank itself, seeded by ``(seed, epoch, rank, step)``
(:func:`~flowers_job.loaders.delta.order.batch_seed`): whichever process decodes it, and
after a restart inside the epoch, a step has the same pixels. A restart inside an epoch
skips the steps before it without reading them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from flowers_job.errors import ShardError
from flowers_job.loaders.delta.log import SplitFile, open_table, split_files
from flowers_job.loaders.delta.order import RankRows, batch_seed, rank_rows, shard_ranges
from flowers_job.location import Location, filesystem
from flowers_job.vision.batch_decode import JPEG_KEY, LENGTH_KEY, pad_jpegs

if TYPE_CHECKING:
    import pyarrow as pa

    from flowers_job.config.data import DeltaConfig
    from flowers_job.loaders.base import Batch
    from flowers_job.loaders.delta.version_plan import DeltaPlan
    from flowers_job.loaders.position import EpochStart
    from flowers_job.vision.decode_transform import DecodeTransform

__all__ = ["COLUMNS", "FEATURE_COLUMNS", "DeltaReader"]

COLUMNS = ["row_id", "image", "label_index"]
"""The columns a rank reads of the ``images`` table's files."""
FEATURE_COLUMNS = ["row_id", "features", "label_index"]
"""The columns a rank reads of the ``embeddings`` table's files (a plan with a ``model_key``)."""

BATCH_ROWS = 128
"""Rows per record batch of a file's forward read (``ParquetFile.iter_batches``): what a
rank decompresses at a time, well under a window."""

BUFFER_BYTES = 4 * 2**20
"""``ParquetFile``'s read buffer for a file on a local or mounted disk, bytes: column chunks
are streamed through it, page by page, without ``pre_buffer`` (pyarrow's default, which
reads a row group's column chunks whole before the first batch: a row group's ``image``
chunk is up to Spark's 128 MiB ``parquet.block.size``; 131 MiB allocated for a first batch
of 2 MiB at 30x)."""

OBJECT_STORE_BUFFER_BYTES = 16 * 2**20
"""The same buffer for a file in an object store, bytes: each refill is one ranged GET,
whose latency is paid per request, so fewer, larger ones; AWS's S3 performance guidelines
give 8 or 16 MB as typical byte-range sizes. On the moto server of the tests, which reads a
whole object to answer any range of it, a 4 MiB range of a 200 MiB file took 150 ms
against 10 ms from an 8 MiB one (docs/known-issues.md, "moto")."""


def buffer_bytes(url: str) -> int:
    """The read buffer (bytes) for the file at ``url``: :data:`BUFFER_BYTES` on a disk,
    :data:`OBJECT_STORE_BUFFER_BYTES` in an object store."""
    return BUFFER_BYTES if Location.of(url).is_local else OBJECT_STORE_BUFFER_BYTES


class _Cursor:
    """One file's live rows, read forward from the live row ``start``, a record batch at a
    time from the row group that holds it, the deletion vector applied."""

    def __init__(self, file: SplitFile, start: int, columns: list[str]) -> None:
        import pyarrow.parquet as pq

        self.file = file
        fs, path = filesystem(file.url)
        self.source = fs.open_input_file(path)
        parquet = pq.ParquetFile(self.source, buffer_size=buffer_bytes(file.url), pre_buffer=False)
        meta = parquet.metadata
        if meta.num_rows != file.rows:
            self.source.close()
            raise ShardError(f"{file.url} holds {meta.num_rows} rows, its add action {file.rows}")
        groups = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        group_starts = np.concatenate([[0], np.cumsum(groups, dtype=np.int64)])
        self.skip = start if file.keep is None else int(np.flatnonzero(file.keep)[start])
        group = int(np.searchsorted(group_starts, self.skip, side="right")) - 1
        self.physical = int(group_starts[group])  # the next record batch's first row
        self.batches = parquet.iter_batches(
            batch_size=BATCH_ROWS, row_groups=range(group, len(groups)), columns=columns
        )
        self.live = start  # the live row the next take starts at
        self.held: list[pa.RecordBatch] = []  # live rows read and not yet taken
        self.held_rows = 0

    def _read(self) -> None:
        import pyarrow as pa

        batch = next(self.batches, None)
        if batch is None:
            raise ShardError(
                f"{self.file.url} ended before its live row {self.live + self.held_rows}"
            )
        lo, hi = self.physical, self.physical + batch.num_rows
        self.physical = hi
        if hi <= self.skip:
            return
        cut = max(0, self.skip - lo)
        batch = batch.slice(cut)
        if self.file.keep is not None:
            batch = batch.filter(pa.array(self.file.keep[lo + cut : hi]))
        self.held.append(batch)
        self.held_rows += batch.num_rows

    def take(self, n: int) -> pa.Table:
        """The next ``n`` live rows (the cursor's columns)."""
        import pyarrow as pa

        while self.held_rows < n:
            self._read()
        table = pa.Table.from_batches(self.held)
        taken, rest = table.slice(0, n), table.slice(n)
        self.held = rest.to_batches()
        self.held_rows -= n
        self.live += n
        return taken

    def close(self) -> None:
        self.source.close()


def _read_rows(file: SplitFile, start: int, n: int, columns: list[str]) -> pa.Table:
    """``n`` live rows of ``file`` from its live row ``start``."""
    cursor = _Cursor(file, start, columns)
    try:
        return cursor.take(n)
    finally:
        cursor.close()


class _Windows:
    """A rank's rows of one epoch (:class:`RankRows`), window by window: the window being
    read from and the next one (read ahead in a thread) are held, each file read forward
    once (one :class:`_Cursor` each, closed after its last row of the epoch)."""

    def __init__(
        self, rows: RankRows, files: list[SplitFile], window: int, first: int, columns: list[str]
    ) -> None:
        self.rows, self.files, self.window, self.columns = rows, files, window, columns
        self.end = np.zeros(len(files), dtype=np.int64)  # each file's last live row + 1
        np.maximum.at(self.end, rows.file, rows.row + 1)
        self.cursors: dict[int, _Cursor] = {}
        self.loaded: dict[int, Future[tuple[pa.Table, dict[int, int]]]] = {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="delta-read")
        self.windows = math.ceil(len(rows) / window)
        self.submitted = first // window  # the next window to read

    def _load(self, k: int) -> tuple[pa.Table, dict[int, int]]:
        """Window ``k``'s rows, file by file, and where each file's first row is in it (its
        index in the window's table, less that row's live position)."""
        import pyarrow as pa

        a, b = k * self.window, min((k + 1) * self.window, len(self.rows))
        file, row = self.rows.file[a:b], self.rows.row[a:b]
        parts, shift, at = [], {}, 0
        for f in (int(x) for x in np.unique(file)):
            mine = row[file == f]
            lo, hi = int(mine.min()), int(mine.max()) + 1
            cursor = self.cursors.get(f)
            if cursor is None:
                cursor = self.cursors[f] = _Cursor(self.files[f], lo, self.columns)
            if cursor.live != lo:  # the order's contract: each file's rows read forward
                raise ShardError(
                    f"{self.files[f].url}: window {k} starts at live row {lo}, "
                    f"the file's read is at {cursor.live}"
                )
            parts.append(cursor.take(hi - lo))
            shift[f] = at - lo
            at += hi - lo
            if hi == self.end[f]:
                self.cursors.pop(f).close()
        return pa.concat_tables(parts), shift

    def _submit_to(self, k: int) -> None:
        while self.submitted <= min(k, self.windows - 1):
            self.loaded[self.submitted] = self.pool.submit(self._load, self.submitted)
            self.submitted += 1

    def take(self, a: int, b: int) -> pa.Table:
        """Positions ``[a, b)`` of the epoch's rows, in order; then forgets the windows
        before ``b``'s and reads the next one ahead."""
        import pyarrow as pa

        first, last = a // self.window, (b - 1) // self.window
        self._submit_to(last + 1)
        pieces = []
        for k in range(first, last + 1):
            table, shift = self.loaded[k].result()
            lo, hi = max(a, k * self.window), min(b, (k + 1) * self.window)
            file, row = self.rows.file[lo:hi], self.rows.row[lo:hi]
            index = row + np.array([shift[int(f)] for f in file], dtype=np.int64)
            pieces.append(table.take(index))
        for k in [k for k in self.loaded if (k + 1) * self.window <= b]:
            del self.loaded[k]
        return pa.concat_tables(pieces)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for cursor in self.cursors.values():
            cursor.close()
        self.cursors.clear()
        self.loaded.clear()


def _steps(
    rows: RankRows,
    files: list[SplitFile],
    sizes: list[int],
    first: int,
    window: int,
    columns: list[str],
) -> Iterator[dict[str, Any]]:
    """Each step's stored rows from ``first`` on: ``step``, the payload (``images``: bytes
    per row; or, reading ``features``, ``features``: float32 ``[rows, F]``), and int64
    ``row_id``, ``label_index`` and bool ``valid`` arrays; the rows past ``rows`` (the
    plan's padding, where ``sum(sizes)`` exceeds them) are copies of a real row with
    ``valid`` False. ``window``: the order's shuffle window (rows)."""
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    skipped = min(int(bounds[first]), len(rows))  # a restart's earlier steps: never read
    reads = _Windows(rows, files, window, skipped, columns) if len(rows) > skipped else None
    payload = columns[1]
    try:
        for step in range(first, len(sizes)):
            a, b = int(bounds[step]), int(bounds[step + 1])
            real = max(0, min(b, len(rows)) - a)
            values: list[Any] = []
            ids = np.zeros(b - a, dtype=np.int64)
            labels = np.zeros(b - a, dtype=np.int64)
            if real and reads is not None:
                taken = reads.take(a, a + real)
                values = _payload(taken, payload)
                ids[:real] = taken.column("row_id").to_numpy()
                labels[:real] = taken.column("label_index").to_numpy()
            pads = b - a - real
            if pads:  # padding: the epoch's first row again, masked out
                filler = _first_row(rows, files, columns)
                values += [filler[0]] * pads
                ids[real:], labels[real:] = filler[1], filler[2]
            valid = np.arange(b - a) < real
            yield {
                "step": step,
                "images" if payload == "image" else "features": (
                    values if payload == "image" else np.stack(values)
                ),
                "row_id": ids,
                "label_index": labels,
                "valid": valid,
            }
    finally:
        if reads is not None:
            reads.close()


def _payload(table: pa.Table, column: str) -> list[Any]:
    """The rows' stored images (bytes), or their features (float32 ``[F]`` arrays)."""
    if column == "image":
        return table.column("image").to_pylist()
    flat = table.column(column).combine_chunks()
    return list(flat.flatten().to_numpy().astype(np.float32).reshape(len(flat), -1))


def _first_row(rows: RankRows, files: list[SplitFile], columns: list[str]) -> tuple[Any, int, int]:
    """A row to copy as padding: this rank's first, else the split's first live row."""
    if len(rows):
        t = _read_rows(files[int(rows.file[0])], int(rows.row[0]), 1, columns)
    else:
        t = _read_rows(next(f for f in files if f.live_rows), 0, 1, columns)
    return (
        _payload(t, columns[1])[0],
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
            if "features" in rows:  # the embeddings table: nothing to decode
                images = {"features": torch.from_numpy(rows["features"])}
            elif self.transform.undecoded:
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
        self.files = split_files(table, plan.cache_dir_url, plan.split, plan.model_key, plan.views)
        self.columns = FEATURE_COLUMNS if plan.model_key is not None else COLUMNS
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
            sampler=_steps(
                rows, self.files, sizes, first, self.settings.shuffle_window_rows, self.columns
            ),
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
