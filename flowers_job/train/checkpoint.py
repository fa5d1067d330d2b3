"""Checkpoints: one dict per epoch, written atomically by rank 0, loaded safely by all.

A checkpoint holds the model, optimizer and scheduler state, the epoch just
completed, the early-stopping state and the best weights so far, the per-epoch
history, the MLflow run id and the configuration (the torchvision reference layout).
It is written to a temporary file in the same directory, flushed to disk and renamed
over ``last.pt``, so a crash mid-write never leaves a torn ``last.pt``. Loading uses
``torch.load(weights_only=True)``: a checkpoint can hold tensors and plain data only,
never code.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["CHECKPOINT_NAME", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_NAME = "last.pt"


def save_checkpoint(state: dict[str, Any], directory: Path) -> Path:
    """Atomically write ``state`` to ``directory/last.pt``.

    Raises:
        OSError: the directory cannot be created or written.
    """
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / CHECKPOINT_NAME
    fd, tmp = tempfile.mkstemp(prefix=".last.pt.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def load_checkpoint(
    directory: Path, map_location: torch.device | str = "cpu"
) -> dict[str, Any] | None:
    """Load ``directory/last.pt`` with ``weights_only=True``; None if there is none.

    Raises:
        RuntimeError: the file is corrupt or holds anything but tensors and plain data.
    """
    path = directory / CHECKPOINT_NAME
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        raise RuntimeError(f"cannot load checkpoint {path}: {exc}") from exc
    if not isinstance(state, dict):
        raise RuntimeError(f"checkpoint {path} is not a flowers_job checkpoint")
    return state
