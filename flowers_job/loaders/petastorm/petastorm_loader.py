"""Petastorm (``data.loader=petastorm``): both sides of the loader.

**Driver side.** Petastorm shards by row group: shard ``r`` of ``world_size`` reads the row
groups whose index ``i`` satisfies ``i % world_size == r`` (petastorm
``Reader._partition_row_groups``). Its own ``make_spark_converter`` cuts each partition into
row groups of ~32 MB, so a 50 MB partition gave rank 0 a 32 MB group and rank 1 an 18 MB one,
and shards drifted apart as data grew (36,700 rows: train shards [14353, 11333]). So Spark
writes the cache itself (:func:`write_balanced`): ``num_partitions`` grows with the images'
bytes (a multiple of ``world_size``, at least ``cfg.num_partitions``, <= ~64 MB each), every
partition holds ``floor`` or ``ceil(N / num_partitions)`` rows (:func:`balance`, no global
sort), one row group per file (checked in the footers), uncompressed (the images are JPEG
already): ranks' shards differ by one row at most. :func:`plan_shards` takes each shard's
rows and int64 row checksum from metadata (footers via Petastorm's own row-group listing, a
Spark aggregation of ``row_id`` per file) and fixes ``steps_per_epoch`` so that every rank
runs the same number of steps and reads every row of its shard once per epoch.

**An entry grown by appending** (:meth:`PetastormLoader.append`): the older files and the new
segment's, planned together with each file's dead rows subtracted; the ranks drop the
deletion list's dead rows before the re-cut (:func:`live_rows`).

**Rank side.** :class:`PetastormReader` reads shard ``rank`` of ``world_size``; a
``TransformSpec`` decodes and augments in the loader; Petastorm's ``BatchedDataLoader``
assembles batches from whole row groups as arrays (its row-by-row ``DataLoader`` is not
used), and :func:`rebatch` re-cuts them to :meth:`ShardPlan.batch_sizes`. No padding: every
``valid`` is True.

**Nothing of the cache is unpickled.** Petastorm's readers unpickle a ``Unischema`` from the
``dataset-toolkit.unischema.v1`` key of a dataset's ``_common_metadata`` (or ``_metadata``)
file (``petastorm.etl.dataset_metadata.get_schema``, whose "restricted" unpickler still
allows ``builtins.exec``); ``make_batch_reader`` tries that first, then infers the schema from
Arrow. pyarrow's legacy ``ParquetDataset`` reads those files only when it is given a
directory; given a list of files, it reads only their footers, and Petastorm infers the
schema from Arrow (``Unischema.from_arrow_schema``). So the ranks open only a plan's own list
of Parquet files, and :func:`check_cache_files` refuses a plan that names a directory, a
file outside its cache folder or a file that is not a Spark ``part-*.parquet`` before
Petastorm sees it: a cache folder on a shared path (``/dbfs/tmp``, which Petastorm's docs
suggest) cannot run code in the job, whatever was planted in it.

The stack: Petastorm 0.13.1, its latest release, reads with pyarrow's legacy
``ParquetDataset`` (removed in pyarrow 15), imports ``pyarrow.hdfs``/``pyarrow.filesystem``
(removed in 16) and uses ``np.unicode_`` (removed in NumPy 2). It runs on the local pinned
stack and on Databricks Runtime ML up to 15.4 LTS, and on nothing newer
(docs/architecture.md, the stack). Its ``'thread'`` reader pool can end a shard early
(docs/known-issues.md, "Petastorm"): only ``'dummy'`` and ``'process'`` are offered.
"""

from __future__ import annotations

import copy
import logging
import math
import re
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from packaging.version import Version

