"""The data loaders, one sub-package each behind :class:`~flowers_job.loaders.base.Loader`,
and the registry that resolves ``data.loader`` once, on the driver, before Spark starts.

- ``delta`` (:mod:`flowers_job.loaders.delta`): no cache; the ranks read the ``images``
  table's own files at the planned version with delta-rs (``flowers-job[delta]``). 'auto'
  takes it first, for path tables on classic Spark (:meth:`DeltaLoader.auto_problem
  <flowers_job.loaders.delta.table_loader.DeltaLoader.auto_problem>`).
- ``streaming`` (:mod:`flowers_job.loaders.streaming`): Mosaic Streaming, pre-installed on
  Databricks Runtime ML 15.2 and later, and what Databricks' guide "Prepare data for
  distributed training" recommends: 'auto' there, for catalog tables, and over Spark Connect.
- ``petastorm`` (:mod:`flowers_job.loaders.petastorm`): Petastorm 0.13.1, its latest
  release, which imports only on pyarrow < 15 and NumPy < 2, so beside Spark 4.0 at most:
  the legacy environment of ``requirements/petastorm.txt``.

:func:`resolve_loader` returns the loader class, which the driver hands on (the cache, the
placement check, the ranks' job); nothing looks a loader up by name after it. A third loader
is one new sub-package with a :class:`~flowers_job.loaders.base.Loader` subclass, one line in
:data:`LOADERS` and its name in :data:`flowers_job.config.data.LoaderName`
(docs/architecture.md). Importing this package imports no loader library, no Spark and no
torch: each loader module is imported when it is resolved.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flowers_job.config import JobConfig
    from flowers_job.loaders.base import Loader

__all__ = [
    "LOADERS",
    "TASK_LIBRARIES",
    "check_session",
    "loader_problem",
    "registered_loaders",
    "resolve_loader",
    "task_library_importers",
]

LOADERS: dict[str, str] = {
    "delta": "flowers_job.loaders.delta.table_loader:DeltaLoader",
    "streaming": "flowers_job.loaders.streaming.streaming_loader:StreamingLoader",
    "petastorm": "flowers_job.loaders.petastorm.loader:PetastormLoader",
}
"""Registered loaders: ``data.loader`` name -> ``module:class``. 'auto' tries them in this
order and takes the first that runs here and does not pass itself over
(:meth:`~flowers_job.loaders.base.Loader.auto_problem`): reading the table itself costs no
copy and trains as fast as Streaming's cache (docs/performance.md), so it comes first."""

TASK_LIBRARIES: dict[str, str] = {
    "streaming": "flowers_job.loaders.streaming.library:import_task_libraries",
}
"""What a loader's Spark tasks import, imported the loader's own way: ``data.loader`` name ->
``module:function`` (no argument; returns the modules imported, none where the library is
not installed). The Python workers' daemon calls each before it forks
(:mod:`flowers_job.cluster.python_daemon`). Petastorm's tasks import nothing of their own:
Spark writes its Parquet cache."""

log = logging.getLogger(__name__)


def _registered(name: str) -> type[Loader]:
    """The :class:`~flowers_job.loaders.base.Loader` registered as ``name`` (imports its module).

    Raises:
        ValueError: ``name`` is not registered (the message lists the loaders).
    """
    try:
        module, _, attr = LOADERS[name].partition(":")
    except KeyError:
        raise ValueError(f"unknown loader {name!r}; the loaders are {sorted(LOADERS)}") from None
    cls: type[Loader] = getattr(importlib.import_module(module), attr)
    return cls


def task_library_importers() -> dict[str, Callable[[], list[str]]]:
    """The function of each loader in :data:`TASK_LIBRARIES`; imports only their modules
    (small ones: no loader library until a function is called)."""
    found = {}
    for name, target in TASK_LIBRARIES.items():
        module, _, attr = target.partition(":")
        found[name] = getattr(importlib.import_module(module), attr)
    return found


def registered_loaders() -> list[type[Loader]]:
    """Every registered loader, in :data:`LOADERS` order: for what concerns them all (the sweep of a
    killed run's cache folder, :func:`flowers_job.loaders.cache_sweep.sweep_orphaned_caches`)."""
    return [_registered(name) for name in LOADERS]


def loader_problem(name: str) -> str | None:
    """Why loader ``name`` cannot run on this Python environment; None when it can
    (:meth:`~flowers_job.loaders.base.Loader.problem`).

    Raises:
        ValueError: ``name`` is not registered.
    """
    return _registered(name).problem()


