"""A registered flowers model in seconds, without training: for the serving and predict tests
and the serving benchmark.

The model is the job's own: EfficientNet-Lite0 with its offline ImageNet weights and a new,
untrained head (seeded, so the same every time), logged and registered by the job's own
:meth:`flowers_job.tracking.RunTracker.log_model` with the ``model_config`` the worker builds,
into a sqlite store under ``output_dir``. Its probabilities are not meaningful; its decode,
transform and model path are exactly a trained model's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
import torch

from flowers_job.config import JobConfig, load_config
from flowers_job.models import build_model, preprocessing_for
from flowers_job.tracking import RunTracker, preflight

LABELS = ["daisy", "dandelion", "roses", "sunflowers", "tulips"]


def model_config(cfg: JobConfig, labels: list[str]) -> dict[str, Any]:
    """The pyfunc's ``model_config`` as ``train/worker.py`` builds it for ``cfg``."""
    pre = preprocessing_for(cfg.model.architecture)
    return {
        "architecture": cfg.model.architecture,
        "label_names": labels,
        "image_size": cfg.data.image_size,
        "resize_size": cfg.data.stored_short_side,
        "mean": list(pre.mean),
        "std": list(pre.std),
        "dropout": cfg.model.dropout,
        "max_pixels": cfg.data.max_image_pixels,
        "batch_size": 64,
    }


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
        model_uri, version = tracker.log_model(
            model, model_config(cfg, names), pd.DataFrame({"image": examples})
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
