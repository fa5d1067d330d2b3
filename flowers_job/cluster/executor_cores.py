"""The cores of each executor, by host: how many threads a rank placed there may use.

Classic Spark reads them from its status store; Spark Connect, which has none, from a
barrier stage of one task per task slot.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

from pyspark.sql import SparkSession

from flowers_job.cluster.connect import is_connect_session, run_probe, spark_master
from flowers_job.cluster.slots import task_slots

__all__ = ["executor_cores"]


EXECUTOR_CORES_TIMEOUT_SECONDS = 120.0
"""Bound on :func:`executor_cores`'s probe stage on Connect, seconds (as the executor probe's,
:data:`flowers_job.cluster.executor_probe.PROBE_TIMEOUT_SECONDS`; about a second on a live
cluster)."""
EXECUTOR_CORES_SCHEMA = "executor string, host string, cpus int"
"""What each task of :func:`executor_cores`'s probe stage reports on Connect."""


def _executor_of_task(batches: Iterable[Any]) -> Iterator[Any]:
    """A barrier task's executor (``host:port`` from ``BarrierTaskContext.getTaskInfos``,
    the address Spark knows it by), its host name, and ``spark.task.cpus``
    (``TaskContext.cpus()``)."""
    import socket

    import pandas as pd
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    ctx.barrier()  # every slot taken at once: each executor runs exactly its slots' tasks
    for _ in batches:
        pass
    executor = ctx.getTaskInfos()[ctx.partitionId()].address
    yield pd.DataFrame(
        {"executor": [executor], "host": [socket.gethostname()], "cpus": [ctx.cpus()]}
    )


def executor_cores(
    spark: SparkSession, timeout_seconds: float = EXECUTOR_CORES_TIMEOUT_SECONDS
) -> dict[str, int]:
    """Cores of each registered executor, by its host (an address or a host name), from
    Spark's status store (the UI's data; present with the UI disabled). Empty on a local
    master, whose tasks run in the driver.

    On Spark Connect (no status store): a barrier stage of one task per task slot
    (:func:`task_slots`), which puts exactly ``cores // spark.task.cpus`` tasks on each
    executor; an executor's cores are its tasks times ``TaskContext.cpus()``, keyed by the
    address Spark knows it by (``BarrierTaskContext.getTaskInfos()``, as the status store's
    ``hostPort``) and by its host name (:func:`flowers_job.train.rank.threads_for_rank` looks
    a rank up by either); the fewest where a host has several executors, as on classic
    Spark. A Python worker sees no executor-wide core count (its ``OMP_NUM_THREADS`` is
    ``spark.task.cpus``), so cores left over by ``spark.task.cpus``, or idle where GPU slots
    are fewer than CPU slots, are not counted. Empty when the stage fails or times out
    (``timeout_seconds``): the ranks then assume ``spark.task.cpus``.
    """
    if spark_master(spark).startswith("local"):
        return {}
    if is_connect_session(spark):
        n = task_slots(spark)
        frame = spark.range(n, numPartitions=n).mapInPandas(
            _executor_of_task, EXECUTOR_CORES_SCHEMA, barrier=True
        )
        try:
            rows = run_probe(spark, frame, "executor cores probe", timeout_seconds)
        except Exception as exc:  # the ranks fall back to spark.task.cpus
            logging.getLogger(__name__).warning("no executor cores from a probe stage: %s", exc)
            return {}
        per_executor: dict[str, list[Any]] = {}
        for row in rows:
            per_executor.setdefault(row["executor"], []).append(row)
        cores: dict[str, int] = {}
        for executor, tasks in per_executor.items():
            count = sum(int(t["cpus"] or 1) for t in tasks)
            for host in {executor.rsplit(":", 1)[0], tasks[0]["host"]}:
                cores[host] = min(cores.get(host, 1 << 30), count)
        return cores
    jsc = spark.sparkContext._jsc.sc()
    cores = {}
    try:
        executors = jsc.statusStore().executorList(True)
        for i in range(executors.size()):
            e = executors.apply(i)
            if e.id() == "driver":
                continue
            host = str(e.hostPort()).rsplit(":", 1)[0]
            cores[host] = min(cores.get(host, 1 << 30), int(e.totalCores()))
    except Exception:
        return {}
    return cores
