"""The function TorchDistributor runs on every rank, and how a rank reports its end.

:func:`train_worker` takes the driver's :class:`~flowers_job.train.job_spec.TrainingJob` (the
validated config as a dict and the shard plans), joins the process group, trains
(:func:`flowers_job.train.loop.fit`) and returns a small summary dict, identical on every rank (rank
0's, broadcast: docs/known-issues.md, "Spark"). Around it, what makes a failure name its rank and
never hang:

- a rank whose Python code raises writes ``rank-<r>.json`` (exception and traceback) into the
  job's report dir; a process-group timeout is named as such (:class:`CollectiveTimeoutError`);
- a rank that dies of a fatal signal leaves ``rank-<r>.fatal`` (:mod:`faulthandler`);
- a rank that dies without either (SIGKILL, the OOM killer) is named by its watchdog
  (:mod:`flowers_job.runtime.watchdog`, started first thing): ``rank-<r>.killed``;
- SIGTERM (torchrun stopping the others) unwinds as :class:`Terminated`, so the rank reports
  and rank 0 marks its MLflow run FAILED with the cause; once a rank is reporting a failure,
  a SIGTERM no longer cuts the report short (it is logged and the report goes on: torchrun
  SIGKILLs 30 s later, and the driver ends a run still RUNNING then);
- rank 0 writes ``ranks.json`` (every rank's host) and, once the model is registered,
  ``model.json``; the driver reads them (:mod:`flowers_job.driver.pipeline`).
"""

from __future__ import annotations

import faulthandler
import logging
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flowers_job.config import JobConfig
from flowers_job.errors import CollectiveTimeoutError
from flowers_job.location import Location
from flowers_job.runtime.allocator import tune_this_process
from flowers_job.runtime.hooks import hook
from flowers_job.runtime.parent_watch import watch_driver
from flowers_job.runtime.process_group import (
    DistContext,
    broadcast_object,
    env_rank,
    gather_ranks,
    init_distributed,
    shutdown_distributed,
)
from flowers_job.runtime.reports import (
    DONE_SUFFIX,
    FAILURE_SUFFIX,
    FATAL_SUFFIX,
    MODEL_FILE,
    RANKS_FILE,
    write_json,
)
from flowers_job.runtime.watchdog import start_watchdog, watchdog_done
from flowers_job.train.job_spec import SPLITS, TrainingJob
from flowers_job.train.loop import fit
from flowers_job.train.state import Plans
from flowers_job.vision.pillow_floor import check_pillow

__all__ = [
    "CollectiveTimeoutError",
    "Terminated",
    "threads_for_rank",
    "train_worker",
]

log = logging.getLogger("flowers_job.train")

_FATAL_FILES: list[Any] = []  # kept open for the process's lifetime, as faulthandler requires

_TIMEOUT_MESSAGES = ("timed out waiting", "application timeout", "collective operation timeout")
"""How gloo and NCCL word a process-group timeout (lower case); other errors that merely
mention a timeout (an HTTP call to MLflow, say) are left as they are."""


class Terminated(SystemExit):
    """SIGTERM arrived: torchrun stops the other ranks this way when one fails."""


def train_worker(job: TrainingJob) -> dict[str, Any]:
    """Entry point on every rank (top level and importable, so TorchDistributor can pickle it).

    Args:
        job: from the driver (:func:`flowers_job.driver.pipeline.training_job`); this rank
            exits if the driver it names dies.

    Returns:
        Rank 0's summary (:func:`flowers_job.train.rank0.finish`), on every rank.

    Raises:
        Whatever failed, after writing ``<report_dir>/rank-<rank>.json`` with the rank,
        the exception and its traceback for the driver to report.
    """
    _prepare_process(job)
    try:
        check_pillow()  # CVE-2026-25990: a rank's Python may differ from the driver's
        cfg = job.job_config()
        result, register = _train(cfg, job)
        if register is not None:
            # Rank 0 logs and registers the model after every collective has ended: a slow
            # registry never runs into distributed.timeout_seconds, and the other ranks
            # have already returned. The driver merges model.json into its result.
            registered = register()
            write_json(Location.of(job.report_dir) / MODEL_FILE, registered)
            result = {**result, **registered}
        watchdog_done()
        _remove_host_reports(job)
        _report_done(Location.of(job.report_dir))
        return result
    except BaseException as exc:
        _FAILING.set()  # from here on a SIGTERM waits for the report (_terminated)
        explained = _explain_timeout(exc, job)
        _report_failure(Location.of(job.report_dir), explained or exc)
        watchdog_done()  # the report says how this rank ended
        _remove_host_reports(job)
        if "mlflow" in sys.modules:  # rank 0 had a run open: mark it failed, not running
            from flowers_job.tracking.mlflow_run import end_failed_run

            end_failed_run(f"rank {env_rank()}: {_one_line(explained or exc)}")
        if explained is not None:
            raise explained from exc
        raise


