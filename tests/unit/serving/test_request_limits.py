"""What one request to the served model may cost, and the Pillow it
installs.

The served model refuses, before decoding any image, a request over ``serving.max_rows`` rows
(400) or ``serving.max_request_bytes`` bytes (413 from ``mlflow models serve``, 400 in
process), and answers a request without a Content-Type with 415 instead of MLflow's 500. The
end-to-end test registers the job's own model with an untrained head and small limits
(:func:`tests.support.model_registry.register_model`) and serves it with ``mlflow models serve
--env-manager local`` (a real subprocess, a bounded wait for ``/ping``, killed at the end).
The guard's own test runs MLflow's real ``invocations`` in this process, so that it also
checks the MLflow of a runtime's environment (3.0.1, 3.8.1), whose server does not start with
those lock files' Starlette (tests/unit/serving/test_serving.py).
"""

from __future__ import annotations

import base64
import importlib.metadata
import inspect
import json
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
import pytest
import requests
from mlflow.exceptions import MlflowException
from mlflow.pyfunc import scoring_server

from flowers_job.serving.pyfunc_model import SCORING_APP, guard_scoring_server
from flowers_job.serving.registration import pip_requirements
from flowers_job.vision.pillow_floor import PILLOW_FLOOR
from tests.support import PHOTOS

pytestmark = [pytest.mark.timeout(300), pytest.mark.tier("gate")]

REQUEST_SECONDS = 60
"""Per HTTP request, seconds."""
MAX_ROWS = 2
MAX_BYTES = 100_000
"""The served model's limits here: ``serving.max_rows``, ``serving.max_request_bytes``."""
STARLETTE_1 = "'FastAPI' object has no attribute 'route'"
"""How the scoring server of MLflow 3.0.1 and 3.8.1 fails to start in the runtimes' lock files
(tests/unit/serving/test_serving.py)."""


def _photos(largest: bool, n: int) -> list[bytes]:
    """``n`` real daisy photos, the smallest (about 10 KB) or the largest (about 240 KB)."""
    files = sorted((PHOTOS / "daisy").glob("*.jpg"), key=lambda f: f.stat().st_size)
    return [f.read_bytes() for f in (files[-n:] if largest else files[:n])]


def _body(images: list[bytes]) -> bytes:
    """A ``dataframe_split`` JSON body of ``images``, base64-encoded (docs/using-the-model.md)."""
    rows = [[base64.b64encode(x).decode("ascii")] for x in images]
    return json.dumps({"dataframe_split": {"columns": ["image"], "data": rows}}).encode()


# --- the served model's requirements ---------------------------------------------------------


def test_the_logged_requirements_pin_this_pillow_at_or_above_the_floor() -> None:
    reqs = pip_requirements()
    (pillow,) = [r for r in reqs if r.startswith("pillow")]
    installed = importlib.metadata.version("pillow")
    assert pillow == f"pillow=={installed}"
    assert tuple(map(int, installed.split(".")[:3])) >= tuple(map(int, PILLOW_FLOOR.split(".")))


def test_an_old_pillow_here_is_logged_as_the_floor_not_pinned() -> None:
    """Where the environment has the runtimes' Pillow 11.1.0, the served model asks for the
    floor instead; every other package keeps its pin."""

    def version(name: str) -> str:
        return "11.1.0" if name == "pillow" else importlib.metadata.version(name)

    reqs = pip_requirements(version)
    assert f"pillow>={PILLOW_FLOOR}" in reqs
    assert not [r for r in reqs if r.startswith("pillow==")]
    assert f"torch=={importlib.metadata.version('torch').split('+')[0]}" in reqs


# --- the guard in front of MLflow's invocations ------------------------------------------------


@pytest.fixture
def in_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """As inside ``mlflow models serve`` while it loads the model: its app module is being
    imported (a stand-in module object: importing the real one loads a model from its
    environment variable). MLflow's ``invocations`` is restored afterwards."""
    monkeypatch.setattr(scoring_server, "invocations", scoring_server.invocations)
    monkeypatch.setitem(sys.modules, SCORING_APP, types.ModuleType(SCORING_APP))
    yield


def test_outside_the_scoring_server_nothing_is_wrapped() -> None:
    original = scoring_server.invocations
    assert guard_scoring_server(MAX_BYTES) is False
    assert scoring_server.invocations is original


def test_the_guard_answers_415_and_413_before_mlflow_parses(in_server: None) -> None:
    """MLflow's real ``invocations`` (this environment's MLflow) behind the guard: no
    Content-Type is a 415 naming it, not an AttributeError; a body over the limit is a 413
    naming the setting, even when it is not JSON (it is never parsed); a body within the limit
    reaches MLflow, which answers an unsupported type with its own 415. A second call replaces
    the limit instead of wrapping twice."""
    original = scoring_server.invocations
    with pytest.raises(AttributeError):  # MLflow's own behaviour, which the guard fixes
        original(b"{}", None, None, None)
    assert guard_scoring_server(MAX_BYTES) is True
    guarded = scoring_server.invocations
    assert guarded is not original and inspect.unwrap(guarded) is original

    missing = guarded(b"{}", None, None, None)
    assert missing.status == 415 and "no Content-Type" in missing.response
    assert "application/json" in missing.response
    assert guarded(b"{}", "  ", None, None).status == 415

    big = guarded(b"x" * (MAX_BYTES + 1), "application/json", None, None)
    assert big.status == 413, big
    assert "serving.max_request_bytes" in big.response and str(MAX_BYTES) in big.response

    wrong = guarded(b"{}", "text/plain", None, None)  # MLflow's own answer, naming the type
    assert wrong.status == 415 and "text/plain" in wrong.response

    assert guard_scoring_server(MAX_BYTES * 2) is True
    again = scoring_server.invocations
    assert inspect.unwrap(again) is original and again.__wrapped__ is original  # type: ignore[attr-defined]
    passed = again(b"x" * (MAX_BYTES + 1), "text/plain", None, None)  # reaches MLflow now
    assert passed.status == 415 and "text/plain" in passed.response