from flowers_job.errors import DataError, ShardError
from flowers_job.loaders.base import (
    SEGMENT_COLUMN,
    Batch,
    Deletions,
    Loader,
    ShardPlan,
    check_batch_fits,
    live_mask,
    local_dir,
    read_deletions,
    rebatch,
    wrap_int64,
)
from flowers_job.loaders.petastorm import balanced
from flowers_job.loaders.petastorm.balanced import (
    ROW_GROUP_LIMIT_BYTES,
    ParquetCache,
    balance,
    cache_partitions,
    partition_counts,
    partition_keys,
    url_path,
)
from flowers_job.loaders.petastorm.pyarrow_fs import legacy_filesystem
from flowers_job.loaders.position import CursorReader, EpochCursor, EpochStart, epoch_seed
from flowers_job.location import Location

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from flowers_job.config import JobConfig
    from flowers_job.vision.decode_transform import DecodeTransform

__all__ = [
    "CACHE_FILE_PATTERN",
    "ParquetCache",
    "PetastormLoader",
    "PetastormPlan",
    "PetastormReader",
    "balance",
    "cache_partitions",
    "check_cache_files",
    "footer_rows",
    "live_rows",
    "partition_counts",
    "partition_keys",
    "plan_shards",
    "quiet_petastorm",
    "rebatch",
    "shard_batches",
    "write_balanced",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PetastormPlan(ShardPlan):
    """A :class:`ShardPlan` plus the cache's Parquet files, in Petastorm's order, the
    bytes of the split's largest image (the row width of undecoded batches), and each
    file's rows and int64 row checksum as written (dead rows included: an appended entry's
    plan subtracts them)."""

    file_urls: list[str] = field(default_factory=list)
    max_image_bytes: int = 0
    file_checksums: list[list[int]] = field(default_factory=list)


def quiet_petastorm() -> None:
    """Silence Petastorm's per-reader INFO lines, the deprecations its own code triggers
    (pyarrow's legacy file systems, distutils' ``LooseVersion``), and the warning torch gives
    when ``BatchedDataLoader`` wraps Arrow's read-only arrays (the batches are never written
    to: normalisation makes a new tensor)."""
    for name in ("petastorm", "petastorm.etl.dataset_metadata", "petastorm.reader"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"petastorm(\..*)?")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"pyarrow(\..*)?")
    warnings.filterwarnings(
        "ignore", message="The given NumPy array is not writable", category=UserWarning
    )


def _version(dist: str) -> Version | None:
    try:
        return Version(metadata.version(dist))
    except metadata.PackageNotFoundError:
        return None


