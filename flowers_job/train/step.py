"""One step's arithmetic on the device: normalisation, mixed precision, forward and loss, the
optimizer.

The loaders deliver uint8 images (:mod:`flowers_job.loaders.base`); :class:`DeviceNormalize`
turns them into the model's float32 input once they are on the device, and :func:`forward`
runs the model under autocast with the padding rows masked out of the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flowers_job.train.metrics import PassSums, Sums
from flowers_job.vision.precision import DeviceNormalize, autocast

if TYPE_CHECKING:
    from flowers_job.config import TrainConfig

__all__ = [
    "forward",
    "make_optimizer",
    "masked_loss",
    "train_one_epoch",
]


def make_optimizer(
    train: TrainConfig, params: list[nn.Parameter] | list[dict[str, Any]], lr: float
) -> torch.optim.Optimizer:
    """``train.optimizer`` over ``params`` (parameters, or parameter groups whose own ``lr``
    and ``weight_decay`` win) at learning rate ``lr``: AdamW or Adam with ``weight_decay``,
    or SGD with Nesterov ``momentum``."""
    if train.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=lr, momentum=train.momentum, weight_decay=train.weight_decay, nesterov=True
        )
    cls = torch.optim.AdamW if train.optimizer == "adamw" else torch.optim.Adam
    return cls(params, lr=lr, weight_decay=train.weight_decay)


def masked_loss(
    criterion: nn.Module, logits: torch.Tensor, y: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """The mean of ``criterion``'s per-image losses (``reduction='none'``) over the valid rows;
    0 for a batch of padding only (which then contributes zero gradients).

    Shapes: ``logits`` ``[B, C]``, ``y`` int64 ``[B]``, ``valid`` bool ``[B]``; returns a
    float32 scalar.
    """
    per_image = criterion(logits.float(), y) * valid
    return per_image.sum() / valid.sum().clamp(min=1)


def forward(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    criterion: nn.Module,
    normalize: DeviceNormalize,
    dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Move a batch to the device, normalise it there (channels-last) and run the model under
    autocast.

    ``batch["image"]`` is uint8 ``[B, 3, S, S]``, or ``batch["features"]`` float32
    ``[B, F]`` a frozen backbone's features (the embeddings table's: the head alone runs);
    padding rows (``valid`` False) are masked out of the loss (:func:`masked_loss`).

    Returns:
        ``(labels [B] int64, logits [B, C], loss [] float32, valid [B] bool)``, on the device.
    """
    features = "features" in batch
    x = (
        batch["features"].to(normalize.device, non_blocking=True)
        if features
        else normalize(batch["image"])
    )
    y = batch["label_index"].to(normalize.device, non_blocking=True)
    valid = batch["valid"].to(normalize.device, non_blocking=True)
    with autocast(normalize.device, dtype):
        logits = model(x, from_features=True) if features else model(x)
    return y, logits, masked_loss(criterion, logits, y, valid), valid


# Arguments: the parts of one training step (model, optimizer, scheduler, criterion, AMP), as
# torchvision's reference train_one_epoch takes them.
def train_one_epoch(  # noqa: PLR0913
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    criterion: nn.Module,
    normalize: DeviceNormalize,
    amp_dtype: torch.dtype | None,
    scaler: torch.amp.GradScaler,
    sums: Sums | None = None,
    after_step: Callable[[Sums], None] | None = None,
) -> PassSums:
    """One pass over this rank's training batches.

    ``batches`` yields dicts with ``image`` uint8 ``[B, 3, S, S]`` (normalised here, on the
    device, by ``normalize``), ``label_index`` int64 ``[B]``, ``row_id`` int64 ``[B]`` and
    ``valid`` bool ``[B]`` (False: padding, masked out). ``sums``: the running sums to add
    to (a resumed epoch's, :class:`~flowers_job.train.step_checkpoint.EpochPosition`); new ones
    by default. ``after_step(sums)`` runs after each step (the mid-epoch checkpoint).

    Returns:
        This rank's :meth:`Sums.values <flowers_job.train.metrics.Sums.values>`: sums over the
        valid rows (loss summed over images), and every row read, padding included.
    """
    model.train()
    sums = sums if sums is not None else Sums(normalize.device)
    for batch in batches:
        y, logits, loss, valid = forward(model, batch, criterion, normalize, amp_dtype)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        sums.add(y, logits, loss, valid, batch["row_id"])
        if after_step is not None:
            after_step(sums)
    return sums.values()
