"""``train.resume``: continue from the last complete checkpoint, read by rank 0 alone.

Ranks never read the checkpoint separately (on a cluster they could see different files, or
none): rank 0 loads it and broadcasts it, so a checkpoint rank 0 cannot load fails every
rank together.
"""

from __future__ import annotations

import logging
from typing import Any

from flowers_job.config import JobConfig
from flowers_job.distributed import DistContext, broadcast_object
from flowers_job.train.checkpoint import load_checkpoint
from flowers_job.train.state import TrainState

__all__ = ["check_resumable", "load_on_rank0", "resume"]

log = logging.getLogger("flowers_job.train")


def load_on_rank0(cfg: JobConfig, ctx: DistContext) -> dict[str, Any] | None:
    """The checkpoint to resume from, read by rank 0 and broadcast to every rank (None: no
    checkpoint). A collective.

    Raises:
        RuntimeError: rank 0 could not load the checkpoint (its message), on every rank.
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


def check_resumable(state: dict[str, Any], cfg: JobConfig, label_names: list[str]) -> None:
    """Refuse a checkpoint of another model, image size or label set.

    Raises:
        ValueError: naming ``--resume``, the setting (``model.architecture``,
            ``data.image_size``) or the labels, and both values.
    """
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


def resume(state: TrainState) -> None:
    """With ``train.resume``: restore the model, optimizer, schedule, early stopping and
    history from the checkpoint (:func:`load_on_rank0`); nothing without a checkpoint.

    Raises:
        RuntimeError, ValueError: as :func:`load_on_rank0` and :func:`check_resumable`.
    """
    cfg = state.cfg
    saved = load_on_rank0(cfg, state.ctx) if cfg.train.resume else None
    if saved is None:
        return
    check_resumable(saved, cfg, state.label_names)
    state.model.load_state_dict(saved["model"])
    state.optimizer.load_state_dict(saved["optimizer"])
    state.scheduler.load_state_dict(saved["scheduler"])
    state.stopper.load_state_dict(saved["early_stopping"])
    state.history, state.best_state = list(saved["history"]), saved["best_model"]
    state.stop_reason = saved["stop_reason"]
    state.start_epoch = int(saved["epoch"]) + 1
    log.info("resumed from %s at epoch %d", cfg.paths.checkpoint_dir, state.start_epoch)
