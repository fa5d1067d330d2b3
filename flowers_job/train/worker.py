"""Worker side: the function TorchDistributor runs on every rank, and its epoch loop.

``train_worker(job)`` takes plain data (the validated config as a dict and the driver's
shard plans), joins the process group, trains a DDP model on this rank's Petastorm
shard, and returns a small summary dict, identical on every rank (rank 0's, broadcast:
STACK.md trap 4).

Per epoch: every rank runs exactly ``steps_per_epoch`` steps; losses, accuracies and
row counts are all-reduced; rank 0 decides early stopping and broadcasts the decision;
rank 0 writes the checkpoint and logs to MLflow. Only rank 0 has a ``RunTracker``;
other ranks hold None (the timm habit).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from flowers_job import faults
from flowers_job.config import JobConfig, TrainConfig
from flowers_job.data.shards import CHECKSUM_MODULUS, ShardPlan, quiet_petastorm
from flowers_job.distributed import (
    DistContext,
    all_reduce_sum,
    broadcast_object,
    describe_hosts,
    env_rank,
    gather_ranks,
    init_distributed,
    shutdown_distributed,
)
from flowers_job.models import build_model, preprocessing_for
from flowers_job.processes import watch_driver
from flowers_job.train.checkpoint import (
    load_checkpoint,
    read_run_id,
    save_checkpoint,
    write_run_id,
)
from flowers_job.train.early_stopping import Decision, EarlyStopping
from flowers_job.train.loader import DecodeTransform, ShardError, ShardLoader, open_loader

__all__ = [
    "CollectiveTimeoutError",
    "check_shard",
    "check_totals",
    "evaluate",
    "fit",
    "train_one_epoch",
    "train_worker",
]

log = logging.getLogger("flowers_job.train")


def train_worker(job: dict[str, Any]) -> dict[str, Any]:
    """Entry point on every rank (top level and importable, so TorchDistributor can pickle it).

    Args:
        job: plain data from the driver: ``config`` (``JobConfig.model_dump(mode="json")``),
            ``train``/``val`` (:meth:`ShardPlan.to_dict`), ``label_names``, ``use_gpu``,
            ``threads_per_process``, ``failure_dir`` and ``driver``
            (:func:`~flowers_job.processes.driver_identity`; this rank exits if the
            driver dies).

    Returns:
        Rank 0's summary (see :func:`fit`), on every rank.

    Raises:
        Whatever failed, after writing ``<failure_dir>/rank-<rank>.json`` with the rank,
        the exception and its traceback for the driver to report.
    """
    logging.basicConfig(
        level=logging.INFO, format=f"[rank{env_rank()}] %(asctime)s %(message)s", force=True
    )
    quiet_petastorm()
    logging.getLogger("streaming").setLevel(logging.WARNING)  # per-dataset INFO defaults
    watch_driver(job.get("driver"))
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)
    try:
        cfg = JobConfig.model_validate(job["config"])
        ctx = init_distributed(
            use_gpu=bool(job["use_gpu"]),
            backend=cfg.distributed.backend,
            timeout_seconds=cfg.distributed.timeout_seconds,
            threads_per_process=job.get("threads_per_process"),
        )
        register: Callable[[], dict[str, Any]] | None = None
        try:
            ranks = gather_ranks(ctx)
            for r in ranks:
                r["threads"] = job.get("threads_per_process") or threads_for_rank(job, ranks, r)
            torch.set_num_threads(ranks[ctx.rank]["threads"])
            if ctx.is_main:  # lets the driver name the host of a rank that dies silently
                _write_json(Path(job["failure_dir"]) / RANKS_FILE, {"ranks": ranks})
            result, register = fit(
                cfg,
                ctx,
                ShardPlan.from_dict(job["train"]),
                ShardPlan.from_dict(job["val"]),
                list(job["label_names"]),
                [bytes(b) for b in job.get("example_images", [])],
                ranks,
            )
            result = broadcast_object(result, ctx)  # the last collective
        finally:
            shutdown_distributed()
        assert isinstance(result, dict)
        if register is not None:
            # Rank 0 logs and registers the model after every collective has ended: a slow
            # registry never runs into distributed.timeout_seconds, and the other ranks
            # have already returned. The driver merges model.json into its result.
            registered = register()
            _write_json(Path(job["failure_dir"]) / MODEL_FILE, registered)
            result = {**result, **registered}
        return result
    except BaseException as exc:
        explained = _explain_timeout(exc, job)
        _report_failure(Path(job["failure_dir"]), explained or exc)
        if "mlflow" in sys.modules:  # rank 0 had a run open: mark it failed, not running
            from flowers_job.tracking import end_failed_run

            end_failed_run()
        if explained is not None:
            raise explained from exc
        raise


RANKS_FILE = "ranks.json"
"""Written by rank 0 into the report dir once the group is up: every rank's host, address
and pid (:func:`~flowers_job.distributed.gather_ranks`), for the driver's failure report."""
MODEL_FILE = "model.json"
"""Written by rank 0 into the job's report dir after registering the model: the model URI,
version and run id, which the driver adds to the summary (local mode returns whichever
rank's result was written last: STACK.md trap 4)."""