class PetastormLoader(Loader):
    """Balanced Parquet written by Spark on the driver, Petastorm's sharded reader on the
    ranks."""

    name = "petastorm"
    distribution = "petastorm"
    module = "petastorm.spark"
    extra = "flowers-job[petastorm]"
    plan_type = PetastormPlan

    @classmethod
    def problem(cls) -> str | None:
        """pyarrow and NumPy first (installing petastorm would not help), then the install."""
        version, pyarrow, numpy = _version("petastorm"), _version("pyarrow"), _version("numpy")
        name = f"petastorm {version}" if version else "petastorm (0.13.1, its latest release)"
        if pyarrow is not None and pyarrow >= Version("15"):
            return (
                f"{name} cannot run with pyarrow {pyarrow}: it reads with pyarrow's legacy "
                "ParquetDataset (removed in pyarrow 15) and imports pyarrow.hdfs and "
                "pyarrow.filesystem (removed in 16); it needs pyarrow < 15"
            )
        if numpy is not None and numpy >= Version("2"):
            return (
                f"{name} cannot run with numpy {numpy}: it uses np.unicode_, removed in "
                "NumPy 2; it needs numpy < 2"
            )
        return super().problem()

    @classmethod
    def import_library(cls) -> ModuleType:
        """Import ``petastorm.spark`` with :func:`quiet_petastorm` in force: its import alone
        uses pyarrow's deprecated ``LocalFileSystem``, a FutureWarning on every run."""
        quiet_petastorm()
        return super().import_library()

    @classmethod
    def mid_epoch_problem(cls, cfg: JobConfig) -> str | None:
        """The 'process' reader pool decodes and augments in its own processes, with their
        own random state, and hands row groups back in the order they finish: a replayed
        epoch would not repeat its batches."""
        if cfg.loaders.petastorm.reader_pool_type == "process":
            return (
                "loaders.petastorm.reader_pool_type='process' augments in its own processes and "
                "returns row groups in the order they finish, which a replay does not repeat"
            )
        return None

    def write(self, spark: SparkSession, df: DataFrame, cache_url: str, split: str) -> ShardPlan:
        """Write ``df`` as balanced Parquet partitions under ``<cache_url>/petastorm-<split>``
        (:func:`write_balanced`) and plan its shards from the files' metadata
        (:func:`plan_shards`): row group ``i`` -> rank ``i % world_size``.

        Raises:
            DataError: an empty split, unworkable shards (:func:`plan_shards`), a cache that
                does not hold the rows as written, or the volume filling up during the write
                (naming the directory).
        """
        cfg = self.cfg
        quiet_petastorm()
        out_url = f"{cache_url.rstrip('/')}/petastorm-{split}"
        t0 = time.perf_counter()
        cache = write_balanced(
            spark,
            df,
            out_url,
            world_size=cfg.world_size,
            min_partitions=cfg.num_partitions,
            what=f"the {split} split of {self.source}",
        )
        t1 = time.perf_counter()
        rows, checksum, steps = plan_shards(
            cache.file_urls,
            cache.file_checksums,
            cfg.world_size,
            cfg.train.per_device_batch_size,
            full_batches=split == "train",
            split=split,
        )
        log.info(
            "%s: %d rows (%.1f MB of images) in %d partitions, rows per shard %s, "
            "%d steps per epoch; written and summed in %.1f s, planned in %.2f s",
            split,
            cache.rows,
            cache.image_bytes / 1e6,
            len(cache.file_urls),
            rows,
            steps,
            t1 - t0,
            time.perf_counter() - t1,
        )
        return PetastormPlan(
            loader=self.name,
            cache_dir_url=out_url,
            dataset_size=cache.rows,
            checksum=wrap_int64(sum(checksum)),
            rows_per_shard=rows,
            checksum_per_shard=checksum,
            steps_per_epoch=steps,
            per_device_batch_size=cfg.train.per_device_batch_size,
            file_urls=cache.file_urls,
            max_image_bytes=cache.max_image_bytes,
            file_checksums=[list(c) for c in cache.file_checksums],
        )

    def append(
        self,
        spark: SparkSession,
        base: ShardPlan,
        current: DataFrame,
        added: DataFrame,
        deletions: DataFrame,
        cache_url: str,
        split: str,
    ) -> ShardPlan:
        """``base``'s files, then ``added`` written as balanced Parquet under
        ``<cache_url>/petastorm-<split>`` (:func:`write_balanced`, as many files as ranks at
        least), planned together: each file's rows and checksum less its dead rows (one
        Spark aggregation of the ``row_id`` and ``segment`` columns of every file against
        ``deletions``), Petastorm's shard rule over all files (:func:`plan_shards`). The
        ranks skip the dead rows (:func:`~flowers_job.loaders.base.live_mask`).

        Raises:
            DataError: shards too uneven to plan, or files whose live rows are not
                ``current``'s (count and checksum).
        """
        from pyspark.sql import functions as F

        from flowers_job.loaders.base import row_stats

        assert isinstance(base, PetastormPlan), base
        cfg = self.cfg
        quiet_petastorm()
        if not base.file_checksums:
            raise DataError("the older entry's plan has no per-file checksums")
        files = list(base.file_urls)
        raw = [tuple(c) for c in base.file_checksums]
        out_url = f"{cache_url.rstrip('/')}/petastorm-{split}"
        max_bytes = base.max_image_bytes
        segment_dirs = list(base.segment_dirs)
        if not added.isEmpty():
            cache = write_balanced(
                spark,
                added,
                out_url,
                world_size=cfg.world_size,
                min_partitions=cfg.world_size,
                what=f"the rows added to the {split} split of {self.source}",
            )
            files += cache.file_urls
            raw += cache.file_checksums
            max_bytes = max(max_bytes, cache.max_image_bytes)
            segment_dirs.append(base.cache_dir_url)
        else:
            out_url = base.cache_dir_url
        dead = {
            url_path(str(r["f"])): (int(r["n"]), int(r["s"]))
            for r in spark.read.parquet(*files)
            .select("row_id", SEGMENT_COLUMN, F.input_file_name().alias("f"))
            .join(deletions, "row_id")
            .where(F.col(SEGMENT_COLUMN) < F.col("before"))
            .groupBy("f")
            .agg(
                F.count(F.lit(1)).alias("n"),
                F.sum(F.col("row_id").cast("decimal(38,0)")).alias("s"),
            )
            .collect()
        }
        live = []
        for url, (n, total) in zip(files, raw, strict=True):
            dn, ds = dead.get(url_path(url), (0, 0))
            live.append((n - dn, wrap_int64(total - ds)))
        rows, checksum, steps = plan_shards(
            files,
            live,
            cfg.world_size,
            cfg.train.per_device_batch_size,
            full_batches=split == "train",
            split=split,
        )
        expected = row_stats(current)
        if (sum(rows), wrap_int64(sum(checksum))) != expected:
            raise DataError(
                f"the {split} split's segments hold {sum(rows)} live rows (checksum "
                f"{wrap_int64(sum(checksum))}), the table {expected[0]} ({expected[1]})"
            )
        return PetastormPlan(
            loader=self.name,
            cache_dir_url=out_url,
            dataset_size=sum(rows),
            checksum=wrap_int64(sum(checksum)),
            rows_per_shard=rows,
            checksum_per_shard=checksum,
            steps_per_epoch=steps,
            per_device_batch_size=cfg.train.per_device_batch_size,
            segment_dirs=segment_dirs,
            file_urls=files,
            max_image_bytes=max_bytes,
            file_checksums=[list(c) for c in raw],
        )

    def cache_settings(self, split: str) -> dict[str, Any]:
        """The base's, and the plan's format: 2 since plans hold ``max_image_bytes``, 3
        since they hold each file's checksum and the segments."""
        return {**super().cache_settings(split), "plan_format": 3}

    @classmethod
    def open(
        cls,
        plan: ShardPlan,
        transform: DecodeTransform,
        *,
        rank: int,
        world_size: int,
        num_nodes: int,
        shuffle: bool,
        seed: int,
        cfg: JobConfig,
        pin_memory: bool = False,
    ) -> PetastormReader:
        quiet_petastorm()
        assert isinstance(plan, PetastormPlan), plan
        if transform.undecoded:  # rows as wide as the split's largest image (plan_format 2)
            transform = copy.copy(transform)
            transform.jpeg_width = plan.max_image_bytes
        settings = cfg.loaders.petastorm
        return PetastormReader(
            plan,
            rank,
            world_size,
            transform,
            shuffle=shuffle,
            seed=seed,
            reader_pool_type=settings.reader_pool_type,
            shuffle_buffer_rows=settings.shuffle_buffer_rows,
            workers_count=cfg.data.loader_workers or 1,
            pin_memory=pin_memory,
            deletions=read_deletions(plan.deletions_url),
        )


