"""The SparkSession: Delta Lake enabled, sensible local defaults.

On a cluster (spark-submit, Databricks) the session already exists or the
launcher sets the master; locally we build ``local[*]`` with the Delta jars
resolved from Maven Central by ``configure_spark_with_delta_pip``.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, Row, SparkSession

from flowers_job.cluster.connect import (
    SparkJobTimeout,
    default_parallelism,
    is_connect_session,
    run_tagged,
    spark_master,
)
from flowers_job.runtime.allocator import apply_to_environ
from flowers_job.runtime.allocator import spark_conf as allocator_spark_conf

__all__ = [
    "cuda_device_count",
    "driver_gpus",
    "executor_cores",
    "get_spark",
    "live_task_slots",
    "local_gpu_conf",
    "remove_executors",
    "task_progress",
    "task_slots",
    "wait_for_slots",
]

_LOCAL_DEFAULTS = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    # Few, small tables: the default 200 shuffle partitions only add scheduling overhead.
    "spark.sql.shuffle.partitions": "8",
    "spark.driver.memory": "4g",
    # Image bytes travel through Arrow in the decode UDF; keep batches modest (~ 64 MB).
    "spark.sql.execution.arrow.maxRecordsPerBatch": "512",
    "spark.databricks.delta.snapshotPartitions": "2",
    # Python workers forked with pandas, pyarrow and Streaming's writer already imported:
    # those forked after Spark's one-minute idle cleanup start warm (python_daemon).
    "spark.python.daemon.module": "flowers_job.cluster.python_daemon",
}


def object_store_conf(urls: list[str]) -> tuple[list[str], dict[str, str]]:
    """The Maven packages and Spark settings a local session needs for ``urls``: for any
    ``s3a://`` (``s3://``, ``s3n://``) URI, ``org.apache.hadoop:hadoop-aws`` at pyspark's own
    Hadoop version (its ``hadoop-client-api`` jar's), and with ``AWS_ENDPOINT_URL`` set (an
    S3-compatible store: MinIO, moto), ``fs.s3a.endpoint`` with path-style access. The
    credentials stay where s3a's default provider chain finds them (the ``AWS_*``
    environment variables, ``~/.aws``, an instance profile); nothing here copies them.

    Returns:
        ``(packages, settings)``, both empty when no URI is in S3.
    """
    from flowers_job.location import S3_SCHEMES

    if not any(u.split("://", 1)[0] in S3_SCHEMES for u in urls if "://" in u):
        return [], {}
    import pyspark

    jars = sorted((Path(pyspark.__file__).parent / "jars").glob("hadoop-client-api-*.jar"))
    version = jars[-1].name.removeprefix("hadoop-client-api-").removesuffix(".jar")
    settings = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        settings = {
            "spark.hadoop.fs.s3a.endpoint": endpoint,
            "spark.hadoop.fs.s3a.path.style.access": "true",
            "spark.hadoop.fs.s3a.connection.ssl.enabled": str(endpoint.startswith("https")).lower(),
        }
    return [f"org.apache.hadoop:hadoop-aws:{version}"], settings


def get_spark(
    app_name: str = "flowers_job",
    master: str | None = None,
    conf: Mapping[str, str] | None = None,
    object_stores: list[str] | None = None,
) -> SparkSession:
    """Return the active SparkSession, or build a local one with Delta Lake.

    Args:
        app_name: Spark application name.
        master: Spark master URL for a new session (default ``$FLOWERS_SPARK_MASTER`` or
            ``local[*]``). Ignored when a session already exists (spark-submit, Databricks).
        conf: Spark settings for a new local session, over the local defaults (e.g.
            ``{"spark.driver.memory": "1g"}``). Ignored when a session already exists.
        object_stores: the job's locations (output dir, loader cache, images): a new local
            session gets what S3 needs (:func:`object_store_conf`). Ignored when a session
            already exists (spark-submit: ``--packages``, ``--conf``; docs/cluster.md).

    Returns:
        A session whose ``spark_catalog`` is Delta's.

    Raises:
        RuntimeError: if the JVM cannot start (no Java) or the Delta jars cannot be resolved.
    """
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    # The ranks of local mode (torchrun, started from this process) and, through
    # spark.executorEnv.*, Spark's Python workers get the allocator tuning.
    apply_to_environ()
    if "PYSPARK_GATEWAY_PORT" in os.environ:
        # Under spark-submit the JVM is already configured (master, --packages, resources);
        # the SparkContext is not yet, so the executors' environment can still be set. A
        # setting given to spark-submit (--conf spark.executorEnv.X=...) wins.
        from pyspark import SparkConf

        submitted = SparkConf()
        builder = (
            SparkSession.builder.appName(app_name)
            .config("spark.sql.extensions", _LOCAL_DEFAULTS["spark.sql.extensions"])
            .config(
                "spark.sql.catalog.spark_catalog",
                _LOCAL_DEFAULTS["spark.sql.catalog.spark_catalog"],
            )
        )
        for key, value in allocator_spark_conf().items():
            if not submitted.contains(key):
                builder = builder.config(key, value)
        return builder.getOrCreate()
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # docs/known-issues.md, "Spark"
    # Python workers must run this interpreter (with torch, Pillow...), not the system one.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from delta import configure_spark_with_delta_pip

    builder = SparkSession.builder.appName(app_name).master(
        master or os.environ.get("FLOWERS_SPARK_MASTER", "local[*]")
    )
    gpus = local_gpu_conf(cuda_device_count())
    packages, s3 = object_store_conf(object_stores or [])
    settings = {**_LOCAL_DEFAULTS, **s3, **allocator_spark_conf(), **gpus, **(conf or {})}
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = configure_spark_with_delta_pip(builder, extra_packages=packages).getOrCreate()
    if not is_connect_session(spark):  # SPARK_REMOTE made it Connect: no SparkContext
        spark.sparkContext.setLogLevel(os.environ.get("FLOWERS_SPARK_LOG_LEVEL", "WARN"))
    return spark


def cuda_device_count() -> int:
    """CUDA devices this process can use (``torch.cuda.device_count()``, which honours
    ``CUDA_VISIBLE_DEVICES``); 0 without an NVIDIA driver, and then torch is not imported."""
    if not (Path("/proc/driver/nvidia").exists() or shutil.which("nvidia-smi")):
        return 0
    import torch

    return int(torch.cuda.device_count())


GPU_DISCOVERY_SCRIPT = "flowers-gpu-discovery.sh"


def local_gpu_conf(count: int, directory: Path | None = None) -> dict[str, str]:
    """Spark settings that give a local session's driver ``count`` GPUs (none for 0).

    TorchDistributor's local mode with ``use_gpu`` refuses to start unless the driver has a
    ``gpu`` resource (``spark.driver.resource.gpu.amount`` and a discovery script, which
    Spark runs at start-up and which must print ``{"name": "gpu", "addresses": [...]}``);
    it then gives each rank one of those addresses in ``CUDA_VISIBLE_DEVICES``. The script
    written here (into ``directory``, default the temp dir) prints the indices
    ``0..count-1``: the devices torch sees in this process.
    """
    if count <= 0:
        return {}
    directory = Path(directory or tempfile.gettempdir())
    script = directory / f"{GPU_DISCOVERY_SCRIPT.removesuffix('.sh')}-{count}.sh"
    addresses = ", ".join(f'"{i}"' for i in range(count))
    script.write_text(f'#!/bin/sh\necho \'{{"name": "gpu", "addresses": [{addresses}]}}\'\n')
    script.chmod(0o755)
    return {
        "spark.driver.resource.gpu.amount": str(count),
        "spark.driver.resource.gpu.discoveryScript": str(script),
    }


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


def run_probe(
    spark: SparkSession, frame: DataFrame, what: str, timeout_seconds: float
) -> list[Row]:
    """``frame.collect()`` of a short check run on the executors before any work (a barrier
    ``mapInPandas`` over ``spark.range(n, numPartitions=n)``), bounded: interrupted after
    ``timeout_seconds`` (:func:`~flowers_job.cluster.connect.run_tagged`: a job tag and
    ``interruptTag`` on Connect, a job group on classic Spark). The same stage on both.

    Returns:
        The collected rows.

    Raises:
        SparkJobTimeout: (a ``RuntimeError``) not done within ``timeout_seconds`` (naming
            ``what``).
        pyspark.errors.PySparkException: the stage's own error (a task's Python error is
            in its message).
    """
    return run_tagged(spark, frame.collect, what, timeout_seconds)


PROGRESS_POLL_SECONDS = 0.5
"""How often :func:`task_progress` reads Spark's StatusTracker, seconds."""
PROGRESS_JOIN_SECONDS = 5.0
"""Longest wait for the progress thread to stop once the block is done, seconds."""


