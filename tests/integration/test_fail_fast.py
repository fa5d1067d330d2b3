"""A job bound to fail stops before any work, with a message naming the field to fix.

Real components: the conftest's local[2] Spark session, real MLflow stores (sqlite in a
temp dir; an HTTP URI to a closed local port). The measured times are printed (run with
``-s`` to see them); the only timing assertions are generous bounds against hangs.
"""

from __future__ import annotations

import http.server
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from pyspark.sql import SparkSession

from flowers_job.config import ConfigError, load_config
from flowers_job.driver.pipeline import run_job, run_training
from flowers_job.tracking.mlflow_run import TrackingError, preflight
from tests.support.processes import run_cli

pytestmark = [pytest.mark.timeout(300), pytest.mark.tier("gate")]

HANG_GUARD_SECONDS = 30.0
"""MLflow's own retries take minutes (HTTP) or ~100 s (a database store); the preflight
surfaces in well under a second here. This bound only catches a return to retrying."""

_HTTP_SETTINGS = (
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER",
    "MLFLOW_HTTP_REQUEST_TIMEOUT",
    "MLFLOW_DATABRICKS_ENDPOINT_HTTP_RETRY_TIMEOUT",
)


def _closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _preflight_error(uri: str, tmp_path: Path, what: str) -> str:
    """Preflight against ``uri``: the TrackingError's message, checked to name the field."""
    cfg = load_config(
        None, [f"tracking.tracking_uri={uri}"], **{"paths.output_dir": tmp_path / "out"}
    )
    t0 = time.perf_counter()
    with pytest.raises(TrackingError) as err:
        preflight(cfg)
    elapsed = time.perf_counter() - t0
    print(f"{what}: TrackingError after {elapsed:.3f} s")
    assert elapsed < HANG_GUARD_SECONDS
    message = str(err.value)
    assert message.startswith(f"tracking.tracking_uri: the MLflow store {uri} cannot be used")
    return message


@pytest.mark.parametrize("entry", [run_job, run_training], ids=["run_job", "run_training"])
def test_more_processes_than_task_slots_fail_before_any_work(
    spark: SparkSession, photos: Path, tmp_path: Path, entry: Callable[..., Any]
) -> None:
    """Barrier mode needs one task slot per process; the conftest session has two."""
    cfg = load_config(
        None,
        ["distributed.local_mode=false", "distributed.num_processes=3"],
        **{"data.images": photos, "paths.output_dir": tmp_path / "out"},
    )
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        entry(spark, cfg)
    print(f"{entry.__name__}: slots check after {time.perf_counter() - t0:.3f} s")
    assert "\n  distributed.num_processes: 3 processes, but this Spark cluster (local[2]) " in str(
        err.value
    )
    assert "2 task slots" in str(err.value)
    assert not (tmp_path / "out").exists()  # no ingest, no MLflow store, no cache


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a driver without CUDA")
def test_gpus_requested_without_cuda_fail_before_any_work(
    spark: SparkSession, photos: Path, tmp_path: Path
) -> None:
    cfg = load_config(
        None,
        ["distributed.use_gpu=true"],
        **{"data.images": photos, "paths.output_dir": tmp_path / "out"},
    )
    with pytest.raises(ConfigError, match=r"\n  distributed\.use_gpu: GPUs requested"):
        run_job(spark, cfg)
    assert not (tmp_path / "out").exists()


