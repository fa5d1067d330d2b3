"""One writer per output, as a user meets it: two `flowers-job run` on one output folder
(the second exits 2 naming the first, which finishes unharmed), and a `flowers-job run`
whose output is in a bucket of a real S3 API server (moto) where another live process
holds the lease (exit 2 naming it, before Spark starts, nothing written)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest

from flowers_job.driver.lease import RECORD_NAME, OutputLease
from flowers_job.train.checkpoint import CHECKPOINT_NAME, RUN_FILE_NAME
from tests.support.processes import run_cli
from tests.support.s3 import S3Store, fresh_bucket, s3_server  # noqa: F401 (fixture)

pytestmark = [pytest.mark.timeout(900), pytest.mark.tier("gate")]

FAST = [
    "data.image_size=32",
    "train.per_device_batch_size=8",
    "train.base_learning_rate=0.003",
    "train.epochs=1",
    "distributed.timeout_seconds=300",
]
LEASE_WAIT = 120.0
"""Bound on the first run reaching its lease (seconds: its imports and checks, no Spark)."""
RUN_TIMEOUT = 800.0
"""Bound on the first run (seconds)."""


def _sets(settings: list[str]) -> list[str]:
    return [a for s in settings for a in ("--set", s)]


@pytest.mark.slow
@pytest.mark.tier("full")  # a whole real run: minutes on 2 cores
def test_a_second_run_on_the_same_output_exits_2_naming_the_first(
    photos: Path, tmp_path: Path
) -> None:
    """The first `flowers-job run` holds the lease; a second on the same folder exits 2
    naming the first's host and pid; the first finishes: its summary, test accuracy,
    checkpoint, MLflow run (FINISHED, not taken for dead) all there."""
    out = tmp_path / "out"
    args = ["run", "--images", str(photos), "--output-dir", str(out), *_sets(FAST)]
    log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen(
        [sys.executable, "-m", "flowers_job", *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + LEASE_WAIT
        while not (out / RECORD_NAME).exists():
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"no lease after {LEASE_WAIT} s"
            time.sleep(0.2)

        second = run_cli(*args, timeout=120)
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"pid {first.pid} on host {socket.gethostname()}" in second.stderr
        assert f"{out} is in use by flowers-job run" in second.stderr
        assert first.poll() is None  # the first goes on

        assert first.wait(timeout=RUN_TIMEOUT) == 0, (tmp_path / "first.log").read_text()[-5000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=30)
        log.close()
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["test_accuracy"] <= 1.0 and summary["epochs_completed"] == 1
    assert (out / "checkpoints" / CHECKPOINT_NAME).is_file()
    run_file = json.loads((out / "checkpoints" / RUN_FILE_NAME).read_text())
    assert summary["mlflow_run_id"] in json.dumps(run_file)
    run = mlflow.MlflowClient(summary["mlflow_tracking_uri"]).get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert not (out / RECORD_NAME).exists()  # released at the end


def test_a_run_on_s3_exits_2_while_another_process_holds_the_lease(
    s3_server: str,  # noqa: F811
    photos: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lease object in the bucket names a live holder (this test's process, renewing
    it): `flowers-job run` with its output there exits 2 naming it, before Spark starts,
    and writes nothing to the bucket."""
    store: S3Store = fresh_bucket(s3_server)
    for key, value in store.env().items():
        monkeypatch.setenv(key, value)
    output = store.url("out")
    with OutputLease(output, "ingest") as lease:
        held = store.read(f"out/{RECORD_NAME}")
        proc = run_cli(
            "run",
            "--images",
            str(photos),
            "--output-dir",
            output,
            *_sets([*FAST, f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db"]),
            timeout=180,
            env={**os.environ, **store.env()},
        )
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert f"pid {lease.holder.pid} on host {socket.gethostname()}" in proc.stderr
        assert "flowers-job ingest" in proc.stderr and output in proc.stderr
        assert "SparkContext" not in proc.stderr  # refused before Spark started
        assert store.keys() == [f"out/{RECORD_NAME}"]
        assert store.read(f"out/{RECORD_NAME}") == held  # not even renewed by the other
        assert not (tmp_path / "mlflow.db").exists()  # nor the MLflow store
    assert store.keys() == []
