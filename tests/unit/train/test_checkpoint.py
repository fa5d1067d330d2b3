"""Checkpoints: atomic, resumable, and loaded with weights_only (no code execution)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flowers_job.train.checkpoint import (
    CHECKPOINT_NAME,
    RUN_FILE_NAME,
    load_checkpoint,
    read_run_id,
    save_checkpoint,
    write_run_id,
)
from tests.support.faults import fault_env

pytestmark = pytest.mark.tier("gate")


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


def test_a_writer_killed_mid_write_leaves_last_pt_whole(tmp_path: Path) -> None:
    """SIGKILL the writer while it writes the epoch-2 checkpoint (a real process, paused
    there by the test-only fault setting, after the payload is written and flushed, before
    fsync and rename): last.pt is still epoch 1, and the unfinished temporary file is
    removed by the next load."""
    ckpt = tmp_path / "checkpoints"
    save_checkpoint({"epoch": 1, "w": torch.ones(1000)}, ckpt)
    code = (
        "import sys, torch; from pathlib import Path; "
        "from flowers_job.train.checkpoint import save_checkpoint; "
        "save_checkpoint({'epoch': 2, 'w': torch.zeros(1000)}, Path(sys.argv[1]))"
    )
    env = {**os.environ, **fault_env("pause_checkpoint:0:2")}
    stderr = tmp_path / "writer.stderr"
    with stderr.open("wb") as err:
        writer = subprocess.Popen([sys.executable, "-c", code, str(ckpt)], env=env, stderr=err)
    try:
        # The temporary file exists from mkstemp on, empty until torch.save returns: wait for
        # the fault's warning, which comes after the payload is flushed.
        deadline = time.monotonic() + 120
        while "injected fault pause_checkpoint" not in stderr.read_text(errors="replace"):
            assert writer.poll() is None, f"the writer exited before pausing: {stderr.read_text()}"
            assert time.monotonic() < deadline, "the writer never reached the pause"
            time.sleep(0.2)
    finally:
        writer.kill()
        writer.wait(timeout=30)
    torn = list(ckpt.glob(f".{CHECKPOINT_NAME}.*.tmp"))
    assert len(torn) == 1 and torn[0].stat().st_size > 0
    loaded = load_checkpoint(ckpt)
    assert loaded is not None and loaded["epoch"] == 1
    assert torch.equal(loaded["w"], torch.ones(1000))
    assert [p.name for p in ckpt.iterdir()] == [CHECKPOINT_NAME]


def test_run_id_survives_next_to_the_checkpoint(tmp_path: Path) -> None:
    assert read_run_id(tmp_path) is None
    write_run_id(tmp_path, "abc123")
    assert read_run_id(tmp_path) == "abc123"
    (tmp_path / RUN_FILE_NAME).write_text("{torn")
    assert read_run_id(tmp_path) is None
