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

if TYPE_CHECKING:
    from flowers_job.config import TrainConfig

__all__ = [
    "BF16_MIN_CAPABILITY",
    "DeviceNormalize",
    "amp_dtype",
    "autocast",
    "forward",
    "make_optimizer",
    "masked_loss",
    "train_one_epoch",
]


class DeviceNormalize:
    """uint8 images -> the model's float32 input, on the device: ``(x / 255 - mean) / std``.

    The loaders deliver uint8 ``[B, 3, S, S]`` (a quarter of float32's bytes through the
    loader, the pinned buffer and the host-to-device copy); this runs on the batch once it
    is on ``device`` (one fused multiply-add per pixel, on the GPU when there is one).

    Input: uint8 ``[B, 3, S, S]`` on any device. Output: float32 ``[B, 3, S, S]`` on
    ``device``, channels-last.
    """

    def __init__(
        self, mean: tuple[float, ...], std: tuple[float, ...], device: torch.device
    ) -> None:
        self.device = device
        scale = torch.tensor([1.0 / (255.0 * s) for s in std], dtype=torch.float32)
        shift = torch.tensor([m / s for m, s in zip(mean, std, strict=True)], dtype=torch.float32)
        self.scale = scale.view(1, -1, 1, 1).to(device)
        self.neg_shift = (-shift).view(1, -1, 1, 1).to(device)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(self.device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        return torch.addcmul(self.neg_shift, x.float(), self.scale)


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


BF16_MIN_CAPABILITY = (8, 0)
"""bf16 tensor-core arithmetic starts with Ampere (compute capability 8.0: NVIDIA's CUDA C++
Programming Guide, "Compute Capabilities"). ``torch.cuda.is_bf16_supported()`` also answers
True on older GPUs, a T4 (7.5) among them, where bf16 is emulated through float32 and runs
slower than fp16 on its tensor cores."""


def amp_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``train.amp`` on ``device``; None = float32 (no autocast).

    'auto': bf16 on a GPU of compute capability 8.0 or more (:data:`BF16_MIN_CAPABILITY`),
    fp16 on an older GPU (with a ``GradScaler``: Micikevicius et al. 2018, "Mixed Precision
    Training"), float32 on a CPU. 'bf16' and 'fp16' as asked; 'off': float32.

    Raises:
        ValueError: 'bf16' on a GPU older than compute capability 8.0, naming it.
    """
    if amp == "off":
        return None
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        modern = tuple(capability) >= BF16_MIN_CAPABILITY
        if amp == "bf16" and not modern:
            name = torch.cuda.get_device_name(device)
            raise ValueError(
                f"train.amp=bf16: {device} is a {name} of compute capability "
                f"{capability[0]}.{capability[1]}; bf16 needs 8.0 or more (Ampere and newer). "
                "Use train.amp=auto (fp16 with a gradient scaler there) or fp16"
            )
        if amp == "auto":
            return torch.bfloat16 if modern else torch.float16
    elif amp == "auto":
        return None
    return torch.bfloat16 if amp == "bf16" else torch.float16


def autocast(device: torch.device, dtype: torch.dtype | None) -> torch.autocast:
    """``torch.autocast`` on ``device`` with ``dtype``; disabled when ``dtype`` is None."""
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


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

    ``batch["image"]`` is uint8 ``[B, 3, S, S]``; padding rows (``valid`` False) are masked
    out of the loss (:func:`masked_loss`).

    Returns:
        ``(labels [B] int64, logits [B, C], loss [] float32, valid [B] bool)``, on the device.
    """
    x = normalize(batch["image"])
    y = batch["label_index"].to(normalize.device, non_blocking=True)
    valid = batch["valid"].to(normalize.device, non_blocking=True)
    with autocast(normalize.device, dtype):
        logits = model(x)
    return y, logits, masked_loss(criterion, logits, y, valid), valid


def train_one_epoch(
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
