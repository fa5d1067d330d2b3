"""Faults with real processes: a rank that raises, dies of a signal or hangs, a driver killed with SIGKILL
while writing a checkpoint and resumed (Streaming), an orphaned loader cache, a full cache
volume; with each loader (``data.loader``).

Faults are injected with the test-only ``FLOWERS_JOB_FAULT`` setting, acted out by the
tests' injector (:mod:`tests.support.faults`, which ``FLOWERS_JOB_HOOKS`` switches on at the
job's hook points, :mod:`flowers_job.runtime.hooks`); everything else is the real job: local Spark + Delta,
Petastorm or Mosaic Streaming, TorchDistributor with 2 gloo processes and an MLflow sqlite
store. Besides processes and the cache, nothing of Streaming's may outlive a run: its
shared-memory blocks (``/dev/shm``) and lock files (the temp dir).

No test here ingests: each trains (``run_training``, or ``flowers-job train`` for the
drivers that are killed) on its own copy of the session's tables (60 photos at 32 px,
``tables`` in conftest.py); ingest and ``flowers-job run`` have their own tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import mlflow
import psutil
import pytest
import torch
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from flowers_job.config import JobConfig, load_config
from flowers_job.driver.pipeline import TrainingError, run_training
from flowers_job.driver.prepare import prepare_data
from flowers_job.driver.runs import list_runs
from flowers_job.errors import DataError
from flowers_job.loaders import resolve_loader
from flowers_job.loaders.petastorm.cache_write import write_balanced
from flowers_job.loaders.streaming.streaming_loader import write_mds
from flowers_job.tracking.mlflow_run import FAILURE_TAG
from flowers_job.train.checkpoint import CHECKPOINT_NAME, RUN_FILE_NAME
from tests.support.data import copy_tables
from tests.support.faults import FAULT_ENV, fault_env
from tests.support.processes import MARK_ENV, marked_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.tier("full")]

FAST = [
    "data.image_size=32",  # the size the session's tables were ingested at
    "train.per_device_batch_size=8",
    "train.base_learning_rate=0.003",
]
SHORT_TIMEOUT = 30
"""distributed.timeout_seconds of the runs that meet a hung rank or a slow registry. A
healthy run's longest wait at a collective (rank 1 while rank 0 opens its MLflow run,
checkpoints, or draws the report's figures) must stay well under it. 10 s did not: beside
the netns cluster's four-rank jobs on the slower 2-core machine, rank 1 waited more than 10 s
at Mosaic Streaming's barrier when the readers open (``get_shm_prefix``), before any fault,
and the hung-rank run failed naming rank 1 instead of rank 0 (docs/testing.md)."""


def _streaming_state() -> set[str]:
    """Mosaic Streaming's shared-memory blocks and lock files on this host (``000001_...``)."""
    blocks = {p.name for p in Path("/dev/shm").glob("[0-9][0-9][0-9][0-9][0-9][0-9]_*")}
    locks = {p.name for p in Path(tempfile.gettempdir()).glob("[0-9][0-9][0-9][0-9][0-9][0-9]_*")}
    return blocks | locks


def _training_processes() -> list[psutil.Process]:
    """This test process's descendants that belong to a TorchDistributor run."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "torch.distributed.run" in cmdline or "torchrun" in cmdline or "train.py" in cmdline:
            found.append(proc)
    return found


def _wait_for(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``condition`` every 0.5 s; return the seconds it took. Fails after ``timeout``."""
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)
    return time.monotonic() - t0


def _checkpoint_epoch(directory: Path) -> int | None:
    path = directory / CHECKPOINT_NAME
    try:  # os.replace makes last.pt appear whole; reading it races nothing
        return int(torch.load(path, weights_only=True)["epoch"])
    except (OSError, RuntimeError, EOFError):
        return None


@pytest.fixture
def out(tables: Path, tmp_path: Path) -> Path:
    """This test's output dir (``tmp_path``), holding a copy of the session's tables."""
    return copy_tables(tables, tmp_path)


