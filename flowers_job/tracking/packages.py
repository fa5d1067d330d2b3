"""What the end of a training run imports, checked before training starts.

Rank 0 scores the test split and draws the report's figures after the last epoch
(:mod:`flowers_job.tracking.class_report`, :meth:`flowers_job.tracking.mlflow_run.RunTracker.log_test`): scikit-learn
and matplotlib are imported there, lazily, and nowhere before. A missing or broken one would
surface only after every epoch had run, as rank 0's failure (``ModuleNotFoundError: No module
named 'sklearn'``). Both are requirements of the wheel; this catches the environments that
lack them all the same (a wheel installed with ``--no-deps``, a cluster library that skipped
its requirements, a broken install).

No Spark and no torch here: it runs on the driver in about 2 s (the imports themselves).
"""

from __future__ import annotations

import importlib
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from flowers_job.config import ConfigError

__all__ = ["RUN_PACKAGES", "check_run_packages"]

RUN_PACKAGES: tuple[tuple[str, str, str], ...] = (
    ("scikit-learn", "sklearn.metrics", "the test report's scores"),
    ("matplotlib", "matplotlib.pyplot", "the test report's figures"),
    ("matplotlib", "matplotlib.ticker", "the test report's figures"),
)
"""``(distribution, module, what needs it)`` for each module that only the end of a run
imports: the modules :mod:`flowers_job.tracking.class_report` and ``RunTracker.log_test`` import."""


def _requirement(dist: str) -> str:
    """``dist`` with the installed flowers-job's own requirement on it (``'scikit-learn>=1.6.1'``),
    or the bare name when flowers-job is not installed (a source checkout on ``sys.path``)."""
    try:
        requires = metadata.requires("flowers-job") or []
    except metadata.PackageNotFoundError:
        return dist
    for line in requires:
        req = Requirement(line)
        if canonicalize_name(req.name) == canonicalize_name(dist) and req.marker is None:
            return f"{dist}{req.specifier}"
    return dist


def check_run_packages() -> None:
    """Import every module of :data:`RUN_PACKAGES`, so that a package the end of the run
    needs stops the job before training starts, not after its last epoch.

    A real import, not a look-up: a package that is installed but cannot be imported (a
    broken install, a compiled extension built for another NumPy) fails here as it would at
    the end of the run. The same practice as :meth:`flowers_job.loaders.base.Loader.problem`.

    Raises:
        ConfigError: a module cannot be imported; one line per distribution, naming it, what
            needs it, the import's error and the pip command that installs it, e.g.
            ``scikit-learn (the test report's scores): `import sklearn.metrics` fails:
            ModuleNotFoundError: No module named 'sklearn'; install it: pip install
            'scikit-learn>=1.6.1'``.
    """
    problems: dict[str, str] = {}
    for dist, module, need in RUN_PACKAGES:
        if dist in problems:
            continue
        try:
            importlib.import_module(module)
        except Exception as exc:  # ImportError, or whatever a broken install raises
            problems[dist] = (
                f"{dist} ({need}): `import {module}` fails: {type(exc).__name__}: {exc}; "
                f"install it: pip install '{_requirement(dist)}'"
            )
    if problems:
        lines = "\n".join(f"  {text}" for text in problems.values())
        raise ConfigError(
            "packages that the end of the run needs cannot be imported "
            f"(nothing has started):\n{lines}"
        )
