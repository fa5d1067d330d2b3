"""Retention (driver side): VACUUM the tables after an ingest, never removing what a kept
loader cache or a registered model still names. The retention is ``data.retention_hours``,
raised to keep the oldest protected version of ``images`` readable (a loader cache entry's,
:func:`flowers_job.loaders.cache_dir.cached_versions`, a registered model's, from its run's
``flowers_job.images_version`` tag, or a run's still running); nothing is vacuumed when the registry cannot be
read. A retention below Delta's safe minimum is used only while this process holds the
output's lease (:func:`sole_writer`). The formula and why: docs/architecture.md, "One copy
of every image".
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from flowers_job.cluster.connect import default_parallelism
from flowers_job.config import JobConfig
from flowers_job.config.data import SAFE_RETENTION_HOURS, DataConfig
from flowers_job.location import Location
from flowers_job.tables.delta_tables import TABLE_NAMES, session_settings
from flowers_job.tables.table_ref import TableRef, table_ref
from flowers_job.tracking.tags import TAG_IMAGES_TABLE, TAG_IMAGES_VERSION

__all__ = [
    "is_sole_writer",
    "protected_versions",
    "retention_hours",
    "sole_writer",
    "vacuum_tables",
]

log = logging.getLogger(__name__)

_RETENTION_CHECK = "spark.databricks.delta.retentionDurationCheck.enabled"
_LISTING_PARALLELISM = "spark.sql.sources.parallelPartitionDiscovery.parallelism"
"""VACUUM lists the table's directories in a Spark job of this many tasks (Delta's
``VacuumCommand``); Spark's default, 10,000, costs 10,000 empty tasks on any table."""


_SOLE_WRITER: dict[str, int] = {}
"""Output locations (URLs) whose lease this process holds, and how many holders entered."""
_SOLE_WRITER_LOCK = threading.Lock()


@contextmanager
def sole_writer(output_dir: Location | str | os.PathLike[str]) -> Iterator[None]:
    """While inside, this process is the only flowers_job writer of ``output_dir``: entered
    by the holder of its lease (:class:`flowers_job.driver.lease.OutputLease`), never by
    anything else. Lets VACUUM use a retention below Delta's safe minimum there."""
    url = Location.of(output_dir).url
    with _SOLE_WRITER_LOCK:
        _SOLE_WRITER[url] = _SOLE_WRITER.get(url, 0) + 1
    try:
        yield
    finally:
        with _SOLE_WRITER_LOCK:
            _SOLE_WRITER[url] -= 1
            if not _SOLE_WRITER[url]:
                del _SOLE_WRITER[url]


def is_sole_writer(output_dir: Location | str | os.PathLike[str]) -> bool:
    """Whether this process holds the lease of ``output_dir`` (:func:`sole_writer`)."""
    return Location.of(output_dir).url in _SOLE_WRITER


def retention_hours(data: DataConfig, output_dir: Location) -> int:
    """``data.retention_hours``, or Delta's safe minimum when it is below it and this process
    does not hold the lease of ``output_dir`` (logged)."""
    hours = int(data.retention_hours)
    if hours < SAFE_RETENTION_HOURS and not is_sole_writer(output_dir):
        log.warning(
            "data.retention_hours=%d is below Delta's safe minimum, which VACUUM uses only "
            "under the lease of %s; this process does not hold it: keeping %d h",
            hours,
            output_dir,
            SAFE_RETENTION_HOURS,
        )
        return SAFE_RETENTION_HOURS
    return hours


def _tracked_versions(cfg: JobConfig, table: TableRef) -> set[int]:
    """The ``images`` versions of ``table`` that the tracking store names as in use: those
    the registered model versions of ``tracking.registered_model_name`` were trained on
    (their run's ``flowers_job.images_table`` tag is the table's path or catalog name), and
    those that runs still running read (:func:`_running_versions`).

    Raises:
        Exception: the store cannot be read (MLflow's errors).
    """
    name = cfg.tracking.registered_model_name
    uri = cfg.tracking_uri
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).exists():
        return set()  # no store yet: no run, nothing registered (and none is created here)
    from flowers_job.tracking.credentials import store_client
    from flowers_job.tracking.mlflow_run import use_credentials

    use_credentials(cfg.tracking)
    found = set()
    with store_client(uri) as client:
        for mv in client.search_model_versions(f"name = '{name}'") if name else []:
            if not mv.run_id:
                continue
            tags = client.get_run(mv.run_id).data.tags
            if tags.get(TAG_IMAGES_TABLE) == table.describe() and TAG_IMAGES_VERSION in tags:
                found.add(int(tags[TAG_IMAGES_VERSION]))
        found |= _running_versions(client, cfg.tracking.experiment_name, table)
    return found


