"""The loader interface: a backend is one module holding both of its sides behind it.

A loader turns a split's Delta table into a cache that ``world_size`` ranks read in exactly
``steps_per_epoch`` batches each, every row once per epoch:

- **driver side** (Spark, :mod:`flowers_job.driver.prepare` calls it): ``Loader(sharding, source)``, then
  :meth:`Loader.write` once per split (write the split's cache, plan its shards: a
  :class:`ShardPlan`; a loader whose ranks read the table itself,
  :attr:`Loader.reads_table`, plans it with :meth:`Loader.plan_table` and writes nothing),
  :meth:`Loader.release` when the run ends, and
  :meth:`Loader.sweep` for what a killed run left on this host;
- **rank side** (torch, :mod:`flowers_job.train` calls it): :meth:`Loader.check_layout` with
  the hosts the ranks run on, then :meth:`Loader.open` -> a :class:`ShardReader` whose
  :meth:`~ShardReader.epoch` yields the planned batches, and :meth:`~ShardReader.close`.

Every batch is a dict of tensors (:data:`Batch`):

- ``image``: uint8 ``[B, 3, S, S]``, decoded and, for training, augmented
  (:class:`~flowers_job.vision.decode_transform.DecodeTransform`); normalised later, on the device;
- ``label_index``: int64 ``[B]``; ``row_id``: int64 ``[B]``;
- ``valid``: bool ``[B]``: False for padding rows, which count in no loss, metric or checksum.

Plans are plain data sent to the ranks (:meth:`ShardPlan.to_dict`), beside the loader class
the driver resolved once (:func:`flowers_job.loaders.resolve_loader`), whose
:attr:`Loader.plan_type` rebuilds them; a loader that needs more than the common fields
subclasses :class:`ShardPlan`. The pipeline and the training loop never ask which loader
they have: they go through this interface.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar
from urllib.parse import urlparse

from flowers_job.errors import DataError, ShardError

if TYPE_CHECKING:
    import torch
    from pyspark.sql import DataFrame, SparkSession

    from flowers_job.config import JobConfig, LoadersConfig
    from flowers_job.loaders.position import EpochStart
    from flowers_job.location import Location
    from flowers_job.runtime.layout import HostLayout
    from flowers_job.vision.decode_transform import DecodeTransform

__all__ = [
    "CHECKSUM_MODULUS",
    "DELETIONS_FILE",
    "SEGMENT_COLUMN",
    "Batch",
    "Deletions",
    "Loader",
    "ShardPlan",
    "ShardReader",
    "Sharding",
    "check_batch_fits",
    "live_mask",
    "local_dir",
    "read_deletions",
    "rebatch",
    "row_stats",
    "wrap_int64",
    "write_deletions",
]

T = TypeVar("T")

Batch = dict[str, "torch.Tensor"]
"""One step's rows: ``image``, ``label_index``, ``row_id``, ``valid`` (module doc)."""

CHECKSUM_MODULUS = 2**64
"""Row checksum = sum of ``row_id`` modulo 2**64, as a signed int64 (:func:`wrap_int64`).

``row_id`` is ``xxhash64(relative_path)``, a well-mixed 64-bit value, so a dropped or
repeated row changes the sum but for a 2**-64 chance. The ranks add row ids as int64 torch
tensors, whose additions wrap modulo 2**64 (two's complement), and all-reduce them as int64;
the driver sums them exactly in Spark as ``decimal(38,0)`` (:func:`row_stats`) and wraps the
result once. Exact at any number of rows: no float on either side."""


def wrap_int64(value: int) -> int:
    """``value`` modulo 2**64 as a signed int64 (two's complement), what int64 additions give.

    ``wrap_int64(2**63) == -(2**63)``; ``wrap_int64(-1) == -1``; ``wrap_int64(2**64 + 5) == 5``.
    """
    v = value % CHECKSUM_MODULUS
    return v - CHECKSUM_MODULUS if v >= CHECKSUM_MODULUS // 2 else v


def row_stats(df: DataFrame) -> tuple[int, int]:
    """``(rows, checksum)`` of ``df``'s ``row_id`` column (int64) in one Spark aggregation.

    The checksum is summed as ``decimal(38,0)``, exact up to ~10**19 rows of any int64
    (Spark 4's ANSI mode makes a ``long`` sum raise on overflow instead of wrapping), then
    wrapped once on the driver (:func:`wrap_int64`). Only one row reaches the driver; an
    empty ``df`` gives ``(0, 0)``.
    """
    from pyspark.sql import functions as F

    stats = df.agg(
        F.count(F.lit(1)).alias("rows"),
        F.sum(F.col("row_id").cast("decimal(38,0)")).alias("checksum"),
    ).first()
    if stats is None:
        return 0, 0
    return int(stats["rows"] or 0), wrap_int64(int(stats["checksum"] or 0))


