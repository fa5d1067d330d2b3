"""The runs of an output dir and their true state (flowers_job.driver.runs, ``flowers-job runs``).

A real MLflow sqlite store per test (a copy of one made per module), real driver processes
(a Python process that records itself with ``record_driver``, SIGKILLed where the test needs
a dead driver); no Spark.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pytest

from flowers_job.cli import main
from flowers_job.config import load_config
from flowers_job.driver.runs import (
    ABANDONED,
    UNKNOWN,
    end_abandoned_run,
    list_runs,
    read_driver,
)
from flowers_job.tracking.mlflow_run import EPOCH_KEY, FAILURE_TAG, RunTracker
from flowers_job.tracking.tags import TAG_OUTPUT_DIR
from flowers_job.train.checkpoint import write_run_id
from tests.support import ROOT_DIR

pytestmark = [pytest.mark.timeout(120), pytest.mark.tier("gate")]

REPO = ROOT_DIR
EXPERIMENT = "flowers_job"
DRIVER_START_SECONDS = 60.0
"""Bound on the wait for a driver process to record itself (an import of flowers_job.driver.runs)."""


@dataclass
class Store:
    output_dir: Path
    uri: str
    client: mlflow.MlflowClient
    experiment_id: str

    @property
    def checkpoint_dir(self) -> Path:
        return self.output_dir / "checkpoints"

    def run(
        self,
        name: str,
        start: int,
        epochs: int = 0,
        status: str = "RUNNING",
        output_dir: Path | None = None,
    ) -> str:
        """A run tagged with ``output_dir`` (this store's by default), started at ``start``
        (ms since the epoch), with ``epochs`` epochs of ``val_loss``, ended ``status``."""
        tags = {TAG_OUTPUT_DIR: str((output_dir or self.output_dir).resolve())}
        run = self.client.create_run(self.experiment_id, start_time=start, tags=tags, run_name=name)
        run_id = run.info.run_id
        for epoch in range(1, epochs + 1):
            self.client.log_metric(run_id, EPOCH_KEY, 1.0 / epoch, step=epoch)
        if status != "RUNNING":
            self.client.set_terminated(run_id, status=status, end_time=start + 60_000)
        return run_id

    def status(self, run_id: str) -> str:
        return str(self.client.get_run(run_id).info.status)


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An initialised, empty MLflow sqlite store, made once (its schema migrations take
    seconds); each test gets a copy."""
    path = tmp_path_factory.mktemp("template") / "mlflow.db"
    mlflow.MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def store(tmp_path: Path, empty_store: Path) -> Store:
    """The default store of an output dir (``<output_dir>/mlflow.db``) with the experiment."""
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    shutil.copy(empty_store, output_dir / "mlflow.db")
    uri = load_config(None, [], **{"paths.output_dir": output_dir}).tracking_uri
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment_id = client.create_experiment(
        EXPERIMENT, artifact_location=(output_dir / "mlartifacts").as_uri()
    )
    return Store(output_dir, uri, client, experiment_id)


@contextmanager
def driver_process(checkpoint_dir: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A process that records itself as the driver of ``checkpoint_dir`` and sleeps;
    killed on exit."""
    code = (
        "import sys, time; from pathlib import Path; from flowers_job.driver.runs import "
        "record_driver; record_driver(Path(sys.argv[1])); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(checkpoint_dir)], cwd=REPO)
    try:
        deadline = time.monotonic() + DRIVER_START_SECONDS
        while (read_driver(checkpoint_dir) or {}).get("pid") != proc.pid:
            assert proc.poll() is None, f"the driver process exited with {proc.returncode}"
            assert time.monotonic() < deadline, "the driver process did not record itself"
            time.sleep(0.05)
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def killed_driver(checkpoint_dir: Path) -> int:
    """Record a driver in ``checkpoint_dir``, SIGKILL it; returns its pid."""
    with driver_process(checkpoint_dir) as proc:
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        return proc.pid


@contextmanager
def job_warnings() -> Iterator[list[logging.LogRecord]]:
    """The job's warnings, caught by a handler on the ``flowers_job`` logger itself (not
    pytest's caplog, whose handler sits on the root logger): creating a sqlite store runs
    MLflow's alembic migrations, whose ``logging.config.fileConfig`` (mlflow 3.0.1, the DBR
    environment) replaces the root logger's handlers and disables the loggers that exist by
    then (``disable_existing_loggers``)."""
    for name in ("flowers_job", "flowers_job.driver.runs", "flowers_job.tracking.mlflow_run"):
        logging.getLogger(name).disabled = False
    logger = logging.getLogger("flowers_job")
    handler, level = logging.handlers.BufferingHandler(capacity=1_000), logger.level
    handler.setLevel(logging.WARNING)
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        yield handler.buffer
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_a_killed_drivers_run_is_listed_abandoned_then_ended_failed_on_resume(
    store: Store,
) -> None:
    run_id = store.run("killed", start=1_000_000, epochs=2)
    write_run_id(store.checkpoint_dir, run_id)
    pid = killed_driver(store.checkpoint_dir)
    record = read_driver(store.checkpoint_dir)
    assert record is not None
    assert record["host"] == socket.gethostname() and record["started"].endswith("+00:00")

    (listed,) = list_runs(store.output_dir, store.uri, EXPERIMENT)
    assert (listed["state"], listed["status"]) == (ABANDONED, "RUNNING")
    assert (listed["run_id"], listed["current"], listed["epochs"]) == (run_id, True, [1, 2])

    with job_warnings() as records:
        cause = end_abandoned_run(store.checkpoint_dir, store.uri)
    assert cause is not None
    assert f"its driver (pid {pid} on host {socket.gethostname()}, started " in cause
    assert cause.startswith("interrupted:") and cause.endswith("continued by --resume")
    assert store.status(run_id) == "FAILED"
    assert store.client.get_run(run_id).data.tags[FAILURE_TAG] == cause
    assert any(run_id in r.getMessage() and r.levelno == logging.WARNING for r in records)

    (listed,) = list_runs(store.output_dir, store.uri, EXPERIMENT)
    assert (listed["state"], listed["failure"]) == ("FAILED", cause)
    assert listed["end_time"] is not None
    assert end_abandoned_run(store.checkpoint_dir, store.uri) is None  # once only


def test_a_run_whose_driver_is_alive_is_left_running(
    store: Store,
) -> None:
    run_id = store.run("live", start=1_000_000, epochs=1)
    write_run_id(store.checkpoint_dir, run_id)
    with driver_process(store.checkpoint_dir) as proc:
        (listed,) = list_runs(store.output_dir, store.uri, EXPERIMENT)
        assert listed["state"] == "RUNNING"
        with job_warnings() as records:
            assert end_abandoned_run(store.checkpoint_dir, store.uri) is None
        assert store.status(run_id) == "RUNNING"
        assert FAILURE_TAG not in store.client.get_run(run_id).data.tags
        assert any(f"pid {proc.pid}" in r.getMessage() for r in records)


def test_a_finished_run_is_left_alone(store: Store) -> None:
    run_id = store.run("done", start=1_000_000, epochs=3, status="FINISHED")
    write_run_id(store.checkpoint_dir, run_id)
    killed_driver(store.checkpoint_dir)
    assert end_abandoned_run(store.checkpoint_dir, store.uri) is None
    run = store.client.get_run(run_id)
    assert run.info.status == "FINISHED" and FAILURE_TAG not in run.data.tags
    (listed,) = list_runs(store.output_dir, store.uri, EXPERIMENT)
    assert (listed["state"], listed["epochs"]) == ("FINISHED", [1, 2, 3])


def test_a_driver_on_another_host_is_unknown_then_taken_over(store: Store) -> None:
    run_id = store.run("elsewhere", start=1_000_000)
    write_run_id(store.checkpoint_dir, run_id)
    record = {"host": "other-host.invalid", "pid": 1, "create_time": 0.0, "started": "then"}
    (store.checkpoint_dir / "driver.json").write_text(json.dumps(record))
    (listed,) = list_runs(store.output_dir, store.uri, EXPERIMENT)
    assert listed["state"] == UNKNOWN

    cause = end_abandoned_run(store.checkpoint_dir, store.uri, continued_by="a restart")
    assert cause is not None and "other-host.invalid" in cause and "another host" in cause
    assert cause.endswith("continued by a restart")
    assert store.status(run_id) == "FAILED"


def test_an_unrecorded_driver_is_unknown_and_a_new_run_ends_its_run(store: Store) -> None:
    run_id = store.run("before", start=1_000_000)
    write_run_id(store.checkpoint_dir, run_id)
    (listed,) = list_runs(store.output_dir, store.uri, EXPERIMENT)
    assert listed["state"] == UNKNOWN
    cause = end_abandoned_run(store.checkpoint_dir, store.uri, continued_by=None)
    assert cause is not None and "not recorded" in cause
    assert cause.endswith("a new run replaces it")
    assert store.status(run_id) == "FAILED"


def test_runs_lists_the_output_dirs_runs_newest_first_with_their_states(
    store: Store, capsys: pytest.CaptureFixture[str]
) -> None:
    finished = store.run("first", start=1_000_000, epochs=3, status="FINISHED")
    store.client.create_registered_model("flowers_classifier")
    artifacts = store.client.get_run(finished).info.artifact_uri
    store.client.create_model_version(
        "flowers_classifier", source=f"{artifacts}/model", run_id=finished
    )
    store.client.log_metric(finished, "restarts", 1)
    left = store.run("left", start=2_000_000, epochs=1)  # not current, never ended
    current = store.run("current", start=3_000_000, epochs=2)
    store.run("elsewhere", start=4_000_000, output_dir=store.output_dir.parent / "other")
    write_run_id(store.checkpoint_dir, current)
    killed_driver(store.checkpoint_dir)

    assert main(["runs", "--output-dir", str(store.output_dir)]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    columns = "RUN ID  NAME  STATE  STARTED (UTC)  ENDED (UTC)  EPOCHS  RESTARTS  MODEL  FAILURE"
    assert header.split() == columns.split()
    assert len(lines) == 3 and "elsewhere" not in "\n".join(lines)
    assert lines[0].split()[:3] == ["*", current, "current"]
    assert lines[1].split()[:2] == [left, "left"]
    assert lines[2].split()[:2] == [finished, "first"]
    assert "flowers_classifier/1" in lines[2] and " 1-3 " in lines[2]
    state = header.index("STATE")  # aligned: each run's state starts under STATE
    assert [line[state:].split()[0] for line in lines] == [ABANDONED, ABANDONED, "FINISHED"]

    assert main(["runs", "--output-dir", str(store.output_dir), "--json"]) == 0
    runs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["run_id"], r["state"], r["current"]) for r in runs] == [
        (current, ABANDONED, True),
        (left, ABANDONED, False),
        (finished, "FINISHED", False),
    ]
    assert runs[2]["epochs"] == [1, 2, 3] and runs[2]["restarts"] == 1
    assert (runs[2]["registered_model_name"], runs[2]["registered_model_version"]) == (
        "flowers_classifier",
        1,
    )
    assert runs[2]["start_time"] == "1970-01-01T00:16:40+00:00"
    assert runs[2]["end_time"] == "1970-01-01T00:17:40+00:00"
    assert runs[0]["end_time"] is None and runs[0]["restarts"] == 0


def test_runs_of_an_empty_output_dir_creates_no_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["runs", "--output-dir", str(tmp_path)]) == 0
    assert "no runs of" in capsys.readouterr().out
    assert main(["runs", "--output-dir", str(tmp_path), "--json"]) == 0
    out, err = capsys.readouterr()
    assert out == "" and "no runs of" in err
    assert not (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / "missing").exists()
    assert main(["runs", "--output-dir", str(tmp_path / "missing")]) == 0
    assert not (tmp_path / "missing").exists()


def test_runs_without_the_experiment_is_no_runs(
    store: Store, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["runs", "--output-dir", str(store.output_dir), "--set", "tracking.experiment_name=x"]
    assert main(argv) == 0
    assert "no runs of" in capsys.readouterr().out
    assert store.client.get_experiment_by_name("x") is None


def test_runs_with_an_unreachable_server_exits_1_naming_the_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    argv = ["runs", "--output-dir", str(tmp_path), "--set", f"tracking.tracking_uri={uri}"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("flowers-job runs: TrackingError: tracking.tracking_uri: ")
    assert uri in err


def test_the_run_tracker_tags_the_output_dir_once(store: Store) -> None:
    cfg = load_config(None, [], **{"paths.output_dir": store.output_dir})
    untagged = store.client.create_run(store.experiment_id).info.run_id  # an older run
    store.client.set_terminated(untagged, status="FAILED")
    try:
        tracker = RunTracker(cfg)
        tracker.finish()
        RunTracker(cfg, untagged).finish()  # resumed
    finally:
        mlflow.set_tracking_uri(None)  # type: ignore[arg-type]  # MLflow's own reset
    tags = store.client.get_run(tracker.run_id).data.tags
    assert tags[TAG_OUTPUT_DIR] == str(store.output_dir.resolve())
    assert store.client.get_run(untagged).data.tags[TAG_OUTPUT_DIR] == tags[TAG_OUTPUT_DIR]
