"""Where the ranks of a barrier-mode run sit, and which shard each reads.

TorchDistributor's barrier mode (``distributed.local_mode=false``) runs one Spark task per
rank and sets ``RANK`` from the task's partition id; on pyspark 4.2+, where a task holds
several GPUs (``spark.task.resource.gpu.amount`` > 1), one task per that many ranks,
consecutive ranks on one host (:class:`BarrierStage`). Spark places those tasks on its
executors in its own order: it offers the executors in a shuffled order and gives each
offer one task per pass (``TaskSchedulerImpl.resourceOffers``), so with 2 hosts of 2 slots
ranks 0 and 2 share one host and ranks 1 and 3 the other. :class:`HostLayout` groups the
ranks by host and gives each rank the shard it reads, so that consecutive shards share a
host whatever the order (what Mosaic Streaming needs); :func:`check_placement` asks Spark
where TorchDistributor's barrier stage (:func:`barrier_stage`) goes, before any work, and
refuses a layout the loader cannot serve (unequal ranks per host for Streaming).

:func:`check_cluster` checks that a run fits the Spark cluster before any work: task slots,
GPUs, the tracking store's reach, and the placement. Torch-free: the driver imports it.
"""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from pyspark.sql import SparkSession

from flowers_job.cluster.connect import is_connect_session, run_probe, spark_master
from flowers_job.cluster.executor_probe import PROBE_TIMEOUT_SECONDS
from flowers_job.cluster.slots import driver_gpus, task_slots, wait_for_slots
from flowers_job.cluster.storage import is_local_master
from flowers_job.config import DistributedConfig, JobConfig
from flowers_job.errors import ClusterError
from flowers_job.loaders.base import Loader
from flowers_job.runtime.layout import HostLayout, rank_hosts

__all__ = [
    "GPUS_PER_TASK_SINCE",
    "TASK_GPUS",
    "BarrierStage",
    "barrier_stage",
    "check_cluster",
    "check_placement",
    "placement_hosts",
    "pyspark_version",
    "use_gpu",
]

log = logging.getLogger(__name__)

TASK_GPUS = "spark.task.resource.gpu.amount"
"""The GPUs each Spark task holds; TorchDistributor reads it as a whole number (``int``)."""

GPUS_PER_TASK_SINCE = (4, 2)
"""The first pyspark (major, minor) whose TorchDistributor runs one process per GPU of a
barrier task where :data:`TASK_GPUS` > 1 (SPARK-41916,
https://github.com/apache/spark/pull/53501); :func:`barrier_stage` gives the rule of each."""


def pyspark_version() -> tuple[int, int]:
    """The installed pyspark's (major, minor): ``"4.2.0"`` and ``"4.1.0.dev0"`` give (4, 2)
    and (4, 1); a Databricks Runtime's pyspark by the Spark version it reports. On Spark
    Connect it is the client's, which runs TorchDistributor.

    Raises:
        RuntimeError: the version does not start with ``<major>.<minor>``.
    """
    import pyspark

    match = re.match(r"(\d+)\.(\d+)", pyspark.__version__)
    if match is None:
        raise RuntimeError(f"pyspark {pyspark.__version__}: not a <major>.<minor> version")
    return int(match[1]), int(match[2])


@dataclass(frozen=True)
class BarrierStage:
    """TorchDistributor's barrier stage (``distributed.local_mode=false``) for a run.

    Attributes:
        num_processes: the ranks, ``distributed.num_processes`` (world_size).
        num_tasks: its Spark tasks, which start all at once: one task slot each.
        processes_per_task: the ranks each task's torchrun starts (``--nproc_per_node``);
            task ``i`` (its partition id) runs ranks ``i * processes_per_task`` to
            ``(i + 1) * processes_per_task - 1`` on its host
            (:func:`~flowers_job.runtime.layout.rank_hosts`).
    """

    num_processes: int
    num_tasks: int
    processes_per_task: int


