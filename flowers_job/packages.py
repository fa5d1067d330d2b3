"""Placeholder until the packaging branch lands: the packages the end of a run needs."""

from __future__ import annotations

import importlib

from flowers_job.config import ConfigError

__all__ = ["check_run_packages"]


def check_run_packages() -> None:
    """Raise ConfigError when scikit-learn or matplotlib cannot be imported."""
    for module, dist in (("sklearn", "scikit-learn"), ("matplotlib", "matplotlib")):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"{dist} is missing: {exc}") from None
