"""What a rank trains with: the model, optimizer, schedule and loss built once, the readers of
its shards, and the state that a resume restores and every epoch extends."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel

from flowers_job.config import JobConfig
from flowers_job.loaders.base import Loader, ShardPlan
from flowers_job.location import Location
from flowers_job.runtime.layout import HostLayout
from flowers_job.runtime.process_group import DistContext, describe_hosts
from flowers_job.train.checkpoint import data_identity
from flowers_job.train.device_prefetch import DeviceReader, decodes_on_device
from flowers_job.train.early_stopping import EarlyStopping
from flowers_job.train.fine_tuning import WarmupCosine, attach_ema, make_ema, param_groups
from flowers_job.train.step import make_optimizer
from flowers_job.train.step_checkpoint import CheckpointClock, EpochPosition
from flowers_job.vision.backbones import Classifier, build_model, preprocessing_for
from flowers_job.vision.batch_decode import BatchDecoder
from flowers_job.vision.decode_transform import DecodeTransform
from flowers_job.vision.precision import DeviceNormalize, amp_dtype

if TYPE_CHECKING:
    from flowers_job.tracking.mlflow_run import RunTracker

__all__ = [
    "FrozenFeatures",
    "Plans",
    "TrainState",
    "build_state",
    "make_scheduler",
    "open_reader",
    "open_readers",
]

log = logging.getLogger("flowers_job.train")


@dataclass(frozen=True)
class Plans:
    """The driver's plan of each split (:class:`~flowers_job.loaders.base.ShardPlan`), and the
    loader that wrote them and reads them (resolved once on the driver,
    :func:`flowers_job.loaders.resolve_loader`)."""

    train: ShardPlan
    val: ShardPlan
    test: ShardPlan
    loader: type[Loader]


class FrozenFeatures:
    """The validation shard's backbone features, kept from the first evaluation when the
    backbone is frozen (:func:`flowers_job.train.evaluate.evaluate`).

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
        self.batches: list[tuple[Any, ...]] | None = None


@dataclass
class TrainState:
    """What the epoch loop works with, built by :func:`build_state`, plus its state, which
    a resume restores and every epoch extends. Only rank 0 has a ``tracker`` (None
    elsewhere, the timm habit)."""

    cfg: JobConfig
    ctx: DistContext
    plans: Plans
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
    shard: int = 0
    """The shard this rank reads (:class:`~flowers_job.runtime.layout.HostLayout`)."""
    layout: HostLayout | None = None
    train_reader: DeviceReader | None = None
    val_reader: DeviceReader | None = None
    val_features: FrozenFeatures | None = None
    tracker: RunTracker | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    best_state: dict[str, torch.Tensor] | None = None
    stop_reason: str | None = None
    start_epoch: int = 1
    position: EpochPosition | None = None
    """Where ``start_epoch`` continues, when resumed from a checkpoint inside it."""
    clock: CheckpointClock | None = None
    attempt: int = 0
    """0, or the automatic restart this process belongs to (:mod:`flowers_job.driver.restarts`)."""
    resumed_from: dict[str, Any] | None = None
    """The checkpoint this run continues: ``{"epoch", "step", "saved_at"}``."""
    report_dir: Location | None = None
    """The job's report dir: rank 0 writes ``first_step.json`` there after its first step."""
    first_step_seen: bool = False
    ema: AveragedModel | None = None
    """The weights' moving average (``train.ema_decay``), updated after every step."""
    lineage: dict[str, Any] = field(default_factory=dict)
    """What the run reads (:func:`flowers_job.driver.prepare.lineage`): the tables' versions,
    the ingest fingerprint, the test split's digest."""

    def data_identity(self) -> dict[str, Any]:
        """The data this run trains on, as a checkpoint records it and a resume compares it
        (:func:`~flowers_job.train.checkpoint.data_identity`)."""
        plans = {"train": self.plans.train, "val": self.plans.val, "test": self.plans.test}
        return data_identity(
            self.lineage, {k: (p.dataset_size, p.checksum) for k, p in plans.items()}
        )

    def resume_record(self) -> dict[str, Any]:
        """What every checkpoint carries for a resume's checks besides the configuration:
        ``data`` (:meth:`data_identity`) and ``optimizer_class`` (e.g. ``"AdamW"``)."""
        return {"data": self.data_identity(), "optimizer_class": type(self.optimizer).__name__}

    @property
    def eval_model(self) -> Classifier:
        """What validation scores and the best epoch keeps: the EMA's model with
        ``train.ema_decay``, else the model."""
        return self.ema.module if self.ema is not None else self.model  # type: ignore[return-value]


def _model(cfg: JobConfig, ctx: DistContext, num_classes: int) -> tuple[Classifier, DDP]:
    """The pretrained backbone and new head, on the device, channels-last, wrapped in DDP."""
    model = build_model(
        cfg.model.architecture,
        num_classes,
        cfg.model.resolved_weights,
        weights_path=cfg.model.weights_path,
        freeze_backbone=cfg.model.freeze_backbone,
        frozen_layers=cfg.model.frozen_layers,
        dropout=cfg.model.dropout,
    ).to(ctx.device)
    model.to(memory_format=torch.channels_last)
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    return model, ddp