def _either(values: Iterable[int]) -> str:
    """``"1"``, ``"2 or 4"``, ``"3, 2 or 1"``."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def barrier_stage(
    num_processes: int, gpus_per_task: str | None, version: tuple[int, int] | None = None
) -> BarrierStage:
    """The barrier stage that TorchDistributor of pyspark ``version`` (default: the installed
    one, :func:`pyspark_version`) runs for ``num_processes`` ranks on GPUs, each Spark task
    holding ``gpus_per_task`` (:data:`TASK_GPUS` as set, ``g``); ``None`` where the ranks use
    no GPU (``use_gpu=False``: one process per task, whatever the tasks hold).

    The rule of pyspark's ``TorchDistributor._get_num_tasks`` and ``_get_torchrun_args``
    (SPARK-41916, https://github.com/apache/spark/pull/53501):

    - pyspark 4.2+ (:data:`GPUS_PER_TASK_SINCE`): ``num_processes`` must be a multiple of
      ``g``; ``num_processes / g`` tasks, each a torchrun of one process per GPU of the task
      (``--nproc_per_node`` = the GPUs in its ``CUDA_VISIBLE_DEVICES``).
    - before: ``ceil(num_processes / g)`` tasks of one process each, whose torchrun waits
      for ``num_processes`` of them: with ``g`` > 1 only one process can run (the rendezvous
      of more never completes), on one of its task's GPUs.
    - ``g`` = 1: one task per process.

    Raises:
        ClusterError: naming ``distributed.num_processes`` and :data:`TASK_GPUS`, their values
            and what fits: ``g`` is not a whole number of at least 1 (TorchDistributor reads
            it with ``int`` and refuses GPUs without it); on pyspark 4.2+, ``num_processes``
            is not a multiple of ``g``; before, ``g`` > 1 with ``num_processes`` > 1.
    """
    if gpus_per_task is None:
        return BarrierStage(num_processes, num_processes, 1)
    try:
        g = int(gpus_per_task)  # as TorchDistributor reads it
    except ValueError:
        g = 0
    if g < 1:
        raise ClusterError(
            f"{TASK_GPUS}={gpus_per_task or '<unset>'}: barrier mode "
            "(distributed.local_mode=false) on GPUs needs a whole number of GPUs per Spark "
            "task, at least 1 (TorchDistributor reads it as an int and refuses GPUs without "
            f"it); set {TASK_GPUS}=1 (one task per process) with "
            "spark.executor.resource.gpu.amount, or distributed.use_gpu=false"
        )
    if g == 1:
        return BarrierStage(num_processes, num_processes, 1)
    major, minor = version or pyspark_version()
    since = ".".join(map(str, GPUS_PER_TASK_SINCE))
    if (major, minor) < GPUS_PER_TASK_SINCE:
        if num_processes == 1:
            return BarrierStage(1, 1, 1)
        tasks = -(-num_processes // g)
        raise ClusterError(
            f"{TASK_GPUS}={g} with distributed.num_processes={num_processes}: pyspark "
            f"{major}.{minor}'s TorchDistributor starts ceil({num_processes}/{g})={tasks} "
            f"barrier tasks of one process each and has their torchrun wait for "
            f"{num_processes}, so the ranks never meet (one process per GPU of a task needs "
            f"pyspark {since}+, SPARK-41916); set {TASK_GPUS}=1 (one task per process), or "
            f"use pyspark {since} or later"
        )
    if num_processes % g:
        lower = num_processes // g * g
        fits = [m for m in (lower, lower + g) if m > 0]
        divisors = [d for d in range(g - 1, 0, -1) if num_processes % d == 0]
        raise ClusterError(
            f"distributed.num_processes: {num_processes} is not a multiple of "
            f"{TASK_GPUS}={g}: pyspark {major}.{minor}'s TorchDistributor runs "
            f"num_processes / {g} barrier tasks, each a torchrun of one process per GPU of "
            "the task, and refuses other counts (SPARK-41916); set "
            f"distributed.num_processes={_either(fits)}, or {TASK_GPUS}={_either(divisors)} "
            f"(a divisor of {num_processes})"
        )
    return BarrierStage(num_processes, num_processes // g, g)


def _task_host(batches: Iterable[Any]) -> Iterator[Any]:
    """A barrier task's partition id and host name, as one pandas row."""
    import pandas as pd
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    ctx.barrier()  # every task placed before any answers, as in TorchDistributor's stage
    for _ in batches:
        pass
    yield pd.DataFrame({"partition": [ctx.partitionId()], "host": [socket.gethostname()]})


def placement_hosts(
    spark: SparkSession, num_processes: int, timeout_seconds: float, processes_per_task: int = 1
) -> list[str]:
    """The host name of each rank (index = ``RANK``) of TorchDistributor's barrier stage for
    ``num_processes`` ranks, each of its tasks running ``processes_per_task``
    (:class:`BarrierStage`), as it would be placed now: a barrier ``mapInPandas`` over
    ``spark.range(n, numPartitions=n)``, ``n = num_processes / processes_per_task`` tasks
    holding what TorchDistributor's would (the default resource profile), as
    TorchDistributor's own stage on Connect is a barrier ``mapInArrow`` (classic Spark and
    Connect alike). Task ``i`` runs ranks ``i * processes_per_task`` onwards on its host
    (:func:`~flowers_job.runtime.layout.rank_hosts`).

    Raises:
        ValueError: ``num_processes`` is not a multiple of ``processes_per_task``.
        RuntimeError: the stage did not end within ``timeout_seconds``.
    """
    if processes_per_task < 1 or num_processes % processes_per_task:
        raise ValueError(
            f"{num_processes} processes do not fill tasks of {processes_per_task} processes"
        )
    tasks = num_processes // processes_per_task
    frame = spark.range(tasks, numPartitions=tasks).mapInPandas(
        _task_host, "partition int, host string", barrier=True
    )
    rows = run_probe(spark, frame, "placement probe", timeout_seconds)
    found = {int(r["partition"]): str(r["host"]) for r in rows}
    return rank_hosts([found[i] for i in range(tasks)], processes_per_task)


def check_placement(
    spark: SparkSession,
    loader: type[Loader],
    num_processes: int,
    timeout_seconds: float,
    processes_per_task: int = 1,
) -> str:
    """Refuse, before any work, a placement of ranks on hosts that ``loader`` cannot read
    with: TorchDistributor's barrier stage for ``num_processes`` ranks, ``processes_per_task``
    in each task (:class:`BarrierStage`), reports its hosts (:func:`placement_hosts`,
    seconds).

    Spark fills the executors' slots one task per executor per pass, in a shuffled order:
    where the stage's tasks equal the cluster's slots the placement is fixed; below it,
    which executors get the last pass's tasks may differ from run to run, and the ranks
    check again (:meth:`~flowers_job.loaders.base.Loader.check_layout`) when they start.

    Returns:
        The layout seen (:meth:`HostLayout.describe`).

    Raises:
        ClusterError: the loader cannot serve it, naming ``data.loader`` and the layout.
    """
    hosts = placement_hosts(spark, num_processes, timeout_seconds, processes_per_task)
    layout = HostLayout.of(hosts, 0)
    try:
        loader.check_layout(layout)
    except RuntimeError as exc:
        raise ClusterError(f"invalid configuration:\n  {exc}") from None
    return layout.describe()


def use_gpu(spark: SparkSession, distributed: DistributedConfig) -> bool:
    """Whether the ranks train on GPUs: ``distributed.use_gpu`` when set; otherwise, in local
    mode, a CUDA device on the driver; in barrier mode, tasks that ask for GPUs
    (``spark.task.resource.gpu.amount`` > 0)."""
    if distributed.use_gpu is not None:
        return distributed.use_gpu
    if distributed.local_mode:
        import torch

        return torch.cuda.is_available()
    return float(spark.conf.get("spark.task.resource.gpu.amount", "0") or 0) > 0


def _local_store(uri: str) -> bool:
    """An MLflow store on a local path (``sqlite:``, ``file:`` or a bare path)."""
    return urlparse(uri).scheme in ("", "file", "sqlite")


def _slot_problems(
    spark: SparkSession, cfg: JobConfig, stage: BarrierStage, task_gpus: str, local_master: bool
) -> list[str]:
    """Barrier mode's stage against the cluster's task slots: ``stage.num_tasks`` of them at
    once (on a cluster, waiting for executors up to ``distributed.executor_wait_seconds``)."""
    d = cfg.distributed
    slots = (
        task_slots(spark)
        if local_master
        else wait_for_slots(spark, stage.num_tasks, d.executor_wait_seconds)
    )
    if stage.num_tasks <= slots:
        return []
    try:
        gpus = float(task_gpus)
    except ValueError:
        gpus = 0.0
    kind = (
        f"GPU task slots ({TASK_GPUS}={gpus:g} per task)"
        if gpus > 0
        else f"task slots (spark.task.cpus={spark.conf.get('spark.task.cpus', '1')})"
    )
    if stage.processes_per_task == 1:
        tasks, runs = "", "one task per process, all at once"
    else:
        tasks = (
            f" in {stage.num_tasks} barrier tasks of {stage.processes_per_task} (one process "
            "per GPU of a task)"
        )
        runs = "its tasks all at once"
    return [
        f"distributed.num_processes: {d.num_processes} processes{tasks}, but this Spark cluster "
        f"({spark_master(spark)}) has {slots} {kind}"
        + (
            ""
            if local_master
            else " on the executors registered (distributed.executor_wait_seconds="
            f"{d.executor_wait_seconds:g})"
        )
        + f"; barrier mode (distributed.local_mode=false) runs {runs}"
    ]


def _local_gpu_problems(spark: SparkSession, num_processes: int) -> list[str]:
    """Why local mode cannot run ``num_processes`` ranks on the driver's GPUs: no CUDA
    device, fewer devices than processes, or fewer ``gpu`` resources of the session's driver
    (TorchDistributor would refuse only after the data is prepared); [] when it can."""
    import torch

    gpus = torch.cuda.device_count()
    spark_gpus = driver_gpus(spark)
    if gpus == 0:
        return [
            "distributed.use_gpu: GPUs requested, but the driver has no CUDA device "
            "(local mode runs every process on the driver)"
        ]
    if num_processes > gpus:
        return [
            f"distributed.num_processes: {num_processes} processes, but the driver has "
            f"{gpus} CUDA devices (local mode on GPUs: one device per process; set "
            f"distributed.num_processes={gpus})"
        ]
    if len(spark_gpus) < num_processes:
        return [
            f"distributed.use_gpu: the Spark session's driver has {len(spark_gpus)} GPUs "
            f"as a resource and TorchDistributor's local mode needs {num_processes}: "
            "start the session with spark.driver.resource.gpu.amount and "
            "spark.driver.resource.gpu.discoveryScript (flowers_job.cluster.session.get_spark does "
            "when it finds CUDA devices; flowers_job.cluster.session.local_gpu_conf gives them)"
        ]
    return []


def check_cluster(spark: SparkSession, cfg: JobConfig, loader: type[Loader]) -> None:
    """Check ``distributed`` and ``tracking`` against this Spark cluster, and ``loader``'s
    placement of the ranks (the resolved loader), before any data is touched (seconds: on a cluster it waits for executors to register, at most
    ``distributed.executor_wait_seconds``).

    Every check works on a Spark Connect session too (:mod:`flowers_job.cluster.connect`).

    Raises:
        ClusterError: when
            - barrier mode (``local_mode=false``) on GPUs where TorchDistributor cannot run
              ``num_processes`` with ``spark.task.resource.gpu.amount`` (:func:`barrier_stage`:
              on pyspark 4.2+ ``num_processes`` must be a multiple of it; before 4.2 it must
              be 1 where ``num_processes`` > 1);
            - barrier mode asks for more barrier tasks than the cluster's task slots
              (:func:`~flowers_job.cluster.slots.task_slots`: GPU slots when tasks ask for
              GPUs): one task per process, or per ``spark.task.resource.gpu.amount``
              processes on pyspark 4.2+ (a task that holds 2 GPUs runs 2 processes in 1 slot);
            - barrier mode on a real cluster (not ``local[...]``) with a ``sqlite:``/``file:``
              tracking store not declared shared (``tracking.store_is_shared``): rank 0
              writes it from an executor, on another host than the driver;
            - GPUs are requested in local mode with fewer CUDA devices on the driver than
              processes, or a session whose driver has fewer ``gpu`` resources than
              processes (TorchDistributor would refuse only after the data is prepared);
            - barrier mode on a cluster with a loader that needs equal ranks per host
              (Streaming) where Spark places them unequally (:func:`check_placement`);
            - GPUs in local mode on a Spark Connect session: local mode runs the ranks on
              the client, and pyspark's TorchDistributor looks for the ``gpu`` resource of
              the server's driver (:func:`~flowers_job.cluster.slots.driver_gpus`), so it
              refuses them ("GPUs were unable to be found on the driver") or hands the
              client the server's GPUs; barrier mode is the GPU path there.
    """
    d = cfg.distributed
    problems = []
    local_master = is_local_master(spark)
    stage: BarrierStage | None = None
    if not d.local_mode:
        task_gpus = spark.conf.get(TASK_GPUS, "0") or "0"
        try:
            stage = barrier_stage(
                d.num_processes, task_gpus if use_gpu(spark, cfg.distributed) else None
            )
        except ClusterError as exc:
            problems.append(str(exc))
        if stage is not None:
            problems.extend(_slot_problems(spark, cfg, stage, task_gpus, local_master))
        if not local_master and _local_store(cfg.tracking_uri) and not cfg.tracking.store_is_shared:
            problems.append(
                f"tracking.tracking_uri: {cfg.tracking_uri} is a store on a local path, and with "
                "distributed.local_mode=false rank 0 logs and registers from an executor on "
                "another host: use an MLflow tracking server (http://HOST:5000, databricks), "
                "or set tracking.store_is_shared=true if the path is on storage every host "
                "shares (checked; sqlite over NFS or FUSE is unreliable)"
            )
    elif use_gpu(spark, cfg.distributed) and is_connect_session(spark):
        problems.append(
            "distributed.use_gpu: GPUs requested with distributed.local_mode=true on a Spark "
            "Connect session: local mode runs the processes on this client, and pyspark's "
            "TorchDistributor on Connect looks for GPUs on the server's driver (it refuses "
            "with 'GPUs were unable to be found on the driver'); set "
            "distributed.local_mode=false (barrier tasks on the executors' GPUs, "
            "spark.task.resource.gpu.amount) or distributed.use_gpu=false"
        )
    elif use_gpu(spark, cfg.distributed):
        problems.extend(_local_gpu_problems(spark, d.num_processes))
    if problems:
        raise ClusterError("invalid configuration:\n  " + "\n  ".join(problems))
    if not d.local_mode and not local_master and loader.places_ranks:
        assert stage is not None  # no problem: the stage was computed
        layout = check_placement(
            spark, loader, d.num_processes, PROBE_TIMEOUT_SECONDS, stage.processes_per_task
        )
        log.info("barrier tasks placed on the hosts as %s", layout)
