"""The job, driver side: checks -> ingest -> prepare -> TorchDistributor -> summary -> champion.

Everything here runs on the Spark driver; the only code shipped to the training processes
is :func:`flowers_job.train.rank.train_worker` with a typed job (:func:`training_job`).

Every check runs once, and the ones that leave nothing behind come first: :func:`preflight`
(the loader on this stack, the images root, the packages the end of the run needs; no
Spark), :func:`check_cluster` (task slots, GPUs, the tracking store's reach), then
:func:`check_tracking` (it creates the MLflow experiment) and the executor probe.
:func:`run_job` and :func:`run_training` run them all, then the work. The CLI runs
:func:`preflight` and :func:`check_tracking` before it starts Spark (an unusable store
fails in seconds, with no JVM), then :func:`check_on_cluster` and :func:`execute`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pyspark.sql import SparkSession

from flowers_job.cluster import placement
from flowers_job.cluster.connect import connect_reason, session_kind
from flowers_job.cluster.executor_cores import executor_cores
from flowers_job.cluster.executor_probe import check_executors
from flowers_job.cluster.placement import check_cluster
from flowers_job.config import ConfigError, JobConfig, resolve_embeddings
from flowers_job.driver.failures import (
    TrainingError,
    check_finished,
    failure,
    registered_model,
    wait_for_reports,
)
from flowers_job.driver.lease import output_lease
from flowers_job.driver.prepare import PreparedData, check_resume, prepare_data
from flowers_job.driver.promotion import promote
from flowers_job.driver.restarts import (
    Restart,
    begin_training,
    end_stale_run,
    read_first_step,
    refusal,
    restart_processes,
)
from flowers_job.driver.runs import record_driver
from flowers_job.ingest.job import IngestReport, check_images_root, ingest
from flowers_job.loaders import check_session, resolve_loader
from flowers_job.loaders.base import Loader
from flowers_job.location import Location
from flowers_job.runtime.allocator import apply_to_environ
from flowers_job.runtime.parent_watch import driver_identity
from flowers_job.tables.delta_tables import TABLE_NAMES
from flowers_job.tables.table_ref import table_ref
from flowers_job.tracking.mlflow_run import TrackingError
from flowers_job.tracking.mlflow_run import preflight as tracking_preflight
from flowers_job.train.job_spec import SPLITS, TrainingJob

__all__ = [
    "CheckedJob",
    "Command",
    "TrainingError",
    "check_cluster",
    "check_on_cluster",
    "check_tracking",
    "execute",
    "preflight",
    "run_ingest",
    "run_job",
    "run_training",
    "training_job",
    "write_summary",
]

log = logging.getLogger(__name__)

Command = Literal["ingest", "train", "run"]
"""What the job does: ingest the photos, train on the tables, or both."""


@dataclass(frozen=True)
class CheckedJob:
    """What the checks before Spark (:func:`preflight`) hand the rest of the run."""

    cfg: JobConfig
    """The configuration, ``data.loader`` resolved for ``train``/``run``."""
    loader: type[Loader] | None
    """The loader, resolved once (:func:`~flowers_job.loaders.resolve_loader`): its driver
    side writes the caches, its rank side travels in the ranks' job. None for ``ingest``."""

    @property
    def training_loader(self) -> type[Loader]:
        """:attr:`loader`, for a command that trains.

        Raises:
            ValueError: the job was checked for ``ingest`` only (no loader).
        """
        if self.loader is None:
            raise ValueError("this job was checked for ingest only: no loader was resolved")
        return self.loader


