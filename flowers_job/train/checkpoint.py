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

Two generations of the epoch checkpoint are kept: before a new ``last.pt`` replaces the
old one, the old one becomes ``last.prev.pt`` (a hard link renamed into place, each step
atomic, so ``last.pt`` is never absent; a copy where links are not supported or in an
object store). A ``last.pt`` that cannot be loaded (truncated, unpicklable, not a
checkpoint) falls back to ``last.prev.pt``, logged with both names; both damaged raise the
error of ``last.pt`` (:func:`load_checkpoint`). The first epoch checkpoint of a run
removes a ``last.prev.pt`` left by another run, so a fallback never crosses runs.

What a resume checks besides the configuration (:func:`flowers_job.train.resume.check_resumable`)
is recorded too: the data (:func:`data_identity`: the ``images`` table's Delta version, the
ingest fingerprint, each split's rows and row checksum and the test split's digest) and the
optimizer's class (``optimizer_class``); :func:`data_changes` names what differs.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from flowers_job.location import Location
from flowers_job.runtime.hooks import hook

__all__ = [
    "CHECKPOINT_NAME",
    "PREVIOUS_CHECKPOINT_NAME",
    "RUN_FILE_NAME",
    "STEP_CHECKPOINT_NAME",
    "data_changes",
    "data_identity",
    "load_checkpoint",
    "read_resume_key",
    "read_run_id",
    "remove_checkpoint",
    "save_checkpoint",
    "write_run_id",
]

CHECKPOINT_NAME = "last.pt"
"""The checkpoint of the last completed epoch."""
PREVIOUS_CHECKPOINT_NAME = "last.prev.pt"
"""The epoch checkpoint before ``last.pt``: what a damaged ``last.pt`` falls back to."""
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
    for name in (CHECKPOINT_NAME, PREVIOUS_CHECKPOINT_NAME, STEP_CHECKPOINT_NAME):
        for stale in directory.glob(f".{name}.*.tmp"):
            log.warning("removing %s: a checkpoint write that was interrupted", stale)
            stale.unlink(missing_ok=True)


