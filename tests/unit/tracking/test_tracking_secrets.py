"""A password inside ``tracking.tracking_uri`` reaches the server by MLflow's variables and
nothing else: not the run's params or tags, not an error, not a failure tag.

Real components: a basic-auth MLflow server (``mlflow server --app-name basic-auth`` on
loopback, :func:`tests.support.model_registry.tracking_server`) and a sqlite store.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest

from flowers_job.config import ConfigError, JobConfig, load_config
from flowers_job.tracking.mlflow_run import (
    FAILURE_TAG,
    RunTracker,
    TrackingError,
    flatten,
    mark_run_failed,
    preflight,
    use_credentials,
)
from tests.support.model_registry import tracking_server

pytestmark = [pytest.mark.timeout(300), pytest.mark.tier("gate")]

USER = "secrets-admin"
PASSWORD = "pw-secret-tr4ck1ng-51d0"
"""The server's password, planted in the tracking URI."""
NAMES = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A basic-auth MLflow server on a free loopback port: ``http://127.0.0.1:<port>``."""
    with tracking_server(tmp_path_factory.mktemp("auth-mlflow"), (USER, PASSWORD)) as url:
        yield url


@pytest.fixture(autouse=True)
def _no_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)


def _cfg(tmp_path: Path, uri: str, *overrides: str) -> JobConfig:
    return load_config(
        None,
        [f"tracking.tracking_uri={uri}", "tracking.experiment_name=secrets", *overrides],
        **{"paths.output_dir": tmp_path / "out"},
    )


def _with_password(url: str, password: str = PASSWORD) -> str:
    return url.replace("http://", f"http://{USER}:{password}@")


def test_credentials_of_the_uri_are_exported_as_mlflows_variables(tmp_path: Path) -> None:
    use_credentials(_cfg(tmp_path, "https://alice:pw-from-uri@mlflow.example.com").tracking)
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "alice"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "pw-from-uri"

    secret_file = tmp_path / "pw.txt"
    secret_file.write_text("pw-from-file\n")
    use_credentials(
        _cfg(
            tmp_path, "https://h", "tracking.username=bob", f"tracking.password_file={secret_file}"
        ).tracking
    )
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "bob"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "pw-from-file"
    with pytest.raises(ConfigError, match=r"tracking\.password_env: .*H4_UNSET_VARIABLE"):
        use_credentials(
            _cfg(tmp_path, "https://h", "tracking.password_env=H4_UNSET_VARIABLE").tracking
        )


def test_a_run_on_a_server_whose_uri_carried_the_password_keeps_it_nowhere(
    auth_server: str, tmp_path: Path
) -> None:
    """The preflight authenticates with the password taken out of the URI, and the run's
    params (the whole configuration, as rank 0 logs them) and tags hold no password."""
    cfg = _cfg(tmp_path, _with_password(auth_server))
    assert cfg.tracking_uri == auth_server
    preflight(cfg)  # raises without the credentials: the server answers 401
    tracker = RunTracker(cfg)
    try:
        tracker.log_params(flatten(cfg.model_dump(mode="json")))
    finally:
        tracker.finish()
    run = mlflow.MlflowClient(auth_server).get_run(tracker.run_id)
    assert run.data.params["tracking.tracking_uri"] == auth_server
    assert run.data.params["tracking.username"] == USER
    assert run.data.tags["mlflow.user"] == USER  # MLflow read MLFLOW_TRACKING_USERNAME
    everything = repr(run.data.params) + repr(run.data.tags) + repr(run.info)
    assert PASSWORD not in everything


def test_a_tracking_error_never_shows_the_password(auth_server: str, tmp_path: Path) -> None:
    wrong = "pw-secret-wrong-77aa"
    with pytest.raises(TrackingError) as info:
        preflight(_cfg(tmp_path, _with_password(auth_server, wrong)), timeout_seconds=10)
    text = str(info.value)
    assert text.startswith(f"tracking.tracking_uri: the MLflow store {auth_server} cannot")
    assert "401" in text or "Unauthorized" in text or "UNAUTHENTICATED" in text
    assert wrong not in text and PASSWORD not in text


def test_a_failure_tag_is_redacted_of_the_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver's backstop writes the error's first line to the run: a password that
    appears in it (an MLflow error quoting a request, say) becomes ``***``."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("secrets-failure")).info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    assert mark_run_failed(uri, run_id, f"TrackingError: request with {PASSWORD} failed")
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags[FAILURE_TAG] == "TrackingError: request with *** failed"