def preflight(cfg: JobConfig, command: Command, connect: str | None = None) -> CheckedJob:
    """The checks that need no Spark and leave nothing behind (seconds, no JVM), the
    configuration's before the input's:

    - ``train``/``run``: ``data.loader`` can run on this stack and on this kind of session
      ('auto' resolved; ``connect``: what makes the session Spark Connect, None for classic
      Spark: :func:`~flowers_job.loaders.resolve_loader`), ``embeddings.enabled: auto``
      decided after it (:func:`~flowers_job.config.resolve_embeddings`; off on Spark
      Connect, whose tables delta-rs cannot read), and the packages
      the end of the run needs are importable;
    - ``ingest``/``run``: ``data.images`` is a directory with label folders.

    Returns:
        ``cfg`` with ``data.loader`` and ``embeddings.enabled`` resolved, and the loader,
        for ``train``/``run`` (``cfg`` and no loader for ``ingest``).

    Raises:
        ConfigError: the loader cannot run here, the embeddings cannot be read by it, or
            a package the run needs is missing.
        IngestError: ``data.images`` is not a usable images root.
    """
    from flowers_job.tracking.packages import check_run_packages

    loader = None
    if command in ("train", "run"):
        cfg, loader = resolve_loader(cfg, connect)
        auto = cfg.embeddings.enabled == "auto"
        # A table a Spark Connect session writes types its strings 'string collate
        # UTF8_BINARY', which delta-rs cannot read (docs/known-issues.md, "Delta"): the
        # embeddings table this run would write could not be read by its ranks.
        cfg = resolve_embeddings(cfg, loader.reads_table and connect is None)
        if auto:
            log.info("embeddings.enabled=auto: %s", str(cfg.embeddings.enabled).lower())
        if cfg.embeddings.enabled is True and connect is not None:
            raise ConfigError(
                "embeddings.enabled: a Spark Connect session would write the embeddings "
                "table with string types delta-rs cannot read (docs/known-issues.md); set "
                "embeddings.enabled=false, or run on classic Spark"
            )
        if cfg.embeddings.enabled is True and not loader.reads_table:
            raise ConfigError(
                "embeddings.enabled: the embeddings table is read by the Delta loader "
                f"(path tables, classic Spark, deltalake installed); data.loader resolved to "
                f"{loader.name} here: set embeddings.enabled=false, or run where the Delta "
                "loader runs"
            )
        check_run_packages()
    if command in ("ingest", "run"):
        check_images_root(cfg)
    return CheckedJob(cfg, loader)


def check_tracking(cfg: JobConfig) -> None:
    """The MLflow store answers and holds the experiment (created if need be); the
    configured credentials are exported for the training processes
    (:func:`flowers_job.tracking.mlflow_run.preflight`). No Spark.

    Raises:
        TrackingError: the MLflow store cannot be used.
    """
    tracking_preflight(cfg)


def check_on_cluster(spark: SparkSession, job: CheckedJob) -> None:
    """The checks against the Spark session, before any data is touched:
    :func:`check_cluster`, then the shared storage and the tracking server's credentials
    on every executor (:func:`~flowers_job.cluster.executor_probe.check_executors`).

    Raises:
        ConfigError: naming the setting that does not fit this cluster or its executors.
    """
    check_session(job.training_loader, connect_reason(spark), job.cfg)
    check_cluster(spark, job.cfg, job.training_loader)
    check_executors(spark, job.cfg)


def _check_all(spark: SparkSession, cfg: JobConfig, command: Command) -> CheckedJob:
    """Every check once, those that write nothing first (:func:`preflight`,
    :func:`check_cluster`); the log's first line says which kind of session the job has."""
    log.info("%s", session_kind(spark))
    job = preflight(cfg, command, connect_reason(spark))
    check_cluster(spark, job.cfg, job.training_loader)
    check_tracking(job.cfg)
    check_executors(spark, job.cfg)
    return job


def execute(spark: SparkSession, job: CheckedJob, command: Command) -> dict[str, Any]:
    """Run ``command`` on a configuration that passed :func:`preflight` and
    :func:`check_on_cluster` (for ``train``/``run``).

    Returns:
        The ingest report as a dict (``ingest``), or the run's summary.
    """
    t0 = time.perf_counter()
    cfg = job.cfg
    if command == "ingest":
        return run_ingest(spark, cfg).to_dict()
    report = run_ingest(spark, cfg) if command == "run" else None
    summary = _train(spark, cfg, job.training_loader, report)
    if command == "run":
        summary["job_seconds"] = time.perf_counter() - t0
        write_summary(summary, cfg.paths.summary_path)
    return summary


def run_training(spark: SparkSession, cfg: JobConfig) -> dict[str, Any]:
    """Train on the Delta tables with TorchDistributor and write ``summary.json``.

    Returns:
        The summary (also written to ``<output_dir>/summary.json``).

    Raises:
        ConfigError: ``data.loader`` cannot run on this stack or this kind of session, a
            package is missing (:func:`preflight`), or ``distributed`` does not fit this
            cluster (:func:`check_cluster`), before any work.
        OutputInUseError: another command holds the lease on ``paths.output_dir``
            (:mod:`flowers_job.driver.lease`, held for the whole run), before any work.
        DataError: missing/inconsistent tables or unworkable shards (before any worker starts).
        TrackingError: the MLflow store is unusable (before any worker starts), or the
            champion decision (:func:`~flowers_job.driver.promotion.promote`) failed after the
            model was registered (``summary.json`` is written first).
        TrainingError: a rank failed; the message names the rank and its exception.
    """
    job = _check_all(spark, cfg, "train")  # a check that fails leaves the output as it was
    with output_lease(cfg.paths.output_dir, "train"):  # one writer per output
        return execute(spark, job, "train")