def write_balanced(
    spark: SparkSession,
    df: DataFrame,
    out_url: str,
    *,
    world_size: int,
    min_partitions: int,
    what: str,
) -> ParquetCache:
    """:func:`flowers_job.loaders.petastorm.balanced.write_balanced` with this module's
    :func:`footer_rows` (Petastorm's file systems read the footers)."""
    return balanced.write_balanced(
        spark,
        df,
        out_url,
        world_size=world_size,
        min_partitions=min_partitions,
        what=what,
        footer_rows=footer_rows,
    )


def footer_rows(file_urls: list[str]) -> list[int]:
    """Rows of each Parquet file, from its footer.

    Raises:
        DataError: a file holds several row groups (Petastorm would shard it by row group,
            and the per-file checksums would not describe its shards).
    """
    import pyarrow.parquet as pq
    from petastorm.fs_utils import get_filesystem_and_path_or_paths

    fs, paths = get_filesystem_and_path_or_paths(file_urls, filesystem=legacy_filesystem(file_urls))
    rows = []
    for url, path in zip(file_urls, paths, strict=True):
        with fs.open(path, "rb") as f:
            meta = pq.ParquetFile(f).metadata
        if meta.num_row_groups != 1:
            raise DataError(
                f"{url} holds {meta.num_row_groups} Parquet row groups; the Petastorm cache "
                f"writes one per file (parquet.block.size={ROW_GROUP_LIMIT_BYTES}), and "
                "Parquet's writer cuts row groups smaller when the executor's heap is short: "
                "give the executors more memory"
            )
        rows.append(meta.num_rows)
    return rows


