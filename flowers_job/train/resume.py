"""``train.resume``: continue from the last checkpoint, read by rank 0 alone.

Ranks never read the checkpoint separately (on a cluster they could see different files, or
none): rank 0 chooses it, loads it and broadcasts it, so a checkpoint rank 0 cannot load
fails every rank together.

Which checkpoint: the one inside the epoch after the last completed one (``step.pt``) when
it can continue exactly (the same world size, train plan and a loader that can reach its
position: :meth:`~flowers_job.loaders.base.Loader.mid_epoch_problem`); otherwise the
last completed epoch's (``last.pt``), and that epoch starts again from its beginning, named
in the log. A resume at another world size (``distributed.num_processes``) rescales the
learning rate by ``train.lr_scaling`` and reads every row once per epoch with the loader's
plan for the new world size.

What must be the same (:func:`check_resumable`, :func:`check_same_data`): the model, image
size, trained layers, labels and optimizer, and the data. The driver runs these checks
before the ranks start (:func:`flowers_job.driver.prepare.check_resume`), and rank 0's
resume runs them again on the checkpoint it chose. New data is refused unless
``train.resume_on_new_data``; even then the test split must be unchanged, so that no photo
of the test split is ever trained on and the test scores stay comparable (a test split
kept at the checkpoint's Delta version by time travel would not do: the new ingest may
have put the old test photos in the new train split).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from flowers_job.config import JobConfig
from flowers_job.errors import ConfigError
from flowers_job.runtime.process_group import DistContext, broadcast_object
from flowers_job.train.checkpoint import STEP_CHECKPOINT_NAME, data_changes, load_checkpoint
from flowers_job.train.state import Plans, TrainState, make_scheduler
from flowers_job.train.step_checkpoint import EpochPosition

__all__ = ["check_resumable", "check_same_data", "choose_checkpoint", "load_on_rank0", "resume"]

log = logging.getLogger("flowers_job.train")


def _why_not_continued(
    step: dict[str, Any], cfg: JobConfig, ctx: DistContext, plans: Plans
) -> str | None:
    """Why the mid-epoch checkpoint ``step`` cannot continue in this run; None if it can."""
    world_size = int(step.get("world_size", 0))
    if world_size != ctx.world_size:
        return f"it was taken at world_size {world_size}, this run has {ctx.world_size}"
    plan, saved = plans.train, step.get("plan", {})
    now = {
        "loader": plan.loader,
        "dataset_size": plan.dataset_size,
        "checksum": plan.checksum,
        "rows_per_shard": list(plan.rows_per_shard),
        "steps_per_epoch": plan.steps_per_epoch,
    }
    changed = sorted(k for k, v in now.items() if saved.get(k) != v)
    if changed:
        return f"the train split's plan changed since ({', '.join(changed)})"
    return plans.loader.mid_epoch_problem(cfg.loaders)


def choose_checkpoint(cfg: JobConfig, ctx: DistContext, plans: Plans) -> dict[str, Any] | None:
    """Rank 0: the checkpoint to continue from (module doc), or None without one.

    A damaged ``step.pt`` is passed over (logged) for the epoch checkpoint; a damaged
    ``last.pt`` falls back to ``last.prev.pt`` (:func:`load_checkpoint`).

    Raises:
        RuntimeError: ``last.pt`` and the generation before it are both damaged.
    """
    directory = cfg.paths.checkpoint_dir
    last = load_checkpoint(directory)
    try:
        step = load_checkpoint(directory, name=STEP_CHECKPOINT_NAME)
    except RuntimeError as exc:
        log.warning("%s: resuming from the epoch checkpoint instead", exc)
        step = None
    done = int(last["epoch"]) if last is not None else 0
    if step is None or int(step["epoch"]) != done + 1:
        return last  # no checkpoint inside an epoch, or one whose epoch has ended
    why = _why_not_continued(step, cfg, ctx, plans)
    if why is None:
        return step
    log.warning(
        "the checkpoint inside epoch %d (after step %d of %d) is not continued: %s; epoch %d "
        "starts again from its beginning (%s)",
        int(step["epoch"]),
        int(step["step"]),
        int(step.get("plan", {}).get("steps_per_epoch", 0)),
        why,
        done + 1,
        f"the checkpoint of epoch {done}" if last is not None else "no epoch had ended",
    )
    return last


def load_on_rank0(cfg: JobConfig, ctx: DistContext, plans: Plans) -> dict[str, Any] | None:
    """The checkpoint to resume from (:func:`choose_checkpoint`), read by rank 0 and
    broadcast to every rank (None: no checkpoint). A collective.

    Raises:
        RuntimeError: rank 0 could not load the checkpoint (its message), on every rank.
    """
    payload: tuple[str, Any] = ("none", None)
    if ctx.is_main:
        try:
            payload = ("ok", choose_checkpoint(cfg, ctx, plans))
        except Exception as exc:
            payload = ("error", f"rank 0: {exc}")
    kind, value = broadcast_object(payload, ctx)
    if kind == "error":
        raise RuntimeError(value)
    return value


def _check_optimizer(state: dict[str, Any], cfg: JobConfig, optimizer_class: str | None) -> None:
    """Refuse a checkpoint of another optimizer: its state would load silently into the wrong
    one (AdamW's into SGD) or fail deep inside torch (SGD's into AdamW: ``KeyError: 'step'``).

    Raises:
        ConfigError: naming both optimizers (the class recorded in the checkpoint, when it
            has one, and ``train.optimizer``).
    """
    was = state.get("config", {}).get("train", {}).get("optimizer")
    was_class = state.get("optimizer_class")
    if (was is None or was == cfg.train.optimizer) and (
        was_class is None or optimizer_class is None or was_class == optimizer_class
    ):
        return
    raise ConfigError(
        f"--resume: checkpoint in {cfg.paths.checkpoint_dir} was trained with the optimizer "
        f"{was_class or '?'} (train.optimizer={was!r}), this run builds "
        f"{optimizer_class or '?'} (train.optimizer={cfg.train.optimizer!r}): an optimizer's "
        f"state cannot continue in another; set train.optimizer={was!r} or start a new run "
        "without --resume"
    )


def check_resumable(
    state: dict[str, Any],
    cfg: JobConfig,
    label_names: list[str],
    optimizer_class: str | None = None,
) -> None:
    """Refuse a checkpoint of another model, image size, set of trained layers, label set or
    optimizer (``optimizer_class``: the class this run builds, e.g. ``"AdamW"``; None: only
    ``train.optimizer`` is compared).

    Raises:
        ConfigError: naming ``--resume``, the setting (``model.architecture``,
            ``data.image_size``, ``model.freeze_backbone``, ``model.frozen_layers``,
            ``train.optimizer``) or the labels, and both values.
    """
    saved = state.get("config", {})
    settings: list[tuple[str, str, object]] = [  # (section, key, default in old checkpoints)
        ("model", "architecture", None),
        ("data", "image_size", None),
        ("model", "freeze_backbone", True),  # which parameters train: the optimizer's state
        ("model", "frozen_layers", 0),
    ]
    for section, key, default in settings:
        was = saved.get(section, {}).get(key, default)
        if was != getattr(getattr(cfg, section), key):
            raise ConfigError(
                f"--resume: checkpoint in {cfg.paths.checkpoint_dir} was trained with "
                f"{section}.{key}={was!r}, not {getattr(getattr(cfg, section), key)!r}"
            )
    if list(state.get("label_names", [])) != label_names:
        raise ConfigError(
            f"--resume: checkpoint labels {state.get('label_names')} differ from the tables' "
            f"labels {label_names}"
        )
    _check_optimizer(state, cfg, optimizer_class)


def check_same_data(state: dict[str, Any], now: dict[str, Any], cfg: JobConfig) -> None:
    """Refuse to resume on other data than the checkpoint's (module doc).

    Args:
        state: the checkpoint; its ``data`` is a
            :func:`~flowers_job.train.checkpoint.data_identity` record (a checkpoint written
            before it was recorded is not checked, with a warning).
        now: this run's :func:`~flowers_job.train.checkpoint.data_identity`.
        cfg: ``train.resume_on_new_data`` and the checkpoint dir (named in the messages).

    Raises:
        ConfigError: the data changed (naming each change: the table's version, the ingest
            fingerprint, a split's rows and checksum, old -> new), and
            ``train.resume_on_new_data`` is off; or the test split changed, whatever it is.
    """
    where = f"checkpoint in {cfg.paths.checkpoint_dir} (epoch {state.get('epoch')})"
    record = state.get("data")
    if record is None:
        log.warning("--resume: the %s records no data to check it against (older job)", where)
        return
    changes = data_changes(record, now)
    if not changes:
        return
    what = "; ".join(changes.values())
    if not cfg.train.resume_on_new_data:
        raise ConfigError(
            f"--resume: the data changed since the {where}: {what}. Resuming would train on "
            "other splits, where test photos may be trained on: start a new run without "
            "--resume, or set train.resume_on_new_data: true to continue on the new train "
            "and val splits (the test split must be unchanged)"
        )
    if "test" in changes:
        raise ConfigError(
            f"--resume with train.resume_on_new_data: the test split changed since the "
            f"{where} ({changes['test']}); a resume keeps the test split, so that no test "
            "photo is trained on and the test scores compare: start a new run without --resume"
        )
    log.warning(
        "--resume on new data (train.resume_on_new_data): %s; the test split is unchanged", what
    )


def _rescale(state: TrainState, saved_world_size: int) -> None:
    """A resume at another world size: the learning rate of this world size
    (``state.lr``, by ``train.lr_scaling``, times each group's ``lr_scale``) replaces the
    checkpoint's, and the schedule continues at the same point, counted in epochs."""
    cfg, ctx = state.cfg, state.ctx
    old_lr = cfg.train.learning_rate(saved_world_size)
    for group in state.optimizer.param_groups:
        group["lr"] = group["initial_lr"] = state.lr * group.get("lr_scale", 1.0)
    steps = state.plans.train.steps_per_epoch
    state.scheduler = make_scheduler(cfg, state.optimizer, state.lr, steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "scheduler.step() before optimizer.step()"
        for _ in range((state.start_epoch - 1) * steps):
            state.scheduler.step()
    log.warning(
        "resumed at world_size %d (the checkpoint's: %d): learning rate %.4g -> %.4g (%s "
        "scaling of %.4g), global_batch_size %d -> %d, %d steps per epoch; every row is read "
        "once per epoch with the plan for %d ranks",
        ctx.world_size,
        saved_world_size,
        old_lr,
        state.lr,
        cfg.train.lr_scaling,
        cfg.train.base_learning_rate,
        cfg.train.per_device_batch_size * saved_world_size,
        cfg.global_batch_size,
        steps,
        ctx.world_size,
    )


def resume(state: TrainState) -> None:
    """With ``train.resume``: restore the model, optimizer, schedule, GradScaler, EMA, early
    stopping and history from the checkpoint (:func:`load_on_rank0`), and, from one inside
    an epoch, this rank's position in it; nothing without a checkpoint.

    Raises:
        RuntimeError, ConfigError: as :func:`load_on_rank0`, :func:`check_resumable` and
            :func:`check_same_data`.
    """
    cfg = state.cfg
    saved = load_on_rank0(cfg, state.ctx, state.plans) if cfg.train.resume else None
    if saved is None:
        return
    check_resumable(saved, cfg, state.label_names, type(state.optimizer).__name__)
    check_same_data(saved, state.data_identity(), cfg)
    state.model.load_state_dict(saved["model"])
    state.optimizer.load_state_dict(saved["optimizer"])
    state.scheduler.load_state_dict(saved["scheduler"])
    if saved.get("scaler"):
        state.scaler.load_state_dict(saved["scaler"])
    if state.ema is not None and saved.get("ema"):
        state.ema.load_state_dict(saved["ema"])
    state.stopper.load_state_dict(saved["early_stopping"])
    state.history, state.best_state = list(saved["history"]), saved["best_model"]
    state.stop_reason = saved["stop_reason"]
    state.resumed_from = {
        "epoch": int(saved["epoch"]),
        "step": int(saved.get("step", 0)),
        "saved_at": saved.get("saved_at"),
    }
    if "step" in saved:  # inside an epoch, at this world size (choose_checkpoint)
        state.position = EpochPosition.from_checkpoint(saved, state.shard)
        state.start_epoch = state.position.epoch
        where = f"inside epoch {state.start_epoch} after step {state.position.step}"
    else:
        state.start_epoch = int(saved["epoch"]) + 1
        where = f"at the start of epoch {state.start_epoch}"
    saved_world_size = int(
        saved.get("world_size") or saved["config"]["distributed"]["num_processes"]
    )
    if saved_world_size != state.ctx.world_size:
        _rescale(state, saved_world_size)
    log.info("resumed from %s %s", cfg.paths.checkpoint_dir, where)
