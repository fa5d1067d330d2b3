"""The fine-tuning recipe's parts, each a setting of ``train``
(:class:`~flowers_job.config.model.RecipeConfig`): the optimizer's parameter groups
(layer-wise learning-rate decay, no weight decay on norms and biases), warm-up then cosine
decay, and an exponential moving average (EMA) of the weights.

:func:`flowers_job.train.state.build_state` calls these; with the settings' defaults they
build what the job built before them (one group, warm-up then constant, no EMA).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from flowers_job.config import TrainConfig
from flowers_job.runtime.process_group import DistContext, broadcast_tensor
from flowers_job.vision.backbones import layer_key

__all__ = [
    "WarmupCosine",
    "attach_ema",
    "layer_ids",
    "make_ema",
    "param_groups",
    "sync_ema_buffers",
]


def layer_ids(model: nn.Module) -> tuple[dict[str, int], int]:
    """Number the layers of a :class:`~flowers_job.vision.backbones.Classifier` from input to output,
    for layer-wise learning-rate decay.

    The backbone's trainable parameters, in their registration order (the forward order of
    EfficientNet, MobileNet, ResNet...), are grouped by the block they belong to (the path
    up to the first numbered module: ``backbone.net._blocks.3``, ``backbone.features.5``,
    ``backbone.layer2.0``) or, outside numbered blocks, by their module
    (``backbone.net._conv_stem``); each group is one layer, numbered 0, 1, ... in order of
    first appearance. Every parameter of the head gets the last number, ``num_layers``.

    Returns:
        ``({parameter name: layer id}, num_layers)`` over the trainable parameters, names as
        in ``model.named_parameters()``.
    """
    ids: dict[str, int] = {}
    keys: dict[str, int] = {}
    heads = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if not name.startswith("backbone."):
            heads.append(name)
            continue
        ids[name] = keys.setdefault(layer_key(name), len(keys))
    num_layers = len(keys)
    ids.update(dict.fromkeys(heads, num_layers))
    return ids, num_layers


def param_groups(model: nn.Module, train: TrainConfig, lr: float) -> list[dict[str, Any]]:
    """The optimizer's parameter groups over the trainable parameters of ``model``.

    Each group holds the parameters of one layer (:func:`layer_ids`) and one weight-decay
    class, with ``lr = lr * lr_scale``, ``lr_scale = train.layer_decay ** (num_layers -
    layer)`` (layer-wise decay: Clark et al. 2020, ELECTRA, appendix; Bao et al. 2021, BEiT;
    timm's ``param_groups_layer_decay``), and ``weight_decay`` = ``train.weight_decay``, or 0
    for parameters of fewer than 2 dimensions (normalisation scales and shifts, biases)
    when ``train.decay_norm_and_bias`` is false (timm's ``param_groups_weight_decay``;
    torchvision's reference ``--norm-weight-decay 0``). ``lr_scale`` stays in the group so
    that a resume at another world size can rescale it
    (:func:`flowers_job.train.resume.resume`).

    With the defaults (``layer_decay=1``, ``decay_norm_and_bias=true``) this is one group of
    every trainable parameter at ``lr``, what the job optimised before.

    Returns:
        A list of dicts, ``params`` (a non-empty list of parameters), ``lr``, ``lr_scale``,
        ``weight_decay``, ordered by layer; empty groups are left out.
    """
    ids, num_layers = layer_ids(model)
    groups: dict[tuple[int, bool], dict[str, Any]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decay = train.decay_norm_and_bias or param.ndim >= 2
        layer = ids[name] if train.layer_decay < 1.0 else num_layers
        group = groups.get((layer, decay))
        if group is None:
            scale = train.layer_decay ** (num_layers - layer)
            group = groups[(layer, decay)] = {
                "params": [],
                "lr": lr * scale,
                "lr_scale": scale,
                "weight_decay": train.weight_decay if decay else 0.0,
            }
        group["params"].append(param)
    return [groups[key] for key in sorted(groups)]


class WarmupCosine:
    """The learning-rate factor of step ``step`` (a ``LambdaLR`` multiplier of each group's
    rate): a linear warm-up from ``start_factor`` to 1 over ``warmup_steps`` (Goyal et al.
    2017, section 2.2; the same as ``LinearLR``), then half a cosine from 1 down to
    ``min_ratio`` at ``total_steps`` (Loshchilov & Hutter 2017, SGDR, without restarts),
    ``min_ratio`` after it.

    A callable object rather than a lambda, so that ``LambdaLR.state_dict()`` keeps its
    attributes in the checkpoint.
    """

    def __init__(
        self, start_factor: float, warmup_steps: int, total_steps: int, min_ratio: float
    ) -> None:
        self.start_factor = start_factor
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_ratio = min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.start_factor + (1.0 - self.start_factor) * step / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_ema(model: nn.Module, decay: float | None) -> AveragedModel | None:
    """An exponential moving average of ``model``'s parameters and buffers (BatchNorm
    statistics too), ``ema = decay * ema + (1 - decay) * model`` per update, with torch's
    ``AveragedModel`` and ``get_ema_multi_avg_fn`` (the library's EMA; the first update
    copies the weights). None when ``decay`` is None.

    The average is a deep copy of ``model`` on its device: its ``module`` is a model of the
    same class, which validation and the test score run (``TrainState.eval_model``).
    """
    if decay is None:
        return None
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
    ema.n_averaged = ema.n_averaged.cpu()  # counted on the host: the step never reads the GPU
    return ema


def attach_ema(optimizer: torch.optim.Optimizer, ema: AveragedModel, model: nn.Module) -> None:
    """Update ``ema`` from ``model`` after every step of ``optimizer`` (a step post-hook,
    so the training loop needs no change; a step that the GradScaler skips, on an inf or
    NaN gradient, updates nothing).

    ``AveragedModel.update_parameters``' own step would read its device-side update count
    (``bool(n_averaged == 0)``) and copy it to the device, two host syncs per step on a GPU.
    The count stays on the host here (:func:`make_ema`) and each update is the library's
    ``multi_avg_fn`` (a ``_foreach_lerp_``) over the tensors grouped by device and dtype,
    as ``update_parameters`` groups them: the same arithmetic, queued without waiting.
    """

    def update(*_: Any) -> None:
        with torch.no_grad():
            averaged = [t.detach() for t in (*ema.module.parameters(), *ema.module.buffers())]
            current = [t.detach() for t in (*model.parameters(), *model.buffers())]
            if int(ema.n_averaged) == 0:  # a host tensor: no device read
                for a, c in zip(averaged, current, strict=True):
                    a.copy_(c)
            else:
                groups: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
                for a, c in zip(averaged, current, strict=True):
                    pair = groups.setdefault((a.device, a.dtype), ([], []))
                    pair[0].append(a)
                    pair[1].append(c)
                assert ema.multi_avg_fn is not None
                for group_averaged, group_current in groups.values():
                    ema.multi_avg_fn(group_averaged, group_current, ema.n_averaged)
            ema.n_averaged += 1

    optimizer.register_step_post_hook(update)


def sync_ema_buffers(ema: AveragedModel | None, ctx: DistContext) -> None:
    """Every rank's EMA takes rank 0's averaged floating-point buffers (BatchNorm running
    statistics), in one broadcast; nothing without an EMA or with one rank. A collective.

    The ranks' parameters are the same after every step (DDP), but not their BatchNorm
    statistics: DDP broadcasts rank 0's before each forward pass, which then updates them
    with the rank's own batch, so each rank's EMA averages slightly different statistics.
    Call it before every evaluation, so that every rank scores the average that rank 0
    checkpoints and registers, and a resumed run (every rank loads rank 0's) scores what
    the uninterrupted one would have.
    """
    if ema is None or ctx.world_size == 1:
        return
    buffers = [b for b in ema.module.buffers() if b.is_floating_point()]
    if not buffers:
        return
    flat = torch.cat([b.detach().reshape(-1).float() for b in buffers])
    broadcast_tensor(flat, ctx)
    offset = 0
    for b in buffers:
        b.detach().copy_(flat[offset : offset + b.numel()].view_as(b))
        offset += b.numel()
