"""Petastorm (``data.loader=petastorm``): the loader, both sides behind
:class:`~flowers_job.loaders.base.Loader`.

The driver writes the cache (:mod:`~flowers_job.loaders.petastorm.cache_write`, balanced by
:mod:`~flowers_job.loaders.petastorm.balanced`) and plans its shards
(:mod:`~flowers_job.loaders.petastorm.plan`); the ranks read them
(:mod:`~flowers_job.loaders.petastorm.reader`), opening only the files a plan may name
(:mod:`~flowers_job.loaders.petastorm.cache_files`).

The stack: Petastorm 0.13.1, its latest release, reads with pyarrow's legacy
``ParquetDataset`` (removed in pyarrow 15), imports ``pyarrow.hdfs``/``pyarrow.filesystem``
(removed in 16) and uses ``np.unicode_`` (removed in NumPy 2). It runs on the local pinned
stack and on Databricks Runtime ML up to 15.4 LTS, and on nothing newer
(docs/architecture.md, the stack). Its ``'thread'`` reader pool can end a shard early
(docs/known-issues.md, "Petastorm"): only ``'dummy'`` and ``'process'`` are offered.
"""

from __future__ import annotations

import copy
from importlib import metadata
from types import ModuleType
from typing import TYPE_CHECKING, Any

from packaging.version import Version

from flowers_job.loaders.base import Loader, ShardPlan, read_deletions
from flowers_job.loaders.petastorm.cache_write import append_cache, write_cache
from flowers_job.loaders.petastorm.logs import quiet_petastorm
from flowers_job.loaders.petastorm.plan import PetastormPlan
from flowers_job.loaders.petastorm.reader import PetastormReader

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from flowers_job.config import LoadersConfig
    from flowers_job.location import Location
    from flowers_job.vision.decode_transform import DecodeTransform

__all__ = ["PetastormLoader"]


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
    def memory_settings(cls, settings: LoadersConfig) -> dict[str, str]:
        """The shuffling buffer: rows each reader holds decoded to draw from."""
        return {
            "loaders.petastorm.shuffle_buffer_rows": str(settings.petastorm.shuffle_buffer_rows)
        }

    @classmethod
    def mid_epoch_problem(cls, settings: LoadersConfig) -> str | None:
        """The 'process' reader pool decodes and augments in its own processes, with their
        own random state, and hands row groups back in the order they finish: a replayed
        epoch would not repeat its batches."""
        if settings.petastorm.reader_pool_type == "process":
            return (
                "loaders.petastorm.reader_pool_type='process' augments in its own processes and "
                "returns row groups in the order they finish, which a replay does not repeat"
            )
        return None

    def write(
        self, spark: SparkSession, df: DataFrame, cache_dir: Location, split: str
    ) -> ShardPlan:
        """:func:`~flowers_job.loaders.petastorm.cache_write.write_cache`: balanced Parquet
        under ``<cache_dir>/petastorm-<split>``, its shards planned from the files' metadata."""
        return write_cache(
            spark,
            df,
            cache_dir,
            split,
            world_size=self.sharding.world_size,
            min_partitions=self.sharding.num_partitions,
            per_device_batch_size=self.sharding.per_device_batch_size,
            source=self.source,
        )

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
        """:func:`~flowers_job.loaders.petastorm.cache_write.append_cache`: ``base``'s files
        and ``added``'s, planned together less their dead rows."""
        return append_cache(
            spark,
            base,
            current,
            added,
            deletions,
            cache_dir,
            split,
            world_size=self.sharding.world_size,
            per_device_batch_size=self.sharding.per_device_batch_size,
            source=self.source,
        )

    def cache_settings(self, split: str) -> dict[str, Any]:
        """The base's, and the plan's format: 2 since plans hold ``max_image_bytes``, 3
        since they hold each file's checksum and the segments."""
        return {**super().cache_settings(split), "plan_format": 3}

    # Arguments: the loader interface's calls (Loader.open, Loader.append): their arguments are the
    # interface's.
    @classmethod
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
    ) -> PetastormReader:
        quiet_petastorm()
        assert isinstance(plan, PetastormPlan), plan
        if transform.undecoded:  # rows as wide as the split's largest image (plan_format 2)
            transform = copy.copy(transform)
            transform.jpeg_width = plan.max_image_bytes
        petastorm = settings.petastorm
        return PetastormReader(
            plan,
            rank,
            world_size,
            transform,
            shuffle=shuffle,
            seed=seed,
            reader_pool_type=petastorm.reader_pool_type,
            shuffle_buffer_rows=petastorm.shuffle_buffer_rows,
            workers_count=workers or 1,
            pin_memory=pin_memory,
            deletions=read_deletions(plan.deletions_url),
        )
