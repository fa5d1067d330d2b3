"""The pieces that make a killed run recoverable, each with real processes or a real store:
ranks that exit when their driver dies, the sweep of orphaned loader caches and of a killed
rank's Streaming shared memory, and an
MLflow run that a resume continues without logging anything twice.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlflow
import psutil
import pytest

from flowers_job.config import load_config
from flowers_job.loaders.cache_sweep import ORPHAN_AGE_SECONDS, OWNER_FILE, sweep_orphaned_caches
from flowers_job.location import Location
from flowers_job.runtime.parent_watch import driver_identity, process_alive, watched_processes
from flowers_job.tracking.mlflow_run import RunTracker

pytestmark = [pytest.mark.timeout(300), pytest.mark.tier("gate")]


def _identity(proc: subprocess.Popen[bytes]) -> dict[str, object]:
    return {
        "host": socket.gethostname(),
        "pid": proc.pid,
        "create_time": psutil.Process(proc.pid).create_time(),
    }


def test_a_rank_and_its_children_exit_when_the_driver_dies(tmp_path: Path) -> None:
    """A stand-in driver is SIGKILLed; the "rank" watching it (with a child of its own, like
    Petastorm's process pool) must end with exit status 70 within seconds."""
    driver = subprocess.Popen(["sleep", "600"])
    code = (
        "import json, subprocess, sys, time\n"
        "from flowers_job.runtime.parent_watch import watch_driver\n"
        "assert watch_driver(json.loads(sys.argv[1]), interval_seconds=0.2)\n"
        "child = subprocess.Popen(['sleep', '600'])\n"
        "open(sys.argv[2], 'w').write(str(child.pid))\n"
        "time.sleep(600)\n"
    )
    pid_file = tmp_path / "child.pid"
    rank = subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(_identity(driver)), str(pid_file)]
    )
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert rank.poll() is None, "the rank exited before the driver died"
            assert time.monotonic() < deadline
            time.sleep(0.1)
        grandchild = psutil.Process(int(pid_file.read_text()))
        assert rank.poll() is None  # the driver lives: the rank goes on
        driver.kill()
        driver.wait(timeout=10)
        t0 = time.monotonic()
        assert rank.wait(timeout=30) == 70
        print(f"the rank exited {time.monotonic() - t0:.1f} s after the driver was killed")
        grandchild.wait(timeout=10)  # killed by the rank before it exited
    finally:
        for proc in (driver, rank):
            if proc.poll() is None:
                proc.kill()


def test_a_rank_away_from_the_driver_watches_its_own_ancestors() -> None:
    # On a cluster the driver is on another host: the rank watches the processes above it
    # up to the executor's JVM. Above pytest there is no JVM: only the parent is watched.
    other = {**driver_identity(), "host": "not-" + socket.gethostname()}
    assert [w["pid"] for w in watched_processes(other)] == [os.getppid()]
    assert [w["pid"] for w in watched_processes(None)] == [os.getppid()]
    # The driver on this host but not an ancestor: watched besides the parent.
    me = driver_identity()
    assert [w["pid"] for w in watched_processes(me)] == [os.getppid(), os.getpid()]


def test_process_alive_tells_a_reused_pid_from_the_driver() -> None:
    me = driver_identity()
    assert process_alive(me)
    assert not process_alive({**me, "create_time": float(me["create_time"]) - 3600})


