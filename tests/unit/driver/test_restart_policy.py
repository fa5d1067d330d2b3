"""The driver's restart policy and the checkpoint dir a run starts with, without Spark:
which failures are restarted (:func:`flowers_job.driver.restarts.refusal`), and what
:func:`flowers_job.driver.restarts.begin_training` keeps or removes for a new run, a resume and a
resume under another key. The restarts themselves, with real processes:
tests/faults/test_restart.py and tests/cluster/test_cluster.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowers_job.config import JobConfig, load_config
from flowers_job.driver.failures import TrainingError
from flowers_job.driver.restarts import begin_training, refusal
from flowers_job.train.checkpoint import (
    CHECKPOINT_NAME,
    RUN_FILE_NAME,
    STEP_CHECKPOINT_NAME,
    write_run_id,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.tier("gate")]


def _cfg(out: Path, *sets: str) -> JobConfig:
    return load_config(None, list(sets), **{"paths.output_dir": out})


def _error(kind: str, cause: str = "RuntimeError: boom", rank: int = 1) -> TrainingError:
    return TrainingError(f"rank {rank} failed: {cause}", rank=rank, cause=cause, kind=kind)


@pytest.mark.parametrize("kind", ["killed", "fatal_signal", "timeout", "connection"])
def test_a_failure_that_may_be_transient_is_restarted(tmp_path: Path, kind: str) -> None:
    cfg = _cfg(tmp_path)  # no checkpoint yet: transient failures are restarted all the same
    assert refusal(_error(kind), 0, cfg, []) is None
    assert "train.max_restarts=1" in str(refusal(_error(kind), 1, cfg, []))


def test_what_cannot_go_away_is_not_restarted(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "train.max_restarts=3")
    shard = _error("permanent", "ShardError: rank 1: the train shard read 20 rows")
    assert "does not go away by itself" in str(refusal(shard, 0, cfg, []))
    # an exception before the first checkpoint: deterministic until shown otherwise
    assert "before the first checkpoint" in str(refusal(_error("exception"), 0, cfg, []))
    (cfg.paths.checkpoint_dir).mkdir(parents=True)
    (cfg.paths.checkpoint_dir / STEP_CHECKPOINT_NAME).write_bytes(b"")
    assert refusal(_error("exception"), 0, cfg, []) is None
    # the same exception on the same rank again: deterministic
    same = refusal(_error("exception"), 1, cfg, [_error("exception")])
    assert "attempt 0 failed the same way" in str(same)
    assert refusal(_error("exception", rank=0), 1, cfg, [_error("exception")]) is None


def _checkpoints(directory: Path, key: str | None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in (CHECKPOINT_NAME, STEP_CHECKPOINT_NAME):
        (directory / name).write_bytes(b"old")
    write_run_id(directory, "run-of-yesterday", key)


def test_a_new_run_leaves_nothing_of_the_last_one_to_continue(tmp_path: Path) -> None:
    """Without --resume, an automatic restart before this run's first checkpoint must not
    continue the previous run: its checkpoints and MLflow run id go."""
    cfg = _cfg(tmp_path, "tracking.tracking_uri=sqlite:///" + str(tmp_path / "none.db"))
    _checkpoints(Path(cfg.paths.checkpoint_dir), None)
    assert begin_training(cfg).train.resume is False
    assert not list(cfg.paths.checkpoint_dir.iterdir())


def test_a_resume_key_continues_its_own_run_only(tmp_path: Path) -> None:
    """The bundle's task retries pass the job run id: the same key continues, another key
    (the next day's job run) starts a new run."""
    store = "tracking.tracking_uri=sqlite:///" + str(tmp_path / "none.db")
    resume = _cfg(tmp_path, store, "train.resume=true", "train.resume_key=job-7")
    _checkpoints(Path(resume.paths.checkpoint_dir), "job-7")
    assert begin_training(resume).train.resume is True
    assert (resume.paths.checkpoint_dir / CHECKPOINT_NAME).exists()
    other = _cfg(tmp_path, store, "train.resume=true", "train.resume_key=job-8")
    assert begin_training(other).train.resume is False
    assert not (other.paths.checkpoint_dir / CHECKPOINT_NAME).exists()
    assert not (other.paths.checkpoint_dir / RUN_FILE_NAME).exists()