def run_job(spark: SparkSession, cfg: JobConfig) -> dict[str, Any]:
    """Ingest, then train: the whole Databricks "flowers" pipeline.

    Every check runs once, before the ingest, so that a job bound to fail does no work
    (errors as for :func:`run_training`, plus ``IngestError``).
    """
    job = _check_all(spark, cfg, "run")  # a check that fails leaves the output as it was
    with output_lease(cfg.paths.output_dir, "run"):  # one writer per output
        return execute(spark, job, "run")


def run_ingest(spark: SparkSession, cfg: JobConfig) -> IngestReport:
    """Images folder -> Delta tables (see :func:`flowers_job.ingest.job.ingest`)."""
    t0 = time.perf_counter()
    with output_lease(cfg.paths.output_dir, "ingest"):  # held already under run/the CLI
        report = ingest(spark, cfg)
    log.info(
        "ingest: %d files -> %d images (train %d, val %d, test %d), %d quarantined %s; %s: "
        "%d decoded, images +%d ~%d -%d, %d quarantined by this run, in %.1f s",
        report.files,
        report.images_rows,
        report.train_rows,
        report.val_rows,
        report.test_rows,
        report.quarantined_rows,
        report.quarantine_reasons or "",
        report.mode,
        report.files_decoded,
        report.rows_inserted,
        report.rows_updated,
        report.rows_deleted,
        report.rows_quarantined,
        time.perf_counter() - t0,
    )
    return report