@contextmanager
def task_progress(spark: SparkSession, description: str) -> Iterator[None]:
    """A tqdm bar of the Spark tasks of the jobs run in the block by this thread.

    Classic Spark: StatusTracker, polled every :data:`PROGRESS_POLL_SECONDS` for the jobs of
    a job group; the thread is stopped within :data:`PROGRESS_JOIN_SECONDS` when the block
    ends. Spark Connect has no StatusTracker (no SparkContext): a progress handler
    (``SparkSession.registerProgressHandler``, removed after) gets each operation's stages
    with their task counts as the server reports them (every
    ``spark.connect.progress.reportInterval``, 2 s by default, and at the end), and counts
    only the operations this thread runs, as a job group would."""
    from tqdm import tqdm

    with tqdm(desc=description, unit="task", total=1, dynamic_ncols=True) as bar:
        if is_connect_session(spark):
            with _connect_progress(spark, bar):
                yield
            return
        with _classic_progress(spark, bar, description):
            yield


def _show(bar: Any, total: int, completed: int) -> None:
    bar.total = max(total, 1)
    bar.update(completed - bar.n)


@contextmanager
def _connect_progress(spark: SparkSession, bar: Any) -> Iterator[None]:
    """:func:`task_progress` on Connect: a progress handler drives ``bar``."""
    owner = threading.get_ident()
    lock = threading.Lock()
    seen: dict[tuple[str | None, int], tuple[int, int]] = {}

    def handler(
        stages: Iterable[Any] | None, inflight_tasks: int, operation_id: str | None, done: bool
    ) -> None:  # pyspark calls it with these keywords (pyspark.sql.connect.shell.progress)
        if threading.get_ident() != owner:  # another thread's operation
            return
        with lock:
            for stage in stages or []:
                # a stage skipped (its shuffle output reused) never completes a task
                finished = done or stage.done
                completed = stage.num_tasks if finished else stage.num_completed_tasks
                seen[(operation_id, stage.stage_id)] = (stage.num_tasks, completed)
            _show(bar, sum(t for t, _ in seen.values()), sum(c for _, c in seen.values()))

    # pyspark 4.2 types the handler as its ProgressHandler ABC; it calls any callable
    spark.registerProgressHandler(handler)  # type: ignore[arg-type]
    try:
        yield
    finally:
        spark.removeProgressHandler(handler)  # type: ignore[arg-type]