def plan_shards(
    file_urls: list[str],
    file_checksums: list[tuple[int, int]],
    world_size: int,
    per_device_batch_size: int,
    *,
    full_batches: bool = False,
    split: str = "train",
) -> tuple[list[int], list[int], int]:
    """Rows and row checksum per Petastorm shard, and the common steps per epoch, from
    metadata only (no row is read here).

    Uses Petastorm's own row-group listing (``load_row_groups``, which reads the footers)
    and its shard rule (row group ``i`` goes to shard ``i % world_size``).

    Args:
        file_urls: the split's Parquet files (``file://`` URLs), one row group each.
        file_checksums: per file, ``(rows, int64 row_id sum mod 2**64)``
            (:attr:`ParquetCache.file_checksums`).
        world_size: number of ranks (shards).
        per_device_batch_size: images per rank per step.
        full_batches: require every shard to hold at least one full batch, as training does
            (:func:`~flowers_job.loaders.base.check_batch_fits`).
        split: the split's name, for messages.

    Returns:
        ``(rows_per_shard, checksum_per_shard, steps_per_epoch)``; checksums are int64.

    Raises:
        DataError: fewer row groups than ranks; a file with several row groups; with
            ``full_batches``, a shard smaller than ``per_device_batch_size``; or shards so
            uneven that the smallest cannot fill ``steps_per_epoch`` batches.
    """
    import pyarrow.parquet as pq
    from petastorm.etl.dataset_metadata import load_row_groups
    from petastorm.fs_utils import get_filesystem_and_path_or_paths

    fs, paths = get_filesystem_and_path_or_paths(file_urls, filesystem=legacy_filesystem(file_urls))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # pyarrow's legacy dataset API
        dataset = pq.ParquetDataset(paths, filesystem=fs, validate_schema=False)
        pieces = load_row_groups(dataset)
    if len(pieces) < world_size:
        raise DataError(
            f"{len(pieces)} Parquet row groups for {world_size} ranks: Petastorm needs at least "
            "one row group per rank; raise data.partitions_per_process"
        )
    by_path = {url_path(p): c for p, c in zip(paths, file_checksums, strict=True)}
    if len(pieces) != len(by_path):
        raise DataError(
            f"{len(pieces)} Parquet row groups in {len(by_path)} files: the shards are planned "
            "from per-file checksums, which needs one row group per file"
        )
    rows = [0] * world_size
    checksum = [0] * world_size
    for i, piece in enumerate(pieces):
        n, s = by_path[url_path(piece.path)]
        rows[i % world_size] += n
        checksum[i % world_size] = wrap_int64(checksum[i % world_size] + s)
    check_batch_fits(rows, per_device_batch_size, world_size, split, full_batches)
    steps = max(math.ceil(n / per_device_batch_size) for n in rows)
    if min(rows) < steps:
        raise DataError(
            f"uneven shards {rows}: the smallest cannot fill {steps} steps of at most "
            f"{per_device_batch_size} images; raise data.partitions_per_process or "
            "lower train.per_device_batch_size"
        )
    return rows, checksum, steps


CACHE_FILE_PATTERN = re.compile(r"part-[0-9]+[^/]*\.parquet")
"""The name of a file of a Petastorm cache: Spark's ``part-<partition>-<uuid>-c000.parquet``."""