def _threads_per_process(cfg: JobConfig) -> int | None:
    """Local mode: the driver's cores shared by the ranks. Barrier mode: None, each rank
    decides from its executor's cores (:func:`flowers_job.train.rank.threads_for_rank`)."""
    if cfg.distributed.local_mode:
        return max(1, (os.cpu_count() or 1) // cfg.world_size)
    return None


def training_job(
    spark: SparkSession,
    cfg: JobConfig,
    data: PreparedData,
    report_dir: str,
    use_gpu: bool,
    attempt: int = 0,
) -> TrainingJob:
    """What every rank receives: ``TorchDistributor.run(train_worker, job)``
    (:class:`~flowers_job.train.job_spec.TrainingJob`).

    ``config`` is ``cfg.model_dump(mode="json")``, which leaves out the secret fields
    (``tracking.password``/``token``): the workers get those from the environment only
    (:func:`flowers_job.tracking.mlflow_run.use_credentials`). ``attempt``: 0, or the automatic
    restart (:mod:`flowers_job.driver.restarts`).
    """
    return TrainingJob(
        config=cfg.model_dump(mode="json"),
        plans={split: getattr(data, split).to_dict() for split in SPLITS},
        loader=data.loader,
        report_dir=report_dir,
        label_names=tuple(data.label_names),
        lineage=dict(data.lineage),
        example_images=tuple(data.example_images),
        use_gpu=use_gpu,
        threads_per_process=_threads_per_process(cfg),
        executor_cores={} if cfg.distributed.local_mode else executor_cores(spark),
        task_cpus=int(spark.conf.get("spark.task.cpus", "1") or 1),
        memory_settings={
            "train.per_device_batch_size": str(cfg.train.per_device_batch_size),
            "data.loader_workers": str(cfg.data.loader_workers),
            **data.loader.memory_settings(cfg.loaders),
        },
        driver=driver_identity(),
        attempt=attempt,
    )


def _attempt(
    spark: SparkSession, cfg: JobConfig, data: PreparedData, use_gpu: bool, restarts: list[Restart]
) -> tuple[dict[str, Any] | None, TrainingError | None]:
    """One TorchDistributor run: rank 0's result (and its registered model), or the
    :class:`TrainingError` that names the failing rank. The last restart's record gets the
    times this attempt's rank 0 reported (:data:`~flowers_job.runtime.reports.FIRST_STEP_FILE`)."""
    from pyspark.ml.torch.distributor import TorchDistributor

    from flowers_job.train.rank import train_worker

    d = cfg.distributed
    with report_dir(cfg.paths.output_dir) as reports:
        failure_dir = reports.url
        job = training_job(spark, cfg, data, failure_dir, use_gpu, attempt=len(restarts))
        apply_to_environ()  # local mode's ranks inherit it (a session made elsewhere too)
        record_driver(cfg.paths.checkpoint_dir)  # who drives the run (flowers-job runs)
        distributor = TorchDistributor(
            num_processes=d.num_processes, local_mode=d.local_mode, use_gpu=use_gpu
        )
        error: TrainingError | None = None
        try:
            result = distributor.run(train_worker, job)
            check_finished(reports, cfg.world_size)
            if not isinstance(result, dict):
                raise failure(
                    reports, RuntimeError(f"no result from rank 0 ({result!r})"), cfg.world_size
                )
        except TrainingError as exc:
            error = exc
        except Exception as exc:
            wait_for_reports(reports, cfg.world_size)  # before reading and removing the dir
            error = failure(reports, exc, cfg.world_size)
            error.__cause__ = exc
        if restarts:
            restarts[-1].complete(read_first_step(reports))
        if error is not None:
            end_stale_run(cfg, error)
            return None, error
        assert isinstance(result, dict)
        return {**result, **registered_model(reports)}, None


def _restart(
    spark: SparkSession,
    cfg: JobConfig,
    error: TrainingError,
    errors: list[TrainingError],
    restarts: list[Restart],
    wanted: int,
) -> JobConfig:
    """After a failed attempt: the configuration of the next one (resuming from the last
    checkpoint, with the processes that fit), or ``error`` raised again, with why it is not
    restarted (:func:`~flowers_job.driver.restarts.refusal`)."""
    why = refusal(error, len(restarts), cfg, errors)
    if why is not None:
        if cfg.train.max_restarts > 0:
            error.args = (f"{error}\nnot restarted: {why}",)
        raise error
    try:
        processes = restart_processes(spark, cfg, wanted)
    except ConfigError as exc:
        error.args = (f"{error}\nnot restarted: {exc}",)
        raise error from exc
    restarts.append(Restart.after(error, len(restarts) + 1, cfg.world_size, processes))
    log.warning(
        "restart %d of at most %d, from the last checkpoint, with %d processes, after: %s",
        len(restarts),
        cfg.train.max_restarts,
        processes,
        str(error).splitlines()[0],
    )
    return cfg.model_copy(
        update={
            "train": cfg.train.model_copy(update={"resume": True}),
            "distributed": cfg.distributed.model_copy(update={"num_processes": processes}),
        }
    )


def _train(
    spark: SparkSession,
    cfg: JobConfig,
    loader: type[Loader],
    ingest_report: IngestReport | None = None,
) -> dict[str, Any]:
    """Train on the Delta tables with TorchDistributor (checks done), restarting after a
    failure that may be transient (:mod:`flowers_job.driver.restarts`), write ``summary.json`` and
    decide the champion; errors as :func:`run_training`'s after its checks."""
    use_gpu = placement.use_gpu(spark, cfg.distributed)
    wanted = cfg.distributed.num_processes
    restarts: list[Restart] = []
    errors: list[TrainingError] = []
    while True:
        with prepare_data(spark, cfg, loader) as data:
            if not restarts:  # the data is ready: only now may a new run clear the last one's
                cfg = begin_training(cfg)
                check_resume(cfg, data)  # before the ranks start: the same data, optimizer
            result, error = _attempt(spark, cfg, data, use_gpu, restarts)
            if error is None:
                assert result is not None
                summary = _summary(spark, cfg, data, result, ingest_report, restarts)
                break
        cfg = _restart(spark, cfg, error, errors, restarts, wanted)
        errors.append(error)
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


def _summary(
    spark: SparkSession,
    cfg: JobConfig,
    data: PreparedData,
    result: dict[str, Any],
    ingest_report: IngestReport | None,
    restarts: list[Restart],
) -> dict[str, Any]:
    """``summary.json``: rank 0's result, the data's sizes, where everything is, and the
    restarts it took."""
    quarantined = (
        ingest_report.quarantined_rows
        if ingest_report is not None
        else table_ref(cfg, "quarantine").read(spark).count()
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
        "local_mode": cfg.distributed.local_mode,
        "mlflow_tracking_uri": cfg.tracking_uri,
        "tables": {name: table_ref(cfg, name).describe() for name in TABLE_NAMES},
        "loader_cache": data.loader_cache,
        "embeddings": data.embeddings,
        "restarts": len(restarts),
        "restart_history": [r.to_dict() for r in restarts],
        "history": result["history"],
    }
    if ingest_report is not None:
        summary["ingest"] = ingest_report.to_dict()
    return summary


def write_summary(summary: dict[str, Any], path: Location | Path) -> None:
    """Write ``summary`` as JSON, whole or not at all (:meth:`Location.write_bytes`)."""
    Location.of(path).write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")


@contextmanager
def report_dir(output_dir: Location) -> Iterator[Location]:
    """One attempt's failure-report dir ``<output_dir>/flowers-failures-<random>``, where the
    ranks write their reports and the driver reads them; removed on exit."""
    if output_dir.is_local:
        output_dir.mkdir()
        with tempfile.TemporaryDirectory(prefix="flowers-failures-", dir=output_dir) as path:
            yield Location.of(path)
        return
    reports = output_dir / f"flowers-failures-{uuid.uuid4().hex[:12]}"
    try:
        yield reports
    finally:
        with contextlib.suppress(OSError):
            reports.rmtree()
