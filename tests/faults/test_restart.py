"""Runs that heal themselves, with real processes, per loader (``data.loader``): a rank
killed inside epoch 2 (by the kernel's OOM killer, in a memory cgroup it outgrows) is named
with its signal and restarted automatically from the checkpoint inside that epoch, and the
run trains as an uninterrupted one does, to float tolerance; the same run resumed at other
world sizes (2 -> 3 -> 2) rescales its learning rate and starts an interrupted epoch again
where the checkpoint inside it was taken at another world size. One test, one output dir:
each part starts from the state the last left (a run costs more than its checks).

Everything is the real job: local Spark + Delta, Petastorm, Mosaic Streaming or the Delta
loader (the ranks reading the table),
TorchDistributor with gloo processes, an MLflow sqlite store; each test trains on its own
copy of the session's tables (60 photos at 32 px, ``tables`` in conftest.py).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import pytest
import torch
from pyspark.sql import SparkSession

from flowers_job.config import JobConfig, load_config
from flowers_job.driver.pipeline import TrainingError, run_training
from flowers_job.runtime.hooks import HOOKS_ENV
from flowers_job.tracking.mlflow_run import FAILURE_TAG
from flowers_job.train.checkpoint import STEP_CHECKPOINT_NAME
from tests.support.data import ALL_LOADERS, copy_tables
from tests.support.faults import FAULT_CGROUP_ENV, FAULT_ENV, INJECTOR

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.tier("full")]

BASE_LR = 0.003
SETTINGS = [
    "data.image_size=32",  # the size the session's tables were ingested at
    "train.per_device_batch_size=4",  # 6 steps per epoch on 2 ranks, 4 on 3
    "train.epochs=2",
    f"train.base_learning_rate={BASE_LR}",
    "train.checkpoint_every_steps=2",
    "train.early_stopping.enabled=false",
]
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
TOLERANCE = 1e-6
"""Relative tolerance of the metrics of a run restarted inside an epoch against an
uninterrupted one. The resumed run repeats the same float operations on the same values
(the model, optimizer and random states restored bit for bit, the same batches), so they
agree to the last digit here; the tolerance leaves room for a reduction order that another
BLAS or thread count could change."""


def _config(out: Path, loader: str, *extra: str) -> JobConfig:
    return load_config(
        None, [*SETTINGS, f"data.loader={loader}", *extra], **{"paths.output_dir": out}
    )


@pytest.fixture
def memory_cgroup() -> Iterator[Path | None]:
    """A cgroup v1 memory group capped at 3 GiB (a rank trains in about 1 GiB here), or None
    where none can be made (not root, no v1 memory controller)."""
    if os.geteuid() != 0 or not (CGROUP_ROOT / "memory.limit_in_bytes").exists():
        yield None
        return
    group = CGROUP_ROOT / f"flowers-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(3 << 30))
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            (CGROUP_ROOT / "cgroup.procs").write_text(pid)  # a process still in it
        group.rmdir()


def _epochs(summary: dict[str, object]) -> list[dict[str, float]]:
    history = summary["history"]
    assert isinstance(history, list)
    return history


@pytest.mark.parametrize("loader", ALL_LOADERS, indirect=True)
def test_a_run_that_heals_itself_and_changes_world_size(
    spark: SparkSession,
    tables: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    loader: str,
    memory_cgroup: Path | None,
) -> None:
    """One run's life, after an uninterrupted run of the same settings to compare with:

    1. Rank 1 outgrows its memory cgroup half-way through epoch 2 (after the checkpoint of
       step 2), once (attempt 0), and the kernel's OOM killer SIGKILLs it: no exception, no
       report of its own. The driver names rank 1, the signal and the OOM killer, restarts
       the ranks (``train.max_restarts`` 1, the default) from the checkpoint inside epoch
       2, and the run ends with the epochs and test score of the uninterrupted run; one
       MLflow run, each epoch logged once, ``restarts`` 1. (Without a memory cgroup, not
       root: rank 1 SIGKILLs itself.)
    2. ``--resume`` with 3 processes: epoch 3, then an exception inside epoch 4 after a
       checkpoint there (``train.max_restarts=0``); then ``--resume`` with 2: the learning
       rate and the global batch follow the world size (2 -> 3 -> 2), the checkpoint inside
       epoch 4, taken at 3 processes, is not continued (named in the log) and epoch 4
       starts again from epoch 3's checkpoint; every epoch reads every row once (the ranks'
       checks) and is logged once, in the same MLflow run.
    """
    out = copy_tables(tables, tmp_path / "out")
    expected = run_training(spark, _config(out, loader))
    assert expected["restarts"] == 0
    # A new run in the same output dir (no --resume): the loader caches are reused, the
    # checkpoints of the first run removed.
    monkeypatch.setenv(HOOKS_ENV, INJECTOR)  # the tests' injector acts out FLOWERS_JOB_FAULT
    if memory_cgroup is not None:
        monkeypatch.setenv(FAULT_CGROUP_ENV, str(memory_cgroup))
        monkeypatch.setenv(FAULT_ENV, "oom:1:2:0")
    else:
        monkeypatch.setenv(FAULT_ENV, "kill:1:2:0")
    summary = run_training(spark, _config(out, loader))
    assert summary["mlflow_run_id"] != expected["mlflow_run_id"]
    assert all(use["reused"] or use["entry"] is None for use in summary["loader_cache"].values())
    _check_healed(summary, expected, loader, memory_cgroup is not None)
    _check_mlflow(summary, epochs=[1, 2], restarts=[0, 1], interruptions=1)
    assert not (out / "checkpoints" / STEP_CHECKPOINT_NAME).exists()

    monkeypatch.setenv(FAULT_ENV, "raise:0:4")
    capfd.readouterr()
    with pytest.raises(TrainingError, match="injected fault"):
        run_training(spark, _config(out, loader, *_resumed(3, 4), "train.max_restarts=0"))
    assert "resumed at world_size 3 (the checkpoint's: 2)" in "".join(capfd.readouterr())
    inside = torch.load(out / "checkpoints" / STEP_CHECKPOINT_NAME, weights_only=True)
    assert (inside["epoch"], inside["step"], inside["world_size"]) == (4, 2, 3)
    monkeypatch.delenv(FAULT_ENV)
    summary = run_training(spark, _config(out, loader, *_resumed(2, 4)))
    log = "".join(capfd.readouterr())
    assert "is not continued: it was taken at world_size 3, this run has 2" in log
    assert "resumed at world_size 2 (the checkpoint's: 3)" in log
    history = _epochs(summary)
    assert [h["world_size"] for h in history] == [2, 2, 3, 2]
    assert [h["global_batch_size"] for h in history] == [8, 8, 12, 8]
    rates = [BASE_LR * 2, BASE_LR * 2, BASE_LR * 3, BASE_LR * 2]  # linear scaling
    assert [h["learning_rate"] for h in history] == pytest.approx(rates)
    assert summary["world_size"] == 2 and summary["epochs_this_run"] == 1
    _check_mlflow(summary, epochs=[1, 2, 3, 4], restarts=[0, 1, 0, 0], interruptions=2)


def _resumed(processes: int, epochs: int) -> tuple[str, ...]:
    return (f"distributed.num_processes={processes}", f"train.epochs={epochs}", "train.resume=true")


def _check_healed(
    summary: dict[str, Any], expected: dict[str, Any], loader: str, oom: bool
) -> None:
    """The restart's record, and epochs and test score equal to the uninterrupted run's."""
    assert summary["restarts"] == 1
    (restart,) = summary["restart_history"]
    assert restart["rank"] == 1 and restart["kind"] == "killed"
    assert restart["cause"].startswith("rank 1 was killed by SIGKILL"), restart["cause"]
    if oom:
        assert "OOM killer" in restart["cause"], restart["cause"]
    assert restart["resumed_from"]["epoch"] == 2 and restart["resumed_from"]["step"] == 2
    assert restart["lost_work_seconds"] is not None and restart["restart_seconds"] > 0
    print(
        f"restart ({loader}): {restart['lost_work_seconds']} s of work lost, "
        f"{restart['restart_seconds']} s from the kill to the first step again"
    )
    # Epoch 2 read every row once across the two attempts (the ranks' row checks pass) and
    # trained as the uninterrupted epoch did.
    keys = ("train_loss", "train_accuracy", "val_loss", "val_accuracy", "learning_rate")
    for got, want in zip(_epochs(summary), _epochs(expected), strict=True):
        for key in keys:
            assert got[key] == pytest.approx(want[key], rel=TOLERANCE), (got["epoch"], key)
    assert summary["test_accuracy"] == pytest.approx(expected["test_accuracy"], rel=TOLERANCE)
    assert summary["test_loss"] == pytest.approx(expected["test_loss"], rel=TOLERANCE)


def _check_mlflow(
    summary: dict[str, Any], epochs: list[int], restarts: list[int], interruptions: int
) -> None:
    """One MLflow run, FINISHED, each epoch logged once; each interruption's cause kept."""
    client = mlflow.MlflowClient(summary["mlflow_tracking_uri"])
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert FAILURE_TAG not in run.data.tags
    assert run.data.tags[f"{FAILURE_TAG}.1"].startswith("rank 1 was killed by SIGKILL")
    assert f"{FAILURE_TAG}.{interruptions}" in run.data.tags
    assert f"{FAILURE_TAG}.{interruptions + 1}" not in run.data.tags
    logged = sorted(m.value for m in client.get_metric_history(run.info.run_id, "restarts"))
    assert logged == sorted(restarts)  # one value per attempt: each job counts from 0
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "val_loss")) == epochs
