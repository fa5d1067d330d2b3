"""The job, driver side: ingest -> prepare -> TorchDistributor -> summary.json -> champion.

``run_job`` = ``run_ingest`` + ``run_training``. Everything here runs on the Spark
driver; the only code shipped to the training processes is
:func:`flowers_job.train.worker.train_worker` with plain data.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pyspark.sql import SparkSession

from flowers_job.allocator import apply_to_environ
from flowers_job.config import ConfigError, JobConfig
from flowers_job.data.ingest import TABLE_NAMES, IngestReport, ingest
from flowers_job.data.prepare import PreparedData, prepare_data
from flowers_job.data.stack import resolve_loader
from flowers_job.processes import driver_identity
from flowers_job.promotion import promote
from flowers_job.spark import driver_gpus, executor_cores, task_slots, wait_for_slots
from flowers_job.storage import check_shared_storage, is_local_master
from flowers_job.tracking import TrackingError, preflight

__all__ = [
    "TrainingError",
    "check_cluster",
    "run_ingest",
    "run_job",
    "run_training",
    "training_job",
    "write_summary",
]

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Distributed training failed. ``rank`` and ``cause`` name the first failing rank;
    ``reported_at`` is when that rank reported it (seconds since the epoch)."""

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        cause: str | None = None,
        reported_at: float | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.cause = cause
        self.reported_at = reported_at


def run_ingest(spark: SparkSession, cfg: JobConfig) -> IngestReport:
    """Images folder -> Delta tables (see :func:`flowers_job.data.ingest.ingest`)."""
    t0 = time.perf_counter()
    report = ingest(spark, cfg)
    log.info(
        "ingest: %d files -> %d images (train %d, val %d, test %d), %d quarantined %s, %s in "
        "%.1f s",
        report.files,
        report.images_rows,
        report.train_rows,
        report.val_rows,
        report.test_rows,
        report.quarantined_rows,
        report.quarantine_reasons or "",
        "written" if report.written else "unchanged",
        time.perf_counter() - t0,
    )
    return report


def _use_gpu(spark: SparkSession, cfg: JobConfig) -> bool:
    if cfg.distributed.use_gpu is not None:
        return cfg.distributed.use_gpu
    if cfg.distributed.local_mode:
        import torch

        return torch.cuda.is_available()
    return float(spark.conf.get("spark.task.resource.gpu.amount", "0") or 0) > 0


def _local_store(uri: str) -> bool:
    """An MLflow store on a local path (``sqlite:``, ``file:`` or a bare path)."""
    return urlparse(uri).scheme in ("", "file", "sqlite")


def check_cluster(spark: SparkSession, cfg: JobConfig) -> None:
    """Check ``distributed`` and ``tracking`` against this Spark cluster, before any data is
    touched (seconds: on a cluster it waits for executors to register, at most
    ``distributed.executor_wait_seconds``).

    Raises:
        ConfigError: naming the setting, when
            - barrier mode (``local_mode=false``) asks for more processes than the cluster's
              task slots (:func:`~flowers_job.spark.task_slots`: GPU slots when tasks ask
              for GPUs);
            - barrier mode on a real cluster (not ``local[...]``) with a ``sqlite:``/``file:``
              tracking store not declared shared (``tracking.store_is_shared``): rank 0
              writes it from an executor, on another host than the driver;
            - GPUs are requested in local mode with fewer CUDA devices on the driver than
              processes, or a session whose driver has fewer ``gpu`` resources than
              processes (TorchDistributor would refuse only after the data is prepared).
    """
    d = cfg.distributed
    problems = []
    if not d.local_mode:
        local_master = is_local_master(spark)
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
                f"({spark.sparkContext.master}) has {slots} {kind}"
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
    elif _use_gpu(spark, cfg):
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
                "spark.driver.resource.gpu.discoveryScript (flowers_job.spark.get_spark does "
                "when it finds CUDA devices; flowers_job.spark.local_gpu_conf gives them)"
            )
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