def _keep_previous(directory: Location) -> None:
    """Before a new ``last.pt`` replaces the old one: the old one becomes ``last.prev.pt``.

    Locally a hard link to ``last.pt`` under a temporary name is renamed over
    ``last.prev.pt`` (a copy where the file system has no hard links), so each step is
    atomic and ``last.pt`` itself is never absent; in an object store the object is copied.
    Without a ``last.pt`` (a run's first epoch checkpoint) a ``last.prev.pt`` is another
    run's and is removed: a fallback never continues another run.

    Raises:
        OSError: the directory cannot be written.
    """
    last, prev = directory / CHECKPOINT_NAME, directory / PREVIOUS_CHECKPOINT_NAME
    if not last.exists():
        prev.unlink(missing_ok=True)
        return
    if not directory.is_local:
        prev.write_bytes(last.read_bytes())
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{PREVIOUS_CHECKPOINT_NAME}.", suffix=".tmp", dir=directory)
    os.close(fd)
    os.unlink(tmp)  # a free name for the link
    try:
        try:
            os.link(last.local_path, tmp)
        except OSError:  # no hard links here (some FUSE mounts): a copy, then the rename
            shutil.copyfile(last.local_path, tmp)
        os.replace(tmp, prev.local_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(
    state: dict[str, Any], directory: Location | Path, name: str = CHECKPOINT_NAME
) -> Location:
    """Atomically write ``state`` to ``directory/<name>`` (``last.pt`` or ``step.pt``): on a
    local disk through a temp file, ``fsync`` and ``os.replace``; in an object store as one
    object, serialized in memory first (:meth:`Location.write_bytes`). A new ``last.pt``
    first turns the old one into ``last.prev.pt`` (:func:`_keep_previous`).

    Raises:
        OSError: the directory cannot be created or written.
    """
    directory = Location.of(directory)
    if not directory.is_local:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        if name == CHECKPOINT_NAME:
            hook("checkpoint_write", epoch=int(state.get("epoch", 0)))
            _keep_previous(directory)
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
        if name == CHECKPOINT_NAME:
            _keep_previous(directory)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def remove_checkpoint(directory: Location | Path, name: str) -> None:
    """Remove ``directory/<name>`` if it exists (rank 0, once a later checkpoint replaces it)."""
    (Location.of(directory) / name).unlink(missing_ok=True)


def _load(path: Location, map_location: torch.device | str) -> dict[str, Any] | None:
    """One checkpoint file, loaded with ``weights_only=True``; None if there is none.

    Raises:
        RuntimeError: naming ``path``: the file is corrupt (truncated, unpicklable) or holds
            anything but tensors and plain data, or is not a dict.
    """
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


def load_checkpoint(
    directory: Location | Path,
    map_location: torch.device | str = "cpu",
    name: str = CHECKPOINT_NAME,
) -> dict[str, Any] | None:
    """Load ``directory/<name>`` with ``weights_only=True``; None if there is none.

    ``last.pt`` (the default) that cannot be loaded falls back to ``last.prev.pt``, the
    generation before it, with a warning naming both files; a missing ``last.pt`` is no
    checkpoint (None), whatever ``last.prev.pt`` holds.

    Raises:
        RuntimeError: the file is corrupt or holds anything but tensors and plain data (for
            ``last.pt``: and ``last.prev.pt`` is absent or damaged too, both named).
    """
    directory = Location.of(directory)
    if directory.is_local and directory.is_dir():
        _remove_partial_writes(directory)
    try:
        return _load(directory / name, map_location)
    except RuntimeError as exc:
        if name != CHECKPOINT_NAME:
            raise
        damaged = exc
    prev = directory / PREVIOUS_CHECKPOINT_NAME
    try:
        state = _load(prev, map_location)
    except RuntimeError as exc:
        raise RuntimeError(f"{damaged}; the generation before it is damaged too: {exc}") from (
            damaged
        )
    if state is None:
        raise RuntimeError(f"{damaged}; there is no generation before it ({prev})") from damaged
    log.warning(
        "%s is damaged (%s): falling back to %s, the checkpoint of epoch %s",
        directory / name,
        damaged,
        prev,
        state.get("epoch"),
    )
    return state


def data_identity(
    lineage: Mapping[str, Any], splits: Mapping[str, tuple[int, int]]
) -> dict[str, Any]:
    """What a checkpoint records of the data it was trained on, for :func:`data_changes`.

    Args:
        lineage: the run's lineage (:func:`flowers_job.driver.prepare.lineage`): the
            ``images`` table's path or name and Delta version, the ingest fingerprint (the
            listing's and the ingest settings' digest, written into every table's commit by
            the ingest) and the test split's digest (its ``(content_sha256, label)`` pairs).
        splits: split -> ``(rows, row checksum)`` of its shard plan (the checksum sums the
            ``row_id`` of every row, an xxhash64 of the photo's relative path).

    Returns:
        ``{"table", "images_version", "ingest_fingerprint", "test_split_digest",
        "splits": {split: {"rows", "checksum"}}}``: plain data.
    """
    images = dict(lineage.get("tables", {}).get("images", {}))
    return {
        "table": images.get("path") or images.get("name"),
        "images_version": images.get("version"),
        "ingest_fingerprint": lineage.get("ingest_fingerprint"),
        "test_split_digest": lineage.get("test_split_digest"),
        "splits": {
            split: {"rows": int(rows), "checksum": int(checksum)}
            for split, (rows, checksum) in splits.items()
        },
    }


def _short(value: object) -> str:
    """A fingerprint or digest as 12 characters, anything else as it is."""
    return value[:12] if isinstance(value, str) and len(value) > 12 else repr(value)


def data_changes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, str]:
    """What differs between two :func:`data_identity` records, by what it is: ``images``
    (the table's Delta version), ``fingerprint`` (the ingest's), ``train``, ``val``,
    ``test`` (a split's rows or row checksum; for ``test`` also its content digest).

    Returns:
        ``{what: "old -> new" description}``; empty when the data is the same.
    """
    changes: dict[str, str] = {}
    table = now.get("table") or saved.get("table")
    if saved.get("images_version") != now.get("images_version"):
        changes["images"] = (
            f"images table {table} version {saved.get('images_version')} -> "
            f"{now.get('images_version')}"
        )
    if saved.get("ingest_fingerprint") != now.get("ingest_fingerprint"):
        changes["fingerprint"] = (
            f"ingest fingerprint {_short(saved.get('ingest_fingerprint'))} -> "
            f"{_short(now.get('ingest_fingerprint'))}"
        )
    old_splits, new_splits = saved.get("splits", {}), now.get("splits", {})
    for split in sorted(set(old_splits) | set(new_splits)):
        was, is_ = old_splits.get(split, {}), new_splits.get(split, {})
        if was != is_:
            changes[split] = (
                f"{split} split {was.get('rows')} rows (row checksum {was.get('checksum')}) -> "
                f"{is_.get('rows')} rows (row checksum {is_.get('checksum')})"
            )
    if saved.get("test_split_digest") != now.get("test_split_digest"):
        digest = (
            f"test split digest {_short(saved.get('test_split_digest'))} -> "
            f"{_short(now.get('test_split_digest'))}"
        )
        changes["test"] = f"{changes['test']}, {digest}" if "test" in changes else digest
    return changes


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
