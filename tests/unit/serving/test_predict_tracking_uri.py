"""``predict`` takes its MLflow store from the configuration or the environment, never from an
output folder's summary.json unless ``--tracking-uri-from-output`` says so: whoever can write
that folder could otherwise send the user's credentials to a host of theirs."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from flowers_job.serving.batch_predict import predict_tracking_uri
from tests.support.processes import run_cli

pytestmark = [pytest.mark.timeout(300), pytest.mark.tier("gate")]

PLANTED = "pw-secret-pr3d1ct-2b3c"


def test_the_store_is_the_configs_or_the_environments() -> None:
    default, summary = "sqlite:///out/mlflow.db", "http://evil.example.com"
    assert predict_tracking_uri("http://cfg", default, summary, environ={}) == "http://cfg"
    env = {"MLFLOW_TRACKING_URI": "http://env"}
    assert predict_tracking_uri(None, default, summary, environ=env) == "http://env"
    assert predict_tracking_uri(None, default, summary, environ={}) == default
    assert predict_tracking_uri(None, default, summary, from_output=True, environ={}) == summary
    # a summary's URI is used without the credentials an old summary may hold
    old = "http://u:pw@h:5000"
    assert predict_tracking_uri(None, default, old, from_output=True, environ={}) == "http://h:5000"


@pytest.fixture
def recorder() -> Iterator[tuple[str, list[str]]]:
    """An HTTP server on loopback that answers 404 to everything and records each request's
    path: the host a planted summary.json points at."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.path)
            self.send_error(404)

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_predict_ignores_a_summarys_tracking_server_without_the_flag(
    tmp_path: Path, recorder: tuple[str, list[str]]
) -> None:
    url, seen = recorder
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text(
        json.dumps(
            {
                "registered_model_name": "flowers_classifier",
                "registered_model_version": 1,
                "mlflow_tracking_uri": url,
            }
        )
    )
    (tmp_path / "photos").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env |= {"MLFLOW_TRACKING_USERNAME": "ann", "MLFLOW_TRACKING_PASSWORD": PLANTED}
    args = ["predict", "--output-dir", str(out), "--images", str(tmp_path / "photos")]
    args += ["--output-table", str(tmp_path / "preds")]
    proc = run_cli(*args, env=env, timeout=240)
    assert proc.returncode != 0
    assert seen == []  # the planted server was never asked
    assert f"no MLflow store at {out / 'mlflow.db'}" in proc.stderr
    assert PLANTED not in proc.stdout + proc.stderr

    proc = run_cli(*args, "--tracking-uri-from-output", env=env, timeout=240)
    assert proc.returncode != 0  # the recorder knows no model
    assert seen  # with the flag, the summary's server is the store
    assert PLANTED not in proc.stdout + proc.stderr