def check_cache_files(plan: PetastormPlan) -> None:
    """Refuse a plan whose files Petastorm could read a pickle from, before it opens them.

    Every entry of ``plan.file_urls`` must be a ``part-*.parquet`` file
    (:data:`CACHE_FILE_PATTERN`) directly inside ``plan.cache_dir_url`` or one of its
    ``segment_dirs``, named once; a local
    one must be a regular file (a directory, or a link to one, would make pyarrow read its
    ``_common_metadata`` and Petastorm unpickle its schema from it), and an object-store
    one an object (one ``HEAD`` each: entries are reused on object stores too).

    Raises:
        DataError: no files, or a file that breaks these rules, naming it and the folder.
    """
    folders = {url_path(u).rstrip("/") for u in [plan.cache_dir_url, *plan.segment_dirs]}
    if not plan.file_urls:
        raise DataError(f"the Petastorm plan of {plan.cache_dir_url} names no Parquet files")
    seen: set[str] = set()
    for url in plan.file_urls:
        problem = _cache_file_problem(url, folders, seen)
        if problem:
            raise DataError(
                f"the Petastorm cache's plan names {url}, which {problem}: the ranks open only "
                "the plan's own Parquet files (Petastorm would unpickle a schema from the "
                "metadata file of a folder); remove the cache entry so that it is written again"
            )
        seen.add(url_path(url))


def _cache_file_problem(url: str, folders: set[str], seen: set[str]) -> str | None:
    """What is wrong with ``url`` as a file of one of the cache folders ``folders`` (paths:
    the plan's and its older segments'), or None."""
    path = url_path(url)
    parent, _, name = path.rpartition("/")
    if not CACHE_FILE_PATTERN.fullmatch(name):
        return "is not a Parquet file of the cache (part-*.parquet)"
    if parent.rstrip("/") not in folders:
        return f"lies outside the cache folders {sorted(folders)}"
    if path in seen:
        return "is named twice"
    local = local_dir(url)
    if not (local.is_file() if local is not None else Location.of(url).is_file()):
        return "is not a regular file"
    return None


def transform_spec(transform: DecodeTransform) -> Any:
    """The Petastorm ``TransformSpec`` that decodes a pandas batch's ``image`` column with
    ``transform``: uint8 ``[3, S, S]`` per row, C-contiguous (docs/known-issues.md,
    "Petastorm"); undecoded, ``jpeg`` uint8 ``[jpeg_width]`` and ``jpeg_length`` int64 rows
    instead of ``image``."""
    from petastorm import TransformSpec

    from flowers_job.vision.batch_decode import JPEG_KEY, LENGTH_KEY

    if transform.undecoded:  # Petastorm stacks rows of one width: the plan's widest image
        width = (transform.jpeg_width,)
        edits = [(JPEG_KEY, np.uint8, width, False), (LENGTH_KEY, np.int64, (), False)]
        return TransformSpec(transform, edit_fields=edits, removed_fields=["image"])
    shape = (3, transform.image_size, transform.image_size)
    return TransformSpec(transform, edit_fields=[("image", np.uint8, shape, False)])


