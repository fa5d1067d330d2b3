"""The epoch loop of one rank: train, validate, check every row, decide once, checkpoint.

Per epoch (:func:`run_epoch`, :func:`end_epoch`): every rank runs exactly
``steps_per_epoch`` steps; losses, accuracies and row counts are all-reduced; rank 0
decides early stopping and broadcasts the decision; rank 0 writes the checkpoint and logs to
MLflow. After the last epoch every rank restores the best weights and scores its shard of
the held-out test split once (:func:`~flowers_job.train.evaluate.evaluate_test`).
The loop never asks which loader it has: it reads :class:`~flowers_job.loaders.base.ShardReader`
batches.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from tqdm import tqdm

from flowers_job.config import JobConfig
from flowers_job.location import Location
from flowers_job.runtime.hooks import wrap_batches
from flowers_job.runtime.process_group import DistContext, broadcast_object, gather_ranks
from flowers_job.runtime.reports import FIRST_STEP_FILE, write_json
from flowers_job.train.checkpoint import (
    CHECKPOINT_NAME,
    STEP_CHECKPOINT_NAME,
    remove_checkpoint,
    save_checkpoint,
)
from flowers_job.train.early_stopping import Decision
from flowers_job.train.evaluate import evaluate, evaluate_test
from flowers_job.train.fine_tuning import sync_ema_buffers
from flowers_job.train.metrics import Sums, check_shard, check_totals, reduce_sums
from flowers_job.train.rank0 import finish, start_tracking
from flowers_job.train.resume import resume
from flowers_job.train.state import Plans, TrainState, build_state, open_readers, place_ranks
from flowers_job.train.step import train_one_epoch
from flowers_job.train.step_checkpoint import EpochPosition, gather_positions, restore_rng

__all__ = ["end_epoch", "fit", "run_epoch", "train_one_epoch"]  # train_one_epoch: step.py

log = logging.getLogger("flowers_job.train")


class _LineStream:
    """tqdm target that ends every redraw with a newline: TorchDistributor forwards the
    workers' output line by line, so carriage-return redraws would never show."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def _progress(
    state: TrainState, epoch: int, start: EpochPosition | None
) -> Iterable[dict[str, torch.Tensor]]:
    """This epoch's training batches (from ``start``, when resumed inside it); on rank 0
    with a progress line every 15 s."""
    assert state.train_reader is not None
    steps = state.plans.train.steps_per_epoch
    first = start.step if start is not None else 0
    batches = wrap_batches(  # at the epoch's middle, counted from where it (re)starts
        state.train_reader.epoch(epoch, start.start() if start is not None else None),
        rank=state.ctx.rank,
        epoch=epoch,
        step=steps // 2 - first,
    )
    if not state.ctx.is_main:
        return batches
    return tqdm(
        batches,
        file=_LineStream(sys.stderr),
        total=steps,
        initial=first,
        desc=f"epoch {epoch}",
        unit="step",
        mininterval=15.0,
        ascii=True,
        ncols=100,
    )


def run_epoch(state: TrainState, epoch: int) -> dict[str, float]:
    """Train one epoch, validate, check every rank's rows and all-reduce the metrics.

    Returns:
        ``train_loss``, ``train_accuracy``, ``val_loss``, ``val_accuracy`` (all ranks),
        ``learning_rate``, ``epoch_seconds`` (seconds), ``train_images_per_second`` and
        ``images_per_second`` (train + val images / epoch seconds), identical on every rank.

    Raises:
        ShardError: a rank read other rows than planned, or a row was dropped or read twice.
    """
    ctx, plans, val_reader = state.ctx, state.plans, state.val_reader
    assert val_reader is not None
    start, state.position = state.position, None
    if start is not None and start.epoch == epoch:
        restore_rng(start.rng, ctx.device)  # dropout continues where it was
    else:
        start = None
        torch.manual_seed(state.cfg.train.seed + 1000 * ctx.rank + epoch)  # dropout
    t0 = time.perf_counter() - (start.train_seconds if start is not None else 0.0)
    train_sums = train_one_epoch(
        state.ddp,
        _progress(state, epoch, start),
        state.optimizer,
        state.scheduler,
        state.criterion,
        state.normalize,
        state.amp_dtype,
        state.scaler,
        Sums(ctx.device, start.sums if start is not None else None),
        _mid_epoch_checkpoints(state, epoch, start.step if start is not None else 0, t0),
    )
    t1 = time.perf_counter()
    sync_ema_buffers(state.ema, ctx)  # every rank scores rank 0's average
    val_sums = evaluate(
        state.eval_model,
        lambda: val_reader.epoch(epoch),
        state.criterion,
        state.normalize,
        state.amp_dtype,
        state.val_features,
    )
    t2 = time.perf_counter()
    check_shard("train", plans.train, state.shard, train_sums)
    check_shard("val", plans.val, state.shard, val_sums)
    train, val = reduce_sums([train_sums, val_sums], ctx)
    check_totals("train", plans.train, train)
    check_totals("val", plans.val, val)
    return {
        "train_loss": train.loss_sum / train.rows,
        "train_accuracy": train.correct / train.rows,
        "val_loss": val.loss_sum / val.rows,
        "val_accuracy": val.correct / val.rows,
        "learning_rate": max(float(g["lr"]) for g in state.optimizer.param_groups),
        "epoch_seconds": t2 - t0,
        "train_images_per_second": train.rows / (t1 - t0),
        "images_per_second": (train.rows + val.rows) / (t2 - t0),
        "world_size": float(ctx.world_size),
        "global_batch_size": float(state.cfg.global_batch_size),
    }


