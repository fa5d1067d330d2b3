"""Worker side: the function TorchDistributor runs on every rank, and its epoch loop.

``train_worker(job)`` takes plain data (the validated config as a dict and the driver's
shard plans), joins the process group, trains a DDP model on this rank's Petastorm
shard, and returns a small summary dict, identical on every rank (rank 0's, broadcast:
STACK.md trap 4).

Per epoch: every rank runs exactly ``steps_per_epoch`` steps; losses, accuracies and
row counts are all-reduced; rank 0 decides early stopping and broadcasts the decision;
rank 0 writes the checkpoint and logs to MLflow. Only rank 0 has a ``RunTracker``;
other ranks hold None (the timm habit). After the last epoch every rank restores the best
weights and scores its shard of the held-out test split once (:func:`evaluate_test`);
rank 0 gathers the rows and builds the test report (:mod:`flowers_job.report`).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from flowers_job import faults
from flowers_job.allocator import tune_this_process
from flowers_job.config import JobConfig, TrainConfig
from flowers_job.data.shards import CHECKSUM_MODULUS, ShardPlan, quiet_petastorm
from flowers_job.distributed import (
    DistContext,
    all_gather_object,
    all_reduce_sum,
    broadcast_object,
    describe_hosts,
    env_rank,
    gather_ranks,
    init_distributed,
    shutdown_distributed,
)
from flowers_job.models import Classifier, build_model, preprocessing_for
from flowers_job.processes import watch_driver
from flowers_job.report import (
    WORST_MISTAKES,
    Mistake,
    TestReport,
    build_test_report,
    report_figures,
)
from flowers_job.train.checkpoint import (
    load_checkpoint,
    read_run_id,
    save_checkpoint,
    write_run_id,
)
from flowers_job.train.early_stopping import Decision, EarlyStopping
from flowers_job.train.loader import (
    DecodeTransform,
    DeviceNormalize,
    ShardError,
    ShardLoader,
    open_loader,
)

if TYPE_CHECKING:
    from flowers_job.tracking import RunTracker

__all__ = [
    "CollectiveTimeoutError",
    "FrozenFeatures",
    "check_shard",
    "check_totals",
    "evaluate",
    "evaluate_test",
    "fit",
    "run_epoch",
    "score_shard",
    "train_one_epoch",
    "train_worker",
]

log = logging.getLogger("flowers_job.train")


def train_worker(job: dict[str, Any]) -> dict[str, Any]:
    """Entry point on every rank (top level and importable, so TorchDistributor can pickle it).

    Args:
        job: plain data from the driver: ``config`` (``JobConfig.model_dump(mode="json")``),
            ``train``/``val``/``test`` (:meth:`ShardPlan.to_dict`), ``label_names``,
            ``lineage`` (:func:`flowers_job.data.prepare.lineage`), ``use_gpu``,
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
    _enable_fatal_report(Path(job["failure_dir"]))
    # The environment should have carried the allocator tuning here (spark.executorEnv.*,
    # or the driver's environment in local mode); mallopt covers a cluster that lacks it.
    tune_this_process()
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
                ShardPlan.from_dict(job["test"]),
                list(job["label_names"]),
                [bytes(b) for b in job.get("example_images", [])],
                dict(job.get("lineage") or {}),
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


