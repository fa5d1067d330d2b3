"""Where the ranks of a barrier-mode run sit, and which shard each reads.

TorchDistributor's barrier mode (``distributed.local_mode=false``) runs one Spark task per
rank and sets ``RANK`` from the task's partition id. Spark places those tasks on its
executors in its own order: it offers the executors in a shuffled order and gives each
offer one task per pass (``TaskSchedulerImpl.resourceOffers``), so with 2 hosts of 2 slots
ranks 0 and 2 share one host and ranks 1 and 3 the other. :class:`HostLayout` groups the
ranks by host and gives each rank the shard it reads, so that consecutive shards share a
host whatever the order (what Mosaic Streaming needs); :func:`check_placement` asks Spark
where a stage of ``distributed.num_processes`` barrier tasks goes, before any work, and
refuses a layout the loader cannot serve (unequal ranks per host for Streaming).

:func:`check_cluster` checks that a run fits the Spark cluster before any work: task slots,
GPUs, the tracking store's reach, and the placement. Torch-free: the driver imports it.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import urlparse

from pyspark.sql import SparkSession

from flowers_job.cluster.connect import is_connect_session, spark_master
from flowers_job.cluster.executor_probe import PROBE_TIMEOUT_SECONDS
from flowers_job.cluster.session import driver_gpus, run_probe, task_slots, wait_for_slots
from flowers_job.cluster.storage import is_local_master
from flowers_job.config import JobConfig
from flowers_job.errors import ClusterError
from flowers_job.loaders.base import Loader
from flowers_job.runtime.layout import HostLayout

__all__ = [
    "check_cluster",
    "check_placement",
    "placement_hosts",
    "use_gpu",
]

log = logging.getLogger(__name__)


def _task_host(batches: Iterable[Any]) -> Iterator[Any]:
    """A barrier task's partition id and host name, as one pandas row."""
    import pandas as pd
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    ctx.barrier()  # every task placed before any answers, as in TorchDistributor's stage
    for _ in batches:
        pass
    yield pd.DataFrame({"partition": [ctx.partitionId()], "host": [socket.gethostname()]})


def placement_hosts(spark: SparkSession, num_processes: int, timeout_seconds: float) -> list[str]:
    """The host name of each rank (index = partition id = ``RANK``) of a barrier stage of
    ``num_processes`` tasks, as TorchDistributor's would be placed now: a barrier
    ``mapInPandas`` over ``spark.range(num_processes, numPartitions=num_processes)``, as
    TorchDistributor's own stage on Connect is a barrier ``mapInArrow`` (classic Spark and
    Connect alike).

    Raises:
        RuntimeError: the stage did not end within ``timeout_seconds``.
    """
    frame = spark.range(num_processes, numPartitions=num_processes).mapInPandas(
        _task_host, "partition int, host string", barrier=True
    )
    rows = run_probe(spark, frame, "placement probe", timeout_seconds)
    found = {int(r["partition"]): str(r["host"]) for r in rows}
    return [found[i] for i in range(num_processes)]


def check_placement(
    spark: SparkSession, loader: type[Loader], num_processes: int, timeout_seconds: float
) -> str:
    """Refuse, before any work, a placement of ranks on hosts that ``loader`` cannot read
    with: a barrier stage of ``num_processes`` tasks reports its hosts
    (:func:`placement_hosts`, seconds).

    Spark fills the executors' slots one task per executor per pass, in a shuffled order:
    where ``num_processes`` equals the cluster's slots the placement is fixed; below it,
    which executors get the last pass's tasks may differ from run to run, and the ranks
    check again (:meth:`~flowers_job.loaders.base.Loader.check_layout`) when they start.

    Returns:
        The layout seen (:meth:`HostLayout.describe`).

    Raises:
        ClusterError: the loader cannot serve it, naming ``data.loader`` and the layout.
    """
    layout = HostLayout.of(placement_hosts(spark, num_processes, timeout_seconds), 0)
    try:
        loader.check_layout(layout)
    except RuntimeError as exc:
        raise ClusterError(f"invalid configuration:\n  {exc}") from None
    return layout.describe()


def use_gpu(spark: SparkSession, cfg: JobConfig) -> bool:
    """Whether the ranks train on GPUs: ``distributed.use_gpu`` when set; otherwise, in local
    mode, a CUDA device on the driver; in barrier mode, tasks that ask for GPUs
    (``spark.task.resource.gpu.amount`` > 0)."""
    if cfg.distributed.use_gpu is not None:
        return cfg.distributed.use_gpu
    if cfg.distributed.local_mode:
        import torch

        return torch.cuda.is_available()
    return float(spark.conf.get("spark.task.resource.gpu.amount", "0") or 0) > 0