def _fault_config(out: Path, loader: str, *extra: str, epochs: int = 2) -> JobConfig:
    return load_config(
        None,
        [*FAST, f"train.epochs={epochs}", f"data.loader={loader}", *extra],
        **{"paths.output_dir": out},
    )


def _failing_run(
    spark: SparkSession, cfg: JobConfig, monkeypatch: pytest.MonkeyPatch, fault: str
) -> TrainingError:
    """Train on the tables in ``cfg``'s output dir with ``FLOWERS_JOB_FAULT=fault``; the
    run's TrainingError."""
    _set_fault(monkeypatch, fault)
    with pytest.raises(TrainingError) as err:
        run_training(spark, cfg)
    return err.value


def _set_fault(monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """``FLOWERS_JOB_FAULT=fault`` and the injector that acts it out, for this test."""
    for name, value in fault_env(fault).items():
        monkeypatch.setenv(name, value)


def _assert_nothing_left(out: Path, cfg: JobConfig) -> None:
    """After a failed run: no training process, no summary, the MLflow run FAILED with its
    cause in a tag."""
    assert not _training_processes()
    assert not (out / "summary.json").exists()
    run_id = json.loads((out / "checkpoints" / RUN_FILE_NAME).read_text())["mlflow_run_id"]
    run = mlflow.MlflowClient(cfg.tracking_uri).get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags.get(FAILURE_TAG), run.data.tags


def test_a_failing_rank_is_named_with_its_exception(
    spark: SparkSession,
    out: Path,
    monkeypatch: pytest.MonkeyPatch,
    loader: str,
) -> None:
    """TorchDistributor only says "failed during training"; we name the rank, its exception
    and traceback, within 60 s of the fault, and leave no training process behind. One
    attempt (``train.max_restarts=0``): a restart would fail the same way, and stop there
    (tests/unit/driver/test_restart_policy.py)."""
    before = _streaming_state()
    cfg = _fault_config(out, loader, "train.max_restarts=0")
    error = _failing_run(spark, cfg, monkeypatch, "raise:1:2")  # half-way through epoch 2
    surfaced = time.time()
    assert error.rank == 1
    assert error.cause == f"RuntimeError: injected fault ({FAULT_ENV}=raise:1:2)"
    assert "rank 1 failed" in str(error)
    assert "Traceback" in str(error) and "in inject" in str(error)  # rank 1's own
    assert error.reported_at is not None
    print(f"raise: surfaced on the driver {surfaced - error.reported_at:.1f} s after the fault")
    assert surfaced - error.reported_at < 60
    _assert_nothing_left(out, cfg)
    assert not list((out / "loader_cache").glob("run-*"))  # cache removed on failure
    assert _streaming_state() <= before  # no shared memory or lock file left
    assert _checkpoint_epoch(out / "checkpoints") == 1  # epoch 1 is kept for --resume


def test_a_rank_killed_by_a_signal_is_named_with_it(
    spark: SparkSession,
    out: Path,
    monkeypatch: pytest.MonkeyPatch,
    loader: str,
) -> None:
    """Rank 1 dies of SIGABRT half-way through epoch 2 (``os.abort()``, as a crash in native
    code does): no exception, so its faulthandler report (``rank-1.fatal``) names it; rank 0
    loses its peer or is stopped by torchrun. The error names rank 1, the signal and its
    Python stack first, not rank 0's consequences. With ``train.max_restarts=0`` the run
    fails at once, as before automatic restarts (tests/faults/test_restart.py restarts one)."""
    cfg = _fault_config(out, loader, "train.max_restarts=0")
    error = _failing_run(spark, cfg, monkeypatch, "abort:1:2")
    print(str(error).splitlines()[0])
    assert error.rank == 1
    assert error.cause == "FatalSignal: Aborted"
    assert str(error).startswith("rank 1 died of a fatal signal")
    assert "Current thread" in str(error) and "in inject" in str(error)  # its Python stack
    # Rank 0's MLflow run is FAILED whatever rank 0 was doing when torchrun stopped it (a
    # SIGTERM once cut rank 0's report short and the run stayed RUNNING): the report now
    # finishes under SIGTERM, and the driver ends a run left open.
    _assert_nothing_left(out, cfg)
    assert _checkpoint_epoch(out / "checkpoints") == 1


def test_a_registration_that_fails_after_the_last_collective_fails_the_run(
    spark: SparkSession,
    out: Path,
    monkeypatch: pytest.MonkeyPatch,
    loader: str,
) -> None:
    """Rank 0 raises while it registers the model, after rank 1 has returned and written
    TorchDistributor's result file: TorchDistributor returns that result (pyspark 4.0's
    torchrun wrapper exits 0 whatever torchrun's status), and the driver still fails the
    run, naming rank 0 and its exception; no summary is written."""
    # the fault comes after the last epoch; one attempt (a restart would fail the same way)
    cfg = _fault_config(out, loader, "train.max_restarts=0", epochs=1)
    error = _failing_run(spark, cfg, monkeypatch, "fail_registration:0:0")
    assert error.rank == 0
    assert error.cause == f"RuntimeError: injected fault ({FAULT_ENV}=fail_registration:0:0)"
    _assert_nothing_left(out, cfg)


def test_a_hung_rank_fails_the_run_within_the_process_group_timeout(
    spark: SparkSession,
    out: Path,
    monkeypatch: pytest.MonkeyPatch,
    loader: str,
) -> None:
    """Rank 1 stops answering at epoch 2: rank 0's next collective times out after
    distributed.timeout_seconds, the run fails naming it, and the hung rank is stopped."""
    timeout = SHORT_TIMEOUT
    before = _streaming_state()
    # a timeout is restarted by default; this one would hang again (the fault fires on every
    # attempt): one attempt
    cfg = _fault_config(
        out, loader, f"distributed.timeout_seconds={timeout}", "train.max_restarts=0"
    )
    _set_fault(monkeypatch, "hang:1:2")
    t0 = time.time()
    with pytest.raises(TrainingError) as err:
        run_training(spark, cfg)
    surfaced = time.time()
    assert err.value.rank == 0
    assert err.value.cause is not None
    assert err.value.cause.startswith("CollectiveTimeoutError: rank 0: a collective waited")
    assert f"distributed.timeout_seconds={float(timeout)} s" in str(err.value)
    assert err.value.reported_at is not None
    print(
        f"hang: rank 0 timed out, surfaced {surfaced - err.value.reported_at:.1f} s later; "
        f"run_training took {surfaced - t0:.0f} s"
    )
    assert surfaced - err.value.reported_at < 60
    assert not _training_processes()
    assert not list((out / "loader_cache").glob("run-*"))
    assert _streaming_state() <= before


def _start_cli(
    out: Path, mark: str, log: Path, loader: str, *args: str, fault: str = ""
) -> subprocess.Popen[bytes]:
    """``flowers-job train`` on the tables in ``out``, in the background."""
    sets = [a for s in [*FAST, "train.epochs=3", f"data.loader={loader}"] for a in ("--set", s)]
    env = {**os.environ, MARK_ENV: mark, **fault_env(fault)}
    cmd = [sys.executable, "-m", "flowers_job", "train"]
    with log.open("ab") as sink:
        return subprocess.Popen(
            [*cmd, "--output-dir", str(out), *sets, *args], env=env, stdout=sink, stderr=sink
        )


def _kill_driver(proc: subprocess.Popen[bytes], mark: str) -> float:
    """SIGKILL the driver only; return the seconds until all of its processes were gone."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    return _wait_for(lambda: not marked_processes(mark), 90, "the killed driver's processes")


@pytest.mark.parametrize("loader", ["streaming"], indirect=True)
def test_driver_killed_mid_checkpoint_then_resumed(
    spark: SparkSession,
    tables: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    loader: str,
) -> None:
    """SIGKILL the driver (``flowers-job train``) while rank 0 writes the epoch-2
    checkpoint, then resume (``train.resume``, as ``--resume`` sets it): the run ends with
    epochs 1, 2, 3 in one MLflow run, each epoch logged once, and no process, cache or
    Streaming state of the killed driver is left behind.

    The resume also meets a model registry slower than distributed.timeout_seconds: rank 0
    registers after the last collective, so the run still finishes and the driver's summary
    has the registered version (whichever rank's result it got).

    Streaming only: it is the loader with state of its own outside the processes (shared
    memory, lock files), and the only one on Databricks. What a killed driver leaves with
    Petastorm (its ranks, the run's cache folder) is the loaders' common code, and the
    cluster tests kill a Petastorm job's driver and resume a Petastorm run
    (tests/cluster/test_cluster.py). That a CLI driver's JVM exits when it finishes: test_job_e2e's
    CLI run."""
    out, log, mark = tmp_path / "out", tmp_path / "driver.log", uuid.uuid4().hex
    copy_tables(tables, out)
    try:
        _kill_and_resume(spark, monkeypatch, out, log, mark, loader)
    finally:  # a failed assertion must not leave a driver running
        for proc in marked_processes(mark):
            proc.kill()


def _kill_and_resume(
    spark: SparkSession,
    monkeypatch: pytest.MonkeyPatch,
    out: Path,
    log: Path,
    mark: str,
    loader: str,
) -> None:
    ckpt, cache = out / "checkpoints", out / "loader_cache"
    before = _streaming_state()

    # 1. Killed while rank 0 is writing the epoch-2 checkpoint (rank 1 waits for it at the
    # next collective): a driver killed in the middle of training.
    proc = _start_cli(out, mark, log, loader, fault="pause_checkpoint:0:2")
    _wait_for(
        lambda: _checkpoint_epoch(ckpt) == 1 and any(ckpt.glob(f".{CHECKPOINT_NAME}.*.tmp")),
        600,
        "the epoch-2 checkpoint write",
    )
    gone = _kill_driver(proc, mark)
    print(f"driver killed mid-checkpoint: all its processes gone after {gone:.1f} s")
    # SIGTERM from torchrun may have let rank 0 delete its unfinished file; either way
    # last.pt is still the whole epoch-1 checkpoint (test_checkpoint covers a torn file).
    assert _checkpoint_epoch(ckpt) == 1
    assert _streaming_state() <= before  # the watchdog removed Streaming's state
    orphans = list(cache.glob("run-*"))
    assert len(orphans) == 1  # the killed run could not clean up its cache
    run_id = json.loads((ckpt / RUN_FILE_NAME).read_text())["mlflow_run_id"]
    # Either rank 0 ended the run on torchrun's SIGTERM (the driver's torchrun wrapper stops
    # torchrun when its parent dies) or the ranks' watchdog ended them first and nothing
    # could: then the run is still RUNNING, and `flowers-job runs` tells the truth.
    store = f"sqlite:///{(out / 'mlflow.db').resolve()}"
    status = mlflow.MlflowClient(store).get_run(run_id).info.status
    (listed,) = list_runs(out, store, "flowers_job")
    expected = {"RUNNING": "ABANDONED", "FAILED": "FAILED"}
    assert (listed["run_id"], listed["state"]) == (run_id, expected[status]), listed

    # 2. Resumed to the end, here; rank 0's registration takes longer than the process-group
    # timeout: were it before the last collective, rank 1 would time out waiting for it.
    cfg = _fault_config(
        out,
        loader,
        "train.resume=true",
        f"distributed.timeout_seconds={SHORT_TIMEOUT}",
        epochs=3,
    )
    _set_fault(monkeypatch, f"slow_registration:0:{SHORT_TIMEOUT + 5}")
    returned = run_training(spark, cfg)
    assert not orphans[0].exists()  # swept at the start of the resumed run
    assert not _training_processes()
    summary = json.loads((out / "summary.json").read_text())
    assert returned["registered_model_version"] == summary["registered_model_version"] == 1
    assert returned["model_uri"] == summary["model_uri"]
    assert summary["model_uri"].startswith("models:/")
    assert [h["epoch"] for h in summary["history"]] == [1, 2, 3]
    assert summary["epochs_this_run"] == 2 and summary["epochs_completed"] == 3
    assert summary["mlflow_run_id"] == run_id  # one MLflow run across both drivers
    client = mlflow.MlflowClient(summary["mlflow_tracking_uri"])
    experiment = client.get_experiment_by_name("flowers_job")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]
    finished = client.get_run(run_id)
    assert finished.info.status == "FINISHED"
    # the cause of the interruption is kept: rank 0's SIGTERM, or, for a run left RUNNING,
    # the resume's (it ended the abandoned run FAILED before continuing it)
    interrupted = finished.data.tags[f"{FAILURE_TAG}.1"]
    if status == "RUNNING":
        assert interrupted.startswith("interrupted: its driver"), interrupted
    assert FAILURE_TAG not in finished.data.tags
    for key in ("train_loss", "val_loss", "val_accuracy", "epoch_seconds"):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [1, 2, 3], key
    logged = {m.step: m.value for m in client.get_metric_history(run_id, "val_loss")}
    assert logged == {h["epoch"]: pytest.approx(h["val_loss"]) for h in summary["history"]}
    assert not list(cache.glob("run-*"))
    assert not list(ckpt.glob("*.tmp")) and not list(ckpt.glob(".*.tmp"))
    assert _streaming_state() <= before


@contextmanager
def _small_volume(path: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` mounted at ``path`` (root only: CI and dev machines are)."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], timeout=30, check=False)


def test_no_space_for_the_cache_is_a_clear_error_and_leaves_nothing(
    spark: SparkSession, tables: Path, tmp_path: Path, loader: str
) -> None:
    """A cache volume too small for the train table: DataError naming the directory, before
    any worker starts, and nothing of this run's cache left on the volume."""
    out = copy_tables(tables, tmp_path / "out")
    with _small_volume(tmp_path / "small", "512k") as volume:
        cfg = _fault_config(out, loader, f"paths.cache_url={volume.as_uri()}")
        with (
            pytest.raises(DataError, match="no space for the loader cache") as err,
            prepare_data(spark, *resolve_loader(cfg)),
        ):
            pytest.fail("prepare_data must not succeed")
        assert str(volume) in str(err.value) and "MiB free" in str(err.value)
        assert not list(volume.iterdir())


def test_a_volume_that_fills_up_during_the_write_is_named(
    spark: SparkSession, tmp_path: Path, loader: str
) -> None:
    """The free-space check passed but the volume fills up anyway (another writer, say):
    Spark's "No space left on device" becomes a DataError naming the directory."""
    with _small_volume(tmp_path / "small", "256k") as volume:
        noise = "unhex(concat_ws('', transform(sequence(1, 512), i -> sha2(concat(id, i), 256))))"
        df = spark.range(64).select(
            F.col("id").alias("row_id"),
            F.expr(noise).alias("image"),
            F.lit(0).cast("long").alias("label_index"),
        )
        # 64 rows of 16 KiB of hash output (no dictionary or compression can shrink it): 1 MiB
        with pytest.raises(DataError, match="no space left for the loader cache") as err:
            if loader == "petastorm":
                write_balanced(
                    spark,
                    df,
                    f"{volume.as_uri()}/petastorm-train",
                    world_size=2,
                    min_partitions=2,
                    what="a test table",
                )
            else:
                write_mds(
                    df,
                    volume / "mds-train",
                    world_size=2,
                    num_partitions=2,
                    per_device_batch_size=8,
                    full_batches=True,
                    split="train",
                )
        assert str(volume) in str(err.value)