FATAL_SUFFIX = ".fatal"
"""``rank-<rank>.fatal`` in the report dir: what :mod:`faulthandler` writes when that rank
dies of a fatal signal (SIGSEGV, SIGABRT, SIGBUS, SIGILL, SIGFPE), a crash in native code
that leaves no Python exception and so no ``rank-<rank>.json``: the signal and every
thread's Python stack. Empty while the rank lives; the driver reports a non-empty one."""
_FATAL_FILES: list[Any] = []  # kept open for the process's lifetime, as faulthandler requires


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
    normalize: DeviceNormalize,
    amp_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Move a batch to the device, normalise it there (channels-last) and run the model under
    autocast.

    ``batch["image"]`` is uint8 ``[B, 3, S, S]``; ``criterion`` gives one loss per image
    (``reduction='none'``); padding rows (``valid`` False) are masked out, and the loss is
    the mean over the valid rows (0 for a batch of padding only, which then contributes
    zero gradients).

    Returns:
        ``(labels [B] int64, logits [B, C], loss [] float32, valid [B] bool)``.
    """
    x = normalize(batch["image"])
    y = batch["label_index"].to(normalize.device, non_blocking=True)
    valid = batch["valid"].to(normalize.device, non_blocking=True)
    with _autocast(normalize.device, amp_dtype):
        logits = model(x)
    return y, logits, _masked_loss(criterion, logits, y, valid), valid


def _autocast(device: torch.device, amp_dtype: torch.dtype | None) -> torch.autocast:
    return torch.autocast(
        device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None
    )


def _masked_loss(
    criterion: nn.Module, logits: torch.Tensor, y: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    per_image = criterion(logits.float(), y) * valid
    return per_image.sum() / valid.sum().clamp(min=1)


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
    normalize: DeviceNormalize,
    amp_dtype: torch.dtype | None,
    scaler: torch.amp.GradScaler,
) -> list[float]:
    """One pass over this rank's training batches (see :mod:`flowers_job.train.loader`).

    ``batches`` yields dicts with ``image`` uint8 ``[B, 3, S, S]`` (normalised here, on the
    device, by ``normalize``), ``label_index`` int64 ``[B]``, ``row_id`` int64 ``[B]`` and
    ``valid`` bool ``[B]`` (False: padding, masked out).

    Returns:
        This rank's ``[loss_sum, correct, rows, row_checksum, rows_read]``: sums over the
        valid rows (loss summed over images), and every row read, padding included.
    """
    model.train()
    device = normalize.device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    rows = checksum = read = 0
    for batch in batches:
        y, logits, loss, valid = _forward(model, batch, criterion, normalize, amp_dtype)
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


class FrozenFeatures:
    """The validation shard's backbone features, kept from the first evaluation when the
    backbone is frozen.

    A frozen backbone in eval mode maps the same unaugmented image to the same features
    every epoch, so only the head needs to run again: validation costs one backbone pass
    per run instead of one per epoch. The kept batches are exactly the first pass's
    (features, labels, validity, row ids), so the metrics are the same to the last digit
    (``head(features)`` is the very computation ``model(x)`` does after the backbone).

    Memory: ``rows x num_features`` floats of the autocast dtype (float32 on CPU: 1280 x 4
    bytes per row for EfficientNet-Lite0, 3.7 MB for the 734 validation photos), on the
    device.
    """

    def __init__(self) -> None:
        self.batches: list[tuple[torch.Tensor, ...]] | None = None


@torch.inference_mode()
def evaluate(
    model: Classifier,
    batches: Callable[[], Iterable[dict[str, torch.Tensor]]],
    criterion: nn.Module,
    normalize: DeviceNormalize,
    amp_dtype: torch.dtype | None,
    features: FrozenFeatures | None = None,
) -> list[float]:
    """Loss and accuracy sums on this rank's validation shard (no collectives: pass the
    unwrapped model, not the DDP wrapper).

    Args:
        batches: opens this epoch's validation batches (as :func:`train_one_epoch`'s);
            not called when ``features`` holds the shard already.
        features: with a frozen backbone (:class:`~flowers_job.models.Classifier`), the
            kept features (filled on the first call); None: run the whole model.

    Returns:
        This rank's ``[loss_sum, correct, rows, row_checksum, rows_read]``, as
        :func:`train_one_epoch`.
    """
    model.eval()
    device = normalize.device
    if features is not None and features.batches is not None:
        kept: Iterable[tuple[torch.Tensor, ...]] = features.batches
    else:
        kept = _features(model, batches(), normalize, amp_dtype, features)
    loss_sum, correct, rows, checksum, read = 0.0, 0, 0, 0, 0
    for feats, y, valid, row_id in kept:
        with _autocast(device, amp_dtype):
            logits = model.head(feats) if features is not None else feats
        loss = _masked_loss(criterion, logits, y, valid)
        b_loss, b_correct, b_rows, b_checksum, b_read = _sums(y, logits, loss, valid, row_id)
        loss_sum += float(b_loss)
        correct += int(b_correct)
        rows, checksum, read = rows + b_rows, checksum + b_checksum, read + b_read
    return [loss_sum, float(correct), float(rows), float(checksum), float(read)]


def _features(
    model: Classifier,
    batches: Iterable[dict[str, torch.Tensor]],
    normalize: DeviceNormalize,
    amp_dtype: torch.dtype | None,
    features: FrozenFeatures | None,
) -> Iterator[tuple[torch.Tensor, ...]]:
    """``(backbone features, or logits without features, labels, valid, row ids)`` per
    batch; with ``features``, kept once the shard has been read to its end."""
    kept: list[tuple[torch.Tensor, ...]] = []
    for batch in batches:
        x = normalize(batch["image"])
        y = batch["label_index"].to(normalize.device, non_blocking=True)
        valid = batch["valid"].to(normalize.device, non_blocking=True)
        with _autocast(normalize.device, amp_dtype):
            out = model.backbone(x) if features is not None else model(x)
        item = (out, y, valid, batch["row_id"])
        if features is not None:
            kept.append(item)
        yield item
    if features is not None:
        features.batches = kept


SUMS = 5
"""Entries of the sums :func:`train_one_epoch` and :func:`evaluate` return."""


@dataclass
class ShardScores:
    """One rank's scores of its test shard (:func:`score_shard`).

    Attributes:
        sums: ``[loss_sum, correct, rows, row_checksum, rows_read]``, as :func:`evaluate`.
        labels / predicted: int64 ``[rows]`` label indices of every valid row.
        mistakes: this rank's worst misclassified rows (highest loss first), with pixels.
    """

    sums: list[float]
    labels: np.ndarray
    predicted: np.ndarray
    mistakes: list[Mistake]


@torch.inference_mode()
def score_shard(
    model: Classifier,
    batches: Iterable[dict[str, torch.Tensor]],
    criterion: nn.Module,
    normalize: DeviceNormalize,
    amp_dtype: torch.dtype | None,
    keep_mistakes: int = WORST_MISTAKES,
) -> ShardScores:
    """Score every row of this rank's shard once, keeping each row's label and prediction.

    ``batches`` as :func:`evaluate`'s (uint8 images, unaugmented); pass the unwrapped model.
    The ``keep_mistakes`` misclassified rows with the highest cross-entropy keep their
    uint8 ``[3, S, S]`` image, for the report's grid.
    """
    model.eval()
    loss_sum, correct, rows, checksum, read = 0.0, 0, 0, 0, 0
    labels: list[np.ndarray] = []
    predicted: list[np.ndarray] = []
    mistakes: list[Mistake] = []
    for batch in batches:
        y, logits, loss, valid = _forward(model, batch, criterion, normalize, amp_dtype)
        b_loss, b_correct, b_rows, b_checksum, b_read = _sums(
            y, logits, loss, valid, batch["row_id"]
        )
        loss_sum += float(b_loss)
        correct += int(b_correct)
        rows, checksum, read = rows + b_rows, checksum + b_checksum, read + b_read
        probs = torch.softmax(logits.float(), dim=1)
        keep = valid.cpu()
        y_cpu, pred_cpu = y.cpu()[keep], probs.argmax(1).cpu()[keep]
        labels.append(y_cpu.numpy())
        predicted.append(pred_cpu.numpy())
        row_loss = criterion(logits.float(), y).cpu()[keep]
        p_pred = probs.max(1).values.cpu()[keep]
        row_ids, images = batch["row_id"][keep], batch["image"][keep]
        for i in torch.nonzero(y_cpu != pred_cpu).flatten().tolist():
            mistakes.append(
                Mistake(
                    float(row_loss[i]),
                    int(row_ids[i]),
                    int(y_cpu[i]),
                    int(pred_cpu[i]),
                    float(p_pred[i]),
                    images[i].numpy().copy(),
                )
            )
        mistakes = sorted(mistakes, key=lambda m: -m.loss)[:keep_mistakes]
    return ShardScores(
        [loss_sum, float(correct), float(rows), float(checksum), float(read)],
        np.concatenate(labels) if labels else np.zeros(0, dtype=np.int64),
        np.concatenate(predicted) if predicted else np.zeros(0, dtype=np.int64),
        mistakes,
    )


def evaluate_test(loop: _Loop) -> TestReport | None:
    """Score the held-out test split once, with the model as it is now (the restored best
    weights): every rank its shard, rows checked against the plan as every epoch's are.

    A collective: every rank calls it. The test split takes no part in training, early
    stopping or the choice of the best epoch.

    Returns:
        On rank 0 the :class:`~flowers_job.report.TestReport` over all ranks; None elsewhere.

    Raises:
        ShardError: a rank read other rows than planned, or a row was dropped or read twice.
    """
    ctx, plan = loop.ctx, loop.test_plan
    t0 = time.perf_counter()
    loader = _loader(loop, plan, train=False)
    try:
        scores = score_shard(
            loop.model, loader.epoch(1), loop.criterion, loop.normalize, loop.amp_dtype
        )
    finally:
        loader.close()
    check_shard("test", plan, ctx.rank, scores.sums)
    totals = all_reduce_sum(scores.sums, ctx)
    check_totals("test", plan, totals)
    gathered = all_gather_object(
        (scores.labels, scores.predicted, scores.mistakes, time.perf_counter() - t0), ctx
    )
    if not ctx.is_main:
        return None
    return build_test_report(
        np.concatenate([g[0] for g in gathered]),
        np.concatenate([g[1] for g in gathered]),
        totals[0],
        loop.label_names,
        max(g[3] for g in gathered),
        [m for g in gathered for m in g[2]],
    )


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


@dataclass
class _Loop:
    """What the epoch loop works with, built by :func:`_setup` (plus its state, which a
    resume restores and every epoch extends)."""

    cfg: JobConfig
    ctx: DistContext
    train_plan: ShardPlan
    val_plan: ShardPlan
    test_plan: ShardPlan
    label_names: list[str]
    model: Classifier
    ddp: DDP
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    criterion: nn.Module
    normalize: DeviceNormalize
    amp_dtype: torch.dtype | None
    stopper: EarlyStopping
    lr: float
    num_nodes: int = 1
    train_loader: ShardLoader | None = None
    val_loader: ShardLoader | None = None
    val_features: FrozenFeatures | None = None
    tracker: RunTracker | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    best_state: dict[str, torch.Tensor] | None = None
    stop_reason: str | None = None
    start_epoch: int = 1


def fit(
    cfg: JobConfig,
    ctx: DistContext,
    train_plan: ShardPlan,
    val_plan: ShardPlan,
    test_plan: ShardPlan,
    label_names: list[str],
    example_images: list[bytes],
    lineage: dict[str, Any],
    ranks: list[dict[str, Any]] | None = None,
) -> tuple[dict[str, Any] | None, Callable[[], dict[str, Any]] | None]:
    """Train, validate, early-stop and checkpoint; restore the best weights and score the
    test split once; (rank 0) log to MLflow.

    ``example_images`` (stored JPEG bytes) become the registered model's input example;
    ``lineage`` (:func:`flowers_job.data.prepare.lineage`) is logged with the run;
    ``ranks`` (:func:`~flowers_job.distributed.gather_ranks`, gathered when None) go into
    the summary. On resume, rank 0 alone reads the checkpoint and broadcasts it: ranks never
    read it separately (on a cluster they could see different files, or none).

    Returns:
        ``(summary, register)``. On rank 0: the training summary (:func:`_finish`) and
        ``register``, which logs the test report, figures and lineage, logs and registers
        the model and ends the MLflow run, returning ``{"model_uri",
        "registered_model_version"}``; call it after the last collective. ``(None, None)``
        on other ranks.
    """
    t_start = time.perf_counter()
    loop = _setup(cfg, ctx, train_plan, val_plan, test_plan, label_names)
    _resume(loop)
    _start_tracking(loop)
    ranks = ranks if ranks is not None else gather_ranks(ctx)
    _open_loaders(loop, ranks)
    try:
        for epoch in range(loop.start_epoch, cfg.train.epochs + 1):
            if loop.stop_reason is not None:
                break
            metrics = run_epoch(loop, epoch)
            _end_epoch(loop, epoch, metrics)
    finally:
        for opened in (loop.train_loader, loop.val_loader):
            if opened is not None:
                opened.close()
    restored = _restore_best(loop)
    test = evaluate_test(loop)
    return _finish(
        loop, ranks, example_images, lineage, restored, test, time.perf_counter() - t_start
    )


def _setup(
    cfg: JobConfig,
    ctx: DistContext,
    train_plan: ShardPlan,
    val_plan: ShardPlan,
    test_plan: ShardPlan,
    label_names: list[str],
) -> _Loop:
    """The model (pretrained, channels-last, DDP), optimizer, warm-up schedule, AMP, loss
    and early stopping of this rank."""
    torch.manual_seed(cfg.train.seed)
    if ctx.device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input shapes: pick the fastest kernels
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
    es = cfg.train.early_stopping
    pre = preprocessing_for(cfg.model.architecture)
    return _Loop(
        cfg=cfg,
        ctx=ctx,
        train_plan=train_plan,
        val_plan=val_plan,
        test_plan=test_plan,
        label_names=label_names,
        model=model,
        ddp=ddp,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=torch.amp.GradScaler(ctx.device.type, enabled=amp_dtype == torch.float16),
        criterion=nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing, reduction="none"),
        normalize=DeviceNormalize(pre.mean, pre.std, ctx.device),
        amp_dtype=amp_dtype,
        stopper=EarlyStopping(es.mode, es.min_delta, es.patience, es.stopping_threshold),
        lr=lr,
        val_features=(
            FrozenFeatures() if cfg.model.freeze_backbone and cfg.train.cache_val_features else None
        ),
    )


def _resume(loop: _Loop) -> None:
    """With ``train.resume``: restore the model, optimizer, schedule, early stopping and
    history from the checkpoint (read by rank 0, broadcast; :func:`_load_on_rank0`)."""
    cfg = loop.cfg
    state = _load_on_rank0(cfg, loop.ctx) if cfg.train.resume else None
    if state is None:
        return
    _check_resumable(state, cfg, loop.label_names)
    loop.model.load_state_dict(state["model"])
    loop.optimizer.load_state_dict(state["optimizer"])
    loop.scheduler.load_state_dict(state["scheduler"])
    loop.stopper.load_state_dict(state["early_stopping"])
    loop.history, loop.best_state = list(state["history"]), state["best_model"]
    loop.stop_reason = state["stop_reason"]
    loop.start_epoch = int(state["epoch"]) + 1
    log.info("resumed from %s at epoch %d", cfg.paths.checkpoint_dir, loop.start_epoch)


def _start_tracking(loop: _Loop) -> None:
    """Rank 0: open (or, on resume, reopen) the MLflow run, log the epochs checkpointed but
    not yet logged, the parameters, and the run's shape."""
    cfg, ctx, train_plan, val_plan = loop.cfg, loop.ctx, loop.train_plan, loop.val_plan
    if not ctx.is_main:
        return
    from flowers_job.tracking import RunTracker, flatten

    # The run id is recorded as soon as the run exists: a run killed even before its
    # first checkpoint resumes into the same MLflow run.
    run_id = read_run_id(cfg.paths.checkpoint_dir) if cfg.train.resume else None
    tracker = loop.tracker = RunTracker(cfg, run_id)
    write_run_id(cfg.paths.checkpoint_dir, tracker.run_id)
    for done in loop.history:  # epochs checkpointed before a kill, not yet logged
        tracker.log_epoch({k: v for k, v in done.items() if k != "epoch"}, int(done["epoch"]))
    tracker.log_params(
        {
            **flatten(cfg.model_dump(mode="json", exclude={"train": {"resume"}})),
            "world_size": ctx.world_size,
            "global_batch_size": cfg.global_batch_size,
            "learning_rate": loop.lr,
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
        loop.lr,
        cfg.train.lr_scaling,
        cfg.train.base_learning_rate,
        train_plan.dataset_size,
        train_plan.rows_per_shard,
        val_plan.dataset_size,
        val_plan.rows_per_shard,
        train_plan.steps_per_epoch,
        torch.get_num_threads(),
    )


def _open_loaders(loop: _Loop, ranks: list[dict[str, Any]]) -> None:
    """Open this rank's train and validation loaders (:func:`_loader`), after making
    ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` describe the hosts (a collective).

    Raises:
        RuntimeError: ``data.loader=streaming`` with ranks laid out irregularly on hosts.
    """
    ctx = loop.ctx
    num_nodes = describe_hosts(ctx, ranks)
    if ctx.is_main:
        log.info(
            "ranks: %s",
            ", ".join(
                f"{r['rank']}@{r['host']}({r['address']}, {r['interface']}, pid {r['pid']}, "
                f"{r.get('threads')} threads, {r.get('allocator', {}).get('allocator')})"
                for r in ranks
            ),
        )
    if num_nodes is None and loop.train_plan.loader == "streaming":
        raise RuntimeError(
            "data.loader=streaming: Mosaic Streaming needs the same number of ranks on every "
            "host, with consecutive ranks; this run's layout is irregular (use "
            "data.loader=petastorm, or one task slot per GPU on equal hosts)"
        )
    loop.num_nodes = num_nodes or 1
    loop.train_loader = _loader(loop, loop.train_plan, train=True)
    loop.val_loader = _loader(loop, loop.val_plan, train=False)


def _loader(loop: _Loop, plan: ShardPlan, train: bool) -> ShardLoader:
    """This rank's loader of ``plan`` (:func:`open_loader`): augmented and shuffled for
    training, in stored order with the eval resize/crop otherwise."""
    cfg, ctx = loop.cfg, loop.ctx
    return open_loader(
        plan,
        ctx.rank,
        ctx.world_size,
        loop.num_nodes,
        DecodeTransform(train, cfg.data.image_size, cfg.data.stored_short_side),
        shuffle=train,
        seed=cfg.train.seed,
        data=cfg.data.model_dump(mode="json"),
        pin_memory=ctx.device.type == "cuda",
    )


def run_epoch(loop: _Loop, epoch: int) -> dict[str, float]:
    """Train one epoch, validate, check every rank's rows and all-reduce the metrics.

    Returns:
        ``train_loss``, ``train_accuracy``, ``val_loss``, ``val_accuracy`` (all ranks),
        ``learning_rate``, ``epoch_seconds`` (seconds), ``train_images_per_second`` and
        ``images_per_second`` (train + val images / epoch seconds), identical on every rank.

    Raises:
        ShardError: a rank read other rows than planned, or the ranks together did not read
            every row exactly once.
    """
    ctx, plan, val_plan = loop.ctx, loop.train_plan, loop.val_plan
    assert loop.train_loader is not None and loop.val_loader is not None
    torch.manual_seed(loop.cfg.train.seed + 1000 * ctx.rank + epoch)  # augmentation stream
    t0 = time.perf_counter()
    batches = loop.train_loader.epoch(epoch)
    if os.environ.get(faults.FAULT_ENV):  # test-only
        batches = faults.mid_epoch(batches, ctx.rank, epoch, plan.steps_per_epoch // 2)
    if ctx.is_main:
        batches = tqdm(
            batches,
            file=_LineStream(sys.stderr),
            total=plan.steps_per_epoch,
            desc=f"epoch {epoch}",
            unit="step",
            mininterval=15.0,
            ascii=True,
            ncols=100,
        )
    train_sums = train_one_epoch(
        loop.ddp,
        batches,
        loop.optimizer,
        loop.scheduler,
        loop.criterion,
        loop.normalize,
        loop.amp_dtype,
        loop.scaler,
    )
    t1 = time.perf_counter()
    val_loader = loop.val_loader
    val_sums = evaluate(
        loop.model,
        lambda: val_loader.epoch(epoch),
        loop.criterion,
        loop.normalize,
        loop.amp_dtype,
        loop.val_features,
    )
    t2 = time.perf_counter()
    check_shard("train", plan, ctx.rank, train_sums)
    check_shard("val", val_plan, ctx.rank, val_sums)
    tot = all_reduce_sum([*train_sums, *val_sums], ctx)
    check_totals("train", plan, tot[:SUMS])
    check_totals("val", val_plan, tot[SUMS:])
    return {
        "train_loss": tot[0] / tot[2],
        "train_accuracy": tot[1] / tot[2],
        "val_loss": tot[SUMS] / tot[SUMS + 2],
        "val_accuracy": tot[SUMS + 1] / tot[SUMS + 2],
        "learning_rate": float(loop.optimizer.param_groups[0]["lr"]),
        "epoch_seconds": t2 - t0,
        "train_images_per_second": tot[2] / (t1 - t0),
        "images_per_second": (tot[2] + tot[SUMS + 2]) / (t2 - t0),
    }


def _end_epoch(loop: _Loop, epoch: int, metrics: dict[str, float]) -> None:
    """Early stopping decided once by rank 0 and broadcast (ranks can never disagree about
    stopping), the best weights kept, then (rank 0) the checkpoint and the MLflow metrics."""
    ctx, es = loop.ctx, loop.cfg.train.early_stopping
    decision = Decision(improved=False, stop=False)
    if ctx.is_main:
        decision = loop.stopper.step(metrics[es.monitor], epoch)
        if not es.enabled:  # still track the best epoch, never stop early
            decision = Decision(decision.improved, stop=False)
    decision = broadcast_object(decision, ctx)
    if decision.improved:
        loop.best_state = {
            k: v.detach().to("cpu", copy=True) for k, v in loop.model.state_dict().items()
        }
    if decision.stop:
        loop.stop_reason = decision.reason
    loop.history.append({"epoch": epoch, **metrics})
    if not ctx.is_main:
        return
    assert loop.tracker is not None
    # checkpoint first, then MLflow: see RunTracker
    save_checkpoint(
        {
            "model": loop.model.state_dict(),
            "optimizer": loop.optimizer.state_dict(),
            "scheduler": loop.scheduler.state_dict(),
            "epoch": epoch,
            "early_stopping": loop.stopper.state_dict(),
            "best_model": loop.best_state,
            "history": loop.history,
            "stop_reason": loop.stop_reason,
            "label_names": loop.label_names,
            "config": loop.cfg.model_dump(mode="json"),
        },
        loop.cfg.paths.checkpoint_dir,
    )
    loop.tracker.log_epoch(metrics, epoch)
    log.info(
        "epoch %d/%d | train loss %.4f acc %.4f | val loss %.4f acc %.4f | %.1f s | %.1f img/s%s",
        epoch,
        loop.cfg.train.epochs,
        metrics["train_loss"],
        metrics["train_accuracy"],
        metrics["val_loss"],
        metrics["val_accuracy"],
        metrics["epoch_seconds"],
        metrics["images_per_second"],
        f" | stop: {loop.stop_reason}" if loop.stop_reason else "",
    )


def _restore_best(loop: _Loop) -> bool:
    """Every rank: load the best epoch's weights (``early_stopping.restore_best_weights``).

    Returns:
        True if the best weights were restored.
    """
    if not (loop.cfg.train.early_stopping.restore_best_weights and loop.best_state is not None):
        return False
    loop.model.load_state_dict(loop.best_state)
    return True


def _finish(
    loop: _Loop,
    ranks: list[dict[str, Any]],
    example_images: list[bytes],
    lineage: dict[str, Any],
    restored: bool,
    test: TestReport | None,
    seconds: float,
) -> tuple[dict[str, Any] | None, Callable[[], dict[str, Any]] | None]:
    """On rank 0: the summary and the ``register`` step (see :func:`fit`)."""
    cfg, ctx = loop.cfg, loop.ctx
    if not ctx.is_main:
        return None, None
    tracker = loop.tracker
    assert tracker is not None and test is not None
    history, best_epoch = loop.history, loop.stopper.best_epoch
    final = next(h for h in history if h["epoch"] == best_epoch) if restored else history[-1]
    from flowers_job.serving import model_config  # MLflow: rank 0 only

    config = model_config(cfg, loop.label_names)
    # Drawn now, while the other ranks wait at the last collective: after it they exit, and
    # rank 0's work after it (MLflow I/O only) stays short.
    figures = report_figures(test, loop.history, loop.stopper.best_epoch)
    epoch_seconds = [h["epoch_seconds"] for h in history]
    summary = {
        **test.metrics(),
        "test_rows": test.rows,
        "test": test.to_dict(),
        "val_accuracy": final["val_accuracy"],
        "val_loss": final["val_loss"],
        "best_epoch": best_epoch,
        "epochs_completed": len(history),
        "epochs_this_run": sum(h["epoch"] >= loop.start_epoch for h in history),
        "stop_reason": loop.stop_reason or "max_epochs",
        "loader": loop.train_plan.loader,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "device": ctx.device.type,
        "per_device_batch_size": cfg.train.per_device_batch_size,
        "global_batch_size": cfg.global_batch_size,
        "learning_rate": loop.lr,
        "steps_per_epoch": loop.train_plan.steps_per_epoch,
        "seconds_per_epoch": sum(epoch_seconds) / len(epoch_seconds) if epoch_seconds else 0.0,
        "images_per_second": (
            sum(h["images_per_second"] * h["epoch_seconds"] for h in history) / sum(epoch_seconds)
            if epoch_seconds
            else 0.0
        ),
        "train_seconds": seconds,
        "history": history,
        "ranks": ranks,
        "lineage": lineage,
        "mlflow_run_id": tracker.run_id,
        "registered_model_name": cfg.tracking.registered_model_name,
    }
    model = loop.model

    def register() -> dict[str, Any]:
        faults.delay("slow_registration", ctx.rank)
        tracker.log_final(
            {"best_val_loss": final["val_loss"], "best_val_accuracy": final["val_accuracy"]},
            step=best_epoch,
        )
        tracker.log_test(test, figures)
        tracker.log_lineage(lineage)
        faults.inject("fail_registration", ctx.rank, 0)
        model_uri, version = tracker.log_model(
            model, config, pd.DataFrame({"image": example_images})
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
