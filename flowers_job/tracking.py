"""MLflow: experiment preflight on the driver; run, metrics and model from rank 0 only.

The driver checks the store and creates the experiment before any worker starts
(:func:`preflight`). Rank 0 then owns one MLflow run (:class:`RunTracker`): params
once, metrics per epoch with ``step=epoch``, and at the end the model as a pyfunc
(:class:`~flowers_job.serving.FlowersClassifierModel`) with signature and input example,
registered under ``tracking.registered_model_name``. A resumed run continues the same
MLflow run and logs no param twice.
"""

from __future__ import annotations

import logging
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
import torch
from mlflow.models import infer_signature

from flowers_job.config import JobConfig

__all__ = ["EPOCH_KEY", "RunTracker", "TrackingError", "end_failed_run", "flatten", "preflight"]

EPOCH_KEY = "val_loss"
"""The metric whose steps say which epochs a run has logged (every epoch logs it)."""

log = logging.getLogger(__name__)


class TrackingError(RuntimeError):
    """The MLflow store cannot be used."""


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"epochs": 3}}`` -> ``{"train.epochs": 3}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def preflight(cfg: JobConfig) -> str:
    """Check the tracking store and get or create the experiment; runs on the driver.

    Returns:
        The experiment id.

    Raises:
        TrackingError: the store cannot be reached or the experiment cannot be created.
    """
    if not cfg.tracking.tracking_uri:
        cfg.paths.output_dir.mkdir(parents=True, exist_ok=True)
    uri = cfg.tracking_uri
    try:
        client = mlflow.MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(cfg.tracking.experiment_name)
        if exp is not None:
            return str(exp.experiment_id)
        return str(
            client.create_experiment(
                cfg.tracking.experiment_name, artifact_location=cfg.artifact_location
            )
        )
    except Exception as exc:
        raise TrackingError(f"tracking.tracking_uri {uri}: MLflow store unusable: {exc}") from exc


def _pip_requirements() -> list[str]:
    names = ["torch", "torchvision", "pillow", "pandas", "numpy", "mlflow", "pydantic", "pyyaml"]
    names.append("efficientnet-lite-pytorch")
    reqs = []
    for name in names:
        try:
            reqs.append(f"{name}=={metadata.version(name).split('+')[0]}")
        except metadata.PackageNotFoundError:
            reqs.append(name)
    return reqs


class RunTracker:
    """The MLflow run of one training job. Construct on rank 0 only.

    Resuming (``run_id`` given) continues that run and keeps it free of duplicates: params
    already logged are not logged again, and an epoch already logged (``step=epoch`` of
    ``val_loss``) is skipped. The worker logs an epoch only after its checkpoint is on
    disk and, on resume, logs the checkpoint's history first, so a run killed anywhere
    ends up with every completed epoch logged exactly once.
    """

    def __init__(self, cfg: JobConfig, run_id: str | None = None) -> None:
        self.cfg = cfg
        mlflow.set_tracking_uri(cfg.tracking_uri)
        exp = mlflow.set_experiment(cfg.tracking.experiment_name)
        self.resumed = run_id is not None
        self.run = mlflow.start_run(
            run_id=run_id,
            experiment_id=exp.experiment_id,
            run_name=None if run_id else cfg.tracking.run_name,
        )
        self.run_id: str = self.run.info.run_id
        client = mlflow.MlflowClient()
        self._params: dict[str, str] = dict(self.run.data.params)
        self._logged_epochs: set[int] = (
            {m.step for m in client.get_metric_history(self.run_id, EPOCH_KEY)}
            if self.resumed
            else set()
        )

    def log_params(self, params: dict[str, Any]) -> None:
        """Log the params this run does not have yet (a resumed run keeps its first values)."""
        new = {k: ("" if v is None else v) for k, v in params.items() if k not in self._params}
        changed = sorted(
            k for k, v in params.items() if k in self._params and self._params[k] != str(v)
        )
        if changed:
            log.warning("resumed run keeps its first values of %s", ", ".join(changed))
        if new:
            mlflow.log_params(new)
            self._params.update({k: str(v) for k, v in new.items()})

    def log_epoch(self, metrics: dict[str, float], epoch: int) -> bool:
        """Log one epoch's metrics at ``step=epoch`` unless that epoch is logged already.

        Returns:
            True if logged, False if the run already had this epoch.
        """
        if epoch in self._logged_epochs:
            return False
        mlflow.log_metrics(metrics, step=epoch)
        if EPOCH_KEY in metrics:
            self._logged_epochs.add(epoch)
        return True

    def log_model(
        self,
        model: torch.nn.Module,
        model_config: dict[str, Any],
        example: pd.DataFrame,
    ) -> tuple[str, int | None]:
        """Log the pyfunc model and register it.

        Returns:
            ``(model_uri, registered_model_version)``; the version is None when
            ``tracking.registered_model_name`` is None.
        """
        from flowers_job.serving import FlowersClassifierModel

        name = self.cfg.tracking.registered_model_name
        with tempfile.TemporaryDirectory() as tmp:
            weights = Path(tmp) / "state_dict.pt"
            torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, weights)
            probe = FlowersClassifierModel()
            probe.load_context(_Context(model_config, {"state_dict": str(weights)}))
            output = probe.predict(None, example)
            info = mlflow.pyfunc.log_model(
                name="model",
                python_model=str(Path(__file__).with_name("serving_entry.py")),
                artifacts={"state_dict": str(weights)},
                model_config=model_config,
                code_paths=[str(Path(__file__).parent)],
                signature=infer_signature(example, output),
                input_example=example,
                pip_requirements=_pip_requirements(),
                registered_model_name=name,
            )
        mlflow.log_dict({"label_names": model_config["label_names"]}, "label_names.json")
        version = info.registered_model_version
        return info.model_uri, int(version) if version is not None else None

    def finish(self, status: str = "FINISHED") -> None:
        mlflow.end_run(status=status)


def end_failed_run() -> None:
    """Mark this process's active MLflow run FAILED (no-op without one; never raises)."""
    try:
        if mlflow.active_run() is not None:
            mlflow.end_run(status="FAILED")
    except Exception:
        pass


class _Context:
    """Stand-in for MLflow's PythonModelContext, to check the model before logging it."""

    def __init__(self, model_config: dict[str, Any], artifacts: dict[str, str]) -> None:
        self.model_config = model_config
        self.artifacts = artifacts