@contextmanager
def _classic_progress(spark: SparkSession, bar: Any, description: str) -> Iterator[None]:
    """:func:`task_progress` on classic Spark: the StatusTracker of a job group, polled."""
    sc = spark.sparkContext
    group = f"flowers-predict-{uuid.uuid4().hex[:8]}"
    properties = ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel")
    before = {key: sc.getLocalProperty(key) for key in properties}
    sc.setJobGroup(group, description)
    tracker = sc.statusTracker()
    done = threading.Event()

    def counts() -> tuple[int, int]:
        total = completed = 0
        for job_id in tracker.getJobIdsForGroup(group):
            job = tracker.getJobInfo(job_id)
            for stage_id in job.stageIds if job else []:
                stage = tracker.getStageInfo(stage_id)
                if stage is not None:
                    total += stage.numTasks
                    # a stage skipped (its shuffle output reused) never completes a task
                    done_job = job is not None and job.status == "SUCCEEDED"
                    completed += stage.numTasks if done_job else stage.numCompletedTasks
        return total, completed

    def poll() -> None:
        while not done.wait(PROGRESS_POLL_SECONDS):
            _show(bar, *counts())

    thread = threading.Thread(target=poll, name=group, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(PROGRESS_JOIN_SECONDS)
        for key, value in before.items():  # None removes the property
            sc.setLocalProperty(key, value)  # type: ignore[arg-type]
        _show(bar, *counts())
