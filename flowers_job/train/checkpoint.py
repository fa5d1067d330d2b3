"""Checkpoints: one dict per epoch (``last.pt``) and one inside the next epoch
(``step.pt``), written atomically by rank 0, loaded safely by all.

A checkpoint holds the model, optimizer, scheduler and GradScaler state, the epoch just
completed, the early-stopping state and the best weights so far, the per-epoch
history, the world size and the configuration (the torchvision reference layout); one
inside an epoch adds the step and every rank's running sums, loader position and random
state (:mod:`flowers_job.train.step_checkpoint`). The MLflow run id lives next to them in
``mlflow_run.json`` (:func:`write_run_id`).
It is written to a temporary file in the same directory, flushed to disk and renamed
over ``last.pt``, so a crash mid-write never leaves a torn ``last.pt``; in an object store
(``paths.output_dir`` = ``s3a://...``) it is one object, whole or absent. Loading uses
``torch.load(weights_only=True)``: a checkpoint can hold tensors and plain data only,
never code.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from flowers_job.location import Location
from flowers_job.runtime.hooks import hook

__all__ = [
    "CHECKPOINT_NAME",
    "RUN_FILE_NAME",
    "STEP_CHECKPOINT_NAME",
    "load_checkpoint",
    "read_resume_key",
    "read_run_id",
    "remove_checkpoint",
    "save_checkpoint",
    "write_run_id",
]

CHECKPOINT_NAME = "last.pt"
"""The checkpoint of the last completed epoch."""
STEP_CHECKPOINT_NAME = "step.pt"
"""A checkpoint inside the epoch after ``last.pt``'s (``train.checkpoint_every_*``): the
model after ``step`` steps, each rank's running sums, loader position and random state.
Removed once that epoch's own ``last.pt`` is written."""
RUN_FILE_NAME = "mlflow_run.json"
"""Next to the checkpoint: the MLflow run id, written as soon as the run exists, so that a
run killed before its first checkpoint still resumes into the same MLflow run."""

log = logging.getLogger(__name__)


def _remove_partial_writes(directory: Location) -> None:
    if not directory.is_local:
        return  # an object is written in one request: no partial write to find
    for name in (CHECKPOINT_NAME, STEP_CHECKPOINT_NAME):
        for stale in directory.glob(f".{name}.*.tmp"):
            log.warning("removing %s: a checkpoint write that was interrupted", stale)
            stale.unlink(missing_ok=True)


def save_checkpoint(
    state: dict[str, Any], directory: Location | Path, name: str = CHECKPOINT_NAME
) -> Location:
    """Atomically write ``state`` to ``directory/<name>`` (``last.pt`` or ``step.pt``): on a
    local disk through a temp file, ``fsync`` and ``os.replace``; in an object store as one
    object, serialized in memory first (:meth:`Location.write_bytes`).

    Raises:
        OSError: the directory cannot be created or written.
    """
    directory = Location.of(directory)
    if not directory.is_local:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        if name == CHECKPOINT_NAME:
            hook("checkpoint_write", epoch=int(state.get("epoch", 0)))
        (directory / name).write_bytes(buffer.getvalue())
        return directory / name
    directory.mkdir(parents=True, exist_ok=True)
    _remove_partial_writes(directory)  # only rank 0 of one job writes here
    target = directory / name
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            if name == CHECKPOINT_NAME:
                hook("checkpoint_write", epoch=int(state.get("epoch", 0)))
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def remove_checkpoint(directory: Location | Path, name: str) -> None:
    """Remove ``directory/<name>`` if it exists (rank 0, once a later checkpoint replaces it)."""
    (Location.of(directory) / name).unlink(missing_ok=True)


def load_checkpoint(
    directory: Location | Path,
    map_location: torch.device | str = "cpu",
    name: str = CHECKPOINT_NAME,
) -> dict[str, Any] | None:
    """Load ``directory/<name>`` with ``weights_only=True``; None if there is none.

    Raises:
        RuntimeError: the file is corrupt or holds anything but tensors and plain data.
    """
    directory = Location.of(directory)
    path = directory / name
    if directory.is_local and directory.is_dir():
        _remove_partial_writes(directory)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as exc:
        raise RuntimeError(f"cannot load checkpoint {path}: {exc}") from exc
    if not isinstance(state, dict):
        raise RuntimeError(f"checkpoint {path} is not a flowers_job checkpoint")
    return state


def write_run_id(directory: Location | Path, run_id: str, resume_key: str | None = None) -> None:
    """Record the MLflow ``run_id`` of this training, and the ``train.resume_key`` it runs
    under, in ``directory/mlflow_run.json`` (atomic).

    Raises:
        OSError: the directory cannot be written.
    """
    record = json.dumps({"mlflow_run_id": run_id, "resume_key": resume_key})
    (Location.of(directory) / RUN_FILE_NAME).write_text(record)


def read_resume_key(directory: Location | Path) -> str | None:
    """The ``train.resume_key`` recorded by :func:`write_run_id`, or None."""
    try:
        key = json.loads((Location.of(directory) / RUN_FILE_NAME).read_text()).get("resume_key")
    except (OSError, ValueError, AttributeError):
        return None
    return None if key is None else str(key)


def read_run_id(directory: Location | Path) -> str | None:
    """The run id recorded by :func:`write_run_id`, or None if there is none."""
    try:
        return str(
            json.loads((Location.of(directory) / RUN_FILE_NAME).read_text())["mlflow_run_id"]
        )
    except (OSError, ValueError, KeyError):
        return None