@dataclass(frozen=True)
class Sharding:
    """What the driver side lays a split out for: ``world_size`` ranks reading
    ``per_device_batch_size`` rows a step each, from at least ``num_partitions`` Spark
    partitions (the multiple of the world size the job repartitions to)."""

    world_size: int
    num_partitions: int
    per_device_batch_size: int


@dataclass(frozen=True)
class ShardPlan:
    """How one split is read by ``world_size`` ranks. Plain data: it is sent to the ranks.

    Attributes:
        loader: the registered name of the loader that wrote the cache and reads it.
        cache_dir_url: the split's cache directory (``file://`` URL).
        dataset_size: rows in the split.
        checksum: int64 sum of ``row_id`` modulo 2**64 over every row of the split
            (:data:`CHECKSUM_MODULUS`, :func:`wrap_int64`).
        rows_per_shard: rows each rank reads per epoch (index = rank), padding included.
        checksum_per_shard: per-rank int64 row checksums (``row_id`` summed modulo 2**64)
            when a rank reads the same rows every epoch;
            None when the ranks' rows change every epoch: then only the all-reduced totals
            are checked.
        steps_per_epoch: batches per epoch, the same on every rank.
        per_device_batch_size: nominal images per rank per step (the largest batch).
        segment_dirs: the folders of the older segments of an entry that grew by appending
            (:meth:`Loader.append`), oldest first; ``cache_dir_url`` is the newest. Empty for
            an entry written whole.
        deletions_url: the entry's deletion list (:func:`write_deletions`): rows of older
            segments that the current version removed or replaced, which the readers skip
            (Petastorm) or mask as padding (Streaming); None when there is none.
        stored_rows: real rows stored in all segments, dead ones included (0: the same as
            ``dataset_size``): the dead share ``1 - dataset_size / stored_rows`` decides
            when the entry is written whole again (``cache.compact_dead_fraction``).
    """

    loader: str
    cache_dir_url: str
    dataset_size: int
    checksum: int
    rows_per_shard: list[int]
    checksum_per_shard: list[int] | None
    steps_per_epoch: int
    per_device_batch_size: int
    segment_dirs: list[str] = field(default_factory=list)
    deletions_url: str | None = None
    stored_rows: int = 0

    def batch_sizes(self, rank: int) -> list[int]:
        """Per-step batch sizes of ``rank``: ``steps_per_epoch`` numbers summing to its rows.

        Rank ``r`` splits its rows into batches of ``floor`` or ``ceil(rows_r /
        steps_per_epoch)`` rows, so no rank pads, drops or repeats a row.
        """
        q, r = divmod(self.rows_per_shard[rank], self.steps_per_epoch)
        return [q + 1] * r + [q] * (self.steps_per_epoch - r)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the ranks: ``loader.plan_type(**plan.to_dict())`` rebuilds it, with
        the loader the driver resolved (:attr:`Loader.plan_type`)."""
        return asdict(self)


SEGMENT_COLUMN = "segment"
"""The cache's column that names the segment a row was written in: the ``images`` Delta
version of the entry that wrote it (int64), the same for every row of one write."""
DELETIONS_FILE = "deletions.npy"
"""An appended entry's deletion list, in its data folder (:func:`write_deletions`)."""


@dataclass(frozen=True)
class Deletions:
    """The rows of older segments that are dead: a copy of ``row_ids[i]`` stored in a
    segment below ``before[i]`` is dead (removed from the split, or replaced by a newer copy
    in segment ``before[i]`` or later). The same idea as Delta's deletion vectors, keyed by
    row id and segment instead of by file and position.

    Attributes:
        row_ids: int64 ``[D]``, sorted, unique.
        before: int64 ``[D]``: the segment (``images`` version) from which copies are alive.
    """

    row_ids: Any
    before: Any

    def __len__(self) -> int:
        return len(self.row_ids)