def _local_store(uri: str) -> bool:
    """An MLflow store on a local path (``sqlite:``, ``file:`` or a bare path)."""
    return urlparse(uri).scheme in ("", "file", "sqlite")


def check_cluster(spark: SparkSession, cfg: JobConfig, loader: type[Loader]) -> None:
    """Check ``distributed`` and ``tracking`` against this Spark cluster, and ``loader``'s
    placement of the ranks (the resolved loader), before any data is touched (seconds: on a cluster it waits for executors to register, at most
    ``distributed.executor_wait_seconds``).

    Every check works on a Spark Connect session too (:mod:`flowers_job.cluster.connect`).

    Raises:
        ClusterError: when
            - barrier mode (``local_mode=false``) asks for more processes than the cluster's
              task slots (:func:`~flowers_job.cluster.session.task_slots`: GPU slots when tasks ask
              for GPUs);
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
              the server's driver (:func:`~flowers_job.cluster.session.driver_gpus`), so it
              refuses them ("GPUs were unable to be found on the driver") or hands the
              client the server's GPUs; barrier mode is the GPU path there.
    """
    d = cfg.distributed
    problems = []
    local_master = is_local_master(spark)
    if not d.local_mode:
        slots = (
            task_slots(spark)
            if local_master
            else wait_for_slots(spark, d.num_processes, d.executor_wait_seconds)
        )
        if d.num_processes > slots:
            gpus = float(spark.conf.get("spark.task.resource.gpu.amount", "0") or 0)
            kind = (
                f"GPU task slots (spark.task.resource.gpu.amount={gpus:g} per task)"
                if gpus > 0
                else f"task slots (spark.task.cpus={spark.conf.get('spark.task.cpus', '1')})"
            )
            problems.append(
                f"distributed.num_processes: {d.num_processes} processes, but this Spark cluster "
                f"({spark_master(spark)}) has {slots} {kind}"
                + (
                    ""
                    if local_master
                    else " on the executors registered (distributed.executor_wait_seconds="
                    f"{d.executor_wait_seconds:g})"
                )
                + "; barrier mode (distributed.local_mode=false) runs one task per process, "
                "all at once"
            )
        if not local_master and _local_store(cfg.tracking_uri) and not cfg.tracking.store_is_shared:
            problems.append(
                f"tracking.tracking_uri: {cfg.tracking_uri} is a store on a local path, and with "
                "distributed.local_mode=false rank 0 logs and registers from an executor on "
                "another host: use an MLflow tracking server (http://HOST:5000, databricks), "
                "or set tracking.store_is_shared=true if the path is on storage every host "
                "shares (checked; sqlite over NFS or FUSE is unreliable)"
            )
    elif use_gpu(spark, cfg) and is_connect_session(spark):
        problems.append(
            "distributed.use_gpu: GPUs requested with distributed.local_mode=true on a Spark "
            "Connect session: local mode runs the processes on this client, and pyspark's "
            "TorchDistributor on Connect looks for GPUs on the server's driver (it refuses "
            "with 'GPUs were unable to be found on the driver'); set "
            "distributed.local_mode=false (barrier tasks on the executors' GPUs, "
            "spark.task.resource.gpu.amount) or distributed.use_gpu=false"
        )
    elif use_gpu(spark, cfg):
        import torch

        gpus = torch.cuda.device_count()
        spark_gpus = driver_gpus(spark)
        if gpus == 0:
            problems.append(
                "distributed.use_gpu: GPUs requested, but the driver has no CUDA device "
                "(local mode runs every process on the driver)"
            )
        elif d.num_processes > gpus:
            problems.append(
                f"distributed.num_processes: {d.num_processes} processes, but the driver has "
                f"{gpus} CUDA devices (local mode on GPUs: one device per process; set "
                f"distributed.num_processes={gpus})"
            )
        elif len(spark_gpus) < d.num_processes:
            problems.append(
                f"distributed.use_gpu: the Spark session's driver has {len(spark_gpus)} GPUs "
                f"as a resource and TorchDistributor's local mode needs {d.num_processes}: "
                "start the session with spark.driver.resource.gpu.amount and "
                "spark.driver.resource.gpu.discoveryScript (flowers_job.cluster.session.get_spark does "
                "when it finds CUDA devices; flowers_job.cluster.session.local_gpu_conf gives them)"
            )
    if problems:
        raise ClusterError("invalid configuration:\n  " + "\n  ".join(problems))
    if not d.local_mode and not local_master and loader.places_ranks:
        layout = check_placement(spark, loader, d.num_processes, PROBE_TIMEOUT_SECONDS)
        log.info("barrier tasks placed on the hosts as %s", layout)
