"""The job's one extension point for tests: named hook points that an opt-in injector acts on.

``FLOWERS_JOB_HOOKS`` (:data:`HOOKS_ENV`) names the injector: an absolute path to a ``.py``
file, or an importable module name. Production code calls a hook point by name
(:func:`hook`, :func:`wrap_batches`); the injector does whatever it likes there (raise,
sleep, kill its process) by defining a function of that name. Without the variable every
hook point is a no-op that costs one environment lookup. Never set it in production.

=========================== ============================================================
hook point (context)        where it is called
=========================== ============================================================
``rank_start``              a training rank, before its watchdog starts
(``rank``, ``attempt``)     (:mod:`flowers_job.train.rank`)
``mid_epoch``               wraps a rank's training batches of an epoch; ``step`` is the
(``rank``, ``epoch``,       epoch's middle, counted from where it (re)starts
``step``)                   (:func:`wrap_batches`, :mod:`flowers_job.train.loop`)
``checkpoint_write``        the epoch checkpoint serialized, not yet synced and renamed
(``epoch``)                 over ``last.pt`` (nor uploaded to an object store)
``before_registration``     rank 0, before it logs the final metrics and registers the
(``rank``)                  model, after the last collective
``before_log_model``        rank 0, after the final metrics, the test report and the
(``rank``)                  lineage are logged, before the model is logged and registered
``ingest_table_written``    ingest (driver), right after it wrote or merged ``table``
(``table``)                 (``"quarantine"``, then ``"images"``)
=========================== ============================================================

The tests' injector, with the fault settings it reads, is ``tests/support/faults.py``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar, cast

from flowers_job.errors import ConfigError

__all__ = ["HOOKS_ENV", "HOOK_POINTS", "HooksError", "hook", "injector", "wrap_batches"]

T = TypeVar("T")

HOOKS_ENV = "FLOWERS_JOB_HOOKS"
"""Names the injector: an absolute path to a ``.py`` file or an importable module name."""
HOOK_POINTS = frozenset(
    {
        "rank_start",
        "mid_epoch",
        "checkpoint_write",
        "before_registration",
        "before_log_model",
        "ingest_table_written",
    }
)
"""Every hook point that production code calls (the table above)."""

_loaded: dict[str, ModuleType] = {}
"""The injector of this process, by the ``FLOWERS_JOB_HOOKS`` value it was loaded from (one
entry at most)."""


class HooksError(ConfigError):
    """``FLOWERS_JOB_HOOKS`` names no injector that can be loaded: a setting that cannot
    work (exit 2, as every :class:`~flowers_job.errors.ConfigError`)."""


def injector() -> ModuleType | None:
    """The injector that ``FLOWERS_JOB_HOOKS`` names, loaded once per process and value
    (loaded again when the variable changes); None when the variable is unset or empty.

    Raises:
        HooksError: the value is neither an absolute path to an existing ``.py`` file nor
            an importable module name, or loading it failed (the message names the variable
            and its value; the loader's error is the cause).
    """
    value = os.environ.get(HOOKS_ENV)
    if not value:
        return None
    module = _loaded.get(value)
    if module is None:
        module = _load(value)
        _loaded.clear()
        _loaded[value] = module
    return module


def hook(point: str, **context: Any) -> None:
    """Call ``<injector>.<point>(**context)`` if ``FLOWERS_JOB_HOOKS`` names an injector
    that defines a function ``point``; nothing otherwise.

    Raises:
        HooksError: as :func:`injector`.
        ValueError: ``point`` is no hook point (:data:`HOOK_POINTS`; checked only with an
            injector).
        Exception: whatever the injector's function raises (that is what it is for).
    """
    module = injector()
    if module is None:
        return
    function = _function(module, point)
    if function is not None:
        function(**context)


def wrap_batches(batches: Iterable[T], *, rank: int, epoch: int, step: int) -> Iterable[T]:
    """``<injector>.mid_epoch(batches, rank=rank, epoch=epoch, step=step)`` if
    ``FLOWERS_JOB_HOOKS`` names an injector that defines ``mid_epoch``; ``batches`` itself
    otherwise. ``step`` is the batch (counted from this iterable's first) at which an
    injector acts.

    Raises:
        HooksError: as :func:`injector`.
    """
    module = injector()
    function = None if module is None else _function(module, "mid_epoch")
    if function is None:
        return batches
    return cast(Iterable[T], function(batches, rank=rank, epoch=epoch, step=step))


def _function(module: ModuleType, point: str) -> Any:
    """The injector's function for hook point ``point``, or None."""
    if point not in HOOK_POINTS:
        raise ValueError(f"no hook point {point!r}; the hook points: {sorted(HOOK_POINTS)}")
    function = getattr(module, point, None)
    return function if callable(function) else None


def _load(value: str) -> ModuleType:
    """Import the injector that ``value`` names (see :func:`injector`)."""
    bad = f"{HOOKS_ENV}={value!r}"
    if value.endswith(".py") or os.sep in value or "/" in value:
        path = Path(value)
        if not path.is_absolute() or path.suffix != ".py" or not path.is_file():
            raise HooksError(f"{bad}: not an absolute path to an existing .py file")
        spec = importlib.util.spec_from_file_location(f"_flowers_job_injector_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise HooksError(f"{bad}: cannot be loaded as a Python file")
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise HooksError(f"{bad}: loading the injector failed: {exc!r}") from exc
        return module
    if not all(part.isidentifier() for part in value.split(".")):
        raise HooksError(f"{bad}: neither an absolute path to a .py file nor a module name")
    try:
        return importlib.import_module(value)
    except Exception as exc:
        raise HooksError(f"{bad}: importing the injector failed: {exc!r}") from exc
