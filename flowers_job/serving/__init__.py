"""The model after training: the pyfunc model and its entry, model references, the scorer, the
pandas UDF and batch predict. Runs in the served model, in Spark tasks and on the driver;
imports neither training nor ingest."""

from __future__ import annotations

from typing import Any

__all__ = ["FlowersClassifierModel"]


def __getattr__(name: str) -> Any:
    """``flowers_job.serving.FlowersClassifierModel``, imported on first use: the name that the
    entry file of every model registered before the package's re-layout by process imports
    (``from flowers_job.serving import FlowersClassifierModel``), so that such a model still
    loads in a process where this version of the package is imported first (promotion's
    rescoring of an older champion, ``flowers-job predict`` with an older version).

    Raises:
        AttributeError: any other name.
    """
    if name == "FlowersClassifierModel":
        from flowers_job.serving.pyfunc_model import FlowersClassifierModel

        return FlowersClassifierModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
