"""The Delta loader (``data.loader=delta``): no cache; the ranks read the ``images`` table.

**Driver side.** :meth:`DeltaLoader.plan_table` takes a split's rows and their checksum
at the checked version from the table check's one Spark aggregation over every split,
checks that delta-rs reads the same live rows from the log (so that a table it cannot read
is refused before any rank starts), and plans who reads how many: the split's
rows in ``world_size`` contiguous, balanced ranges (:mod:`flowers_job.loaders.delta.order`),
``ceil(largest / per_device_batch_size)`` steps for every rank. Nothing is written: a run's
preparation costs a read of the log, whatever the table's size, and a new version costs
nothing more than an old one.

**Rank side.** :class:`~flowers_job.loaders.delta.file_reader.DeltaReader` reads the table's
log at the plan's version with delta-rs, checks that the split's live rows are the
planned ones, and reads its rows from the Parquet files themselves (deletion vectors
applied), each of its files once per epoch.

The table's files must stay readable while the ranks read them: VACUUM keeps what its
retention keeps (``data.retention_hours``, at least Delta's 168 h by default), and the
job's own ingest runs under the output's lease, never beside a run on the same output.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from flowers_job.errors import DataError
from flowers_job.loaders.base import Loader, Sharding, ShardPlan, check_batch_fits, wrap_int64
from flowers_job.loaders.delta.order import shard_ranges
from flowers_job.loaders.delta.version_plan import DeltaPlan

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from flowers_job.config import JobConfig, LoadersConfig
    from flowers_job.loaders.delta.file_reader import DeltaReader
    from flowers_job.location import Location
    from flowers_job.vision.decode_transform import DecodeTransform

__all__ = ["DeltaLoader", "DeltaPlan"]


class DeltaLoader(Loader):
    """The ranks read the Delta table's own files with delta-rs; the driver only plans."""

    name = "delta"
    distribution = "deltalake"
    module = "deltalake"
    extra = "flowers-job[delta]"
    plan_type = DeltaPlan
    reads_table = True

    @classmethod
    def auto_problem(cls, cfg: JobConfig, connect: str | None) -> str | None:
        """'auto' reads the table itself only where the driver and the ranks can open its
        files: path tables (``tables.schema`` unset) on classic Spark. A catalog's managed
        tables are the catalog's to serve (Unity Catalog refuses reads of their storage
        paths, which is why Databricks' own reader goes through it), and a Spark Connect
        client may see neither the files nor tables it can parse (Spark Connect writes its
        strings with a collation delta-rs 1.6.6 does not read: docs/known-issues.md)."""
        if cfg.tables.schema_name is not None:
            return "the tables are catalog tables (tables.schema): their files are the catalog's"
        if connect is not None:
            return f"the session is Spark Connect ({connect})"
        return None

    def __init__(self, sharding: Sharding, source: str) -> None:
        super().__init__(sharding, source)
        self._opened: tuple[tuple[str, int], Any] | None = None
        """The log last read on the driver: ``((table_url, version), DeltaTable)``."""

    def write(
        self, spark: SparkSession, df: DataFrame, cache_dir: Location, split: str
    ) -> ShardPlan:
        """Never called: the Delta loader writes no cache (:meth:`plan_table`).

        Raises:
            DataError: always.
        """
        raise DataError("the delta loader reads the table itself: it writes no cache")

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
        """The plan of ``split``, ``rows`` rows at ``version`` of the table at ``table_url``
        whose ``row_id`` values sum to ``row_id_sum`` (Spark's count when it checked the
        tables; the plan's checksum is that sum wrapped to int64,
        :func:`~flowers_job.loaders.base.wrap_int64`). No Spark job: the log is read with
        delta-rs (:meth:`_check_readable`). With ``model_key``, the table is the
        ``embeddings`` table and the rows are ``views`` of that key's features
        (:class:`~flowers_job.loaders.delta.version_plan.DeltaPlan`).

        Raises:
            DataError: an empty split, delta-rs reads other live rows than ``rows``, or
                (training) a rank with fewer rows than ``train.per_device_batch_size``.
        """
        checksum = wrap_int64(row_id_sum)
        if rows == 0:
            raise DataError(f"the {split} split of {self.source} at version {version} is empty")
        self._check_readable(table_url, version, split, rows, model_key, views)
        world_size, batch = self.sharding.world_size, self.sharding.per_device_batch_size
        real = [stop - start for start, stop in shard_ranges(rows, world_size)]
        check_batch_fits(real, batch, world_size, split, split == "train")
        steps = math.ceil(max(real) / batch)
        padding = [max(0, steps - r) for r in real]
        return DeltaPlan(
            loader=self.name,
            cache_dir_url=table_url,
            dataset_size=rows,
            checksum=checksum,
            rows_per_shard=[r + p for r, p in zip(real, padding, strict=True)],
            checksum_per_shard=None,
            steps_per_epoch=steps,
            per_device_batch_size=batch,
            version=version,
            split=split,
            padding_per_shard=padding if any(padding) else None,
            model_key=model_key,
            views=list(views) if views is not None else None,
        )

    def _check_readable(
        self,
        table_url: str,
        version: int,
        split: str,
        rows: int,
        model_key: str | None = None,
        views: list[str] | None = None,
    ) -> None:
        """Before any rank starts: delta-rs reads the table's log at ``version`` here, as
        the ranks will, and finds ``rows`` live rows in ``split`` (Spark's count). The log
        is read once per run and version.

        Raises:
            DataError: delta-rs cannot read the table (a type or protocol feature it does
                not read, or a store the driver cannot reach), or counts other rows; the
                message names the table, the version and the loader that reads it through
                Spark instead.
        """
        from flowers_job.loaders.delta.log import open_table, split_files

        advice = "; data.loader=streaming reads the table through Spark instead"
        key = (table_url, version)
        try:
            if self._opened is None or self._opened[0] != key:
                self._opened = (key, open_table(table_url, version))
            files = split_files(self._opened[1], table_url, split, model_key, views)
        except DataError as exc:
            raise DataError(f"{exc}{advice}") from exc
        live = sum(f.live_rows for f in files)
        if live != rows:
            raise DataError(
                f"data.loader=delta: the {split} split of {table_url} at version {version} "
                f"holds {live} live rows in delta-rs's reading of its log, {rows} in "
                f"Spark's{advice}"
            )

    @classmethod
    def memory_settings(cls, settings: LoadersConfig) -> dict[str, str]:
        """The rows of stored images a rank holds to shuffle, and the batches decoded ahead."""
        return {
            "loaders.delta.shuffle_window_rows": str(settings.delta.shuffle_window_rows),
            "loaders.delta.prefetch_batches": str(settings.delta.prefetch_batches),
        }

    # Arguments: the loader interface's calls (Loader.open): their arguments are the
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
    ) -> DeltaReader:
        """:class:`~flowers_job.loaders.delta.file_reader.DeltaReader` of ``plan``; any
        placement of the ranks on hosts reads it."""
        from flowers_job.loaders.delta.file_reader import DeltaReader

        assert isinstance(plan, DeltaPlan), plan
        return DeltaReader(
            plan,
            transform,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            settings=settings.delta,
            workers=workers,
            pin_memory=pin_memory,
        )