def test_sweep_removes_the_caches_of_dead_drivers_only(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead_identity = _identity(dead)
    dead.wait(timeout=10)
    owners = {
        "run-dead": dead_identity,
        "run-alive": driver_identity(),
        "run-elsewhere-old": {
            "host": "other-host",
            "pid": 1,
            "create_time": time.time() - ORPHAN_AGE_SECONDS - 60,
        },
        "run-elsewhere-recent": {"host": "other-host", "pid": 1, "create_time": time.time()},
    }
    for name, owner in owners.items():
        (tmp_path / name / "part").mkdir(parents=True)
        (tmp_path / name / OWNER_FILE).write_text(json.dumps(owner))
    (tmp_path / "run-not-ours").mkdir()  # no owner.json: never touched
    (tmp_path / "unrelated").mkdir()

    removed = sweep_orphaned_caches(Location.of(tmp_path))

    assert sorted(p.name for p in removed) == ["run-dead", "run-elsewhere-old"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["run-alive", "run-elsewhere-recent", "run-not-ours", "unrelated"]
    assert sweep_orphaned_caches(Location.of(tmp_path / "missing")) == []
    # not a local file system
    assert sweep_orphaned_caches(Location.of("dbfs:/tmp/petastorm")) == []


def test_a_resumed_run_logs_no_param_and_no_epoch_twice(tmp_path: Path) -> None:
    cfg = load_config(None, [], **{"paths.output_dir": tmp_path})
    first = RunTracker(cfg)
    first.log_params({"a": 1, "b": "x"})
    assert first.log_epoch({"val_loss": 0.9, "train_loss": 1.0}, 1)
    assert first.log_epoch({"val_loss": 0.8, "train_loss": 0.9}, 2)
    mlflow.end_run(status="KILLED")  # as if the driver died here

    second = RunTracker(cfg, first.run_id)
    second.log_params({"a": 1, "b": "y", "c": 3})  # b keeps its first value, c is new
    assert not second.log_epoch({"val_loss": 0.8, "train_loss": 0.9}, 2)  # already there
    assert second.log_epoch({"val_loss": 0.7, "train_loss": 0.8}, 3)
    second.finish()

    client = mlflow.MlflowClient(cfg.tracking_uri)
    run = client.get_run(first.run_id)
    assert run.data.params == {"a": "1", "b": "x", "c": "3"}
    for key in ("val_loss", "train_loss"):
        assert [m.step for m in client.get_metric_history(first.run_id, key)] == [1, 2, 3]
    assert run.info.status == "FINISHED"


def test_the_shared_memory_of_a_killed_runs_streaming_datasets_is_swept(tmp_path: Path) -> None:
    """Real POSIX shared memory and lock files, named and laid out as Mosaic Streaming does
    (its own ``_pack_locals`` writes the registry block); only the blocks whose registry names
    a folder under the run's cache go."""
    pytest.importorskip("streaming", reason="the streaming loader is not installed")
    from multiprocessing import shared_memory

    from streaming.base.shared.prefix import _pack_locals

    from flowers_job.loaders.streaming.streaming_loader import remove_streaming_state

    ours, other = tmp_path / "run-a", tmp_path / "run-b"
    blocks = []
    for prefix, folder in ((990001, ours / "mds-train"), (990002, other / "mds-train")):
        data = _pack_locals([str(folder.resolve())], prefix)
        registry = shared_memory.SharedMemory(f"{prefix:06}_locals", create=True, size=len(data))
        assert registry.buf is not None
        registry.buf[: len(data)] = data
        blocks += [
            registry,
            shared_memory.SharedMemory(f"{prefix:06}_barrier", create=True, size=8),
        ]
        (Path(tempfile.gettempdir()) / f"{prefix:06}_barrier_filelock").touch()
    try:
        removed = remove_streaming_state(ours)
        assert sorted(removed) == ["990001_barrier", "990001_barrier_filelock", "990001_locals"]
        assert not list(Path("/dev/shm").glob("990001_*"))
        assert sorted(p.name for p in Path("/dev/shm").glob("990002_*")) == [
            "990002_barrier",
            "990002_locals",
        ]
    finally:
        for block in blocks:
            block.close()
            with contextlib.suppress(FileNotFoundError):
                block.unlink()
        (Path(tempfile.gettempdir()) / "990002_barrier_filelock").unlink(missing_ok=True)


_SIGTERM_IN_REPORT = """
import os, signal, sys, time
import mlflow
from flowers_job.train import rank

mlflow.set_tracking_uri(sys.argv[1])
print(mlflow.start_run().info.run_id, flush=True)
report = rank._report_failure


def report_under_sigterm(directory, exc):
    os.kill(os.getpid(), signal.SIGTERM)  # torchrun stopping the ranks, mid-report
    time.sleep(0.5)  # the handler runs here
    report(directory, exc)


rank._report_failure = report_under_sigterm
from flowers_job.loaders.streaming.streaming_loader import StreamingLoader
from flowers_job.train.job_spec import TrainingJob

job = TrainingJob({"no_such_section": 1}, {}, StreamingLoader, report_dir=sys.argv[2])
rank.train_worker(job)
"""


def test_a_sigterm_during_a_ranks_failure_report_does_not_cut_it_short(tmp_path: Path) -> None:
    """Rank 0 fails (an invalid config here) and torchrun's SIGTERM arrives while it writes
    its report: the report is still written, the exception is still the rank's own, and its
    MLflow run ends FAILED with the cause, not RUNNING."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = subprocess.run(
        [sys.executable, "-c", _SIGTERM_IN_REPORT, uri, str(tmp_path / "failures")],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        # The child's own store: no MLFLOW_* setting of an earlier test (an experiment id).
        env={**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}, "RANK": "0"},
    )
    assert proc.returncode == 1, proc.stderr
    assert "SIGTERM while reporting its failure" in proc.stderr
    assert "Terminated" not in proc.stderr  # the rank's own exception propagated
    report = json.loads((tmp_path / "failures" / "rank-0.json").read_text())
    assert report["type"] == "ValidationError"
    run = mlflow.MlflowClient(uri).get_run(proc.stdout.split()[0])
    assert run.info.status == "FAILED"
    assert run.data.tags["flowers_job.failure"].startswith("rank 0: ValidationError")


def test_the_driver_ends_a_run_its_ranks_left_running(tmp_path: Path) -> None:
    """A rank 0 SIGKILLed mid-run cannot end its run: the driver's backstop marks it FAILED
    with the cause, and leaves an ended run as it is."""
    from flowers_job.tracking.mlflow_run import mark_run_failed

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    experiment = client.create_experiment("backstop")
    running = client.create_run(experiment).info.run_id
    finished = client.create_run(experiment).info.run_id
    client.set_terminated(finished, "FINISHED")

    assert mark_run_failed(uri, running, "rank 1 was killed by SIGKILL")
    assert not mark_run_failed(uri, finished, "not this one")
    assert not mark_run_failed(uri, "0" * 32, "no such run")  # logged, not raised
    assert client.get_run(running).info.status == "FAILED"
    assert client.get_run(running).data.tags["flowers_job.failure"] == (
        "rank 1 was killed by SIGKILL"
    )
    assert client.get_run(finished).info.status == "FINISHED"
    assert "flowers_job.failure" not in client.get_run(finished).data.tags