def _mid_epoch_checkpoints(
    state: TrainState, epoch: int, first_step: int, t0: float
) -> Callable[[Sums], None]:
    """The hook :func:`train_one_epoch` calls after each step: when the clock says so (the
    same on every rank), every rank's position is gathered and rank 0 writes ``step.pt``."""
    step = first_step
    clock, reader = state.clock, state.train_reader
    assert clock is not None and reader is not None

    def after_step(sums: Sums) -> None:
        nonlocal step
        step += 1
        if step == first_step + 1 and state.ctx.is_main:
            _first_step(state)
        if not clock.due(step):
            return
        t1 = time.perf_counter()
        positions = gather_positions(state.ctx, state.shard, sums.values(), reader)
        if state.ctx.is_main:
            extra = {
                "step": step,
                "positions": positions,
                "train_seconds": time.perf_counter() - t0,
                "plan": _plan_identity(state),
            }
            _checkpoint(state, epoch, STEP_CHECKPOINT_NAME, extra)
            log.info(
                "checkpoint inside epoch %d after step %d (%.2f s)",
                epoch,
                step,
                time.perf_counter() - t1,
            )
        clock.reset()

    return after_step


def _first_step(state: TrainState) -> None:
    """Rank 0, after its first step in this process: when it began training again after a
    restart or resume, and from which checkpoint (``first_step.json``, read by the driver:
    :mod:`flowers_job.driver.restarts`)."""
    if state.report_dir is None or state.first_step_seen:
        return
    state.first_step_seen = True
    record = {
        "attempt": state.attempt,
        "first_step_at": time.time(),
        "resumed_from": state.resumed_from,
    }
    with contextlib.suppress(OSError):  # a report, not the run: never fail it
        write_json(state.report_dir / FIRST_STEP_FILE, record)


def _plan_identity(state: TrainState) -> dict[str, Any]:
    """What a mid-epoch checkpoint can only continue with: the same train plan."""
    plan = state.plans.train
    return {
        "loader": plan.loader,
        "dataset_size": plan.dataset_size,
        "checksum": plan.checksum,
        "rows_per_shard": list(plan.rows_per_shard),
        "steps_per_epoch": plan.steps_per_epoch,
    }


def _decide(state: TrainState, epoch: int, metrics: dict[str, float]) -> Decision:
    """Early stopping, decided once by rank 0 and broadcast: ranks can never disagree about
    stopping."""
    es = state.cfg.train.early_stopping
    decision = Decision(improved=False, stop=False)
    if state.ctx.is_main:
        decision = state.stopper.step(metrics[es.monitor], epoch)
        if not es.enabled:  # still track the best epoch, never stop early
            decision = Decision(decision.improved, stop=False)
    result: Decision = broadcast_object(decision, state.ctx)
    return result


def _checkpoint(
    state: TrainState,
    epoch: int,
    name: str = CHECKPOINT_NAME,
    extra: dict[str, Any] | None = None,
) -> None:
    """Rank 0: everything a resume needs, atomically (:func:`save_checkpoint`): after
    ``epoch`` (``last.pt``), or inside it with the ranks' positions in ``extra``
    (``step.pt``)."""
    save_checkpoint(
        {
            "model": state.model.state_dict(),
            "optimizer": state.optimizer.state_dict(),
            "scheduler": state.scheduler.state_dict(),
            "scaler": state.scaler.state_dict(),
            "ema": state.ema.state_dict() if state.ema is not None else None,
            "epoch": epoch,
            "world_size": state.ctx.world_size,
            "saved_at": time.time(),
            "early_stopping": state.stopper.state_dict(),
            "best_model": state.best_state,
            "history": state.history,
            "stop_reason": state.stop_reason,
            "label_names": state.label_names,
            "config": state.cfg.model_dump(mode="json"),
            **state.resume_record(),  # the data and the optimizer, checked on resume
            **(extra or {}),
        },
        state.cfg.paths.checkpoint_dir,
        name,
    )


