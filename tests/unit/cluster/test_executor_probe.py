"""The tracking server's credentials on the executors, checked before any work.

Real components: a protected MLflow server (``mlflow server --app-name basic-auth``, on
loopback) and the conftest's local[2] Spark session. That session's Python workers have
the environment its JVM started with, which holds no MLflow credentials: like executors on
a cluster, they never see what the driver sets later. The cluster version (executors on
other hosts, credentials given through ``spark.executorEnv.*``) is in cluster/test_cluster.py.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from flowers_job.cluster.executor_probe import check_executors
from flowers_job.config import ConfigError, load_config
from flowers_job.tracking.credentials import (
    DATABRICKS_VARIABLES,
    credential_problems,
    credential_variables,
    executor_report,
    executor_tracking,
    redact,
)
from flowers_job.tracking.mlflow_run import preflight
from tests.support.model_registry import tracking_server

pytestmark = [pytest.mark.timeout(300), pytest.mark.tier("gate")]

USER = "flowers-probe"
PASSWORD = "pw-executor-probe-7c1d9e2a"
"""The server's password: found in no error, log record or message."""
NAMES = ["MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"]


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A basic-auth MLflow server on a free loopback port; its URL."""
    with tracking_server(tmp_path_factory.mktemp("auth-mlflow"), (USER, PASSWORD)) as url:
        yield url


def _set(monkeypatch: pytest.MonkeyPatch, password: str | None) -> None:
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    if password is not None:
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", USER)
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)


def test_an_executor_needs_the_drivers_credentials(
    auth_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What one executor reports: the variables the driver uses that it lacks, and whether
    an authenticated call succeeds; then the error the driver makes of it."""
    _set(monkeypatch, PASSWORD)
    plan = executor_tracking(auth_server, "Default", local_mode=False, timeout_seconds=10)
    assert plan is not None and plan["wanted"] == NAMES
    assert executor_tracking(auth_server, "Default", True, 10) is None  # ranks on the driver
    assert executor_tracking("sqlite:///x.db", "Default", False, 10) is None

    assert executor_report(**plan) == {"missing": [], "set": NAMES, "error": None}
    _set(monkeypatch, "pw-wrong-5b6a")
    wrong = executor_report(**plan)
    assert wrong["missing"] == [] and "401" in wrong["error"]
    assert "pw-wrong-5b6a" not in wrong["error"]
    _set(monkeypatch, None)
    bare = executor_report(**plan)
    assert bare["missing"] == NAMES and bare["set"] == [] and "401" in bare["error"]

    (problem,) = credential_problems(
        plan, [{"host": "fl-w1", "address": "10.88.0.11", "tracking": bare}]
    )
    assert problem.startswith(f"tracking.tracking_uri: the MLflow store {auth_server} cannot")
    assert (
        "MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD set on the driver but missing on "
        "executor host fl-w1 (10.88.0.11)"
    ) in problem
    assert "--conf spark.executorEnv.MLFLOW_TRACKING_PASSWORD=..." in problem
    assert "spark_env_vars" in problem
    assert PASSWORD not in problem


def test_the_probe_refuses_executors_without_credentials(
    spark: SparkSession,
    auth_server: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Barrier mode on the local master: the driver reaches the server with the configured
    credentials (the preflight passes and creates the experiment), the Python workers,
    where the ranks would run, do not have them: ConfigError before any work, naming the
    variables and the host, never the password."""
    _set(monkeypatch, None)
    cfg = load_config(
        None,
        [
            f"tracking.tracking_uri={auth_server}",
            f"tracking.username={USER}",
            f"tracking.password={PASSWORD}",
            "tracking.experiment_name=probe",
            "distributed.local_mode=false",
        ],
        **{"paths.output_dir": tmp_path / "out"},
    )
    caplog.set_level(logging.DEBUG)
    preflight(cfg)  # exports the configured credentials, as the CLI's check does
    with pytest.raises(ConfigError) as err:
        check_executors(spark, cfg)
    message = str(err.value)
    assert (
        f"tracking.tracking_uri: the MLflow store {auth_server} cannot be used from the executors"
    ) in message
    assert "MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD set on the driver but missing" in (
        message
    )
    assert f"executor host {socket.gethostname()} (" in message
    assert PASSWORD not in message
    assert PASSWORD not in caplog.text
    assert not (tmp_path / "out" / "tables").exists()
    # local mode: the ranks run on the driver, with its environment; nothing to probe
    local = cfg.model_copy(
        update={"distributed": cfg.distributed.model_copy(update={"local_mode": True})}
    )
    assert check_executors(spark, local) == []


def test_the_databricks_variables_are_the_sdks() -> None:
    """The Databricks variables the probe asks for (and redacts) are those the installed
    Databricks SDK authenticates with, and its secrets are the SDK's sensitive ones."""
    from databricks.sdk.config import Config

    chosen = {"host", "profile", "config_file", "auth_type"}
    sdk = {
        a.env: a.sensitive for a in Config.attributes() if a.env and (a.auth or a.name in chosen)
    }
    assert sdk == DATABRICKS_VARIABLES
    assert credential_variables("databricks") == tuple(DATABRICKS_VARIABLES)
    token = "dapi-probe-0a9b8c"
    assert redact(f"bad {token}", {"DATABRICKS_TOKEN": token}) == "bad ***"
