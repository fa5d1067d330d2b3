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


def test_a_label_absent_from_the_test_split_is_reported_absent_without_warnings() -> None:
    report = build_test_report(np.array([0, 1]), np.array([0, 0]), 1.0, NAMES, 1.0, [])
    assert report.per_class[2] == {
        "label": "c",
        "precision": None,
        "recall": None,
        "f1": None,
        "support": 0,
    }
    assert report.per_class[1]["f1"] == 0.0  # present and never found: a real 0


def test_perfect_predictions_score_a_macro_f1_of_one_when_a_label_is_absent() -> None:
    """Three labels, the test split holds two: the absent one is not averaged in (it made
    perfect predictions score 2/3)."""
    labels = np.array([0, 0, 1, 1, 1])
    report = build_test_report(labels, labels.copy(), 1.0, NAMES, 1.0, [])
    assert report.macro_f1 == 1.0


def test_macro_f1_is_scikit_learns_over_the_labels_in_the_test_split() -> None:
    """As ``f1_score(average="macro", labels=<labels present in y_true>)``: a prediction of
    the absent label still costs the precision of none and the recall of the true one."""
    from sklearn.metrics import f1_score

    labels = np.array([0, 0, 0, 1, 1, 1])
    predicted = np.array([0, 2, 0, 1, 1, 0])
    report = build_test_report(labels, predicted, 1.0, NAMES, 1.0, [])
    expected = f1_score(labels, predicted, average="macro", labels=[0, 1])
    assert report.macro_f1 == pytest.approx(expected)
    # by hand: a: precision 2/3, recall 2/3, F1 2/3; b: precision 1, recall 2/3, F1 0.8
    assert report.macro_f1 == pytest.approx((2 / 3 + 0.8) / 2)
    assert report.confusion[0] == [2, 0, 1]  # the wrong "c" shows in the confusion matrix


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


def test_labels_are_drawn_as_plain_text() -> None:
    """Folder names that matplotlib would parse as mathtext: ``$\\notacommand$`` made
    ``savefig`` raise, ``a_b^c`` and ``$x$`` would be drawn as formulas."""
    names = ["$\\notacommand$", "a_b^c", "50%", "$x$"]
    mistake = Mistake(
        2.0,
        row_id=1,
        label=0,
        predicted=3,
        probability=0.5,
        image=np.zeros((3, 8, 8), dtype=np.uint8),
    )
    report = build_test_report(
        np.array([0, 1, 2, 3]), np.array([3, 1, 2, 3]), 2.0, names, 1.0, [mistake]
    )
    confusion, mistakes = confusion_figure(report), mistakes_figure(report)
    for fig in (confusion, mistakes):
        fig.savefig(io.BytesIO(), format="png")
    ax = confusion.axes[0]
    for ticks in (ax.get_xticklabels(), ax.get_yticklabels()):
        assert [t.get_text() for t in ticks] == names
        assert not any(t.get_parse_math() or t.get_usetex() for t in ticks)
    title = mistakes.axes[0].title
    assert title.get_text().startswith("true $\\notacommand$\npredicted $x$")
    assert not title.get_parse_math()
