"""The day model's fit (benchmarks/day_model.py): it recovers a known linear cost, weighs
points by their relative error, and refuses what it cannot fit or compare."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.tier("gate")

ROOT_DIR = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("day_model", ROOT_DIR / "benchmarks" / "day_model.py")
assert spec is not None and spec.loader is not None
day_model = importlib.util.module_from_spec(spec)
sys.modules["day_model"] = day_model
spec.loader.exec_module(day_model)


def test_fit_recovers_a_known_cost_and_reports_residuals() -> None:
    rows: list[dict[str, Any]] = [
        {"label": f"{n} {k}", "files": n, "changed": k, "seconds": 20 + 0.001 * n + 0.01 * k}
        for n in (3_670, 36_700, 110_100, 367_000)
        for k in (0, n // 100, n)
    ]
    fit = day_model.fit_relative(
        "ingest", "a + b n + c k", ["1", "files", "changed"], rows, "seconds"
    )
    assert fit.coefficients == pytest.approx([20, 0.001, 0.01], rel=1e-6)
    assert fit.max_relative_residual < 1e-6
    assert fit.predict({"files": 10_000_000, "changed": 110_000}) == pytest.approx(11_120, rel=1e-6)

    rows[0]["seconds"] *= 1.5  # one slow point shows as its own residual, not hidden in a mean
    worst = max(
        day_model.fit_relative("i", "", ["1", "files", "changed"], rows, "seconds").points,
        key=lambda p: abs(p["relative_residual"]),
    )
    assert worst["label"] == rows[0]["label"] and worst["relative_residual"] > 0.1


def test_fit_refuses_too_few_points_and_empty_seconds() -> None:
    with pytest.raises(ValueError, match="2 points for 3 terms"):
        day_model.fit_relative("s", "", ["1", "x", "y"], [{"x": 1, "y": 1, "s": 1}] * 2, "s")
    with pytest.raises(ValueError, match="observed s <= 0"):
        day_model.fit_relative("s", "", ["1"], [{"s": 0}], "s")


def test_runs_of_several_sessions_are_not_mixed(tmp_path: Path) -> None:
    for factor, date in ((1, "2026-11-27T10:00:00+00:00"), (10, "2026-11-28T10:00:00+00:00")):
        run = {
            "factor": factor,
            "fraction": 1.0,
            "store": {"kind": "disk"},
            "machine": {"date": date},
        }
        (tmp_path / f"scale_x{factor}.json").write_text(json.dumps(run))
    with pytest.raises(ValueError, match="several days"):
        day_model.load_runs(tmp_path)
    with pytest.raises(ValueError, match="no scale_x"):
        day_model.load_runs(tmp_path / "empty")