def write_deletions(url: str, deletions: Deletions) -> int:
    """Store ``deletions`` at ``url`` as one ``.npy`` array int64 ``[2, D]`` (row ids, then
    segments), on a disk or an object store; its bytes (16 per row, plus a 128-byte header)."""
    import io

    import numpy as np

    from flowers_job.location import Location

    buf = io.BytesIO()
    np.save(buf, np.stack([deletions.row_ids, deletions.before]).astype(np.int64))
    Location.of(url).write_bytes(buf.getvalue())
    return len(buf.getvalue())


def read_deletions(url: str | None) -> Deletions | None:
    """The deletion list at ``url`` (None: none). Loaded without pickle.

    Raises:
        DataError: the file is not an int64 ``[2, D]`` array of sorted unique row ids.
    """
    if url is None:
        return None
    import io

    import numpy as np

    from flowers_job.location import Location

    try:
        array = np.load(io.BytesIO(Location.of(url).read_bytes()), allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"the loader cache's deletion list {url} cannot be read: {exc}") from exc
    ids = array[0] if array.ndim == 2 and len(array) == 2 else None
    # ids[1:] > ids[:-1], not np.diff: row ids span int64, and their differences overflow
    if array.dtype != np.int64 or ids is None or not (ids[1:] > ids[:-1]).all():
        raise DataError(
            f"the loader cache's deletion list {url} is not an int64 [2, D] array of sorted "
            "unique row ids; remove the cache entry so that it is written again"
        )
    return Deletions(array[0], array[1])


def live_mask(
    row_id: torch.Tensor, segment: torch.Tensor, deletions: Deletions | None
) -> torch.Tensor:
    """bool ``[B]``: which rows of a batch (``row_id`` and ``segment`` int64 ``[B]``) are
    alive under ``deletions`` (all of them when it is None). One ``searchsorted`` over the
    sorted row ids: ``O(B log D)``."""
    import torch

    if deletions is None or len(deletions) == 0:
        return torch.ones(len(row_id), dtype=torch.bool)
    ids = torch.as_tensor(deletions.row_ids)
    before = torch.as_tensor(deletions.before)
    at = torch.searchsorted(ids, row_id).clamp(max=len(ids) - 1)
    dead = (ids[at] == row_id) & (segment < before[at])
    return ~dead


class ShardReader(Protocol):
    """The rank side of a loader, as the training loop sees it: one iterator per epoch."""

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch, the same on every rank."""
        ...

    def epoch(self, epoch: int, start: EpochStart | None = None) -> Iterator[Batch]:
        """This rank's batches of ``epoch`` (1-based): exactly ``steps_per_epoch`` of them,
        or, from ``start`` (a mid-epoch checkpoint), the ``steps_per_epoch - start.step``
        that follow, the same batches an uninterrupted epoch yields there.

        Raises:
            ShardError: the loader yielded more or fewer batches or rows than planned, or
                could not reach ``start``.
        """
        ...

    def position(self) -> dict[str, Any]:
        """Plain data (ints, tensors) from which :meth:`epoch` continues after the batches
        this epoch has yielded so far (a mid-epoch checkpoint holds it)."""
        ...

    def close(self) -> None:
        """Release the reader's resources (processes, shared memory, lock files)."""
        ...


