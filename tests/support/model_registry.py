"""A registered flowers model in seconds, without training, the model served over HTTP, and a
real MLflow tracking server: for the serving, predict, promotion and executor probe tests
and the serving benchmark.

The model is the job's own: EfficientNet-Lite0 with its offline ImageNet weights and a new,
untrained head (seeded, so the same every time), logged and registered by the job's own
:meth:`flowers_job.tracking.mlflow_run.RunTracker.log_model` with the ``model_config`` the worker builds (:func:`flowers_job.serving.pyfunc_model.model_config`),
into a sqlite store under ``output_dir``. Its probabilities are not meaningful; its decode,
transform and model path are exactly a trained model's.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
import requests
import torch

from tests.support import REPO
from tests.support.processes import stop_group

sys.path.insert(0, str(REPO / "tools"))
from cluster import mlflow_server

from flowers_job.config import load_config
from flowers_job.serving.pyfunc_model import model_config
from flowers_job.serving.registration import log_pyfunc_model
from flowers_job.tracking.mlflow_run import RunTracker, preflight
from flowers_job.vision.backbones import build_model

LABELS = ["daisy", "dandelion", "roses", "sunflowers", "tulips"]
START_SECONDS = 120
"""Longest wait for the server's /ping, seconds."""
STOP_SECONDS = 20
"""Longest wait for a server's process group to exit after SIGTERM (then SIGKILL), seconds."""


def register_model(
    output_dir: Path,
    examples: list[bytes],
    *,
    seed: int = 0,
    overrides: list[str] | None = None,
    labels: list[str] | None = None,
) -> dict[str, Any]:
    """Log and register one untrained-head model under ``output_dir`` (sqlite store).

    Args:
        output_dir: ``paths.output_dir``: ``mlflow.db`` and ``mlartifacts/`` go there.
        examples: image bytes for the input example (1 or 2 real photos are enough).
        seed: torch seed of the new head; another seed gives other probabilities.
        overrides: ``--set`` style config overrides (e.g. ``data.image_size=160``).
        labels: label names (default: the five flower labels).

    Returns:
        The keys of ``summary.json`` that ``flowers-job predict`` reads:
        ``registered_model_name``, ``registered_model_version``, ``mlflow_tracking_uri``,
        plus ``model_uri`` and ``label_names``.
    """
    cfg = load_config(None, overrides or [], **{"paths.output_dir": output_dir})
    names = labels or LABELS
    torch.manual_seed(seed)
    model = build_model(cfg.model.architecture, len(names), "package", dropout=cfg.model.dropout)
    model.eval()
    preflight(cfg)  # the experiment, its artifacts under output_dir (not ./mlruns)
    tracker = RunTracker(cfg)
    try:
        model_uri, version = log_pyfunc_model(
            model,
            model_config(cfg, names),
            pd.DataFrame({"image": examples}),
            cfg.tracking.registered_model_name,
        )
    finally:
        tracker.finish()
    mlflow.set_tracking_uri(None)  # type: ignore[arg-type]  # MLflow's own reset, as in its _use_tracking_uri
    return {
        "registered_model_name": cfg.tracking.registered_model_name,
        "registered_model_version": version,
        "mlflow_tracking_uri": cfg.tracking_uri,
        "model_uri": model_uri,
        "label_names": names,
    }


SERVER_START_SECONDS = 180.0
"""Longest wait for a tracking server's ``/health``, seconds."""


@contextmanager
def tracking_server(store: Path, auth: tuple[str, str] | None = None) -> Iterator[str]:
    """A real MLflow tracking server (``mlflow server``, this environment's mlflow) on a free
    loopback port: a sqlite store and proxied artifacts under ``store``
    (``--artifacts-destination``: runs get ``mlflow-artifacts:`` URIs), with ``auth`` (user,
    password) MLflow's basic-auth app (``tools/cluster.py``, ``mlflow_server``). Yields its
    URL once ``/health`` answers. The server runs in a process group of its own (``mlflow
    server`` and the uvicorn it starts), stopped as a group on exit: SIGTERM, then SIGKILL
    after :data:`STOP_SECONDS` (:func:`tests.support.processes.stop_group`).

    Raises:
        RuntimeError: the server exited or did not answer within
            :data:`SERVER_START_SECONDS` (the log's tail attached).
    """
    port = free_port()
    argv, env = mlflow_server(Path(sys.executable), "127.0.0.1", port, store, auth)
    url = f"http://127.0.0.1:{port}"
    with open(store / "server.log", "wb") as out:
        proc = subprocess.Popen(
            argv, env={**os.environ, **env}, stdout=out, stderr=out, start_new_session=True
        )
    try:
        deadline = time.monotonic() + SERVER_START_SECONDS
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log = (store / "server.log").read_text(errors="replace")
                    raise RuntimeError(f"the MLflow server did not start:\n{log[-3000:]}") from None
                time.sleep(0.5)
        yield url
    finally:
        stop_group(proc, STOP_SECONDS)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve(model_uri: str, tracking_uri: str, log_path: Path) -> Iterator[str]:
    """``mlflow models serve -m MODEL_URI --env-manager local`` on a free loopback port.

    Yields the base URL once ``/ping`` answers 200 (within :data:`START_SECONDS`); on exit the
    server's process group gets SIGTERM, then SIGKILL after :data:`STOP_SECONDS`
    (:func:`tests.support.processes.stop_group`).

    Raises:
        RuntimeError: the server exited or did not answer in time (the log's tail attached).
    """
    port = free_port()
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": tracking_uri,
        # the server runs `uvicorn` from PATH: this environment's
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    url = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri),
                *("--env-manager", "local", "--host", "127.0.0.1", "--port", str(port)),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the server and its uvicorn child
        )
        try:
            deadline = time.monotonic() + START_SECONDS
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"the server exited ({proc.returncode}): {log_path.read_text()[-3000:]}"
                    )
                try:
                    if requests.get(f"{url}/ping", timeout=2).status_code == 200:
                        break
                except requests.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no answer on {url}/ping within {START_SECONDS} s")
                time.sleep(0.5)
            yield url
        finally:
            stop_group(proc, STOP_SECONDS)
