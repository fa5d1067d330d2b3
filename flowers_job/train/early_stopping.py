"""Early stopping on a validation metric.

Semantics follow Keras ``EarlyStopping`` (``min_delta``, ``patience``,
``restore_best_weights``), which the Databricks guides use, plus Lightning's
``stopping_threshold`` and ``check_finite``. The object is pure Python: rank 0 owns the
decision and broadcasts it (see :mod:`flowers_job.train.loop`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["Decision", "EarlyStopping"]


@dataclass(frozen=True)
class Decision:
    """Outcome of one epoch: is it the new best, and should training stop (and why)."""

    improved: bool
    stop: bool
    reason: str | None = None


@dataclass
class EarlyStopping:
    """Track the best value of a metric and decide when to stop.

    Args:
        mode: 'min' (loss) or 'max' (accuracy).
        min_delta: an epoch improves only if it beats the best by more than this.
        patience: epochs without improvement before stopping (Keras: stop when
            ``wait >= patience``).
        stopping_threshold: stop once the metric is at least this good.
    """

    mode: Literal["min", "max"] = "min"
    min_delta: float = 0.0
    patience: int = 2
    stopping_threshold: float | None = None
    best: float | None = None
    best_epoch: int = 0
    wait: int = 0

    def _better(self, value: float, reference: float, delta: float) -> bool:
        return value < reference - delta if self.mode == "min" else value > reference + delta

    def step(self, value: float, epoch: int) -> Decision:
        """Record the metric of ``epoch`` and decide.

        Returns:
            A :class:`Decision`; ``reason`` is 'non_finite_metric', 'stopping_threshold' or
            'early_stopping' when ``stop`` is True.
        """
        if not math.isfinite(value):
            return Decision(improved=False, stop=True, reason="non_finite_metric")
        improved = self.best is None or self._better(value, self.best, self.min_delta)
        if improved:
            self.best, self.best_epoch, self.wait = value, epoch, 0
        else:
            self.wait += 1
        if self.stopping_threshold is not None and not self._better(
            self.stopping_threshold, value, 0.0
        ):
            return Decision(improved, stop=True, reason="stopping_threshold")
        if not improved and self.wait >= self.patience:
            return Decision(improved, stop=True, reason="early_stopping")
        return Decision(improved, stop=False)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)