def shard_batches(
    plan: PetastormPlan,
    rank: int,
    world_size: int,
    transform: DecodeTransform,
    *,
    shuffle: bool,
    seed: int,
    reader_pool_type: str = "dummy",
    shuffle_buffer_rows: int = 0,
    workers_count: int = 1,
    deletions: Deletions | None = None,
) -> Iterator[Batch]:
    """One epoch of this rank's shard: ``plan.steps_per_epoch`` batches, without the rows
    of ``deletions`` (an appended entry's dead rows: :func:`live_rows`).

    Each batch: ``image`` uint8 ``[B, 3, S, S]``, ``label_index`` int64 ``[B]``,
    ``row_id`` int64 ``[B]``, with ``B`` from ``plan.batch_sizes(rank)``. Petastorm's
    ``BatchedDataLoader`` assembles them from whole row groups (array slices and one gather
    when shuffling, no per-row Python); ``workers_count`` decoding processes with
    ``reader_pool_type='process'`` (the 'dummy' pool decodes in this thread).

    Raises:
        DataError: the plan names a file that is not its own (:func:`check_cache_files`).
        ShardError: the shard yielded a different number of rows than planned (for
            example Petastorm's thread pool ending a shard early, docs/known-issues.md).
    """
    from petastorm.pytorch import BatchedDataLoader
    from petastorm.spark.spark_dataset_converter import SparkDatasetConverter

    check_cache_files(plan)  # a list of files: Petastorm then unpickles nothing
    converter = SparkDatasetConverter(plan.cache_dir_url, plan.file_urls, plan.dataset_size)
    with converter.make_torch_dataloader(
        batch_size=plan.per_device_batch_size,
        num_epochs=1,
        cur_shard=rank,
        shard_count=world_size,
        transform_spec=transform_spec(transform),
        data_loader_fn=BatchedDataLoader,
        reader_pool_type=reader_pool_type,
        workers_count=max(1, workers_count),
        shuffling_queue_capacity=shuffle_buffer_rows if shuffle else 0,
        shuffle_row_groups=shuffle,
        shuffle_rows=shuffle,
        seed=seed,
        filesystem=legacy_filesystem(plan.file_urls),
    ) as loader:
        yield from rebatch(live_rows(loader, deletions), plan.batch_sizes(rank))


def live_rows(batches: Iterable[Batch], deletions: Deletions | None) -> Iterator[Batch]:
    """``batches`` without their ``segment`` column and without the rows ``deletions``
    marks dead (:func:`~flowers_job.loaders.base.live_mask`); batches left empty are
    dropped.

    Raises:
        ShardError: there are deletions and the cache's rows carry no segment.
    """
    for read in batches:
        segment = read.pop(SEGMENT_COLUMN, None)
        batch = read
        if deletions is not None and len(deletions):
            if segment is None:
                raise ShardError("the cache has a deletion list but its rows no segment column")
            keep = live_mask(read["row_id"], segment, deletions)
            if not bool(keep.all()):
                batch = {k: v[keep] for k, v in read.items()}
        if len(batch["row_id"]):
            yield batch


@dataclass
class PetastormReader(CursorReader):
    """Petastorm: shard ``rank`` of ``world_size``, re-cut to the plan's batch sizes.

    Shuffling (``shuffle=True``): row groups and rows within them are shuffled by
    Petastorm with ``seed + epoch``; its shuffling buffer and the augmentation draw from
    torch's global generator, which is seeded from ``(seed, epoch, rank)`` before each
    epoch, so the order of an epoch is the same whenever it is run (with the 'dummy' reader
    pool). ``pin_memory`` (CUDA): each batch is copied into page-locked memory, so that the
    host-to-device copy can run asynchronously (``non_blocking=True``).
    """

    plan: PetastormPlan
    rank: int
    world_size: int
    transform: DecodeTransform
    shuffle: bool
    seed: int
    reader_pool_type: str = "dummy"
    shuffle_buffer_rows: int = 0
    workers_count: int = 1
    pin_memory: bool = False
    deletions: Deletions | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self.plan.steps_per_epoch

    def epoch(self, epoch: int, start: EpochStart | None = None) -> Iterator[Batch]:
        """The epoch's batches (:meth:`ShardReader.epoch`); from a mid-epoch ``start``, the
        first ``start.step`` batches are read again and dropped (:meth:`EpochCursor.replay`:
        Petastorm cannot seek into a shuffled epoch), which costs their decoding and
        augmentation (benchmarks/README.md)."""
        # the shuffling buffer and the augmentation draw from the loader's own stream
        self._cursor = cursor = EpochCursor(epoch_seed(self.seed, epoch, self.rank))
        batches = cursor.wrap(
            lambda: shard_batches(
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
                deletions=self.deletions,
            )
        )
        if start is not None:
            cursor.replay(batches, start, self.rank)
        for batch in batches:
            batch["valid"] = torch.ones(len(batch["row_id"]), dtype=torch.bool)
            yield {k: v.pin_memory() for k, v in batch.items()} if self.pin_memory else batch

    def close(self) -> None:
        pass