def end_epoch(state: TrainState, epoch: int, metrics: dict[str, float]) -> None:
    """The decision (:func:`_decide`), the best weights kept, then (rank 0) the checkpoint
    and the MLflow metrics, in that order (see :class:`~flowers_job.tracking.mlflow_run.RunTracker`)."""
    decision = _decide(state, epoch, metrics)
    if decision.improved:
        state.best_state = {
            k: v.detach().to("cpu", copy=True) for k, v in state.eval_model.state_dict().items()
        }
    if decision.stop:
        state.stop_reason = decision.reason
    state.history.append({"epoch": epoch, **metrics})
    assert state.clock is not None
    state.clock.reset()
    if not state.ctx.is_main:
        return
    assert state.tracker is not None
    _checkpoint(state, epoch)
    remove_checkpoint(state.cfg.paths.checkpoint_dir, STEP_CHECKPOINT_NAME)
    state.tracker.log_epoch(metrics, epoch)
    log.info(
        "epoch %d/%d | train loss %.4f acc %.4f | val loss %.4f acc %.4f | %.1f s | %.1f img/s%s",
        epoch,
        state.cfg.train.epochs,
        metrics["train_loss"],
        metrics["train_accuracy"],
        metrics["val_loss"],
        metrics["val_accuracy"],
        metrics["epoch_seconds"],
        metrics["images_per_second"],
        f" | stop: {state.stop_reason}" if state.stop_reason else "",
    )


def restore_best(state: TrainState) -> bool:
    """Every rank: load the best epoch's weights (``early_stopping.restore_best_weights``);
    otherwise, with ``train.ema_decay``, the last weights' average (what validation scored).

    Returns:
        True if the best weights were restored.
    """
    if not (state.cfg.train.early_stopping.restore_best_weights and state.best_state is not None):
        if state.ema is not None:
            state.model.load_state_dict(state.eval_model.state_dict())
        return False
    state.model.load_state_dict(state.best_state)
    return True


def _epochs(state: TrainState) -> None:
    """Run the epochs left (after a resume, from its next epoch) until the last or a stop."""
    try:
        for epoch in range(state.start_epoch, state.cfg.train.epochs + 1):
            if state.stop_reason is not None:
                break
            metrics = run_epoch(state, epoch)
            end_epoch(state, epoch, metrics)
    finally:
        for reader in (state.train_reader, state.val_reader):
            if reader is not None:
                reader.close()


# Arguments: the rank's job, its plans and the run's lineage, as the rank's entry hands them over.
def fit(  # noqa: PLR0913
    cfg: JobConfig,
    ctx: DistContext,
    plans: Plans,
    label_names: list[str],
    example_images: list[bytes],
    lineage: dict[str, Any],
    ranks: list[dict[str, Any]] | None = None,
    attempt: int = 0,
    report_dir: Location | None = None,
) -> tuple[dict[str, Any] | None, Callable[[], dict[str, Any]] | None]:
    """Train, validate, early-stop and checkpoint; restore the best weights and score the
    test split once; (rank 0) log to MLflow.

    ``example_images`` (stored JPEG bytes) become the registered model's input example;
    ``lineage`` (:func:`flowers_job.driver.prepare.lineage`) is logged with the run;
    ``ranks`` (:func:`~flowers_job.runtime.process_group.gather_ranks`, gathered when None) go into
    the summary. On resume, rank 0 alone reads the checkpoint and broadcasts it
    (:func:`~flowers_job.train.resume.resume`).

    Returns:
        ``(summary, register)`` on rank 0 (:func:`~flowers_job.train.rank0.finish`): call
        ``register`` after the last collective. ``(None, None)`` on other ranks.
    """
    t_start = time.perf_counter()
    state = build_state(cfg, ctx, plans, label_names)
    state.attempt, state.report_dir, state.lineage = attempt, report_dir, lineage
    ranks = ranks if ranks is not None else gather_ranks(ctx)
    place_ranks(state, ranks)
    resume(state)
    start_tracking(state)
    open_readers(state, ranks)
    _epochs(state)
    restored = restore_best(state)
    test = evaluate_test(state)
    return finish(
        state, ranks, example_images, lineage, restored, test, time.perf_counter() - t_start
    )
