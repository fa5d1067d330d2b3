"""The test report of a run: scores per class, and the figures a reviewer reads in MLflow.

Pure functions of plain data (no torch, no Spark, no MLflow): rank 0 builds them after the
last collective, and :class:`~flowers_job.tracking.mlflow_run.RunTracker` logs them. Scores come from
scikit-learn (``confusion_matrix``, ``precision_recall_fscore_support``); figures are
matplotlib's, drawn with the non-interactive Agg backend.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "WORST_MISTAKES",
    "Mistake",
    "TestReport",
    "build_test_report",
    "confusion_figure",
    "curves_figure",
    "mistakes_figure",
    "report_figures",
]

WORST_MISTAKES = 16
"""Test mistakes shown in the grid: those with the highest loss (least probability on the
true label)."""


@dataclass
class Mistake:
    """One misclassified test image.

    Attributes:
        loss: cross-entropy of the image (nats).
        row_id: its ``row_id`` in the test table.
        label / predicted: label indices.
        probability: the model's probability of ``predicted`` (0-1).
        image: the image as the model saw it, uint8 ``[3, S, S]`` (before normalisation).
    """

    loss: float
    row_id: int
    label: int
    predicted: int
    probability: float
    image: np.ndarray = field(repr=False)


@dataclass
class TestReport:
    """Scores of one model on the test split, over every rank's shard.

    Attributes:
        rows: test images scored.
        loss: mean cross-entropy (nats; with ``train.label_smoothing`` as in training).
        accuracy: fraction of images whose most probable label is the true one.
        macro_f1: unweighted mean of the F1 scores of the labels present in the test
            split (those with ``support > 0``), as scikit-learn's ``f1_score(y_true,
            y_pred, average="macro", labels=<labels in y_true>)``; a label absent from the
            test split (a class too small to reach it) has no F1 and is not averaged in.
        per_class: one dict per label (``label``, ``precision``, ``recall``, ``f1``,
            ``support``), in label-index order; a label absent from the test split has
            ``support`` 0 and ``None`` scores (absent, not 0).
        confusion: ``[num_labels, num_labels]`` counts; row = true label, column = predicted.
        label_names: the labels, by index.
        images_per_second: test images / seconds of the test pass (all ranks together).
        worst: up to :data:`WORST_MISTAKES` mistakes, highest loss first.
    """

    __test__ = False  # a report, not a pytest test class

    rows: int
    loss: float
    accuracy: float
    macro_f1: float
    per_class: list[dict[str, Any]]
    confusion: list[list[int]]
    label_names: list[str]
    images_per_second: float
    worst: list[Mistake] = field(default_factory=list, repr=False)

    def metrics(self) -> dict[str, float]:
        """The MLflow metrics: ``test_accuracy``, ``test_loss``, ``test_macro_f1``,
        ``test_images_per_second``."""
        return {
            "test_accuracy": self.accuracy,
            "test_loss": self.loss,
            "test_macro_f1": self.macro_f1,
            "test_images_per_second": self.images_per_second,
        }

    def to_dict(self) -> dict[str, Any]:
        """Everything but the mistakes' pixels (for ``summary.json``)."""
        out = asdict(self)
        out["worst"] = [{k: v for k, v in asdict(m).items() if k != "image"} for m in self.worst]
        return out


def build_test_report(
    labels: np.ndarray,
    predicted: np.ndarray,
    loss_sum: float,
    label_names: list[str],
    seconds: float,
    mistakes: list[Mistake],
) -> TestReport:
    """Score the test split from every row's true and predicted label.

    Args:
        labels / predicted: int64 ``[N]`` label indices of every test row (all ranks).
        loss_sum: summed cross-entropy over the ``N`` rows (nats).
        seconds: wall time of the test pass.
        mistakes: candidates for the grid (any order; the worst are kept).

    Raises:
        ValueError: no rows, or ``labels`` and ``predicted`` of different lengths.
    """
    from sklearn.metrics import confusion_matrix, precision_recall_fscore_support

    if len(labels) == 0 or len(labels) != len(predicted):
        raise ValueError(
            f"build_test_report: {len(labels)} labels and {len(predicted)} predictions"
        )
    index = list(range(len(label_names)))
    cm = confusion_matrix(labels, predicted, labels=index)
    precision, recall, f1, support = precision_recall_fscore_support(
        labels, predicted, labels=index, zero_division=0
    )
    present = [i for i in index if support[i] > 0]
    per_class = [
        {
            "label": name,
            "precision": float(precision[i]) if support[i] else None,
            "recall": float(recall[i]) if support[i] else None,
            "f1": float(f1[i]) if support[i] else None,
            "support": int(support[i]),
        }
        for i, name in enumerate(label_names)
    ]
    n = len(labels)
    return TestReport(
        rows=n,
        loss=loss_sum / n,
        accuracy=float(np.mean(labels == predicted)),
        macro_f1=float(np.mean(f1[present])),
        per_class=per_class,
        confusion=cm.astype(int).tolist(),
        label_names=list(label_names),
        images_per_second=n / seconds if seconds > 0 else 0.0,
        worst=sorted(mistakes, key=lambda m: -m.loss)[:WORST_MISTAKES],
    )


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display; figures are only saved
    import matplotlib.pyplot as plt

    return plt