def _running_versions(client: Any, experiment_name: str, table: TableRef) -> set[int]:
    """The ``images`` versions that runs of ``experiment_name`` still ``RUNNING`` read of
    ``table``: a run whose ranks read the table itself (``data.loader=delta``) needs its
    version's files until it ends, from whichever output it runs (a catalog table is shared
    by every output that names it), and a killed run's resume reads it again.

    Raises:
        Exception: the tracking store cannot be read (MLflow's errors).
    """
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        return set()
    runs = client.search_runs(
        [experiment.experiment_id], filter_string="attributes.status = 'RUNNING'"
    )
    return {
        int(run.data.tags[TAG_IMAGES_VERSION])
        for run in runs
        if run.data.tags.get(TAG_IMAGES_TABLE) == table.describe()
        and run.data.tags.get(TAG_IMAGES_VERSION, "").isdigit()
    }


def protected_versions(cfg: JobConfig) -> set[int]:
    """The versions of ``images`` that VACUUM must keep readable: those of the loader
    cache's entries, of the registered models, and of the runs still running.

    Raises:
        Exception: the MLflow registry cannot be read.
    """
    from flowers_job.loaders.cache_dir import cached_versions

    table = table_ref(cfg, "images")
    return cached_versions(cfg.paths.cache_root, table.describe()) | _tracked_versions(cfg, table)


def _hours_since_commit(spark: SparkSession, table: TableRef, version: int) -> float | None:
    """Hours since the commit of ``version`` of ``table``; None if there is no such commit
    (yet)."""
    rows = table.history(spark).where(f"version = {int(version)}").select("timestamp").collect()
    if not rows:
        return None
    return max(0.0, (time.time() - rows[0]["timestamp"].timestamp()) / 3600.0)


def _table_age_hours(spark: SparkSession, table: TableRef) -> float | None:
    """Hours since ``table`` was created (``DESCRIBE DETAIL``'s ``createdAt``); None if
    unknown. (A catalog table overwritten by name is replaced, ``CREATE OR REPLACE``: its
    ``createdAt`` is kept, as a path table's is.)"""
    row = table.detail(spark)
    if row["createdAt"] is None:
        return None
    return max(0.0, (time.time() - row["createdAt"].timestamp()) / 3600.0)


def vacuum_tables(spark: SparkSession, cfg: JobConfig) -> dict[str, int] | None:
    """VACUUM ``images`` and ``quarantine`` with ``data.retention_hours`` (Delta's safe minimum
    when it is below it and this process does not hold the output's lease), raised to keep
    every protected version of ``images`` readable (docs/architecture.md, "One copy of every
    image").

    Returns:
        Table name -> the retention used (whole hours); None when the protected versions could
        not be read and nothing was vacuumed (logged as a warning).
    """
    try:
        protected = protected_versions(cfg)
    except Exception as exc:
        log.warning(
            "not vacuuming the tables: the model registry could not be read to find the "
            "versions registered models were trained on (%s: %s)",
            type(exc).__name__,
            exc,
        )
        return None
    base = retention_hours(cfg.data, cfg.paths.output_dir)
    hours = {name: base for name in TABLE_NAMES}
    if protected:
        oldest = min(protected)
        age = _hours_since_commit(spark, table_ref(cfg, "images"), oldest)
        if age is not None:
            hours["images"] = max(hours["images"], math.ceil(age) + 1)
    settings = {
        _RETENTION_CHECK: "false",  # retention_hours below Delta's 168 is allowed
        # two listing tasks per slot, not 10,000: a third of the time on a small table
        # (docs/performance.md)
        _LISTING_PARALLELISM: str(2 * default_parallelism(spark)),
    }
    with session_settings(spark, settings):
        for name, retain in hours.items():
            table = table_ref(cfg, name)
            age = _table_age_hours(spark, table)
            if age is not None and age < retain:
                # No file of a table younger than the retention can be old enough to go; a
                # VACUUM lists every file of the table (seconds even for a small one).
                log.info("not vacuuming %s: created %.1f h ago, retention %d h", name, age, retain)
                continue
            t0 = time.perf_counter()
            table.vacuum(spark, retain)
            log.info(
                "vacuumed %s, keeping %d h of history%s, in %.1f s",
                name,
                retain,
                f" (images versions {sorted(protected)} are kept)"
                if name == "images" and protected
                else "",
                time.perf_counter() - t0,
            )
    return hours
