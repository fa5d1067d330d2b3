"""The registered model behind a real REST endpoint: ``mlflow models serve --env-manager local``.

One model is registered for the module (no training: the job's own model with an untrained
head, :mod:`tests.support.model_registry`), served on a free loopback port, and sent real HTTP
requests with real photos, base64-encoded in a ``dataframe_split`` or ``dataframe_records``
payload as docs/using-the-model.md documents. Every wait is bounded.
"""

from __future__ import annotations

import base64
import importlib.metadata
import os
from collections.abc import Iterator
from typing import Any

import mlflow
import numpy as np
import pandas as pd
import pytest
import requests

from tests.support import LABELS, PHOTOS
from tests.support.model_registry import register_model, serve

pytestmark = [pytest.mark.timeout(300), pytest.mark.tier("full")]

REQUEST_SECONDS = 60  # per HTTP request, seconds
STARLETTE_1 = "'FastAPI' object has no attribute 'route'"
"""How the scoring server of MLflow 3.0.1 and 3.8.1 (Databricks Runtime 17.3's and 18's) fails
to start with Starlette 1.x, which dropped ``route`` (the FastAPI 0.165 of the runtimes' lock
files here: the runtimes ship no FastAPI)."""


def _runtime_serving() -> str:
    """Why the server does not start in a runtime's environment, naming the versions."""
    version = importlib.metadata.version
    return (
        f"mlflow {version('mlflow-skinny')}'s `mlflow models serve` does not start with FastAPI "
        f"{version('fastapi')} and Starlette {version('starlette')} ({STARLETTE_1}); it "
        "serves with FastAPI 0.115.12 and Starlette 0.46.2 (docs/using-the-model.md)"
    )


def _photos(n: int) -> list[bytes]:
    """``n`` real photos, taken in turn from each label."""
    files = [sorted((PHOTOS / label).glob("*.jpg"))[: n // len(LABELS) + 1] for label in LABELS]
    ordered = [f for group in zip(*files, strict=True) for f in group]
    return [f.read_bytes() for f in ordered[:n]]


def _b64(content: bytes) -> str:
    return base64.b64encode(content).decode("ascii")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A registered model, served; yields ``url``, ``model_uri``, ``tracking_uri``."""
    out = tmp_path_factory.mktemp("served")
    info = register_model(out, _photos(1))
    model_uri = f"models:/{info['registered_model_name']}/{info['registered_model_version']}"
    tracking_uri = info["mlflow_tracking_uri"]
    try:
        with serve(model_uri, tracking_uri, out / "serve.log") as url:
            yield {"url": url, "model_uri": model_uri, "tracking_uri": tracking_uri}
    except RuntimeError:
        log = (out / "serve.log").read_text(errors="replace")
        if os.environ.get("FLOWERS_EXPECT_WHEEL") == "1" and STARLETTE_1 in log:
            pytest.skip(_runtime_serving())
        raise


@pytest.fixture(scope="module")
def in_process(served: dict[str, Any]) -> Any:
    """The same registered model, loaded in this process."""
    mlflow.set_tracking_uri(served["tracking_uri"])
    try:
        return mlflow.pyfunc.load_model(served["model_uri"])
    finally:
        mlflow.set_tracking_uri(None)  # type: ignore[arg-type]  # MLflow's own reset


def _post(url: str, payload: dict[str, Any]) -> requests.Response:
    return requests.post(f"{url}/invocations", json=payload, timeout=REQUEST_SECONDS)


def _check_probabilities(response: requests.Response, expected: pd.DataFrame) -> None:
    assert response.status_code == 200, response.text[:2000]
    got = pd.DataFrame(response.json()["predictions"])
    assert list(got.columns) == sorted(LABELS)
    assert got.shape == expected.shape
    assert np.abs(got.sum(axis=1) - 1.0).max() < 1e-6
    assert np.abs(got.to_numpy() - expected.to_numpy()).max() < 1e-6


def test_one_image(served: dict[str, Any], in_process: Any) -> None:
    image = _photos(1)
    payload = {"dataframe_split": {"columns": ["image"], "data": [[_b64(image[0])]]}}
    _check_probabilities(
        _post(served["url"], payload), in_process.predict(pd.DataFrame({"image": image}))
    )


def test_batch_of_32(served: dict[str, Any], in_process: Any) -> None:
    images = _photos(32)
    payload = {"dataframe_records": [{"image": _b64(x)} for x in images]}
    _check_probabilities(
        _post(served["url"], payload), in_process.predict(pd.DataFrame({"image": images}))
    )


def test_corrupt_image_is_a_400_naming_the_row(served: dict[str, Any]) -> None:
    good = _photos(1)[0]
    rows = [[_b64(good)], [_b64(good[: len(good) // 3])], [_b64(b"not a photo")]]
    response = _post(served["url"], {"dataframe_split": {"columns": ["image"], "data": rows}})
    assert response.status_code == 400, response.text[:2000]
    body = response.json()
    assert body["error_code"] == "INVALID_PARAMETER_VALUE"
    assert "2 of 3 images cannot be decoded" in body["message"]
    assert "row 1: corrupt:" in body["message"]
    assert "row 2: not_an_image:" in body["message"]

    # the `inputs` format does not base64-decode a binary column: a 400 that says so
    response = _post(served["url"], {"inputs": {"image": [_b64(good)]}})
    assert response.status_code == 400
    assert "the bytes are base64 text" in response.json()["message"]

    # the server still answers
    assert requests.get(f"{served['url']}/ping", timeout=REQUEST_SECONDS).status_code == 200
    payload = {"dataframe_split": {"columns": ["image"], "data": [[_b64(good)]]}}
    assert _post(served["url"], payload).status_code == 200