def build_state(
    cfg: JobConfig, ctx: DistContext, plans: Plans, label_names: list[str]
) -> TrainState:
    """The model (pretrained, channels-last, DDP), optimizer (its parameter groups:
    :func:`~flowers_job.train.fine_tuning.param_groups`), schedule, EMA, AMP, loss and early
    stopping of this rank.

    The learning rate is ``train.base_learning_rate`` scaled by ``world_size``
    (:meth:`~flowers_job.config.TrainConfig.learning_rate`), reached after a linear warm-up
    from the unscaled rate over ``train.warmup_epochs`` (Goyal et al. 2017, section 2.2).
    """
    torch.manual_seed(cfg.train.seed)
    if ctx.device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input shapes: pick the fastest kernels
    model, ddp = _model(cfg, ctx, len(label_names))
    lr = cfg.train.learning_rate(ctx.world_size)
    optimizer = make_optimizer(cfg.train, param_groups(model, cfg.train, lr), lr)
    scheduler = make_scheduler(cfg, optimizer, lr, plans.train.steps_per_epoch)
    ema = make_ema(model, cfg.train.ema_decay)
    if ema is not None:
        attach_ema(optimizer, ema, model)
    dtype = amp_dtype(cfg.train.amp, ctx.device)
    es = cfg.train.early_stopping
    pre = preprocessing_for(cfg.model.architecture)
    frozen = cfg.model.freeze_backbone and cfg.train.cache_val_features
    return TrainState(
        cfg=cfg,
        ctx=ctx,
        plans=plans,
        label_names=label_names,
        model=model,
        ddp=ddp,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=torch.amp.GradScaler(ctx.device.type, enabled=dtype == torch.float16),
        criterion=nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing, reduction="none"),
        normalize=DeviceNormalize(pre.mean, pre.std, ctx.device),
        amp_dtype=dtype,
        stopper=EarlyStopping(es.mode, es.min_delta, es.patience, es.stopping_threshold),
        lr=lr,
        val_features=FrozenFeatures() if frozen else None,
        clock=CheckpointClock(cfg.train, ctx, plans.train.steps_per_epoch),
        ema=ema,
    )


def make_scheduler(
    cfg: JobConfig, optimizer: torch.optim.Optimizer, lr: float, steps_per_epoch: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """The per-step schedule: a linear warm-up from ``train.base_learning_rate`` to ``lr``
    over ``train.warmup_epochs`` epochs of ``steps_per_epoch`` steps (Goyal et al. 2017,
    section 2.2), then constant, or with ``train.lr_schedule: cosine`` a cosine decay to the
    last step of ``train.epochs`` (:class:`~flowers_job.train.fine_tuning.WarmupCosine`)."""
    warmup_steps = round(cfg.train.warmup_epochs * steps_per_epoch)
    if cfg.train.lr_schedule == "cosine":
        total, ratio = cfg.train.epochs * steps_per_epoch, cfg.train.lr_min_ratio
        start = cfg.train.base_learning_rate / lr if warmup_steps else 1.0
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, WarmupCosine(start, warmup_steps, total, ratio)
        )
    return torch.optim.lr_scheduler.LinearLR(
        optimizer,
        start_factor=cfg.train.base_learning_rate / lr if warmup_steps else 1.0,
        total_iters=max(1, warmup_steps),
    )


def open_reader(state: TrainState, plan: ShardPlan, train: bool) -> DeviceReader:
    """This rank's reader of ``plan``, from the loader that wrote it: augmented and shuffled
    for training, in stored order with the eval resize/crop otherwise; its batches on the
    device (:class:`~flowers_job.train.device_prefetch.DeviceReader`), decoded there when
    :func:`decodes_on_device`, read ahead by ``data.prefetch_to_device`` on a GPU."""
    cfg, ctx = state.cfg, state.ctx
    size, resize = cfg.data.image_size, cfg.data.stored_short_side
    on_device = decodes_on_device(cfg.data.decode_device, ctx.device)
    reader = state.plans.loader.open(
        plan,
        DecodeTransform(train, size, resize, undecoded=on_device),
        rank=state.shard,
        world_size=ctx.world_size,
        num_nodes=state.num_nodes,
        shuffle=train,
        seed=cfg.train.seed,
        settings=cfg.loaders,
        workers=cfg.data.loader_workers,
        pin_memory=False,  # the DeviceReader pins, in its own thread
    )
    prefetch = cfg.data.prefetch_to_device
    return DeviceReader(
        reader,
        ctx.device,
        BatchDecoder(train, size, resize, ctx.device) if on_device else None,
        seed=cfg.train.seed,
        shard=state.shard,
        prefetch=2 if prefetch is None else prefetch,
    )


def place_ranks(state: TrainState, ranks: list[dict[str, Any]]) -> None:
    """Group the ranks by host (:func:`~flowers_job.runtime.process_group.describe_hosts`): this
    rank's shard, ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``; before resuming, which continues the
    shard's position."""
    state.layout = describe_hosts(state.ctx, ranks)
    state.shard, state.num_nodes = state.layout.shard, state.layout.num_nodes


def open_readers(state: TrainState, ranks: list[dict[str, Any]]) -> None:
    """Open this rank's train and validation readers (of its shard, :func:`place_ranks`),
    after letting the loader refuse a layout of ranks on hosts it cannot read with.

    Raises:
        RuntimeError: the loader cannot read with this layout of ranks on hosts
            (:meth:`~flowers_job.loaders.base.Loader.check_layout`).
    """
    assert state.layout is not None, "place_ranks first"
    if state.ctx.is_main:
        log.info(
            "ranks: %s",
            ", ".join(
                f"{r['rank']}@{r['host']}({r['address']}, {r['interface']}, pid {r['pid']}, "
                f"{r.get('threads')} threads, {r.get('allocator', {}).get('allocator')})"
                for r in ranks
            )
            + f"; shards by host: {state.layout.describe()}",
        )
    state.plans.loader.check_layout(state.layout)
    state.train_reader = open_reader(state, state.plans.train, train=True)
    state.val_reader = open_reader(state, state.plans.val, train=False)
