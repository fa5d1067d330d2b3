"""A `flowers-job run` whose ``tracking.tracking_uri``
carried a password (``http://user:<pw>@host``) to a real basic-auth MLflow server leaves
that password nowhere: not in any file under the output dir (logs, JSON, the Delta tables,
every checkpoint, loaded too), not in the run's artifacts on the server, not in the
process's stdout/stderr, not in the MLflow run's params or tags.

Real components: ``mlflow server --app-name basic-auth`` on loopback, the CLI in a
subprocess (local Spark, TorchDistributor local mode, 2 gloo processes), 60 real photos.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import mlflow
import pytest
import torch

from tests.support.data import LOADERS, loader_skip_reason
from tests.support.model_registry import tracking_server
from tests.support.processes import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200), pytest.mark.tier("full")]

USER = "secrets-admin"


def _loader() -> str:
    for name in LOADERS:
        if loader_skip_reason(name) is None:
            return name
    pytest.skip("no loader can run on this stack")


def test_a_password_in_the_tracking_uri_ends_up_nowhere(
    photos: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    password = f"pw-secret-{uuid.uuid4().hex}"  # unique: any hit is this run's leak
    store = tmp_path_factory.mktemp("secrets-server")
    out = tmp_path / "out"
    with tracking_server(store, (USER, password)) as url:
        uri = url.replace("http://", f"http://{USER}:{password}@")
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_")}
        sets = [
            f"tracking.tracking_uri={uri}",
            "tracking.experiment_name=secrets-run",
            "data.image_size=32",
            "train.per_device_batch_size=8",
            "train.epochs=1",
            f"data.loader={_loader()}",
            "distributed.timeout_seconds=300",
        ]
        args = ["run", "--images", str(photos), "--output-dir", str(out)]
        proc = run_cli(*args, *[a for s in sets for a in ("--set", s)], timeout=1100, env=env)
        assert proc.returncode == 0, proc.stderr[-5000:] + proc.stdout[-3000:]
        assert password not in proc.stdout + proc.stderr, "the CLI's output"

        summary = json.loads((out / "summary.json").read_text())
        assert summary["mlflow_tracking_uri"] == url  # stored without its user info
        files = [p for p in out.rglob("*") if p.is_file()]
        files += [p for p in (store / "artifacts").rglob("*") if p.is_file()]
        checkpoints = [p for p in files if p.suffix == ".pt"]
        assert checkpoints and any(p.name == "last.pt" for p in checkpoints)
        for path in files:
            assert password.encode() not in path.read_bytes(), f"{path} holds the password"
        for path in checkpoints:  # a compressed pickle would hide it from grep: load it too
            state = torch.load(path, map_location="cpu", weights_only=False)
            assert password not in repr(state), f"{path} holds the password once loaded"

        os.environ["MLFLOW_TRACKING_USERNAME"] = USER  # the conftest restores both
        os.environ["MLFLOW_TRACKING_PASSWORD"] = password
        run = mlflow.MlflowClient(url).get_run(summary["mlflow_run_id"])
        assert run.data.params["tracking.tracking_uri"] == url
        assert run.data.tags["mlflow.user"] == USER  # rank 0 authenticated as the URI's user
        assert password not in repr(run.data.params) + repr(run.data.tags)
