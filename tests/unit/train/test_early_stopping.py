"""Early stopping: Keras semantics (min_delta, patience) plus stopping_threshold and non-finite."""

from __future__ import annotations

import math

import pytest

from flowers_job.train.early_stopping import EarlyStopping

pytestmark = pytest.mark.tier("gate")


def _run(stopper: EarlyStopping, values: list[float]) -> tuple[int, str | None]:
    for epoch, v in enumerate(values, start=1):
        d = stopper.step(v, epoch)
        if d.stop:
            return epoch, d.reason
    return len(values), None


def test_patience_counts_epochs_without_improvement_beyond_min_delta() -> None:
    s = EarlyStopping("min", min_delta=0.01, patience=2)
    # 0.995 is better than 1.0 but not by more than min_delta: no improvement.
    assert _run(s, [1.0, 0.995, 0.999, 0.5]) == (3, "early_stopping")
    assert (s.best, s.best_epoch) == (1.0, 1)


def test_improvement_resets_patience() -> None:
    s = EarlyStopping("min", min_delta=0.0, patience=2)
    assert _run(s, [1.0, 1.1, 0.9, 1.0, 0.8, 0.85, 0.86]) == (7, "early_stopping")
    assert (s.best, s.best_epoch) == (0.8, 5)


def test_max_mode_and_stopping_threshold() -> None:
    s = EarlyStopping("max", min_delta=0.0, patience=5, stopping_threshold=0.9)
    assert _run(s, [0.5, 0.8, 0.91, 0.95]) == (3, "stopping_threshold")
    s = EarlyStopping("min", patience=5, stopping_threshold=0.2)
    assert _run(s, [0.5, 0.3, 0.2]) == (3, "stopping_threshold")


def test_non_finite_metric_stops_without_becoming_best() -> None:
    s = EarlyStopping("min", patience=3)
    assert _run(s, [1.0, math.nan]) == (2, "non_finite_metric")
    assert s.best == 1.0


def test_state_round_trip_resumes_the_same_decision() -> None:
    a = EarlyStopping("min", min_delta=0.0, patience=2)
    _run(a, [1.0, 1.2])
    b = EarlyStopping("min")
    b.load_state_dict(a.state_dict())
    assert b.step(1.3, 3).stop and (b.best, b.best_epoch, b.wait) == (1.0, 1, 2)
