"""The task slots a cluster offers a barrier stage, now and as executors come and go.

A barrier stage needs a slot per task at once. Executors register seconds after the
session starts and a host can stop answering while Spark still counts it, so the driver
counts slots (:func:`task_slots`), waits for them (:func:`wait_for_slots`), and counts out
and removes executors that no longer answer before a restart (:func:`live_task_slots`,
:func:`remove_executors`). Spark Connect can count but not remove (no ``SparkContext``).
"""

from __future__ import annotations

import logging
import time

from pyspark.sql import SparkSession

from flowers_job.cluster.connect import (
    SparkJobTimeout,
    default_parallelism,
    is_connect_session,
    spark_master,
)

__all__ = ["driver_gpus", "live_task_slots", "remove_executors", "task_slots", "wait_for_slots"]


def driver_gpus(spark: SparkSession) -> list[str]:
    """The addresses of the driver's ``gpu`` resource (what local mode's ranks can use);
    [] when the session was started without one.

    On Spark Connect: always [], as there is no ``SparkContext.resources`` on the client
    (``[JVM_ATTRIBUTE_NOT_SUPPORTED]``). pyspark's TorchDistributor there asks the server's
    driver for its ``gpu`` resource (``pyspark.ml.torch.distributor._get_resources``) and
    refuses ``use_gpu`` with ``local_mode=True`` without one ("GPUs were unable to be found
    on the driver"); with one, it would hand the server's GPU addresses to ranks that run on
    the client, another machine. Barrier mode is the GPU path on Connect
    (:func:`flowers_job.cluster.placement.check_cluster` refuses the other before any work)."""
    if is_connect_session(spark):
        return []
    resources = spark.sparkContext.resources
    return list(resources["gpu"].addresses) if "gpu" in resources else []


def _conf_float(spark: SparkSession, key: str) -> float:
    """A numeric Spark setting of the session (the server's on Connect), 0 when unset."""
    try:
        return float(spark.conf.get(key, "0") or 0)
    except ValueError:
        return 0.0


