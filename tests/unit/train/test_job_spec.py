"""The driver-to-ranks contract: a frozen, typed job that pickles by value, names each
loader's memory settings, and places a barrier-mode rank's threads from it."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest

from flowers_job.config import load_config
from flowers_job.loaders.petastorm.loader import PetastormLoader
from flowers_job.loaders.streaming.streaming_loader import StreamingLoader
from flowers_job.train.job_spec import SPLITS, TrainingJob
from flowers_job.train.rank import threads_for_rank

pytestmark = pytest.mark.tier("gate")


def _job(**changes: object) -> TrainingJob:
    job = TrainingJob(
        config={"distributed": {"timeout_seconds": 45}},
        plans={split: {"dataset_size": 1} for split in SPLITS},
        loader=StreamingLoader,
        report_dir="/tmp/reports",
    )
    return dataclasses.replace(job, **changes)  # type: ignore[arg-type]


def test_the_job_is_frozen_and_pickles_with_its_loader_by_reference() -> None:
    job = _job(executor_cores={"10.0.0.2": 4})
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.attempt = 1  # type: ignore[misc]
    back = pickle.loads(pickle.dumps(job))
    assert back == job and back.loader is StreamingLoader
    assert back.timeout_seconds == 45


def test_each_loader_names_its_own_memory_settings(tmp_path: Path) -> None:
    cfg = load_config(None, [f"paths.output_dir={tmp_path}"])
    assert StreamingLoader.memory_settings(cfg.loaders) == {
        "loaders.streaming.prefetch_batches": str(cfg.loaders.streaming.prefetch_batches)
    }
    assert PetastormLoader.memory_settings(cfg.loaders) == {
        "loaders.petastorm.shuffle_buffer_rows": str(cfg.loaders.petastorm.shuffle_buffer_rows)
    }


@pytest.mark.parametrize(
    ("cores", "me", "expected"),
    [
        ({"10.0.0.2": 8}, {"host": "h1", "address": "10.0.0.2"}, 4),  # two ranks share it
        ({"h2": 6}, {"host": "h2", "address": None}, 6),  # found by host name, alone
        ({"a": 2, "b": 16}, {"host": "h3", "address": "10.9.9.9"}, 2),  # unknown: smallest
        ({}, {"host": "h1", "address": None}, 3),  # local mode: spark.task.cpus
    ],
)
def test_a_barrier_rank_gets_its_executors_cores_shared_by_its_host(
    cores: dict[str, int], me: dict[str, object], expected: int
) -> None:
    ranks = [{"host": "h1"}, {"host": "h1"}, {"host": "h2"}, {"host": "h3"}]
    job = _job(executor_cores=cores, task_cpus=3 if not cores else 1)
    assert threads_for_rank(job, ranks, me) == expected
