"""Which loader can run on this stack: checked on the driver before Spark starts.

Two loaders read the training data (``data.loader``):

- ``petastorm``: Petastorm 0.13.1, its latest release, reads with pyarrow's legacy
  ``ParquetDataset`` (removed in pyarrow 15), imports ``pyarrow.hdfs``/``pyarrow.filesystem``
  (removed in 16) and uses ``np.unicode_`` (removed in NumPy 2). It runs on the local pinned
  stack and on Databricks Runtime ML up to 15.4 LTS, and on nothing newer.
- ``streaming``: Mosaic Streaming (``mosaicml-streaming``), pre-installed on Databricks
  Runtime ML 15.2 and later, and what Databricks' guide "Prepare data for distributed
  training" now recommends.

Facts and sources: ``../shared/runtimes/README.md`` and the README's "Supported runtimes".
No Spark and no torch here.
"""

from __future__ import annotations

import importlib
import logging
from importlib import metadata
from typing import Literal

from packaging.version import Version

from flowers_job.config import ConfigError, JobConfig

__all__ = ["LOADERS", "Loader", "loader_problem", "resolve_loader"]

Loader = Literal["petastorm", "streaming"]
LOADERS: tuple[Loader, ...] = ("petastorm", "streaming")

_PACKAGES: dict[str, str] = {"petastorm": "petastorm", "streaming": "mosaicml-streaming"}
_EXTRAS: dict[str, str] = {
    "petastorm": "flowers-job[petastorm]",
    "streaming": "flowers-job[streaming]",
}

log = logging.getLogger(__name__)


def _version(dist: str) -> Version | None:
    try:
        return Version(metadata.version(dist))
    except metadata.PackageNotFoundError:
        return None


def loader_problem(loader: str) -> str | None:
    """Why ``loader`` cannot run on this Python environment; None when it can.

    Checks the installed versions first (the reasons users can act on), then imports the
    package for real, so that a broken install is caught as well.

    Raises:
        KeyError: ``loader`` is not one of :data:`LOADERS`.

    Returns:
        None, or a sentence naming the package, its version and what it cannot work with,
        e.g. ``"petastorm 0.13.1 cannot run with pyarrow 19.0.1: ..."``.
    """
    dist = _PACKAGES[loader]
    version = _version(dist)
    if loader == "petastorm":  # the stack first: installing petastorm would not help
        pyarrow, numpy = _version("pyarrow"), _version("numpy")
        name = f"petastorm {version}" if version else "petastorm (0.13.1, its latest release)"
        if pyarrow is not None and pyarrow >= Version("15"):
            return (
                f"{name} cannot run with pyarrow {pyarrow}: it reads with pyarrow's legacy "
                "ParquetDataset (removed in pyarrow 15) and imports pyarrow.hdfs and "
                "pyarrow.filesystem (removed in 16); it needs pyarrow < 15"
            )
        if numpy is not None and numpy >= Version("2"):
            return (
                f"{name} cannot run with numpy {numpy}: it uses np.unicode_, removed in "
                "NumPy 2; it needs numpy < 2"
            )
    if version is None:
        return f"{dist} is not installed (pip install '{_EXTRAS[loader]}')"
    module = "petastorm.spark" if loader == "petastorm" else "streaming"
    try:
        importlib.import_module(module)
    except Exception as exc:
        return f"{dist} {version} is installed but `import {module}` fails: {type(exc).__name__}: {exc}"
    return None


def resolve_loader(cfg: JobConfig) -> JobConfig:
    """``cfg`` with ``data.loader`` resolved to a loader that runs here.

    'auto' becomes 'petastorm' where Petastorm can run (the local pinned stack), else
    'streaming' (Databricks Runtime ML 16.4 and later).

    Raises:
        ConfigError: the configured loader (or, for 'auto', either loader) cannot run on this
            stack; the message names ``data.loader``, the package and version that cannot
            work, and the loader that can, if any.
    """
    wanted = cfg.data.loader
    candidates: tuple[Loader, ...] = LOADERS if wanted == "auto" else (wanted,)
    problems: dict[Loader, str] = {}
    for loader in candidates:
        problem = loader_problem(loader)
        if problem is None:
            if wanted == "auto" and problems:
                log.info("data.loader=auto: %s (petastorm: %s)", loader, problems["petastorm"])
            return cfg.model_copy(update={"data": cfg.data.model_copy(update={"loader": loader})})
        problems[loader] = problem
    others = [x for x in LOADERS if x not in problems]
    working = [x for x in others if loader_problem(x) is None]
    advice = (
        f"; use data.loader={working[0]} instead (it can run here)"
        if working
        else "; no loader can run here: install flowers-job[streaming] (or [petastorm] on "
        "pyarrow < 15 and numpy < 2)"
    )
    detail = "; ".join(f"{name}: {text}" for name, text in problems.items())
    raise ConfigError(
        f"invalid configuration:\n  data.loader: {wanted!r} cannot run on this stack: {detail}{advice}"
    )