def task_slots(
    spark: SparkSession, fresh: bool = False, timeout_seconds: float | None = None
) -> int:
    """Concurrent task slots of the cluster's registered executors, as the scheduler counts
    them for a barrier stage: per executor, the fewest of cores / ``spark.task.cpus`` and,
    for every resource a task asks for (``spark.task.resource.gpu.amount``), the executor's
    amount / the task's (Spark's ``SparkContext.maxNumConcurrentTasks``). On a local master
    that is ``local[n]``'s n / ``spark.task.cpus``.

    Spark Connect has no ``maxNumConcurrentTasks`` (no SparkContext, no JVM): there the CPU
    slots are :func:`~flowers_job.cluster.connect.default_parallelism` (the executors' total
    cores) // ``spark.task.cpus``; when tasks ask for GPUs, the GPU slots are counted from the
    server's settings, ``(total cores // spark.executor.cores) * (spark.executor.resource.
    gpu.amount // spark.task.resource.gpu.amount)``, and the fewer is taken. Without
    ``spark.executor.cores`` or ``spark.executor.resource.gpu.amount`` set there (a task
    sees only its own GPUs in ``TaskContext.resources()``, not its executor's), Connect cannot
    tell GPU slots from CPU slots, and a barrier stage that asks for more fails at its start.

    The count is of tasks, not processes: barrier mode (``local_mode=false``) needs one slot
    per barrier task, which is one per training process, or, on pyspark 4.2+ with
    ``spark.task.resource.gpu.amount`` > 1, one per that many processes (a task holding 2
    GPUs runs 2 in its one slot: :func:`flowers_job.cluster.placement.barrier_stage`).

    Args:
        fresh: on Connect, count the executors' cores again (polling, :func:`wait_for_slots`).
        timeout_seconds: bound on that count on Connect (None: unbounded).

    Raises:
        SparkJobTimeout: Connect's count did not end within ``timeout_seconds`` (no executor).
    """
    if is_connect_session(spark):
        cores = default_parallelism(spark, fresh=fresh, timeout_seconds=timeout_seconds)
        slots = cores // max(1, int(_conf_float(spark, "spark.task.cpus") or 1))
        task_gpus = _conf_float(spark, "spark.task.resource.gpu.amount")
        executor_gpus = _conf_float(spark, "spark.executor.resource.gpu.amount")
        cores_each = int(_conf_float(spark, "spark.executor.cores"))
        if task_gpus > 0 and executor_gpus > 0 and cores_each > 0:
            slots = min(slots, (cores // cores_each) * int(executor_gpus // task_gpus))
        return max(1, slots)
    jsc = spark.sparkContext._jsc.sc()
    try:
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(profile))
    except Exception:  # an older JVM side: CPU slots only
        cpus_per_task = int(spark.conf.get("spark.task.cpus", "1") or 1)
        return max(1, spark.sparkContext.defaultParallelism // cpus_per_task)


SLOTS_SETTLE_SECONDS = 15.0
""":func:`wait_for_slots` stops waiting once the slot count has not changed for this long."""


def wait_for_slots(
    spark: SparkSession,
    needed: int,
    timeout_seconds: float,
    settle_seconds: float = SLOTS_SETTLE_SECONDS,
) -> int:
    """:func:`task_slots`, polled until it reaches ``needed``, or it is above 0 and has not
    changed for ``settle_seconds`` (every executor the cluster will give has registered), or
    ``timeout_seconds`` pass.

    Executors register with the driver seconds after the session starts (spark-submit on a
    standalone or YARN cluster), so a count taken at once can be short. On Spark Connect each
    poll is a fresh count (a small Spark job), bounded by the time left: with no executor
    the job waits for resources, is interrupted, and counts as 0 slots.

    Returns:
        The last count (below ``needed`` only when it settled lower, or after the timeout).
    """
    start = time.monotonic()

    def count(first: bool) -> int:
        if not is_connect_session(spark):
            return task_slots(spark)
        left = max(1.0, timeout_seconds - (time.monotonic() - start))
        try:
            return task_slots(spark, fresh=not first, timeout_seconds=left)
        except SparkJobTimeout:
            return 0

    slots = count(True)
    changed = start
    while slots < needed and time.monotonic() - start < timeout_seconds:
        if slots > 0 and time.monotonic() - changed >= settle_seconds:
            break
        time.sleep(0.5)
        now = count(False)
        if now != slots:
            slots, changed = now, time.monotonic()
    return slots


LIVENESS_PROBE_SECONDS = 3.0
"""How long :func:`live_task_slots` waits for an executor's block manager to accept a TCP
connection, seconds."""


def live_task_slots(
    spark: SparkSession, probe_seconds: float = LIVENESS_PROBE_SECONDS
) -> tuple[int, list[str]]:
    """:func:`task_slots` without the executors that no longer answer, and their ids.

    Spark keeps an executor that stopped answering (its host off the network) registered
    until its heartbeats have been missing for ``spark.network.timeout`` (120 s by default),
    and would place a barrier task there. Each registered executor's RPC port is probed with
    one TCP connection (``probe_seconds``); one that does not accept it is counted out
    (``cores // spark.task.cpus`` slots). :func:`remove_executors` keeps tasks off them. On
    a local master: ``(task_slots, [])``.

    On Spark Connect: ``(task_slots, [])`` (a fresh count), as the client has no status
    store to list the executors (no SparkContext); a silent executor then stays counted
    until Spark's own heartbeat timeout removes it.
    """
    import socket

    if is_connect_session(spark):
        return task_slots(spark, fresh=True), []
    if spark_master(spark).startswith("local"):
        return task_slots(spark), []
    jsc = spark.sparkContext._jsc.sc()
    task_cpus = int(spark.conf.get("spark.task.cpus", "1") or 1)
    dead: dict[str, int] = {}
    executors = jsc.statusStore().executorList(True)
    for i in range(executors.size()):
        e = executors.apply(i)
        if e.id() == "driver":
            continue
        host, _, port = str(e.hostPort()).rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=probe_seconds).close()
        except (OSError, ValueError):
            dead[str(e.id())] = int(e.totalCores()) // task_cpus
    return max(0, task_slots(spark) - sum(dead.values())), sorted(dead)


def remove_executors(spark: SparkSession, ids: list[str]) -> None:
    """Ask Spark to remove executors ``ids`` (``SparkContext.killExecutors``): no task is
    placed on them from now on. Spark's own shutdown then waits for them (about a minute
    for an unreachable host, measured on the test cluster) before the driver exits.

    On Spark Connect there is no ``killExecutors`` (no SparkContext): nothing is removed, a
    warning is logged, and Spark's heartbeat timeout (``spark.network.timeout``) removes a
    silent executor."""
    if not ids:
        return
    logger = logging.getLogger(__name__)
    if is_connect_session(spark):
        logger.warning(
            "executors %s do not answer; a Spark Connect client cannot remove them (no "
            "SparkContext.killExecutors): Spark's heartbeat timeout will",
            ", ".join(ids),
        )
        return
    logger.warning("executors %s do not answer: removed", ", ".join(ids))
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    try:
        spark.sparkContext._jsc.sc().killExecutors(
            jvm.PythonUtils.toSeq(jvm.java.util.ArrayList(ids))
        )
    except Exception as exc:  # a cluster manager that cannot kill executors
        logger.warning("could not remove executors %s: %s", ids, exc)
