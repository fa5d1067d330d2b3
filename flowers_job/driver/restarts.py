"""Automatic restarts (driver side): which failures are retried, with how many processes,
and what each restart cost.

After a failed attempt the driver asks :func:`refusal` whether to restart. A failure that
may be transient is retried, up to ``train.max_restarts`` times in one job, from the last
checkpoint, in the same MLflow run: a rank killed or aborted (a signal, the OOM killer), a
host or executor lost, a collective timeout, a connection closed (the kinds of
:class:`~flowers_job.driver.failures.TrainingError`). A failure that cannot go away fails at once:
a configuration, data or shard error; an exception before the first checkpoint; the same
exception as an earlier attempt (deterministic). Ray Train's ``FailureConfig(max_failures)``
and TorchElastic's ``--max-restarts`` restart the same way; TorchDistributor itself has no
retry, and Spark does not retry a barrier stage task by task.

Before a restart in barrier mode the driver counts the task slots again
(:func:`restart_processes`): with fewer than ``distributed.num_processes`` it continues with
as many as fit when ``distributed.min_processes`` allows it, else it fails naming the slots.

Torch-free and Spark-free at import: rank 0 writes :data:`~flowers_job.runtime.reports.FIRST_STEP_FILE`
(:func:`~flowers_job.runtime.reports.write_json`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowers_job.location import Location
from flowers_job.runtime.reports import FIRST_STEP_FILE

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from flowers_job.config import JobConfig
    from flowers_job.driver.failures import TrainingError

__all__ = [
    "TRANSIENT_KINDS",
    "Restart",
    "begin_training",
    "checkpoint_exists",
    "end_stale_run",
    "read_first_step",
    "refusal",
    "restart_processes",
]

log = logging.getLogger(__name__)

TRANSIENT_KINDS = frozenset({"killed", "fatal_signal", "timeout", "connection"})
"""Failure kinds (:attr:`TrainingError.kind <flowers_job.driver.failures.TrainingError>`) that
may not happen again: restarted whenever restarts remain."""


def read_first_step(report_dir: Location | Path) -> dict[str, Any] | None:
    """:data:`~flowers_job.runtime.reports.FIRST_STEP_FILE` of an attempt, or None (rank 0 never trained a step)."""
    try:
        return dict(json.loads((Location.of(report_dir) / FIRST_STEP_FILE).read_text()))
    except (OSError, ValueError):
        return None


def checkpoint_exists(cfg: JobConfig) -> bool:
    """Whether a checkpoint (an epoch's, or one inside an epoch) exists to restart from."""
    from flowers_job.train.checkpoint import CHECKPOINT_NAME, STEP_CHECKPOINT_NAME

    directory = cfg.paths.checkpoint_dir
    return any((directory / n).exists() for n in (CHECKPOINT_NAME, STEP_CHECKPOINT_NAME))


@dataclass
class Restart:
    """One automatic restart, as ``summary.json``'s ``restart_history`` lists it.

    Attributes:
        attempt: the attempt it started (1 for the first restart).
        cause: the failed attempt's error, first line; kind: its kind; rank: the rank named.
        failed_at: when that rank failed (seconds since the epoch).
        world_size_before, world_size_after: processes of the failed and the next attempt.
        resumed_from: the checkpoint the next attempt continued (epoch, step, saved_at).
        lost_work_seconds: training done after that checkpoint and lost (failed_at -
            saved_at).
        restart_seconds: from the failure to the next attempt's first training step (the
            failure surfacing, the ranks stopping, the driver's restart, the processes,
            the model and the readers starting, Petastorm's replay of an epoch's first
            batches).
    """

    attempt: int
    cause: str
    kind: str
    rank: int | None
    failed_at: float
    world_size_before: int
    world_size_after: int
    resumed_from: dict[str, Any] | None = None
    lost_work_seconds: float | None = None
    restart_seconds: float | None = None

    def complete(self, first_step: dict[str, Any] | None) -> None:
        """Fill in the times from the next attempt's :data:`~flowers_job.runtime.reports.FIRST_STEP_FILE`."""
        if first_step is None:
            return
        self.resumed_from = first_step.get("resumed_from")
        self.restart_seconds = round(float(first_step["first_step_at"]) - self.failed_at, 1)
        saved_at = (self.resumed_from or {}).get("saved_at")
        if saved_at is not None:
            self.lost_work_seconds = round(max(0.0, self.failed_at - float(saved_at)), 1)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["time_lost_seconds"] = (
            round(self.lost_work_seconds + self.restart_seconds, 1)
            if self.lost_work_seconds is not None and self.restart_seconds is not None
            else None
        )
        return d

    @classmethod
    def after(
        cls, error: TrainingError, attempt: int, world_size_before: int, world_size_after: int
    ) -> Restart:
        """The record of the restart that follows ``error``."""
        return cls(
            attempt=attempt,
            cause=str(error).splitlines()[0],
            kind=error.kind,
            rank=error.rank,
            failed_at=error.reported_at or time.time(),
            world_size_before=world_size_before,
            world_size_after=world_size_after,
        )


def refusal(
    error: TrainingError, restarts: int, cfg: JobConfig, earlier: list[TrainingError]
) -> str | None:
    """Why the driver does not restart after ``error``; None: it restarts.

    Args:
        error: the failed attempt's error.
        restarts: restarts done so far in this job.
        cfg: the job's configuration (``train.max_restarts``, the checkpoint dir).
        earlier: the errors of the attempts before this one.
    """
    if restarts >= cfg.train.max_restarts:
        return f"train.max_restarts={cfg.train.max_restarts} restart(s) used"
    if error.kind == "permanent":
        return f"{error.cause or 'this error'} does not go away by itself"
    if error.kind in TRANSIENT_KINDS:
        return None
    if not checkpoint_exists(cfg):
        return "it came before the first checkpoint and is not transient"
    for n, old in enumerate(earlier):
        if old.cause == error.cause and old.rank == error.rank:
            return f"attempt {n} failed the same way: the exception is deterministic"
    return None


def restart_processes(spark: SparkSession, cfg: JobConfig, wanted: int) -> int:
    """The number of processes a restart runs: ``wanted`` (the configured
    ``distributed.num_processes``), or in barrier mode as many as the task slots left allow,
    down to ``distributed.min_processes``. A slot runs one barrier task, which holds
    ``processes_per_task`` ranks where a task holds several GPUs on pyspark 4.2+
    (:func:`~flowers_job.cluster.placement.barrier_stage`): fewer processes are a multiple
    of that.

    On Spark Connect the slots are a fresh count of the executors' cores
    (:func:`~flowers_job.cluster.slots.live_task_slots`); the client can neither list nor
    remove a silent executor, which Spark's heartbeat timeout removes instead.

    Raises:
        ClusterError: fewer slots than that remain, naming the slots needed and left.
    """
    from flowers_job.cluster.placement import TASK_GPUS, barrier_stage, use_gpu
    from flowers_job.cluster.slots import live_task_slots, remove_executors, wait_for_slots
    from flowers_job.errors import ClusterError

    d = cfg.distributed
    if d.local_mode:
        return wanted
    task_gpus = spark.conf.get(TASK_GPUS, "0") or "0"
    per_task = barrier_stage(
        wanted, task_gpus if use_gpu(spark, cfg.distributed) else None
    ).processes_per_task
    tasks = wanted // per_task
    least = None if d.min_processes is None else -(-d.min_processes // per_task)  # tasks
    wait_for_slots(spark, tasks, d.executor_wait_seconds)
    slots, silent = live_task_slots(spark)
    if slots >= tasks or (least is not None and slots >= least):
        remove_executors(spark, silent)  # no barrier task may go to a silent executor
    if slots >= tasks:
        return wanted
    if least is not None and slots >= least:
        fewer = slots * per_task
        log.warning(
            "the restart finds %d live task slots for the %d processes asked: continuing "
            "with %d (distributed.min_processes=%d)",
            slots,
            wanted,
            fewer,
            d.min_processes,
        )
        return fewer
    raise ClusterError(
        f"distributed.num_processes: the restart needs {tasks} task slots and "
        f"{slots} remain on this cluster's live executors"
        + (f" (executors {', '.join(silent)} do not answer)" if silent else "")
        + "; set distributed.min_processes to continue with fewer processes, or resume "
        "later with --resume"
    )


def begin_training(cfg: JobConfig) -> JobConfig:
    """Before a job's first attempt, on the driver: whether it continues a run, and the
    checkpoint dir made ready for it.

    - ``train.resume`` with a ``train.resume_key`` other than the one the checkpoint was
      written under (``mlflow_run.json``): a new run (logged);
    - a run whose driver was killed and left it RUNNING ends FAILED first
      (:func:`flowers_job.driver.runs.end_abandoned_run`), whether this run continues it or not;
    - a new run removes the previous run's checkpoints and MLflow run id, so that an
      automatic restart before this run's first checkpoint can never continue that one;

    Returns:
        ``cfg``, with ``train.resume`` off where a new run starts.
    """
    from flowers_job.driver.runs import end_abandoned_run
    from flowers_job.train.checkpoint import (
        CHECKPOINT_NAME,
        RUN_FILE_NAME,
        STEP_CHECKPOINT_NAME,
        read_resume_key,
    )

    directory = cfg.paths.checkpoint_dir
    key = cfg.train.resume_key
    if cfg.train.resume and key is not None and (directory / RUN_FILE_NAME).exists():
        recorded = read_resume_key(directory)
        if recorded != key:
            log.warning(
                "train.resume_key=%r: the checkpoint in %s belongs to key %r: a new run starts",
                key,
                directory,
                recorded,
            )
            cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"resume": False})})
    end_abandoned_run(
        directory, cfg.tracking_uri, continued_by="--resume" if cfg.train.resume else None
    )
    if not cfg.train.resume:
        old = [
            n
            for n in (CHECKPOINT_NAME, STEP_CHECKPOINT_NAME, RUN_FILE_NAME)
            if (directory / n).exists()
        ]
        for name in old:
            (directory / name).unlink()
        if old:
            log.info("a new run: removed the last run's %s from %s", ", ".join(old), directory)
    return cfg


def end_stale_run(cfg: JobConfig, error: TrainingError) -> None:
    """After a failed attempt: the MLflow run that rank 0 recorded ends FAILED, if a rank
    left it RUNNING (rank 0 SIGKILLed, or stopped before it could end it), and its cause
    tag holds the first line of ``error``: the rank that failed first, which rank 0 may
    only have seen as a lost peer (:func:`flowers_job.tracking.mlflow_run.mark_run_failed`)."""
    from flowers_job.tracking.mlflow_run import mark_run_failed
    from flowers_job.train.checkpoint import read_run_id

    run_id = read_run_id(cfg.paths.checkpoint_dir)
    if run_id is not None:
        mark_run_failed(cfg.tracking_uri, run_id, str(error).splitlines()[0], correct_cause=True)
