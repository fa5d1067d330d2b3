"""What the executors see, checked before any work: one barrier stage, one task per task slot.

On a cluster the executors need two things the driver has, and a job that lacks either
would fail late (after the ingest, or after the training):

- the storage the job writes, at the same paths (:mod:`flowers_job.cluster.storage`: the driver
  writes a token, each task reads it back);
- in barrier mode (``distributed.local_mode=false``), the MLflow tracking server, usable
  with credentials of their own: rank 0 logs and registers the model from an executor,
  and the job never copies the driver's secrets there (:mod:`flowers_job.tracking.credentials`).

Both are checked by the same Spark stage: a barrier stage, so that every task slot runs a
task at the same time and every executor is probed. One task per executor makes the MLflow
call (each executor's environment is the same for all its tasks).
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from pyspark.sql import SparkSession

from flowers_job.cluster.connect import run_probe
from flowers_job.cluster.slots import task_slots
from flowers_job.cluster.storage import (
    is_local_master,
    shared_dirs,
    storage_problems,
    store_variables,
    tokens,
    unreadable,
)
from flowers_job.config import JobConfig
from flowers_job.errors import ClusterError
from flowers_job.location import Location
from flowers_job.tracking.credentials import (
    ExecutorTracking,
    credential_problems,
    executor_report,
    executor_tracking,
    redact,
)

__all__ = ["PROBE_TIMEOUT_SECONDS", "check_executors", "probe_executors"]

PROBE_TIMEOUT_SECONDS = 120.0
"""Bound on a probe's Spark job before any work (seconds; this one's, and the placement's of
:mod:`flowers_job.cluster.placement`): about a second for the storage alone on a live cluster, plus
MLflow's import (seconds) and one call (at most two tries of
:data:`~flowers_job.tracking.mlflow_run.PREFLIGHT_TIMEOUT_SECONDS`) for the tracking server."""

log = logging.getLogger(__name__)


def _probe_task(
    token: str, paths: list[str], tracking: ExecutorTracking | None
) -> Callable[[Iterable[Any]], Iterator[Any]]:
    """The barrier ``mapInPandas`` function of the probe: one row per task, its report as
    JSON (a ``report`` string column: the reports differ in keys)."""

    def task(batches: Iterable[Any]) -> Iterator[Any]:
        import pandas as pd
        from pyspark import BarrierTaskContext

        for _ in batches:
            pass

        ctx = BarrierTaskContext.get()
        infos, me = ctx.getTaskInfos(), ctx.partitionId()
        executor = infos[me].address  # host:port, one per executor
        row: dict[str, Any] = {
            "host": socket.gethostname(),
            "address": executor.rsplit(":", 1)[0],
            "missing": unreadable(token, paths) if paths else [],
            "store_variables": store_variables(),
        }
        first = min(i for i, info in enumerate(infos) if info.address == executor)
        if tracking is not None and me == first:
            row["tracking"] = executor_report(**tracking)
        yield pd.DataFrame({"report": [json.dumps(row)]})

    return task


def probe_executors(
    spark: SparkSession,
    dirs: dict[str, Location],
    tracking: ExecutorTracking | None,
    timeout_seconds: float = PROBE_TIMEOUT_SECONDS,
) -> list[dict[str, Any]]:
    """The executor probe's stage: a barrier ``mapInPandas`` over ``spark.range(n,
    numPartitions=n)``, ``n`` = :func:`~flowers_job.cluster.slots.task_slots` (one task per
    slot, every executor probed), each task reading back the tokens written into ``dirs``
    (:func:`~flowers_job.cluster.storage.tokens`) and, on one task per executor, calling the
    tracking server. The same stage on classic Spark and Connect.

    Returns:
        One ``{"host", "address", "missing", "store_variables"}`` dict per task, plus
        ``"tracking"`` on one task per executor when ``tracking`` is given.

    Raises:
        RuntimeError: the stage did not end within ``timeout_seconds``.
    """
    with tokens(dirs) as token:
        task = _probe_task(token, [str(p) for p in dirs.values()], tracking)
        n = max(1, task_slots(spark))
        frame = spark.range(n, numPartitions=n).mapInPandas(task, "report string", barrier=True)
        rows = run_probe(spark, frame, "executor probe", timeout_seconds)
    return [json.loads(row["report"]) for row in rows]


def check_executors(
    spark: SparkSession, cfg: JobConfig, timeout_seconds: float = PROBE_TIMEOUT_SECONDS
) -> list[dict[str, Any]]:
    """Check that every executor sees the job's storage and can use its tracking server.

    What is probed: the directories of :func:`~flowers_job.cluster.storage.shared_dirs` on a real
    cluster (not on a ``local[...]`` master: one host); the MLflow store in barrier mode
    when it is a server or Databricks (:func:`~flowers_job.tracking.credentials.executor_tracking`;
    on a local master too, whose Python workers have the environment the driver had when
    its JVM started, plus ``spark.executorEnv.*``). Nothing to probe: no Spark job. Run it
    after :func:`flowers_job.tracking.mlflow_run.preflight`, which exports the configured credentials
    and creates the experiment.

    Returns:
        One ``{"host", "address", "missing"}`` per task (``"tracking"``:
        :func:`~flowers_job.tracking.credentials.executor_report`'s dict, on one task per
        executor); empty when nothing was probed.

    Raises:
        ClusterError: an executor cannot read a token (names the setting, the directory and
            the executor's host and address), or cannot use the tracking server (names
            ``tracking.tracking_uri``, the credential variables missing there, the hosts,
            MLflow's error and the fix). Never a credential's value.
        RuntimeError: the probe's Spark job did not end within ``timeout_seconds``.
    """
    from flowers_job.tracking.mlflow_run import PREFLIGHT_TIMEOUT_SECONDS

    dirs = {} if is_local_master(spark) else shared_dirs(cfg.paths, cfg.tracking_uri)
    tracking = executor_tracking(
        cfg.tracking_uri,
        cfg.tracking.experiment_name,
        cfg.distributed.local_mode,
        PREFLIGHT_TIMEOUT_SECONDS,
    )
    if not dirs and tracking is None:
        return []
    results = probe_executors(spark, dirs, tracking, timeout_seconds)
    problems = storage_problems(dirs, results)
    if tracking is not None:
        problems += credential_problems(tracking, [r for r in results if "tracking" in r])
    if problems:
        raise ClusterError(redact("invalid configuration:\n  " + "\n  ".join(problems)))
    hosts = sorted({f"{r['host']} ({r['address']})" for r in results})
    seen = ["storage shared" if dirs else "one host"]
    if tracking is not None:
        names = ", ".join(tracking["wanted"]) or "no credential variable"
        seen.append(f"MLflow {tracking['uri']} usable with {names}")
    log.info(
        "executor probe: %d task slots on %s: %s", len(results), ", ".join(hosts), "; ".join(seen)
    )
    return results