def test_another_invocations_signature_is_left_alone(
    in_server: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def invocations(request: Any) -> Any:  # a future MLflow's, say
        return request

    monkeypatch.setattr(scoring_server, "invocations", invocations)
    assert guard_scoring_server(MAX_BYTES) is False
    assert scoring_server.invocations is invocations
    assert "is not the function this model guards" in caplog.text


# --- the served model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def registered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The job's model with an untrained head and small limits, registered (no training)."""
    from tests.support.model_registry import register_model

    out = tmp_path_factory.mktemp("limits")
    overrides = [f"serving.max_rows={MAX_ROWS}", f"serving.max_request_bytes={MAX_BYTES}"]
    info = register_model(out, _photos(False, 1), overrides=overrides)
    model_uri = f"models:/{info['registered_model_name']}/{info['registered_model_version']}"
    return {"out": out, "model_uri": model_uri, "tracking_uri": info["mlflow_tracking_uri"]}


def test_in_process_the_model_refuses_rows_and_bytes_before_decoding(
    registered: dict[str, Any],
) -> None:
    """``predict`` in this process: more rows than ``serving.max_rows``, or more image bytes
    than ``serving.max_request_bytes``, is an ``INVALID_PARAMETER_VALUE`` naming the setting,
    whatever the bytes are (they are not decoded: garbage does not change the answer)."""
    mlflow.set_tracking_uri(registered["tracking_uri"])
    try:
        model = mlflow.pyfunc.load_model(registered["model_uri"])
    finally:
        mlflow.set_tracking_uri(None)  # type: ignore[arg-type]  # MLflow's own reset
    assert len(model.predict(pd.DataFrame({"image": _photos(False, MAX_ROWS)}))) == MAX_ROWS
    for images, setting in (
        ([b"not an image"] * (MAX_ROWS + 1), "serving.max_rows"),
        ([b"\xff" * (MAX_BYTES + 1)], "serving.max_request_bytes"),
        (_photos(True, 1), "serving.max_request_bytes"),
    ):
        with pytest.raises(MlflowException) as caught:
            model.predict(pd.DataFrame({"image": images}))
        assert caught.value.error_code == "INVALID_PARAMETER_VALUE"
        assert setting in caught.value.message and "cannot be decoded" not in caught.value.message


def test_the_served_model_answers_oversized_and_untyped_requests_with_4xx(
    registered: dict[str, Any],
) -> None:
    """``mlflow models serve``: within the limits 200; one row over ``max_rows`` 400; a body
    over ``max_request_bytes`` 413; no Content-Type 415 (MLflow alone: 500); each answer names
    what to change, and the server keeps answering."""
    from tests.support.model_registry import serve

    log = registered["out"] / "serve.log"
    try:
        with serve(registered["model_uri"], registered["tracking_uri"], log) as url:
            _check_served(f"{url}/invocations")
            assert requests.get(f"{url}/ping", timeout=REQUEST_SECONDS).status_code == 200
    except RuntimeError:
        if os.environ.get("FLOWERS_EXPECT_WHEEL") == "1" and STARLETTE_1 in Path(log).read_text():
            pytest.skip("this MLflow's scoring server does not start with this Starlette")
        raise


def _check_served(invocations: str) -> None:
    json_type = {"Content-Type": "application/json"}

    def post(body: bytes, headers: dict[str, str]) -> requests.Response:
        return requests.post(invocations, data=body, headers=headers, timeout=REQUEST_SECONDS)

    ok = post(_body(_photos(False, MAX_ROWS)), json_type)
    assert ok.status_code == 200, ok.text[:2000]
    assert len(ok.json()["predictions"]) == MAX_ROWS

    rows = post(_body(_photos(False, MAX_ROWS + 1)), json_type)
    assert rows.status_code == 400, rows.text[:2000]
    assert rows.json()["error_code"] == "INVALID_PARAMETER_VALUE"
    assert "serving.max_rows" in rows.json()["message"]

    body = _body(_photos(True, 1))
    assert len(body) > MAX_BYTES
    big = post(body, json_type)
    assert big.status_code == 413, big.text[:2000]
    assert "serving.max_request_bytes" in big.text

    untyped = post(_body(_photos(False, 1)), {})  # requests sends no Content-Type for bytes
    assert untyped.status_code == 415, untyped.text[:2000]
    assert "Content-Type" in untyped.text