def session_problem(loader: type[Loader], connect: str | None) -> str | None:
    """Why ``loader`` cannot run on this session: on Spark Connect (``connect``: what made it
    Connect, :func:`flowers_job.cluster.connect.connect_reason`), a loader whose driver side
    needs classic Spark (:attr:`~flowers_job.loaders.base.Loader.classic_only`); else None."""
    if connect is None or loader.classic_only is None:
        return None
    return (
        f"{loader.name} needs {loader.classic_only}, which Spark Connect does not have ({connect})"
    )


def _runs_here(name: str, connect: str | None) -> str | None:
    """Why loader ``name`` cannot run on this environment and session; None when it can."""
    return loader_problem(name) or session_problem(_registered(name), connect)


def _first_fit(
    cfg: JobConfig | None, connect: str | None, problems: dict[str, str | None] | None = None
) -> str | None:
    """The loader 'auto' takes: the first of :data:`LOADERS` that runs here and does not
    pass itself over for ``cfg`` (:meth:`~flowers_job.loaders.base.Loader.auto_problem`;
    not asked without a ``cfg``), else the first that runs here; None when none runs.
    ``problems``: :func:`_runs_here` of every loader, when the caller has them already."""
    problems = problems or {name: _runs_here(name, connect) for name in LOADERS}
    runs = [name for name in LOADERS if problems[name] is None]
    taken = [
        name for name in runs if cfg is None or _registered(name).auto_problem(cfg, connect) is None
    ]
    return next(iter(taken or runs), None)


def check_session(loader: type[Loader], connect: str | None, cfg: JobConfig | None = None) -> None:
    """Refuse ``loader`` on a session it cannot run on, before any work
    (:func:`session_problem`), naming the loader that 'auto' would take there for ``cfg``.

    Raises:
        ClusterError: naming ``data.loader``, the API Connect lacks, and the loader to use.
    """
    from flowers_job.errors import ClusterError

    problem = session_problem(loader, connect)
    if problem is None:
        return
    fit = _first_fit(cfg, connect)
    advice = f"; use data.loader={fit}" if fit else ""
    raise ClusterError(
        f"invalid configuration:\n  data.loader: {loader.name!r} cannot run on this "
        f"session: {problem}{advice}"
    )


def resolve_loader(cfg: JobConfig, connect: str | None = None) -> tuple[JobConfig, type[Loader]]:
    """The loader of ``cfg``, resolved once before Spark starts: ``cfg`` with ``data.loader``
    set to its name, and the loader itself (its driver side and its rank side), which the
    driver passes on (:func:`flowers_job.driver.prepare.prepare_data`, the placement check,
    the ranks' job). Nothing looks a loader up by name after this.

    'auto' becomes the first registered loader (:data:`LOADERS`) that can run here and
    takes this job (:meth:`~flowers_job.loaders.base.Loader.auto_problem`): 'delta' where
    deltalake is installed, for path tables on classic Spark; else 'streaming' wherever
    Mosaic Streaming is installed; else 'petastorm'. On Spark Connect (``connect``: what
    made the session Connect, or None for classic Spark) the first that runs there too
    (:func:`session_problem`).

    Raises:
        ConfigError: the configured loader (or, for 'auto', every loader) cannot run on
            this stack; the message names ``data.loader``, the package and version that
            cannot work, and the loader that can, if any.
    """
    from flowers_job.config import ConfigError

    wanted = cfg.data.loader
    if wanted == "auto":
        problems = {name: _runs_here(name, connect) for name in LOADERS}
        name = _first_fit(cfg, connect, problems)
        if name is not None:
            passed = {
                x: problems[x] or _registered(x).auto_problem(cfg, connect)
                for x in list(LOADERS)[: list(LOADERS).index(name)]
            }
            if passed:
                log.info(
                    "data.loader=auto: %s (%s)",
                    name,
                    "; ".join(f"not {x}: {why}" for x, why in passed.items()),
                )
            data = cfg.data.model_copy(update={"loader": name})
            return cfg.model_copy(update={"data": data}), _registered(name)
    else:
        problems = {wanted: _runs_here(wanted, connect)}
        if problems[wanted] is None:
            return cfg, _registered(wanted)
    fit = _first_fit(cfg, connect)
    advice = (
        f"; use data.loader={fit} instead (it can run here)"
        if fit
        else "; no loader can run here: install flowers-job[delta] or [streaming] (or "
        "[petastorm] on pyarrow < 15 and numpy < 2)"
    )
    detail = "; ".join(f"{name}: {text}" for name, text in problems.items())
    raise ConfigError(
        f"invalid configuration:\n  data.loader: {wanted!r} cannot run on this stack: "
        f"{detail}{advice}"
    )