def _plain_text(fig: Any) -> Any:
    """``fig`` with every text drawn as written: no mathtext, no TeX. Labels are the photo
    folders' names, and matplotlib parses a text with an even number of unescaped ``$`` as
    mathtext (``text.parse_math``): a folder ``$\\notacommand$`` made ``savefig`` raise
    after training, before the model was registered, and ``a_$b$`` would be drawn as a
    formula. ``Text.set_parse_math(False)`` (matplotlib >= 3.5) turns that off per text; the
    tick labels are made first (:meth:`~matplotlib.axes.Axes.get_xticklabels`) so that
    drawing reuses them. Returns ``fig``."""
    from matplotlib.text import Text

    for ax in fig.axes:
        ax.get_xticklabels(which="both")
        ax.get_yticklabels(which="both")
    for text in fig.findobj(Text):
        text.set_parse_math(False)
        text.set_usetex(False)
    return fig


def curves_figure(history: list[dict[str, float]], best_epoch: int | None) -> Any:
    """Loss and accuracy over epochs (train and val), the best epoch marked.

    Args:
        history: one dict per epoch with ``epoch``, ``train_loss``, ``val_loss``,
            ``train_accuracy``, ``val_accuracy``.

    Returns:
        A matplotlib ``Figure`` (two panels).
    """
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    epochs = [h["epoch"] for h in history]
    for ax, key, title in ((ax_loss, "loss", "Loss"), (ax_acc, "accuracy", "Accuracy")):
        for split, style in (("train", "o-"), ("val", "s-")):
            ax.plot(epochs, [h[f"{split}_{key}"] for h in history], style, label=split)
        if best_epoch is not None:
            ax.axvline(best_epoch, color="grey", linestyle="--", label=f"best epoch {best_epoch}")
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    return _plain_text(fig)


def confusion_figure(report: TestReport) -> Any:
    """The test confusion matrix (rows: true label, columns: predicted), counts annotated;
    labels drawn as plain text (:func:`_plain_text`)."""
    plt = _pyplot()
    from sklearn.metrics import ConfusionMatrixDisplay

    k = len(report.label_names)
    fig, ax = plt.subplots(figsize=(1.2 * k + 2, 1.2 * k + 1.5), constrained_layout=True)
    ConfusionMatrixDisplay(np.asarray(report.confusion), display_labels=report.label_names).plot(
        ax=ax, cmap="Blues", colorbar=False, xticks_rotation=45
    )
    ax.set_title(f"Test confusion matrix ({report.rows} images, accuracy {report.accuracy:.3f})")
    return _plain_text(fig)


def mistakes_figure(report: TestReport) -> Any:
    """A grid of the worst test mistakes, each titled with its true and predicted label and
    the predicted probability (labels drawn as plain text: :func:`_plain_text`)."""
    plt = _pyplot()
    worst = report.worst
    cols = 4
    rows = max(1, -(-len(worst) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 3.3 * rows), squeeze=False)
    names = report.label_names
    for ax in axes.flat:
        ax.axis("off")
    for ax, m in zip(axes.flat, worst, strict=False):
        ax.imshow(np.transpose(m.image, (1, 2, 0)))
        ax.set_title(
            f"true {names[m.label]}\npredicted {names[m.predicted]} ({m.probability:.2f})",
            fontsize=9,
        )
    fig.suptitle(f"Worst test mistakes ({len(worst)} of {report.rows} images)")
    _plain_text(fig)  # before tight_layout, which measures the texts
    fig.tight_layout(rect=(0, 0, 1, 0.97))  # leave the top strip to the title
    return fig


def report_figures(
    report: TestReport, history: list[dict[str, float]], best_epoch: int | None
) -> dict[str, Any]:
    """The run's three figures by name: ``curves`` (:func:`curves_figure`),
    ``confusion_matrix`` (:func:`confusion_figure`), ``worst_mistakes``
    (:func:`mistakes_figure`)."""
    return {
        "curves": curves_figure(history, best_epoch),
        "confusion_matrix": confusion_figure(report),
        "worst_mistakes": mistakes_figure(report),
    }
