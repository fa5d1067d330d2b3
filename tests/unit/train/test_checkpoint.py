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

from flowers_job.config import load_config
from flowers_job.train.checkpoint import (
    CHECKPOINT_NAME,
    PREVIOUS_CHECKPOINT_NAME,
    RUN_FILE_NAME,
    STEP_CHECKPOINT_NAME,
    load_checkpoint,
    read_run_id,
    save_checkpoint,
    write_run_id,
)
from flowers_job.train.resume import choose_checkpoint
from tests.support.faults import fault_env

pytestmark = pytest.mark.tier("gate")


def test_round_trip_and_no_temporary_files_left(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    state = {"model": model.state_dict(), "epoch": 4, "history": [{"epoch": 4, "val_loss": 0.5}]}
    save_checkpoint(state, tmp_path)
    save_checkpoint({**state, "epoch": 5}, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [CHECKPOINT_NAME, PREVIOUS_CHECKPOINT_NAME]
    )
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


def _epoch(path: Path) -> int:
    return int(torch.load(path, weights_only=True)["epoch"])


def test_the_last_two_epoch_checkpoints_are_kept(tmp_path: Path) -> None:
    for epoch in (1, 2, 3):
        save_checkpoint({"epoch": epoch, "w": torch.full((10,), float(epoch))}, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [CHECKPOINT_NAME, PREVIOUS_CHECKPOINT_NAME]
    )
    assert _epoch(tmp_path / CHECKPOINT_NAME) == 3
    assert _epoch(tmp_path / PREVIOUS_CHECKPOINT_NAME) == 2
    # a step checkpoint leaves the generations alone
    save_checkpoint({"epoch": 4, "step": 2}, tmp_path, STEP_CHECKPOINT_NAME)
    assert _epoch(tmp_path / PREVIOUS_CHECKPOINT_NAME) == 2


@pytest.mark.parametrize("damage", ["truncated", "garbage", "not a dict"])
def test_a_damaged_last_pt_falls_back_to_the_one_before(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    save_checkpoint({"epoch": 1, "w": torch.ones(1000)}, tmp_path)
    save_checkpoint({"epoch": 2, "w": torch.zeros(1000)}, tmp_path)
    last = tmp_path / CHECKPOINT_NAME
    if damage == "truncated":
        last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    elif damage == "garbage":
        last.write_bytes(b"not a pickle at all")
    else:
        torch.save([1, 2, 3], last)
    with caplog.at_level("WARNING", logger="flowers_job.train.checkpoint"):
        loaded = load_checkpoint(tmp_path)
    assert loaded is not None and loaded["epoch"] == 1
    assert torch.equal(loaded["w"], torch.ones(1000))
    assert str(last) in caplog.text and str(tmp_path / PREVIOUS_CHECKPOINT_NAME) in caplog.text
    assert "falling back" in caplog.text


def test_both_generations_damaged_is_the_clean_error(tmp_path: Path) -> None:
    save_checkpoint({"epoch": 1}, tmp_path)
    save_checkpoint({"epoch": 2}, tmp_path)
    for name in (CHECKPOINT_NAME, PREVIOUS_CHECKPOINT_NAME):
        path = tmp_path / name
        path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(
        RuntimeError, match=r"cannot load checkpoint .*last\.pt.*damaged too.*last\.prev\.pt"
    ):
        load_checkpoint(tmp_path)


def test_a_new_run_never_falls_back_to_the_last_runs_checkpoint(tmp_path: Path) -> None:
    save_checkpoint({"epoch": 1, "run": "old"}, tmp_path)
    save_checkpoint({"epoch": 2, "run": "old"}, tmp_path)
    (tmp_path / CHECKPOINT_NAME).unlink()  # a new run removes last.pt (begin_training)
    assert load_checkpoint(tmp_path) is None  # no last.pt: no checkpoint, whatever is left
    save_checkpoint({"epoch": 1, "run": "new"}, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT_NAME]
    (tmp_path / CHECKPOINT_NAME).write_bytes(b"torn")
    with pytest.raises(RuntimeError, match="no generation before it"):
        load_checkpoint(tmp_path)


def test_a_damaged_step_pt_resumes_from_the_epoch_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = load_config(None, [], **{"paths.output_dir": tmp_path, "train.resume": True})
    directory = Path(cfg.paths.checkpoint_dir)
    save_checkpoint({"epoch": 1}, directory)
    (directory / STEP_CHECKPOINT_NAME).write_bytes(b"torn")
    with caplog.at_level("WARNING", logger="flowers_job.train"):
        chosen = choose_checkpoint(cfg, None, None)  # type: ignore[arg-type]
    assert chosen is not None and chosen["epoch"] == 1
    assert "step.pt" in caplog.text and "epoch checkpoint instead" in caplog.text
