"""The test report: scores per class against a hand count, and the figures as real PNGs."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from flowers_job.tracking.class_report import (
    WORST_MISTAKES,
    Mistake,
    build_test_report,
    confusion_figure,
    curves_figure,
    mistakes_figure,
)

pytestmark = pytest.mark.tier("gate")

NAMES = ["a", "b", "c"]


def _mistake(loss: float) -> Mistake:
    image = np.full((3, 8, 8), int(loss * 10) % 255, dtype=np.uint8)
    return Mistake(loss, row_id=int(loss * 100), label=0, predicted=1, probability=0.5, image=image)


def test_scores_match_a_hand_count() -> None:
    labels = np.array([0, 0, 0, 1, 1, 2])
    predicted = np.array([0, 0, 1, 1, 2, 2])
    report = build_test_report(labels, predicted, 3.0, NAMES, 2.0, [])
    assert report.rows == 6 and report.loss == 0.5
    assert report.accuracy == pytest.approx(4 / 6)
    assert report.confusion == [[2, 1, 0], [0, 1, 1], [0, 0, 1]]
    a, b, c = report.per_class
    # a: precision 2/2, recall 2/3; b: 1/2, 1/2; c: 1/2, 1/1
    assert (a["precision"], a["recall"], a["support"]) == (1.0, pytest.approx(2 / 3), 3)
    assert (b["precision"], b["recall"], b["support"]) == (0.5, 0.5, 2)
    assert (c["precision"], c["recall"], c["support"]) == (0.5, 1.0, 1)
    assert a["f1"] == pytest.approx(0.8) and c["f1"] == pytest.approx(2 / 3)
    assert report.macro_f1 == pytest.approx((0.8 + 0.5 + 2 / 3) / 3)
    assert report.images_per_second == 3.0
    assert report.metrics()["test_accuracy"] == report.accuracy


def test_a_label_absent_from_the_test_split_scores_zero_without_warnings() -> None:
    report = build_test_report(np.array([0, 1]), np.array([0, 0]), 1.0, NAMES, 1.0, [])
    assert report.per_class[2] == {
        "label": "c",
        "precision": 0.0,
        "recall": 0.0,
        "f1": 0.0,
        "support": 0,
    }


def test_the_worst_mistakes_are_kept_highest_loss_first() -> None:
    mistakes = [_mistake(float(i)) for i in range(WORST_MISTAKES + 5)]
    report = build_test_report(np.array([0]), np.array([1]), 1.0, NAMES, 1.0, mistakes[::-1])
    assert [m.loss for m in report.worst] == sorted((m.loss for m in mistakes), reverse=True)[
        :WORST_MISTAKES
    ]
    assert "image" not in report.to_dict()["worst"][0]


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="0 labels"):
        build_test_report(np.array([]), np.array([]), 0.0, NAMES, 1.0, [])


def _png_size(fig: object) -> tuple[int, int]:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")  # type: ignore[attr-defined]
    return Image.open(io.BytesIO(buffer.getvalue())).size


def test_figures_render() -> None:
    history = [
        {"epoch": e, "train_loss": 1 / e, "val_loss": 1.2 / e, "train_accuracy": 0.5 + e / 10}
        | {"val_accuracy": 0.4 + e / 10}
        for e in (1, 2, 3)
    ]
    report = build_test_report(
        np.array([0, 1, 2]), np.array([1, 1, 2]), 2.0, NAMES, 1.0, [_mistake(2.0)]
    )
    for fig in (curves_figure(history, 2), confusion_figure(report), mistakes_figure(report)):
        width, height = _png_size(fig)
        assert width > 300 and height > 200