def _threads_per_process(cfg: JobConfig) -> int | None:
    """Local mode: the driver's cores shared by the ranks. Barrier mode: None, each rank
    decides from its executor's cores (:func:`flowers_job.train.worker.threads_for_rank`)."""
    if cfg.distributed.local_mode:
        return max(1, (os.cpu_count() or 1) // cfg.world_size)
    return None


def _failure(failure_dir: Path, exc: BaseException, world_size: int) -> TrainingError:
    """The driver's error for a failed TorchDistributor run, from the ranks' reports.

    Two kinds of report, in ``failure_dir``: ``rank-<r>.json``, the exception and traceback
    of a rank whose Python code raised, and ``rank-<r>.fatal``, what :mod:`faulthandler`
    wrote when a rank died of a fatal signal (a crash in native code: SIGSEGV, SIGABRT, ...)
    and every thread's Python stack. The first (by time) names the rank and its cause; the
    others are usually its consequences (a collective that lost its peer, torchrun's
    SIGTERM) and are listed after it. Ranks that wrote neither were stopped from outside:
    hung (the others' collectives then time out), killed by torchrun after another rank
    failed, or killed by the OS (SIGKILL, the OOM killer).
    """
    from flowers_job.train.worker import FATAL_SUFFIX

    reports = []
    for path in sorted(failure_dir.glob("rank-*.json")):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    for path in sorted(failure_dir.glob(f"rank-*{FATAL_SUFFIX}")):
        try:
            text = path.read_text(errors="replace").strip()
            if text:
                reports.append(_fatal_report(path, text))
        except OSError:
            continue
    if not reports:
        return TrainingError(
            f"distributed training failed and no rank reported an exception (killed by the OS, "
            f"out of memory?): {exc}"
        )
    reports.sort(key=lambda r: r.get("time", 0.0))
    first = reports[0]
    where = _rank_hosts(failure_dir)
    silent = sorted(set(range(world_size)) - {int(r["rank"]) for r in reports})
    then = "".join(
        f"\nthen rank {r['rank']}: {r['type']}: {r['message']}"
        for r in reports[1:]
        if r["rank"] != first["rank"]
    )
    note = (
        f"\nranks {', '.join(f'{r}{where.get(r, str())}' for r in silent)} reported no "
        "exception: killed (with their host, executor or driver), stopped after the failure, "
        "or hung (a collective that times out names distributed.timeout_seconds)"
        if silent
        else ""
    )
    what = "died of a fatal signal" if first["type"] == "FatalSignal" else "failed"
    return TrainingError(
        f"rank {first['rank']} {what}{where.get(int(first['rank']), '')}: {first['type']}: "
        f"{first['message']}{then}{note}\n"
        f"--- traceback of rank {first['rank']} ---\n{first['traceback']}",
        rank=first["rank"],
        cause=f"{first['type']}: {first['message']}",
        reported_at=first.get("time"),
    )


def _fatal_report(path: Path, text: str) -> dict[str, Any]:
    """A ``rank-<r>.fatal`` file as a report: type ``FatalSignal``, the message from
    faulthandler's first line ("Fatal Python error: Aborted" -> "Aborted"), the stacks as
    the traceback, and the file's modification time as the time."""
    rank = int(path.name.split("-", 1)[1].split(".", 1)[0])
    first_line = text.splitlines()[0]
    return {
        "rank": rank,
        "type": "FatalSignal",
        "message": first_line.removeprefix("Fatal Python error:").strip(),
        "traceback": text,
        "time": path.stat().st_mtime,
    }


def _check_finished(failure_dir: Path, world_size: int) -> None:
    """After TorchDistributor returned: raise if a rank failed anyway, or rank 0 did not
    record the registered model.

    TorchDistributor's local mode reads the result file that *any* rank wrote, and pyspark
    4.0's ``torch_run_process_wrapper`` exits 0 whatever torchrun's status; so a run can
    "succeed" while a rank crashed, or while torchrun stopped rank 0 in the middle of the
    model registration that follows the last collective.

    Raises:
        TrainingError: a rank wrote a report, or ``model.json`` is missing.
    """
    from flowers_job.train.worker import FATAL_SUFFIX, MODEL_FILE

    fatal = [p for p in failure_dir.glob(f"rank-*{FATAL_SUFFIX}") if p.stat().st_size > 0]
    if fatal or list(failure_dir.glob("rank-*.json")):
        raise _failure(failure_dir, RuntimeError("a rank failed after training"), world_size)
    if not (failure_dir / MODEL_FILE).exists():
        raise TrainingError(
            f"rank 0 did not finish: TorchDistributor returned, but rank 0 wrote no {MODEL_FILE} "
            "(it logs and registers the model after the last collective); it was stopped or "
            "killed from outside (torchrun, the OS) without reporting an exception",
            rank=0,
            cause="no registered model",
        )


def _rank_hosts(report_dir: Path) -> dict[int, str]:
    """`` on host (address)`` of each rank, from rank 0's ``ranks.json`` ({} without one)."""
    from flowers_job.train.worker import RANKS_FILE

    try:
        ranks = json.loads((report_dir / RANKS_FILE).read_text())["ranks"]
        return {int(r["rank"]): f" on host {r['host']} ({r['address']})" for r in ranks}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _registered_model(report_dir: Path) -> dict[str, Any]:
    """What rank 0 wrote after registering the model (``model.json``), or {}."""
    from flowers_job.train.worker import MODEL_FILE

    try:
        return dict(json.loads((report_dir / MODEL_FILE).read_text()))
    except (OSError, ValueError):
        return {}


def training_job(
    spark: SparkSession, cfg: JobConfig, data: PreparedData, failure_dir: str, use_gpu: bool
) -> dict[str, Any]:
    """The plain data every rank receives: ``TorchDistributor.run(train_worker, job)``.

    ``config`` is ``cfg.model_dump(mode="json")``, which leaves out the secret fields
    (``tracking.password``/``token``): the workers get those from the environment only
    (:func:`flowers_job.tracking.use_credentials`).
    """
    return {
        "config": cfg.model_dump(mode="json"),
        "train": data.train.to_dict(),
        "val": data.val.to_dict(),
        "test": data.test.to_dict(),
        "label_names": data.label_names,
        "lineage": data.lineage,
        "example_images": data.example_images,
        "use_gpu": use_gpu,
        "threads_per_process": _threads_per_process(cfg),
        "executor_cores": {} if cfg.distributed.local_mode else executor_cores(spark),
        "task_cpus": int(spark.conf.get("spark.task.cpus", "1") or 1),
        "failure_dir": failure_dir,
        "driver": driver_identity(),
    }


def run_training(
    spark: SparkSession, cfg: JobConfig, ingest_report: IngestReport | None = None
) -> dict[str, Any]:
    """Train on the Delta tables with TorchDistributor and write ``summary.json``.

    Returns:
        The summary (also written to ``<output_dir>/summary.json``).

    Raises:
        ConfigError: ``distributed`` does not fit this cluster (:func:`check_cluster`), or
            ``data.loader`` cannot run on this stack (:func:`resolve_loader`), before any work.
        DataError: missing/inconsistent tables or unworkable shards (before any worker starts).
        TrackingError: the MLflow store is unusable (before any worker starts), or the
            champion decision (:func:`~flowers_job.promotion.promote`) failed after the
            model was registered (``summary.json`` is written first).
        TrainingError: a rank failed; the message names the rank and its exception.
    """
    from pyspark.ml.torch.distributor import TorchDistributor

    from flowers_job.train.worker import train_worker

    cfg = resolve_loader(cfg)
    d = cfg.distributed
    check_cluster(spark, cfg)
    check_shared_storage(spark, cfg)
    use_gpu = _use_gpu(spark, cfg)
    preflight(cfg)
    with (
        prepare_data(spark, cfg) as data,
        tempfile.TemporaryDirectory(
            prefix="flowers-failures-", dir=cfg.paths.output_dir
        ) as failure_dir,
    ):
        job = training_job(spark, cfg, data, failure_dir, use_gpu)
        apply_to_environ()  # local mode's ranks inherit it (a session made elsewhere too)
        distributor = TorchDistributor(
            num_processes=d.num_processes, local_mode=d.local_mode, use_gpu=use_gpu
        )
        try:
            result = distributor.run(train_worker, job)
        except Exception as exc:
            raise _failure(Path(failure_dir), exc, cfg.world_size) from exc
        _check_finished(Path(failure_dir), cfg.world_size)
        if not isinstance(result, dict):
            raise _failure(
                Path(failure_dir),
                RuntimeError(f"no result from rank 0 ({result!r})"),
                cfg.world_size,
            )
        result = {**result, **_registered_model(Path(failure_dir))}
        quarantined = (
            ingest_report.quarantined_rows
            if ingest_report is not None
            else spark.read.format("delta").load(str(cfg.paths.table("quarantine"))).count()
        )
        summary = {
            **{k: v for k, v in result.items() if k != "history"},
            "train_rows": data.train.dataset_size,
            "val_rows": data.val.dataset_size,
            "test_rows": data.test.dataset_size,
            "quarantined_rows": int(quarantined),
            "num_partitions": data.num_partitions,
            "rows_per_shard": {
                "train": data.train.rows_per_shard,
                "val": data.val.rows_per_shard,
                "test": data.test.rows_per_shard,
            },
            "label_names": data.label_names,
            "local_mode": d.local_mode,
            "mlflow_tracking_uri": cfg.tracking_uri,
            "tables": {name: str(cfg.paths.table(name)) for name in TABLE_NAMES},
            "history": result["history"],
        }
    if ingest_report is not None:
        summary["ingest"] = ingest_report.to_dict()
    write_summary(summary, cfg.paths.summary_path)
    try:
        decision = promote(spark, cfg, summary)
    except Exception as exc:
        raise TrackingError(
            f"the model was registered (version {summary.get('registered_model_version')}), "
            f"but the champion decision failed: {type(exc).__name__}: {exc}"
        ) from exc
    if decision is not None:
        summary["promotion"] = decision.to_dict()
        write_summary(summary, cfg.paths.summary_path)
    return summary


def run_job(spark: SparkSession, cfg: JobConfig) -> dict[str, Any]:
    """Ingest, then train: the whole Databricks "flowers" pipeline.

    The cluster and the MLflow store are checked before the ingest, so that a job bound to
    fail does no work (errors as for :func:`run_training`, plus ``IngestError``).
    """
    t0 = time.perf_counter()
    cfg = resolve_loader(cfg)
    check_cluster(spark, cfg)
    preflight(cfg)
    check_shared_storage(spark, cfg)
    report = run_ingest(spark, cfg)
    summary = run_training(spark, cfg, report)
    summary["job_seconds"] = time.perf_counter() - t0
    write_summary(summary, cfg.paths.summary_path)
    return summary


def write_summary(summary: dict[str, Any], path: Path) -> None:
    """Write ``summary`` as JSON, atomically (temporary file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)
