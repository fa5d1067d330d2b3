"""Spark Connect is refused before any work: by the CLI with status 2, by the library with a
ConfigError, and the message says what the job needs and what made the session Connect.

Real components: a local Spark Connect server (the pyspark wheel's ``SparkConnectServer``,
started with spark-submit, one per module), its Python client (``pyspark[connect]``: grpcio,
grpcio-status), spark-submit's own ``--remote``. Runs in the local suite only (the DBR 17.3
environment has no grpcio, as ``requirements/dbr-17.3-ml.txt`` is built).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pyspark
import pytest
from pyspark.sql import SparkSession

from flowers_job.config import ConfigError, load_config
from flowers_job.driver.pipeline import run_ingest, run_job, run_training
from flowers_job.serving.batch_predict import predict
from flowers_job.serving.model_ref import ModelRef
from tests.support import ROOT_DIR
from tests.support.processes import run_cli, stop_server

pytestmark = [pytest.mark.timeout(300), pytest.mark.tier("gate")]

SERVER_START_SECONDS = 120.0
"""Bound on the Connect server's start (about 12 s on the 2-core machine)."""
SPARK_HOME = Path(pyspark.__file__).parent
"""The pyspark wheel is a Spark distribution: bin/spark-submit and the jars, Connect's too."""
NEEDS = ("classic", "dedicated (single user) access mode", "Databricks Runtime ML")
"""What every refusal must name, besides the setting."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spark_env() -> dict[str, str]:
    return {**os.environ, "SPARK_HOME": str(SPARK_HOME), "PYSPARK_PYTHON": sys.executable}


@pytest.fixture(scope="module")
def connect_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``sc://127.0.0.1:<port>`` of a local Spark Connect server (``local[1]``, 512 MB)."""
    port = _free_port()
    log = tmp_path_factory.mktemp("connect") / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [
                str(SPARK_HOME / "bin" / "spark-submit"),
                "--class",
                "org.apache.spark.sql.connect.service.SparkConnectServer",
                "--master",
                "local[1]",
                "--driver-memory",
                "512m",
                "--conf",
                "spark.ui.enabled=false",
                "--conf",
                "spark.connect.grpc.binding.address=127.0.0.1",
                "--conf",
                f"spark.connect.grpc.binding.port={port}",
                "spark-internal",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_spark_env(),
        )
    try:
        deadline = time.monotonic() + SERVER_START_SECONDS
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"no Spark Connect server on :{port}:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
        yield f"sc://127.0.0.1:{port}"
    finally:
        stop_server(server)


def _assert_refusal(message: str, setting: str) -> None:
    assert "Spark Connect is not supported" in message, message
    assert setting in message, message
    for need in NEEDS:
        assert need in message, message
    assert "Traceback" not in message and "AttributeError" not in message, message


def test_cli_refuses_spark_connect_with_status_2_before_any_work(
    connect_url: str, photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SPARK_REMOTE`` (its token hidden), and spark-submit ``--remote`` of the job's entry
    point: status 2, the setting named, nothing written (no output dir, no MLflow store)."""
    out = tmp_path / "out"
    env = {**_spark_env(), "SPARK_REMOTE": f"{connect_url}/;token=not-for-logs"}
    monkeypatch.chdir(tmp_path)  # MLflow's default store would be ./mlflow.db
    cli = run_cli("run", "--images", str(photos), "--output-dir", str(out), env=env)
    scored = run_cli(
        *("predict", "--model", "models:/flowers/1", "--images", str(photos)),
        *("--output-table", str(out / "predictions")),
        env=env,
    )
    for proc in (cli, scored):
        assert proc.returncode == 2, proc.stderr[-3000:]
        _assert_refusal(proc.stderr, f"SPARK_REMOTE={connect_url}/;<parameters hidden>")
        assert "not-for-logs" not in proc.stdout + proc.stderr
    submitted = subprocess.run(
        [
            str(SPARK_HOME / "bin" / "spark-submit"),
            *("--remote", connect_url),
            str(ROOT_DIR / "jobs" / "train_flowers.py"),
            *("--images", str(photos), "--output-dir", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env=_spark_env(),
    )
    output = submitted.stdout + submitted.stderr  # spark-submit merges Python's stderr
    assert submitted.returncode == 2, output[-3000:]
    _assert_refusal(output, f"spark.remote={connect_url} from spark-submit --remote")
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_library_refuses_a_connect_session_before_any_work(
    connect_url: str, photos: Path, tmp_path: Path
) -> None:
    """run_job, run_training, run_ingest and predict handed a real Connect session (as
    Databricks serverless compute hands one): ConfigError naming the session's class."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    # typed as the classic session, as Databricks' ``spark`` reaches a job that expects one
    spark = cast(SparkSession, ConnectSession.builder.remote(connect_url).getOrCreate())
    try:
        assert spark.version == pyspark.__version__  # the server answers (no Spark job)
        cfg = load_config(None, [], **{"data.images": photos, "paths.output_dir": tmp_path})
        ref = ModelRef("models:/flowers/1", "flowers", 1, f"sqlite:///{tmp_path}/mlflow.db")
        calls = {
            "run_job": lambda: run_job(spark, cfg),
            "run_training": lambda: run_training(spark, cfg),
            "run_ingest": lambda: run_ingest(spark, cfg),
            "predict": lambda: predict(spark, ref, tmp_path / "predictions", images=photos),
        }
        for name, call in calls.items():
            with pytest.raises(ConfigError) as err:
                call()
            _assert_refusal(str(err.value), "pyspark.sql.connect.session.SparkSession")
            assert sorted(p.name for p in tmp_path.iterdir()) == [], name
    finally:
        spark.stop()
    assert "SPARK_CONNECT_MODE_ENABLED" not in os.environ  # later tests' Spark stays classic