class Loader(ABC):
    """A data loader backend. Subclasses live in one module each and are registered by
    name in :data:`flowers_job.loaders.LOADERS`.

    The driver side is an instance (it may keep what it wrote until :meth:`release`); the
    rank side and the stack check are class methods (a rank has no driver state).
    """

    name: ClassVar[str]
    """The registered name, the value of ``data.loader``."""
    distribution: ClassVar[str]
    """The PyPI distribution that provides the backend."""
    module: ClassVar[str]
    """The module whose import proves the backend is usable."""
    extra: ClassVar[str]
    """The flowers-job extra that installs it, e.g. ``flowers-job[streaming]``."""
    plan_type: ClassVar[type[ShardPlan]] = ShardPlan
    """The plan this loader writes and reads."""
    classic_only: ClassVar[str | None] = None
    """The classic-Spark API this loader's driver side needs and a Spark Connect session
    lacks (as pyspark names it: ``pyspark.sql.DataFrame._jdf``, ``SparkContext``), or None: it
    runs on Connect as on classic Spark (:func:`flowers_job.loaders.check_session`). Set it
    from a real attempt on a Connect server, not from a guess."""

    reads_table: ClassVar[bool] = False
    """The ranks read the ``images`` table itself, at the planned version: the driver
    writes no cache and plans each split with :meth:`plan_table` instead of :meth:`write`."""

    def __init__(self, sharding: Sharding, source: str) -> None:
        """The driver side of one run: its splits laid out for ``sharding``. ``source``: the
        table the splits are read from, as its messages name it
        (:meth:`flowers_job.tables.table_ref.TableRef.describe`)."""
        self.sharding = sharding
        self.source = source

    # ---------------------------------------------------------------- the stack

    @classmethod
    def problem(cls) -> str | None:
        """Why this loader cannot run on this Python environment; None when it can.

        The base check: the distribution is installed and its module imports. Subclasses
        put their own version checks first (the reasons users can act on).
        """
        try:
            version = metadata.version(cls.distribution)
        except metadata.PackageNotFoundError:
            return f"{cls.distribution} is not installed (pip install '{cls.extra}')"
        try:
            cls.import_library()
        except Exception as exc:
            return (
                f"{cls.distribution} {version} is installed but `import {cls.module}` fails: "
                f"{type(exc).__name__}: {exc}"
            )
        return None

    @classmethod
    def auto_problem(cls, cfg: JobConfig, connect: str | None) -> str | None:
        """Why ``data.loader=auto`` passes this loader over for ``cfg`` on this session,
        though it can run here (:meth:`problem` is None); None: 'auto' may take it. A
        loader named in ``data.loader`` is not asked. The base: None."""
        del cfg, connect
        return None

    @classmethod
    def import_library(cls) -> ModuleType:
        """Import :attr:`module`, the way this loader's code imports its library."""
        return importlib.import_module(cls.module)

    # ---------------------------------------------------------------- driver side

    @abstractmethod
    def write(
        self, spark: SparkSession, df: DataFrame, cache_dir: Location, split: str
    ) -> ShardPlan:
        """Write ``df`` (``row_id`` long, ``image`` binary, ``label_index`` long) into this
        run's cache folder ``cache_dir`` and plan its shards.

        Raises:
            DataError: an empty split, unworkable shards, or no space left (naming the
                directory); the caller removes the run's cache folder.
        """

    def plan_table(
        self,
        rows: int,
        row_id_sum: int,
        table_url: str,
        version: int,
        split: str,
        model_key: str | None = None,
        views: list[str] | None = None,
    ) -> ShardPlan:
        """A :attr:`reads_table` loader's plan of ``split``, which holds ``rows`` rows whose
        ``row_id`` values sum to ``row_id_sum`` (exact; Spark counted them when it checked
        the tables) at Delta ``version`` of the table at ``table_url`` (its location, as
        ``DESCRIBE DETAIL`` gives it), which the ranks read; with ``model_key``, the
        ``embeddings`` table's rows of that key and ``views`` (features, not images).

        Raises:
            DataError: an empty split, or unworkable shards.
        """
        raise DataError(f"the {self.name} loader writes a cache: it does not read the table")

    def append(
        self,
        spark: SparkSession,
        base: ShardPlan,
        current: DataFrame,
        added: DataFrame,
        deletions: DataFrame,
        cache_dir: Location,
        split: str,
    ) -> ShardPlan:
        """Grow ``base`` (the plan of an older version's entry of the same lineage) to the
        current version: write ``added`` as a new segment under ``cache_dir`` (nothing when
        it is empty) and plan every segment together, skipping the dead rows.

        Args:
            base: the older entry's plan (its files stay where they are, read-only).
            current: the split's rows now (``row_id``, ``image``, ``label_index``,
                ``segment``): what the plan must read, every row once.
            added: the rows of ``current`` that ``base`` does not hold alive (new, or
                changed since), with ``segment`` = the current version.
            deletions: ``row_id`` long, ``before`` long: every row of ``base``'s segments
                that is dead (:class:`Deletions`; the caller stores the same list at the
                plan's ``deletions_url``).
            cache_dir: this entry's own folder.
            split: the split's name.

        Raises:
            DataError: the segments cannot be planned with this loader's guarantees (too
                uneven, or not holding ``current``'s rows); the caller then writes the
                split whole.
        """
        raise DataError(f"the {self.name} loader cannot append to a cache entry")

    def cache_settings(self, split: str) -> dict[str, Any]:
        """The settings that decide the bytes and the plan of ``split``'s cache: part of its
        key in the loader cache (:func:`flowers_job.loaders.cache_marker.entry_key`). The base: the
        world size, the partitions, the batch size and whether full batches are required."""
        return {**asdict(self.sharding), "full_batches": split == "train"}

    def release(self, cache_dir: Path | None) -> None:
        """The run ended: release what :meth:`write` holds beyond the cache folder's files,
        which the caller removes (``cache_dir``: the run's folder, None if not local)."""
        return None

    @classmethod
    def sweep(cls, cache_dir: Path) -> list[str]:
        """Remove what readers of ``cache_dir`` left on this host outside the folder (shared
        memory, lock files) after a run was killed; the names removed."""
        return []

    # ---------------------------------------------------------------- rank side

    places_ranks: ClassVar[bool] = False
    """:meth:`check_layout` can refuse a layout: the driver asks Spark where barrier mode
    places the ranks before any work (:func:`flowers_job.cluster.placement.check_placement`)."""

    @classmethod
    def check_layout(cls, layout: HostLayout) -> None:
        """Refuse a layout of ranks on hosts this loader cannot read with.

        Args:
            layout: the ranks' hosts (:func:`flowers_job.runtime.process_group.describe_hosts`).

        Raises:
            RuntimeError: naming the loader and what it needs.
        """
        return None

    @classmethod
    def mid_epoch_problem(cls, settings: LoadersConfig) -> str | None:
        """Why this loader, so configured, cannot continue an epoch exactly from a mid-epoch
        checkpoint (the epoch then restarts from its beginning); None when it can."""
        return None

    @classmethod
    def memory_settings(cls, settings: LoadersConfig) -> dict[str, str]:
        """This loader's settings that decide a rank's memory, by their dotted names, with
        their values (as text): what an out-of-memory report names
        (:func:`flowers_job.runtime.watchdog.memory_settings`). None here."""
        return {}

    # Arguments: the loader interface's rank-side call: the shard's place (rank, world_size,
    # num_nodes) and its read options, keyword-only.
    @classmethod
    @abstractmethod
    def open(  # noqa: PLR0913
        cls,
        plan: ShardPlan,
        transform: DecodeTransform,
        *,
        rank: int,
        world_size: int,
        num_nodes: int,
        shuffle: bool,
        seed: int,
        settings: LoadersConfig,
        workers: int,
        pin_memory: bool = False,
    ) -> ShardReader:
        """This rank's reader of ``plan``.

        Args:
            plan: the split's plan, from the driver.
            transform: decodes (and for training augments) one stored image.
            rank: the shard this process reads (:attr:`~flowers_job.runtime.layout.HostLayout.shard`:
                its global rank where the ranks are consecutive on each host);
            world_size: number of ranks (shards); num_nodes: hosts the ranks run on.
            shuffle: a new order every epoch (training) or the stored order.
            seed: the order of epoch ``e`` is a function of ``(seed, e)``.
            settings: the ``loaders`` section (the loader reads its own part).
            workers: decoding processes (``data.loader_workers``; 0: the loader's own
                thread).
            pin_memory: page-locked batches, for asynchronous copies to a CUDA device.
        """