def _prepare_process(job: TrainingJob) -> None:
    """Logging with the rank, the fatal-signal report, the watchdog, the allocator, the driver
    watchdog and the SIGTERM handler: before anything can fail."""
    logging.basicConfig(
        level=logging.INFO, format=f"[rank{env_rank()}] %(asctime)s %(message)s", force=True
    )
    logging.getLogger("botocore").setLevel(logging.WARNING)  # object stores: a line per client
    reports, here = _report_dirs(job)
    _enable_fatal_report(here)
    hook("rank_start", rank=env_rank(), attempt=job.attempt)  # tests only
    start_watchdog(here, env_rank(), job.memory_settings, None if reports.is_local else reports.url)
    # The environment should have carried the allocator tuning here (spark.executorEnv.*,
    # or the driver's environment in local mode); mallopt covers a cluster that lacks it.
    tune_this_process()
    watch_driver(job.driver)
    _FAILING.clear()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)


def _train(
    cfg: JobConfig, job: TrainingJob
) -> tuple[dict[str, Any], Callable[[], dict[str, Any]] | None]:
    """Join the process group, place the threads, train, and broadcast rank 0's result (the
    last collective); ``register`` is rank 0's, None elsewhere."""
    ctx = init_distributed(
        use_gpu=job.use_gpu,
        backend=cfg.distributed.backend,
        timeout_seconds=cfg.distributed.timeout_seconds,
        threads_per_process=job.threads_per_process,
    )
    try:
        ranks = _place_threads(ctx, job)
        result, register = fit(
            cfg,
            ctx,
            _plans(job),
            list(job.label_names),
            list(job.example_images),
            dict(job.lineage),
            ranks,
            attempt=job.attempt,
            report_dir=Location.of(job.report_dir),
        )
        result = broadcast_object(result, ctx)  # the last collective
    finally:
        shutdown_distributed()
    assert isinstance(result, dict)
    return result, register


def _place_threads(ctx: DistContext, job: TrainingJob) -> list[dict[str, Any]]:
    """Gather every rank's place, give each its intra-op threads (:func:`threads_for_rank`),
    and (rank 0) write ``ranks.json`` so the driver can name the host of a rank that dies
    silently."""
    ranks = gather_ranks(ctx)
    for r in ranks:
        r["threads"] = job.threads_per_process or threads_for_rank(job, ranks, r)
    torch.set_num_threads(ranks[ctx.rank]["threads"])
    if ctx.is_main:
        write_json(Location.of(job.report_dir) / RANKS_FILE, {"ranks": ranks})
    return ranks


