"""Petastorm's and legacy pyarrow's noise silenced: its per-reader INFO lines, the
deprecations its own code triggers, and torch's warning on Arrow's read-only arrays."""

from __future__ import annotations

import logging
import warnings

__all__ = ["quiet_petastorm"]


def quiet_petastorm() -> None:
    """Silence Petastorm's per-reader INFO lines, the deprecations its own code triggers
    (pyarrow's legacy file systems, distutils' ``LooseVersion``), and the warning torch gives
    when ``BatchedDataLoader`` wraps Arrow's read-only arrays (the batches are never written
    to: normalisation makes a new tensor)."""
    for name in ("petastorm", "petastorm.etl.dataset_metadata", "petastorm.reader"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"petastorm(\..*)?")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"pyarrow(\..*)?")
    warnings.filterwarnings(
        "ignore", message="The given NumPy array is not writable", category=UserWarning
    )