def rebatch(batches: Iterable[Batch], sizes: list[int]) -> Iterator[Batch]:
    """Re-cut a stream of batches into batches of exactly ``sizes``. A batch that holds the
    next batch's rows is sliced (views, no copy); only batches spanning two incoming ones
    are concatenated.

    Raises:
        ShardError: the stream holds fewer or more rows than ``sum(sizes)``.
    """
    import torch

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


def check_batch_fits(
    rows: list[int], per_device_batch_size: int, world_size: int, split: str, full_batches: bool
) -> None:
    """With ``full_batches``, require every shard to hold at least one full batch.

    A rank with fewer rows than ``per_device_batch_size`` would take smaller optimizer steps
    than configured, every step of every epoch. Validation needs no such thing (its sums are
    exact whatever the batches), so it passes ``full_batches=False``.

    Raises:
        DataError: naming ``train.per_device_batch_size``, the global batch size,
            ``world_size`` and the rows per shard, and the largest batch that would work.
    """
    if full_batches and min(rows) < per_device_batch_size:
        raise DataError(
            f"train.per_device_batch_size={per_device_batch_size} (global batch size "
            f"{per_device_batch_size * world_size} over world_size {world_size}) is larger than "
            f"the smallest {split} shard: rows per shard {rows}; every rank needs at least one "
            f"full batch per epoch: set train.per_device_batch_size <= {min(rows)}, or fewer "
            "distributed.num_processes, or train on more images"
        )


def local_dir(url: str) -> Path | None:
    """The local (or FUSE-mounted) directory of a ``file://`` URL or plain path; None for
    any other scheme (object stores)."""
    parsed = urlparse(url)
    return Path(parsed.path) if parsed.scheme in ("file", "") else None
