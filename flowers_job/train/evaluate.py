"""Evaluation: the validation pass of every epoch (with the frozen backbone's features kept
once) and the one scoring of the held-out test split with the best weights.

No collectives in :func:`evaluate` and :func:`score_shard` (pass the unwrapped model, not
the DDP wrapper); :func:`evaluate_test` is a collective every rank calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from flowers_job.runtime.process_group import all_gather_object
from flowers_job.tracking.class_report import WORST_MISTAKES, Mistake, TestReport, build_test_report
from flowers_job.train.metrics import PassSums, Sums, check_shard, check_totals, reduce_sums
from flowers_job.train.state import FrozenFeatures, TrainState, open_reader
from flowers_job.train.step import forward, masked_loss
from flowers_job.vision.backbones import Classifier
from flowers_job.vision.precision import DeviceNormalize, autocast

__all__ = ["ShardScores", "evaluate", "evaluate_test", "score_shard"]


@torch.inference_mode()
def evaluate(
    model: Classifier,
    batches: Callable[[], Iterable[dict[str, torch.Tensor]]],
    criterion: nn.Module,
    normalize: DeviceNormalize,
    amp_dtype: torch.dtype | None,
    features: FrozenFeatures | None = None,
) -> PassSums:
    """Loss and accuracy sums on this rank's validation shard.

    Args:
        batches: opens this epoch's validation batches (uint8 images, unaugmented); not
            called when ``features`` holds the shard already.
        features: with a frozen backbone (:class:`~flowers_job.vision.backbones.Classifier`), the
            kept features (filled on the first call); None: run the whole model.

    Returns:
        This rank's :meth:`Sums.values <flowers_job.train.metrics.Sums.values>`.
    """
    model.eval()
    device = normalize.device
    if features is not None and features.batches is not None:
        kept: Iterable[tuple[Any, ...]] = features.batches
    else:
        kept = _features(model, batches(), normalize, amp_dtype, features)
    sums = Sums(device)
    for feats, y, valid, row_id, is_features in kept:
        with autocast(device, amp_dtype):
            logits = model.head(feats) if is_features else feats
        sums.add(y, logits, masked_loss(criterion, logits, y, valid), valid, row_id)
    return sums.values()


def _features(
    model: Classifier,
    batches: Iterable[dict[str, torch.Tensor]],
    normalize: DeviceNormalize,
    amp_dtype: torch.dtype | None,
    features: FrozenFeatures | None,
) -> Iterator[tuple[Any, ...]]:
    """``(backbone features, or logits without features, labels, valid, row ids, whether
    the first are features)`` per batch; with ``features``, kept once the shard has been
    read to its end. A batch of the embeddings table brings its features
    (``batch["features"]``)."""
    kept: list[tuple[Any, ...]] = []
    for batch in batches:
        y = batch["label_index"].to(normalize.device, non_blocking=True)
        valid = batch["valid"].to(normalize.device, non_blocking=True)
        if "features" in batch:
            out, is_features = batch["features"].to(normalize.device, non_blocking=True), True
        else:
            x = normalize(batch["image"])
            with autocast(normalize.device, amp_dtype):
                out = model.backbone(x) if features is not None else model(x)
            is_features = features is not None
        item = (out, y, valid, batch["row_id"], is_features)
        if features is not None:
            kept.append(item)
        yield item
    if features is not None:
        features.batches = kept


@dataclass
class ShardScores:
    """One rank's scores of its test shard (:func:`score_shard`).

    Attributes:
        sums: :meth:`Sums.values <flowers_job.train.metrics.Sums.values>`.
        labels / predicted: int64 ``[rows]`` label indices of every valid row.
        mistakes: this rank's worst misclassified rows (highest loss first), with pixels.
    """

    sums: PassSums
    labels: np.ndarray
    predicted: np.ndarray
    mistakes: list[Mistake]


def _batch_mistakes(
    batch: dict[str, torch.Tensor],
    y: torch.Tensor,
    logits: torch.Tensor,
    keep: torch.Tensor,
    criterion: nn.Module,
) -> tuple[np.ndarray, np.ndarray, list[Mistake]]:
    """One batch's valid labels and predictions (int64, host) and its misclassified rows,
    each with its cross-entropy, row id, prediction, probability and uint8 pixels."""
    probs = torch.softmax(logits.float(), dim=1)
    y_cpu, pred_cpu = y.cpu()[keep], probs.argmax(1).cpu()[keep]
    row_loss = criterion(logits.float(), y).cpu()[keep]
    p_pred = probs.max(1).values.cpu()[keep]
    row_ids, images = batch["row_id"].cpu()[keep], batch["image"].cpu()[keep]
    mistakes = [
        Mistake(
            float(row_loss[i]),
            int(row_ids[i]),
            int(y_cpu[i]),
            int(pred_cpu[i]),
            float(p_pred[i]),
            images[i].numpy().copy(),
        )
        for i in torch.nonzero(y_cpu != pred_cpu).flatten().tolist()
    ]
    return y_cpu.numpy(), pred_cpu.numpy(), mistakes


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
    sums = Sums(normalize.device)
    labels: list[np.ndarray] = []
    predicted: list[np.ndarray] = []
    mistakes: list[Mistake] = []
    for batch in batches:
        y, logits, loss, valid = forward(model, batch, criterion, normalize, amp_dtype)
        sums.add(y, logits, loss, valid, batch["row_id"])
        y_np, pred_np, wrong = _batch_mistakes(batch, y, logits, valid.cpu(), criterion)
        labels.append(y_np)
        predicted.append(pred_np)
        mistakes = sorted([*mistakes, *wrong], key=lambda m: -m.loss)[:keep_mistakes]
    return ShardScores(
        sums.values(),
        np.concatenate(labels) if labels else np.zeros(0, dtype=np.int64),
        np.concatenate(predicted) if predicted else np.zeros(0, dtype=np.int64),
        mistakes,
    )


def evaluate_test(state: TrainState) -> TestReport | None:
    """Score the held-out test split once, with the model as it is now (the restored best
    weights): every rank its shard, rows checked against the plan as every epoch's are.

    A collective: every rank calls it. The test split takes no part in training, early
    stopping or the choice of the best epoch.

    Returns:
        On rank 0 the :class:`~flowers_job.tracking.class_report.TestReport` over all ranks; None elsewhere.

    Raises:
        ShardError: a rank read other rows than planned, or a row was dropped or read twice.
    """
    ctx, plan = state.ctx, state.plans.test
    t0 = time.perf_counter()
    reader = open_reader(state, plan, train=False)
    try:
        scores = score_shard(
            state.model, reader.epoch(1), state.criterion, state.normalize, state.amp_dtype
        )
    finally:
        reader.close()
    check_shard("test", plan, state.shard, scores.sums)
    (totals,) = reduce_sums([scores.sums], ctx)
    check_totals("test", plan, totals)
    gathered = all_gather_object(
        (scores.labels, scores.predicted, scores.mistakes, time.perf_counter() - t0), ctx
    )
    if not ctx.is_main:
        return None
    return build_test_report(
        np.concatenate([g[0] for g in gathered]),
        np.concatenate([g[1] for g in gathered]),
        totals.loss_sum,
        state.label_names,
        max(g[3] for g in gathered),
        [m for g in gathered for m in g[2]],
    )