def test_unreachable_tracking_server_fails_within_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow's defaults (7 retries, exponential back-off) take minutes on a closed port.
    The preflight's tighter settings are scoped: the user's own settings are back after it."""
    for name in _HTTP_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "77")  # the user's, kept for training
    uri = f"http://127.0.0.1:{_closed_port()}"
    message = _preflight_error(uri, tmp_path, "closed port")
    assert "Connection refused" in message or "NewConnectionError" in message
    assert {name: os.environ.get(name) for name in _HTTP_SETTINGS} == {
        **dict.fromkeys(_HTTP_SETTINGS),
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "77",
    }


def _dir_where_the_db_file_goes(root: Path) -> str:
    (root / "mlflow.db").mkdir(parents=True)
    return f"sqlite:///{root / 'mlflow.db'}"


def _file_where_a_folder_goes(root: Path) -> str:
    root.mkdir(parents=True)
    (root / "store").write_text("not a folder")
    return f"sqlite:///{root / 'store' / 'mlflow.db'}"


@pytest.mark.parametrize(
    "make_uri",
    [_dir_where_the_db_file_goes, _file_where_a_folder_goes],
    ids=["dir-as-db-file", "file-as-parent-dir"],
)
def test_unusable_sqlite_store_fails_within_seconds(
    tmp_path: Path, make_uri: Callable[[Path], str]
) -> None:
    """A folder where the database file should be: MLflow's store alone retries the
    connection 10 times with back-off (about 100 s) before it gives up."""
    _preflight_error(make_uri(tmp_path / "store-root"), tmp_path, make_uri.__name__)


class _Unauthorized(http.server.BaseHTTPRequestHandler):
    """Answers 401 to everything and records the Authorization header it was sent."""

    seen: ClassVar[list[str | None]] = []

    def do_GET(self) -> None:
        self.seen.append(self.headers.get("Authorization"))
        self.send_response(401)
        self.end_headers()

    def do_POST(self) -> None:
        self.do_GET()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def unauthorized_server() -> Iterator[str]:
    """A local HTTP server that refuses every request (a stand-in for an MLflow server
    with auth: only the request headers matter here). Yields its URL."""
    _Unauthorized.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Unauthorized)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_configured_token_is_sent_but_never_shown(
    tmp_path: Path, unauthorized_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_TOKEN", raising=False)  # restored after the test
    secrets = tmp_path / "secrets.yaml"
    secrets.write_text("tracking:\n  token: tk-SENTINEL-4711\n")
    cfg = load_config(
        secrets,
        [f"tracking.tracking_uri={unauthorized_server}"],
        **{"paths.output_dir": tmp_path / "out"},
    )
    with pytest.raises(TrackingError) as err:
        preflight(cfg)
    assert _Unauthorized.seen and set(_Unauthorized.seen) == {"Bearer tk-SENTINEL-4711"}
    assert "401" in str(err.value) and "SENTINEL" not in str(err.value)
    # the training processes inherit it from here, not from the job
    assert os.environ["MLFLOW_TRACKING_TOKEN"] == "tk-SENTINEL-4711"


def test_cli_stops_on_an_unreachable_store_before_spark_starts(
    photos: Path, tmp_path: Path
) -> None:
    uri = f"http://127.0.0.1:{_closed_port()}"
    t0 = time.perf_counter()
    proc = run_cli(
        "run",
        "--images",
        str(photos),
        "--output-dir",
        str(tmp_path / "out"),
        "--set",
        f"tracking.tracking_uri={uri}",
    )
    elapsed = time.perf_counter() - t0
    print(f"CLI, closed port: exit {proc.returncode} after {elapsed:.1f} s (process start incl.)")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"flowers-job run: TrackingError: tracking.tracking_uri: the MLflow store {uri}" in (
        proc.stderr
    )
    assert "Ivy" not in proc.stderr and "SparkContext" not in proc.stderr  # no JVM was started
    assert not (tmp_path / "out" / "tables").exists()
    assert elapsed < HANG_GUARD_SECONDS * 2  # Python and its imports start in a few seconds


def test_cli_exits_2_when_the_processes_do_not_fit_the_cluster(tmp_path: Path) -> None:
    """The cluster check needs the session (a JVM): it runs right after it starts."""
    t0 = time.perf_counter()
    proc = run_cli(
        "train",
        "--output-dir",
        str(tmp_path / "out"),
        "--set",
        "distributed.local_mode=false",
        "--set",
        "distributed.num_processes=3",
        env={**os.environ, "FLOWERS_SPARK_MASTER": "local[2]"},
    )
    print(
        f"CLI, 3 processes on local[2]: exit {proc.returncode} after {time.perf_counter() - t0:.1f} s"
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "flowers-job: invalid configuration:\n  distributed.num_processes: 3 processes" in (
        proc.stderr
    )
    assert not (tmp_path / "out" / "loader_cache").exists()