def threads_for_rank(job: dict[str, Any], ranks: list[dict[str, Any]], me: dict[str, Any]) -> int:
    """Intra-op threads of one barrier-mode rank: its executor's cores, shared by the ranks on
    its host, and never fewer than ``spark.task.cpus``.

    ``job["executor_cores"]`` maps each executor's host (address or name, from the driver's
    status store) to its cores; the rank's executor is found by its address or host name,
    else the smallest executor is assumed. Spark itself starts Python workers with
    ``OMP_NUM_THREADS=spark.task.cpus`` (1 by default), which would leave all but one core
    of an executor idle during training.
    """
    task_cpus = int(job.get("task_cpus") or 1)
    cores_by_host: dict[str, int] = job.get("executor_cores") or {}
    cores = cores_by_host.get(me.get("address") or "") or cores_by_host.get(me["host"])
    if cores is None:
        cores = min(cores_by_host.values()) if cores_by_host else task_cpus
    sharing = sum(r["host"] == me["host"] for r in ranks)
    return max(task_cpus, int(cores) // max(1, sharing))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


class Terminated(SystemExit):
    """SIGTERM arrived: torchrun stops the other ranks this way when one fails."""


def _terminated(signum: int, frame: Any) -> None:
    # As an exception, SIGTERM unwinds through train_worker's handler: the rank reports
    # it and rank 0 marks its MLflow run FAILED instead of leaving it RUNNING.
    raise Terminated(f"rank {env_rank()}: stopped by SIGTERM (signal {signum})")


class CollectiveTimeoutError(RuntimeError):
    """A collective waited longer than ``distributed.timeout_seconds`` for another rank."""


_TIMEOUT_MESSAGES = ("timed out waiting", "application timeout", "collective operation timeout")
"""How gloo and NCCL word a process-group timeout (lower case); other errors that merely
mention a timeout (an HTTP call to MLflow, say) are left as they are."""


def _explain_timeout(exc: BaseException, job: dict[str, Any]) -> CollectiveTimeoutError | None:
    """gloo says "Timed out waiting 20000ms for recv" or "Application timeout caused pair
    closure", NCCL's watchdog "Watchdog caught collective operation timeout"; say which
    setting and why."""
    text = str(exc).lower()
    if not isinstance(exc, RuntimeError) or not any(m in text for m in _TIMEOUT_MESSAGES):
        return None
    seconds = job.get("config", {}).get("distributed", {}).get("timeout_seconds")
    return CollectiveTimeoutError(
        f"rank {env_rank()}: a collective waited more than distributed.timeout_seconds="
        f"{seconds} s for the other ranks (one of them hung or died): {exc}"
    )


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


def _report_failure(directory: Path, exc: BaseException) -> None:
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
        (directory / f"rank-{rank}.json").write_text(json.dumps(report))
    except OSError:
        log.exception("could not write the failure report of rank %s", rank)


def _optimizer(train: TrainConfig, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    if train.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=lr, momentum=train.momentum, weight_decay=train.weight_decay, nesterov=True
        )
    cls = torch.optim.AdamW if train.optimizer == "adamw" else torch.optim.Adam
    return cls(params, lr=lr, weight_decay=train.weight_decay)


def _amp_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    if amp == "bf16":
        return torch.bfloat16
    if amp == "fp16":
        return torch.float16
    if amp == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def _forward(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    criterion: nn.Module,
    device: torch.device,
    amp_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Move a batch to ``device`` (channels-last) and run the model under autocast.

    ``criterion`` gives one loss per image (``reduction='none'``); padding rows
    (``valid`` False) are masked out, and the loss is the mean over the valid rows (0 for a
    batch of padding only, which then contributes zero gradients).

    Returns:
        ``(labels [B] int64, logits [B, C], loss [] float32, valid [B] bool)``.
    """
    x = batch["image"].to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
    y = batch["label_index"].to(device, non_blocking=True)
    valid = batch["valid"].to(device, non_blocking=True)
    enabled = amp_dtype is not None
    with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=enabled):
        logits = model(x)
        per_image = criterion(logits.float(), y) * valid
        loss = per_image.sum() / valid.sum().clamp(min=1)
    return y, logits, loss, valid


def _sums(
    y: torch.Tensor,
    logits: torch.Tensor,
    loss: torch.Tensor,
    valid: torch.Tensor,
    row_id: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """A batch's ``(loss sum, correct, valid rows, row checksum, rows read)``, valid rows only."""
    n = int(valid.sum())
    correct = ((logits.detach().argmax(1) == y) & valid).sum()
    checksum = int((row_id % CHECKSUM_MODULUS)[valid.cpu()].sum())
    return loss.detach().double() * n, correct, n, checksum, len(y)


def train_one_epoch(
    model: nn.Module,
    batches: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    criterion: nn.Module,
    device: torch.device,
    amp_dtype: torch.dtype | None,
    scaler: torch.amp.GradScaler,
) -> list[float]:
    """One pass over this rank's training batches (see :mod:`flowers_job.train.loader`).

    ``batches`` yields dicts with ``image`` float32 ``[B, 3, S, S]``, ``label_index`` int64
    ``[B]``, ``row_id`` int64 ``[B]`` and ``valid`` bool ``[B]`` (False: padding, masked out).

    Returns:
        This rank's ``[loss_sum, correct, rows, row_checksum, rows_read]``: sums over the
        valid rows (loss summed over images), and every row read, padding included.
    """
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    rows = checksum = read = 0
    for batch in batches:
        y, logits, loss, valid = _forward(model, batch, criterion, device, amp_dtype)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        b_loss, b_correct, b_rows, b_checksum, b_read = _sums(
            y, logits, loss, valid, batch["row_id"]
        )
        loss_sum += b_loss
        correct += b_correct
        rows, checksum, read = rows + b_rows, checksum + b_checksum, read + b_read
    return [float(loss_sum), float(correct), float(rows), float(checksum), float(read)]


@torch.inference_mode()
def evaluate(
    model: nn.Module,
    batches: Any,
    criterion: nn.Module,
    device: torch.device,
    amp_dtype: torch.dtype | None,
) -> list[float]:
    """Loss and accuracy sums on this rank's validation shard (no collectives: pass the
    unwrapped model, not the DDP wrapper).

    Returns:
        This rank's ``[loss_sum, correct, rows, row_checksum, rows_read]``, as
        :func:`train_one_epoch`.
    """
    model.eval()
    loss_sum, correct, rows, checksum, read = 0.0, 0, 0, 0, 0
    for batch in batches:
        y, logits, loss, valid = _forward(model, batch, criterion, device, amp_dtype)
        b_loss, b_correct, b_rows, b_checksum, b_read = _sums(
            y, logits, loss, valid, batch["row_id"]
        )
        loss_sum += float(b_loss)
        correct += int(b_correct)
        rows, checksum, read = rows + b_rows, checksum + b_checksum, read + b_read
    return [loss_sum, float(correct), float(rows), float(checksum), float(read)]


SUMS = 5
"""Entries of the sums :func:`train_one_epoch` and :func:`evaluate` return."""


def check_shard(split: str, plan: ShardPlan, rank: int, sums: list[float]) -> None:
    """This rank's rows against the plan: how many it read (padding included), and, when a
    rank reads the same rows every epoch (Petastorm), their count and checksum.

    Raises:
        ShardError: naming the rank, the split, what was read and what the plan expects.
    """
    rows, checksum, read = int(sums[2]), int(sums[3]), int(sums[4])
    expected = plan.checksum_per_shard[rank] if plan.checksum_per_shard is not None else None
    if read != plan.rows_per_shard[rank] or (
        expected is not None and (rows != read or checksum != expected)
    ):
        raise ShardError(
            f"rank {rank}: the {split} shard read {read} rows ({rows} valid, checksum "
            f"{checksum}); the plan expects {plan.rows_per_shard[rank]} rows"
            + (f" (checksum {expected})" if expected is not None else "")
        )


def check_totals(split: str, plan: ShardPlan, totals: list[float]) -> None:
    """All ranks together read every row of the split exactly once: the all-reduced count of
    valid rows and their checksum equal the split's. The same on every rank, so every rank
    raises together (no hang).

    Raises:
        ShardError: a row was dropped or read twice this epoch.
    """
    rows, checksum = int(totals[2]), int(totals[3])
    if rows != plan.dataset_size or checksum != plan.checksum:
        raise ShardError(
            f"the ranks read {rows} valid {split} rows (checksum {checksum}) this epoch; the "
            f"split has {plan.dataset_size} (checksum {plan.checksum}): a row was dropped or "
            "read twice"
        )


def _check_resumable(state: dict[str, Any], cfg: JobConfig, label_names: list[str]) -> None:
    saved = state.get("config", {})
    for section, key in (("model", "architecture"), ("data", "image_size")):
        if saved.get(section, {}).get(key) != getattr(getattr(cfg, section), key):
            raise ValueError(
                f"--resume: checkpoint in {cfg.paths.checkpoint_dir} was trained with "
                f"{section}.{key}={saved.get(section, {}).get(key)!r}, not "
                f"{getattr(getattr(cfg, section), key)!r}"
            )
    if list(state.get("label_names", [])) != label_names:
        raise ValueError(
            f"--resume: checkpoint labels {state.get('label_names')} differ from the tables' "
            f"labels {label_names}"
        )


def fit(
    cfg: JobConfig,
    ctx: DistContext,
    train_plan: ShardPlan,
    val_plan: ShardPlan,
    label_names: list[str],
    example_images: list[bytes],
    ranks: list[dict[str, Any]] | None = None,
) -> tuple[dict[str, Any] | None, Callable[[], dict[str, Any]] | None]:
    """Train, validate, early-stop and checkpoint; (rank 0) log to MLflow.

    ``example_images`` (stored JPEG bytes) become the registered model's input example;
    ``ranks`` (:func:`~flowers_job.distributed.gather_ranks`, gathered when None) go into
    the summary. On resume, rank 0 alone reads the checkpoint and broadcasts it: ranks never
    read it separately (on a cluster they could see different files, or none).

    Returns:
        ``(summary, register)``. On rank 0: the training summary (val_accuracy, val_loss,
        best_epoch, epochs_completed, stop_reason, world_size, global_batch_size,
        learning_rate, history, seconds_per_epoch, images_per_second, ranks, mlflow_run_id,
        registered_model_name) and ``register``, which logs the model, registers it and ends
        the MLflow run, returning ``{"model_uri", "registered_model_version"}``; call it
        after the last collective. ``(None, None)`` on other ranks.
    """
    t_start = time.perf_counter()
    torch.manual_seed(cfg.train.seed)
    pre = preprocessing_for(cfg.model.architecture)
    model = build_model(
        cfg.model.architecture,
        len(label_names),
        cfg.model.resolved_weights,
        weights_path=cfg.model.weights_path,
        freeze_backbone=cfg.model.freeze_backbone,
        dropout=cfg.model.dropout,
    ).to(ctx.device)
    model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    lr = cfg.train.learning_rate(ctx.world_size)
    optimizer = _optimizer(cfg.train, [p for p in model.parameters() if p.requires_grad], lr)
    warmup_steps = round(cfg.train.warmup_epochs * train_plan.steps_per_epoch)
    # Gradual warm-up from the unscaled rate (Goyal et al. 2017, section 2.2); constant after.
    scheduler = torch.optim.lr_scheduler.LinearLR(
        optimizer,
        start_factor=cfg.train.base_learning_rate / lr if warmup_steps else 1.0,
        total_iters=max(1, warmup_steps),
    )
    amp_dtype = _amp_dtype(cfg.train.amp, ctx.device)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=amp_dtype == torch.float16)
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing, reduction="none")
    es = cfg.train.early_stopping
    stopper = EarlyStopping(es.mode, es.min_delta, es.patience, es.stopping_threshold)

    history: list[dict[str, float]] = []
    best_state: dict[str, torch.Tensor] | None = None
    stop_reason: str | None = None
    start_epoch = 1
    state = _load_on_rank0(cfg, ctx) if cfg.train.resume else None
    if state is not None:
        _check_resumable(state, cfg, label_names)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        stopper.load_state_dict(state["early_stopping"])
        history, best_state = list(state["history"]), state["best_model"]
        stop_reason = state["stop_reason"]
        start_epoch = int(state["epoch"]) + 1
        log.info("resumed from %s at epoch %d", cfg.paths.checkpoint_dir, start_epoch)

    tracker = None
    if ctx.is_main:
        from flowers_job.tracking import RunTracker, flatten

        # The run id is recorded as soon as the run exists: a run killed even before its
        # first checkpoint resumes into the same MLflow run.
        run_id = read_run_id(cfg.paths.checkpoint_dir) if cfg.train.resume else None
        tracker = RunTracker(cfg, run_id)
        write_run_id(cfg.paths.checkpoint_dir, tracker.run_id)
        for done in history:  # epochs checkpointed before a kill, not yet logged
            tracker.log_epoch({k: v for k, v in done.items() if k != "epoch"}, int(done["epoch"]))
        tracker.log_params(
            {
                **flatten(cfg.model_dump(mode="json", exclude={"train": {"resume"}})),
                "world_size": ctx.world_size,
                "global_batch_size": cfg.global_batch_size,
                "learning_rate": lr,
                "num_partitions": cfg.num_partitions,
                "train_rows": train_plan.dataset_size,
                "val_rows": val_plan.dataset_size,
                "steps_per_epoch": train_plan.steps_per_epoch,
                "backend": ctx.backend,
                "device": ctx.device.type,
            }
        )
        log.info(
            "world_size %d (%s on %s) | per_device_batch_size %d, global_batch_size %d | "
            "lr %.3g (%s scaling of %.3g) | train %d rows %s, val %d rows %s | "
            "steps per epoch %d | %d threads per process",
            ctx.world_size,
            ctx.backend,
            ctx.device.type,
            cfg.train.per_device_batch_size,
            cfg.global_batch_size,
            lr,
            cfg.train.lr_scaling,
            cfg.train.base_learning_rate,
            train_plan.dataset_size,
            train_plan.rows_per_shard,
            val_plan.dataset_size,
            val_plan.rows_per_shard,
            train_plan.steps_per_epoch,
            torch.get_num_threads(),
        )

    size, resize = cfg.data.image_size, cfg.data.stored_short_side
    train_tf = DecodeTransform(True, size, resize, pre.mean, pre.std)
    val_tf = DecodeTransform(False, size, resize, pre.mean, pre.std)

    if ranks is None:
        ranks = gather_ranks(ctx)
    num_nodes = describe_hosts(ctx, ranks)
    if ctx.is_main:
        log.info(
            "ranks: %s",
            ", ".join(
                f"{r['rank']}@{r['host']}({r['address']}, {r['interface']}, pid {r['pid']}, "
                f"{r.get('threads')} threads)"
                for r in ranks
            ),
        )
    if num_nodes is None and train_plan.loader == "streaming":
        raise RuntimeError(
            "data.loader=streaming: Mosaic Streaming needs the same number of ranks on every "
            "host, with consecutive ranks; this run's layout is irregular (use "
            "data.loader=petastorm, or one task slot per GPU on equal hosts)"
        )

    def loader(plan: ShardPlan, tf: DecodeTransform, shuffle: bool) -> ShardLoader:
        return open_loader(
            plan,
            ctx.rank,
            ctx.world_size,
            num_nodes or 1,
            tf,
            shuffle=shuffle,
            seed=cfg.train.seed,
            data=cfg.data.model_dump(mode="json"),
        )

    train_loader, val_loader = loader(train_plan, train_tf, True), loader(val_plan, val_tf, False)

    try:
        for epoch in range(start_epoch, cfg.train.epochs + 1):
            if stop_reason is not None:
                break
            torch.manual_seed(cfg.train.seed + 1000 * ctx.rank + epoch)  # augmentation stream
            t0 = time.perf_counter()
            batches = train_loader.epoch(epoch)
            if os.environ.get(faults.FAULT_ENV):  # test-only
                batches = faults.mid_epoch(
                    batches, ctx.rank, epoch, train_plan.steps_per_epoch // 2
                )
            if ctx.is_main:
                batches = tqdm(
                    batches,
                    file=_LineStream(sys.stderr),
                    total=train_plan.steps_per_epoch,
                    desc=f"epoch {epoch}",
                    unit="step",
                    mininterval=15.0,
                    ascii=True,
                    ncols=100,
                )
            train_sums = train_one_epoch(
                ddp, batches, optimizer, scheduler, criterion, ctx.device, amp_dtype, scaler
            )
            t1 = time.perf_counter()
            val_batches = val_loader.epoch(epoch)
            val_sums = evaluate(model, val_batches, criterion, ctx.device, amp_dtype)
            t2 = time.perf_counter()
            check_shard("train", train_plan, ctx.rank, train_sums)
            check_shard("val", val_plan, ctx.rank, val_sums)
            tot = all_reduce_sum([*train_sums, *val_sums], ctx)
            check_totals("train", train_plan, tot[:SUMS])
            check_totals("val", val_plan, tot[SUMS:])
            metrics = {
                "train_loss": tot[0] / tot[2],
                "train_accuracy": tot[1] / tot[2],
                "val_loss": tot[SUMS] / tot[SUMS + 2],
                "val_accuracy": tot[SUMS + 1] / tot[SUMS + 2],
                "learning_rate": float(optimizer.param_groups[0]["lr"]),
                "epoch_seconds": t2 - t0,
                "train_images_per_second": tot[2] / (t1 - t0),
                "images_per_second": (tot[2] + tot[SUMS + 2]) / (t2 - t0),
            }
            # One decision, made by rank 0 and shared: ranks can never disagree about stopping.
            decision = Decision(improved=False, stop=False)
            if ctx.is_main:
                decision = stopper.step(metrics[es.monitor], epoch)
                if not es.enabled:  # still track the best epoch, never stop early
                    decision = Decision(decision.improved, stop=False)
            decision = broadcast_object(decision, ctx)
            if decision.improved:
                best_state = {
                    k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()
                }
            if decision.stop:
                stop_reason = decision.reason
            history.append({"epoch": epoch, **metrics})
            if ctx.is_main:  # checkpoint first, then MLflow: see RunTracker
                assert tracker is not None
                save_checkpoint(
                    {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "epoch": epoch,
                        "early_stopping": stopper.state_dict(),
                        "best_model": best_state,
                        "history": history,
                        "stop_reason": stop_reason,
                        "label_names": label_names,
                        "config": cfg.model_dump(mode="json"),
                    },
                    cfg.paths.checkpoint_dir,
                )
                tracker.log_epoch(metrics, epoch)
                log.info(
                    "epoch %d/%d | train loss %.4f acc %.4f | val loss %.4f acc %.4f | %.1f s | "
                    "%.1f img/s%s",
                    epoch,
                    cfg.train.epochs,
                    metrics["train_loss"],
                    metrics["train_accuracy"],
                    metrics["val_loss"],
                    metrics["val_accuracy"],
                    metrics["epoch_seconds"],
                    metrics["images_per_second"],
                    f" | stop: {stop_reason}" if stop_reason else "",
                )
    finally:
        train_loader.close()
        val_loader.close()

    if stop_reason is None:
        stop_reason = "max_epochs"
    if es.restore_best_weights and best_state is not None:
        model.load_state_dict(best_state)
    if not ctx.is_main:
        return None, None
    assert tracker is not None
    best_epoch = stopper.best_epoch
    restored = es.restore_best_weights and best_state is not None
    final = next(h for h in history if h["epoch"] == best_epoch) if restored else history[-1]
    model_config = {
        "architecture": cfg.model.architecture,
        "label_names": label_names,
        "image_size": size,
        "resize_size": resize,
        "mean": list(pre.mean),
        "std": list(pre.std),
        "dropout": cfg.model.dropout,
        "max_pixels": cfg.data.max_image_pixels,
        "batch_size": 64,
    }
    trained = [h for h in history if h["epoch"] >= start_epoch]
    seconds = [h["epoch_seconds"] for h in history]
    summary = {
        "val_accuracy": final["val_accuracy"],
        "val_loss": final["val_loss"],
        "best_epoch": best_epoch,
        "epochs_completed": len(history),
        "epochs_this_run": len(trained),
        "stop_reason": stop_reason,
        "loader": train_plan.loader,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "device": ctx.device.type,
        "per_device_batch_size": cfg.train.per_device_batch_size,
        "global_batch_size": cfg.global_batch_size,
        "learning_rate": lr,
        "steps_per_epoch": train_plan.steps_per_epoch,
        "seconds_per_epoch": sum(seconds) / len(seconds) if seconds else 0.0,
        "images_per_second": (
            sum(h["images_per_second"] * h["epoch_seconds"] for h in history) / sum(seconds)
            if seconds
            else 0.0
        ),
        "train_seconds": time.perf_counter() - t_start,
        "history": history,
        "ranks": ranks,
        "mlflow_run_id": tracker.run_id,
        "registered_model_name": cfg.tracking.registered_model_name,
    }

    def register() -> dict[str, Any]:
        assert tracker is not None
        faults.delay("slow_registration", ctx.rank)
        model_uri, version = tracker.log_model(
            model, model_config, pd.DataFrame({"image": example_images})
        )
        tracker.log_epoch(
            {"best_val_loss": final["val_loss"], "best_val_accuracy": final["val_accuracy"]},
            best_epoch,
        )
        tracker.finish()
        return {"model_uri": model_uri, "registered_model_version": version}

    return summary, register


def _load_on_rank0(cfg: JobConfig, ctx: DistContext) -> dict[str, Any] | None:
    """The checkpoint to resume from, read by rank 0 and broadcast to every rank (None: no
    checkpoint). A collective; a checkpoint rank 0 cannot load fails every rank together.

    Raises:
        RuntimeError: rank 0 could not load the checkpoint (its message).
    """
    payload: tuple[str, Any] = ("none", None)
    if ctx.is_main:
        try:
            payload = ("ok", load_checkpoint(cfg.paths.checkpoint_dir))
        except Exception as exc:
            payload = ("error", f"rank 0: {exc}")
    kind, value = broadcast_object(payload, ctx)
    if kind == "error":
        raise RuntimeError(value)
    return value
