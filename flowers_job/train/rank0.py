"""What rank 0 does with MLflow: open (or reopen) the run before the first epoch, build the
summary, and the register step that runs after the last collective.

Only rank 0 talks to MLflow: every function here returns at once on other ranks, and none
holds a collective. Registration runs after every collective has ended (``register``, called
by :func:`flowers_job.train.rank.train_worker`), so a slow registry never runs into
``distributed.timeout_seconds`` and the other ranks have already returned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pandas as pd
import torch

from flowers_job.runtime.hooks import hook
from flowers_job.tracking.class_report import TestReport, report_figures
from flowers_job.train.checkpoint import read_run_id, write_run_id
from flowers_job.train.state import TrainState

__all__ = ["finish", "start_tracking"]

log = logging.getLogger("flowers_job.train")


def _run_params(state: TrainState) -> dict[str, Any]:
    """The run's parameters: the configuration (flattened) and its derived sizes."""
    from flowers_job.tracking.mlflow_run import flatten

    cfg, ctx, plans = state.cfg, state.ctx, state.plans
    return {
        **flatten(cfg.model_dump(mode="json", exclude={"train": {"resume"}})),
        "world_size": ctx.world_size,
        "global_batch_size": cfg.global_batch_size,
        "learning_rate": state.lr,
        "num_partitions": cfg.num_partitions,
        "train_rows": plans.train.dataset_size,
        "val_rows": plans.val.dataset_size,
        "steps_per_epoch": plans.train.steps_per_epoch,
        "backend": ctx.backend,
        "device": ctx.device.type,
    }


def _banner(state: TrainState) -> None:
    """One line with the run's shape: world size, batch sizes, learning rate, data sizes."""
    cfg, ctx, plans = state.cfg, state.ctx, state.plans
    log.info(
        "world_size %d (%s on %s) | per_device_batch_size %d, global_batch_size %d | "
        "lr %.3g (%s scaling of %.3g) | train %d rows %s, val %d rows %s | "
        "steps per epoch %d | %d threads per process",
        ctx.world_size,
        ctx.backend,
        ctx.device.type,
        cfg.train.per_device_batch_size,
        cfg.global_batch_size,
        state.lr,
        cfg.train.lr_scaling,
        cfg.train.base_learning_rate,
        plans.train.dataset_size,
        plans.train.rows_per_shard,
        plans.val.dataset_size,
        plans.val.rows_per_shard,
        plans.train.steps_per_epoch,
        torch.get_num_threads(),
    )


def start_tracking(state: TrainState) -> None:
    """Rank 0: check that the packages the end of the run needs import here (an executor's
    environment can differ from the driver's), open (or, on resume, reopen) the MLflow run,
    log the epochs checkpointed but not yet logged, the parameters, and the run's shape.

    Raises:
        ConfigError: a package the test report needs cannot be imported on this host
            (:func:`~flowers_job.tracking.packages.check_run_packages`), before the first epoch.
    """
    cfg = state.cfg
    if not state.ctx.is_main:
        return
    from flowers_job.tracking.mlflow_run import RunTracker
    from flowers_job.tracking.packages import check_run_packages

    check_run_packages()

    # The run id is recorded as soon as the run exists: a run killed even before its
    # first checkpoint resumes into the same MLflow run.
    run_id = read_run_id(cfg.paths.checkpoint_dir) if cfg.train.resume else None
    tracker = state.tracker = RunTracker(cfg, run_id)
    write_run_id(cfg.paths.checkpoint_dir, tracker.run_id, cfg.train.resume_key)
    tracker.record_recovery(state.attempt)
    for done in state.history:  # epochs checkpointed before a kill, not yet logged
        tracker.log_epoch({k: v for k, v in done.items() if k != "epoch"}, int(done["epoch"]))
    tracker.log_params(_run_params(state))
    _banner(state)


def _summary(
    state: TrainState, final: dict[str, float], test: TestReport, seconds: float
) -> dict[str, Any]:
    """Rank 0's summary of the run (the driver adds the data's sizes and writes it)."""
    cfg, ctx, history = state.cfg, state.ctx, state.history
    epoch_seconds = [h["epoch_seconds"] for h in history]
    return {
        **test.metrics(),
        "test_rows": test.rows,
        "test": test.to_dict(),
        "val_accuracy": final["val_accuracy"],
        "val_loss": final["val_loss"],
        "best_epoch": state.stopper.best_epoch,
        "epochs_completed": len(history),
        "epochs_this_run": sum(h["epoch"] >= state.start_epoch for h in history),
        "stop_reason": state.stop_reason or "max_epochs",
        "loader": state.plans.train.loader,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "device": ctx.device.type,
        "per_device_batch_size": cfg.train.per_device_batch_size,
        "global_batch_size": cfg.global_batch_size,
        "learning_rate": state.lr,
        "steps_per_epoch": state.plans.train.steps_per_epoch,
        "seconds_per_epoch": sum(epoch_seconds) / len(epoch_seconds) if epoch_seconds else 0.0,
        "images_per_second": (
            sum(h["images_per_second"] * h["epoch_seconds"] for h in history) / sum(epoch_seconds)
            if epoch_seconds
            else 0.0
        ),
        "train_seconds": seconds,
        "history": history,
    }


def finish(
    state: TrainState,
    ranks: list[dict[str, Any]],
    example_images: list[bytes],
    lineage: dict[str, Any],
    restored: bool,
    test: TestReport | None,
    seconds: float,
) -> tuple[dict[str, Any] | None, Callable[[], dict[str, Any]] | None]:
    """On rank 0: the summary and the ``register`` step; ``(None, None)`` elsewhere.

    ``register`` logs the best and test scores, the test report's figures and tables and
    the lineage, logs and registers the model (``example_images`` as its input example) and
    ends the MLflow run, returning ``{"model_uri", "registered_model_version"}``; call it
    after the last collective. The figures are drawn now, while the other ranks wait at the
    last collective: after it they exit, and rank 0's work after it stays MLflow I/O only.
    """
    if not state.ctx.is_main:
        return None, None
    tracker = state.tracker
    assert tracker is not None and test is not None
    best_epoch = state.stopper.best_epoch
    final = (
        next(h for h in state.history if h["epoch"] == best_epoch)
        if restored
        else state.history[-1]
    )
    from flowers_job.serving.pyfunc_model import model_config  # MLflow: rank 0 only
    from flowers_job.serving.registration import log_pyfunc_model

    config = model_config(state.cfg, state.label_names)
    figures = report_figures(test, state.history, best_epoch)
    summary = {
        **_summary(state, final, test, seconds),
        "ranks": ranks,
        "lineage": lineage,
        "mlflow_run_id": tracker.run_id,
        "registered_model_name": state.cfg.tracking.registered_model_name,
    }
    model, rank = state.model, state.ctx.rank

    def register() -> dict[str, Any]:
        hook("before_registration", rank=rank)
        tracker.log_final(
            {"best_val_loss": final["val_loss"], "best_val_accuracy": final["val_accuracy"]},
            step=best_epoch,
        )
        tracker.log_test(test, figures)
        tracker.log_lineage(lineage)
        hook("before_log_model", rank=rank)
        model_uri, version = log_pyfunc_model(
            model,
            config,
            pd.DataFrame({"image": example_images}),
            state.cfg.tracking.registered_model_name,
        )
        tracker.finish()
        return {"model_uri": model_uri, "registered_model_version": version}

    return summary, register
