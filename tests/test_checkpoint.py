"""Checkpoints: atomic, resumable, and loaded with weights_only (no code execution)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from flowers_job.train.checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint


def test_round_trip_and_no_temporary_files_left(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    state = {"model": model.state_dict(), "epoch": 4, "history": [{"epoch": 4, "val_loss": 0.5}]}
    save_checkpoint(state, tmp_path)
    save_checkpoint({**state, "epoch": 5}, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT_NAME]
    loaded = load_checkpoint(tmp_path)
    assert loaded is not None and loaded["epoch"] == 5
    assert torch.equal(loaded["model"]["weight"], model.weight)
    assert load_checkpoint(tmp_path / "none") is None


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    save_checkpoint({"epoch": 1}, tmp_path)

    class Unpicklable:
        def __reduce__(self) -> tuple[object, ...]:
            raise RuntimeError("disk full, say")

    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint({"epoch": 2, "bad": Unpicklable()}, tmp_path)
    loaded = load_checkpoint(tmp_path)
    assert loaded is not None and loaded["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT_NAME]


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_malicious_checkpoint_does_not_execute_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with (tmp_path / CHECKPOINT_NAME).open("wb") as f:
        torch.save({"epoch": 1, "payload": _Exploit(marker)}, f, pickle_module=pickle)
    with pytest.raises(RuntimeError, match="cannot load checkpoint"):
        load_checkpoint(tmp_path)
    assert not marker.exists()
