"""The trained model into the MLflow run and the registry: the pyfunc
(:class:`~flowers_job.serving.pyfunc_model.FlowersClassifierModel`) logged from code with its
weights, config, signature, input example and pinned requirements, then registered. Rank 0
calls it, in the run :class:`~flowers_job.tracking.mlflow_run.RunTracker` owns.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
import torch
from mlflow.models import infer_signature
from packaging.version import Version

from flowers_job.serving.pyfunc_model import FlowersClassifierModel
from flowers_job.vision.pillow_floor import PILLOW_FLOOR

__all__ = ["log_pyfunc_model", "pip_requirements"]

_PACKAGE_DIR = Path(__file__).resolve().parent.parent
"""The ``flowers_job`` package directory: the logged model's ``code_paths``."""


def log_pyfunc_model(
    model: torch.nn.Module,
    model_config: dict[str, Any],
    example: pd.DataFrame,
    registered_model_name: str | None,
) -> tuple[str, int | None]:
    """Log ``model`` into the active MLflow run as a pyfunc
    (:class:`~flowers_job.serving.pyfunc_model.FlowersClassifierModel`, "models from code":
    :mod:`flowers_job.serving.model_code`, with the package as its code) with its signature
    and input example (``example``: a DataFrame with an ``image`` column of file bytes, the
    model checked on it first), and register it as ``registered_model_name``.

    Returns:
        ``(model_uri, registered_model_version)``; the version is None when
        ``registered_model_name`` is None.

    Raises:
        Exception: MLflow's errors (the store, the registry), and the model's own on
            ``example``.
    """
    name = registered_model_name
    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "state_dict.pt"
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, weights)
        probe = FlowersClassifierModel()
        probe.load_context(_Context(model_config, {"state_dict": str(weights)}))
        output = probe.predict(None, example)
        info = mlflow.pyfunc.log_model(
            name="model",
            python_model=str(_PACKAGE_DIR / "serving" / "model_code.py"),
            artifacts={"state_dict": str(weights)},
            model_config=model_config,
            code_paths=[str(_PACKAGE_DIR)],
            signature=infer_signature(example, output),
            input_example=example,
            pip_requirements=pip_requirements(),
            registered_model_name=name,
        )
    mlflow.log_dict({"label_names": model_config["label_names"]}, "label_names.json")
    version = info.registered_model_version
    return info.model_uri, int(version) if version is not None else None


def pip_requirements(version: Callable[[str], str] = metadata.version) -> list[str]:
    """The served model's requirements, pinned to this environment's versions without their
    local tags (``torch==2.13.0``, not ``+cu130``): on Linux, PyPI's wheels of those versions
    are the CUDA builds, so a GPU serving endpoint gets a CUDA torch (docs/using-the-model.md,
    "On a GPU"). Pillow is pinned only at or above
    :data:`~flowers_job.vision.pillow_floor.PILLOW_FLOOR`: an older one here (a runtime's own,
    where the job was started without the CLI's check) is written ``pillow>=<floor>``, so that
    a served model never installs a Pillow with CVE-2026-25990.

    Args:
        version: a distribution's installed version by name, raising
            ``importlib.metadata.PackageNotFoundError`` when it is not installed (default:
            ``importlib.metadata.version``).

    Returns:
        Requirement strings, e.g. ``["torch==2.7.0", ..., "pillow==12.3.0", ...]``.
    """
    names = ["torch", "torchvision", "pillow", "pandas", "numpy", "mlflow", "pydantic", "pyyaml"]
    names.append("efficientnet-lite-pytorch")
    reqs = []
    for name in names:
        try:
            installed = version(name).split("+")[0]
            if name == "pillow" and Version(installed) < Version(PILLOW_FLOOR):
                reqs.append(f"pillow>={PILLOW_FLOOR}")
                continue
            reqs.append(f"{name}=={installed}")
        except metadata.PackageNotFoundError:
            if name == "mlflow":  # Databricks runtimes ship mlflow-skinny only
                try:
                    reqs.append(f"mlflow-skinny=={version('mlflow-skinny')}")
                    continue
                except metadata.PackageNotFoundError:
                    pass
            reqs.append(name)
    return reqs


class _Context:
    """Stand-in for MLflow's PythonModelContext, to check the model before logging it."""

    def __init__(self, model_config: dict[str, Any], artifacts: dict[str, str]) -> None:
        self.model_config = model_config
        self.artifacts = artifacts