def threads_for_rank(job: TrainingJob, ranks: list[dict[str, Any]], me: dict[str, Any]) -> int:
    """Intra-op threads of one barrier-mode rank: its executor's cores, shared by the ranks on
    its host, and never fewer than ``spark.task.cpus``.

    ``job.executor_cores`` maps each executor's host (address or name, from the driver's
    status store) to its cores; the rank's executor is found by its address or host name,
    else the smallest executor is assumed. Spark itself starts Python workers with
    ``OMP_NUM_THREADS=spark.task.cpus`` (1 by default), which would leave all but one core
    of an executor idle during training.
    """
    task_cpus = max(1, job.task_cpus)
    cores_by_host = job.executor_cores
    cores = cores_by_host.get(me.get("address") or "") or cores_by_host.get(me["host"])
    if cores is None:
        cores = min(cores_by_host.values()) if cores_by_host else task_cpus
    sharing = sum(r["host"] == me["host"] for r in ranks)
    return max(task_cpus, int(cores) // max(1, sharing))


def _enable_fatal_report(directory: Path) -> None:
    """Point :mod:`faulthandler` at ``<directory>/rank-<rank>.fatal`` (stderr if it cannot
    be created)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _FATAL_FILES.append((directory / f"rank-{env_rank()}{FATAL_SUFFIX}").open("w"))
        faulthandler.enable(file=_FATAL_FILES[-1], all_threads=True)
    except OSError:
        log.exception("no fatal-signal report file in %s; faulthandler writes to stderr", directory)
        faulthandler.enable(all_threads=True)


def _plans(job: TrainingJob) -> Plans:
    """The job's shard plans, rebuilt by the loader the driver resolved."""
    train, val, test = (job.loader.plan_type(**job.plans[split]) for split in SPLITS)
    return Plans(train, val, test, job.loader)


def _report_dirs(job: TrainingJob) -> tuple[Location, Path]:
    """The run's report dir, and where on this host faulthandler and the watchdog write:
    the report dir itself, or (report dir in an object store) a folder of this host's temp
    dir, which the watchdog copies up after a death (:func:`start_watchdog`'s ``upload``)."""
    reports = Location.of(job.report_dir)
    if reports.is_local:
        return reports, reports.local_path
    return reports, Path(tempfile.gettempdir()) / f"{reports.name}-rank{env_rank()}"


def _remove_host_reports(job: TrainingJob) -> None:
    """The rank reported (or had nothing to report): its host folder of a remote report dir
    goes (the watchdog removes it after a death, once it has copied it up)."""
    reports, here = _report_dirs(job)
    if not reports.is_local:
        shutil.rmtree(here, ignore_errors=True)


_FAILING = threading.Event()
"""Set once :func:`train_worker` handles a failure: a SIGTERM then must not interrupt the
report (torchrun's SIGTERM can reach rank 0 while it handles its peer's loss, and its MLflow
run then stayed RUNNING: seen in CI, docs/performance.md)."""


def _terminated(signum: int, frame: Any) -> None:
    # As an exception, SIGTERM unwinds through train_worker's handler: the rank reports
    # it and rank 0 marks its MLflow run FAILED instead of leaving it RUNNING. Inside that
    # handler, raising again would cut the report short: log it and let the report finish.
    if _FAILING.is_set():
        log.warning("rank %s: SIGTERM while reporting its failure: the report goes on", env_rank())
        return
    raise Terminated(f"rank {env_rank()}: stopped by SIGTERM (signal {signum})")


def _one_line(exc: BaseException) -> str:
    """``Type: first line of the message``, for a tag."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _explain_timeout(exc: BaseException, job: TrainingJob) -> CollectiveTimeoutError | None:
    """gloo says "Timed out waiting 20000ms for recv" or "Application timeout caused pair
    closure", NCCL's watchdog "Watchdog caught collective operation timeout"; say which
    setting and why."""
    text = str(exc).lower()
    if not isinstance(exc, RuntimeError) or not any(m in text for m in _TIMEOUT_MESSAGES):
        return None
    seconds = job.timeout_seconds
    return CollectiveTimeoutError(
        f"rank {env_rank()}: a collective waited more than distributed.timeout_seconds="
        f"{seconds} s for the other ranks (one of them hung or died): {exc}"
    )


def _report_done(directory: Location) -> None:
    """``rank-<rank>.done``: this rank ended well (:func:`~flowers_job.driver.failures.wait_for_reports`
    then need not wait for it when another failed)."""
    try:
        (directory / f"rank-{env_rank()}{DONE_SUFFIX}").write_bytes(b"")
    except OSError:
        log.exception("could not write the done marker of rank %s", env_rank())


def _report_failure(directory: Location, exc: BaseException) -> None:
    rank = env_rank()
    report = {
        "rank": rank,
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        "time": time.time(),
    }
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_json(directory / f"rank-{rank}{FAILURE_SUFFIX}", report)
    except OSError:
        log.exception("could not write the failure report of rank %s", rank)
