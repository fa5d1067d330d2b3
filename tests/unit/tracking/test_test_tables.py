"""The test tables a run logs (``test/per_class.json``, ``test/confusion_matrix.json``) are
strict JSON (RFC 8259): a class absent from the test split has ``null`` scores, never
``NaN``, so that any JSON parser reads them. A real local MLflow store (sqlite, artifacts
under ``tmp_path``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pytest

from flowers_job.config import JobConfig, load_config
from flowers_job.tracking.class_report import TestReport, build_test_report
from flowers_job.tracking.mlflow_run import RunTracker, preflight

pytestmark = pytest.mark.tier("gate")

NAMES = ["a", "b", "c"]


def _strict_loads(text: str) -> Any:
    """``json.loads`` that refuses ``NaN``, ``Infinity`` and ``-Infinity`` (Python's parser
    accepts them by default; RFC 8259 has no such numbers)."""

    def refuse(word: str) -> Any:
        raise ValueError(f"not strict JSON: {word}")

    return json.loads(text, parse_constant=refuse)


def _logged_tables(tmp_path: Path, report: TestReport) -> dict[str, Any]:
    """Log ``report`` through :meth:`RunTracker.log_test` into a fresh local store; the two
    tables as downloaded from the run, parsed strictly."""
    cfg: JobConfig = load_config(
        None, ["tracking.experiment_name=test-tables"], **{"paths.output_dir": tmp_path / "out"}
    )
    preflight(cfg)
    tracker = RunTracker(cfg)
    try:
        tracker.log_test(report, {})
    finally:
        mlflow.end_run()
    client = mlflow.MlflowClient(cfg.tracking_uri)
    return {
        name: _strict_loads(
            Path(client.download_artifacts(tracker.run_id, f"test/{name}.json")).read_text()
        )
        for name in ("per_class", "confusion_matrix")
    }


def test_strict_loads_refuses_nan() -> None:
    """The strict parser of these tests fails on what pandas' tables wrote before."""
    with pytest.raises(ValueError, match="NaN"):
        _strict_loads('{"data": [[NaN]]}')


def test_an_absent_class_is_logged_with_null_scores(tmp_path: Path) -> None:
    """Class ``c`` has no test photo: support 0 and null scores; the others keep theirs."""
    labels = np.array([0, 0, 1, 1])
    predicted = np.array([0, 1, 1, 2])  # c is predicted once, never true
    report = build_test_report(labels, predicted, 2.0, NAMES, 1.0, [])
    tables = _logged_tables(tmp_path, report)
    per_class = tables["per_class"]
    assert per_class["columns"] == ["label", "precision", "recall", "f1", "support"]
    a, b, c = per_class["data"]
    assert c == ["c", None, None, None, 0]
    assert a == ["a", 1.0, 0.5, pytest.approx(2 / 3), 2]
    assert b[0] == "b" and b[4] == 2 and all(isinstance(v, float) for v in b[1:4])
    confusion = tables["confusion_matrix"]
    assert confusion["columns"] == ["true_label", *NAMES]
    assert confusion["data"] == [["a", 1, 1, 0], ["b", 0, 1, 1], ["c", 0, 0, 0]]


def test_a_score_that_is_not_a_number_is_logged_as_null(tmp_path: Path) -> None:
    """Whatever the report holds, the logged table stays strict: NaN and infinity (which
    ``json.dumps`` would write as bare words) become null; NumPy numbers become JSON's."""
    report = TestReport(
        rows=2,
        loss=0.5,
        accuracy=0.5,
        macro_f1=0.5,
        per_class=[
            {
                "label": "a",
                "precision": float("nan"),
                "recall": np.float64(1.0),
                "f1": 0.5,
                "support": np.int64(2),
            },
            {"label": "b", "precision": float("inf"), "recall": None, "f1": None, "support": 0},
        ],
        confusion=[[1, 1], [0, 0]],
        label_names=["a", "b"],
        images_per_second=1.0,
    )
    per_class = _logged_tables(tmp_path, report)["per_class"]
    assert per_class["data"] == [["a", None, 1.0, 0.5, 2], ["b", None, None, None, 0]]
