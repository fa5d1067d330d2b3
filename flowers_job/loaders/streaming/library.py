"""Importing mosaicml-streaming cheaply: its example-dataset subpackages stay placeholders
until something uses them (:func:`import_streaming`)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

__all__ = ["TASK_MODULES", "UNUSED_SUBPACKAGES", "import_streaming", "import_task_libraries"]

UNUSED_SUBPACKAGES = ("text", "vision", "multimodal")
"""Subpackages of ``streaming`` that its ``__init__`` imports and this job never uses: the
example datasets (C4, ImageNet, WebVid, ...), which import transformers' tokenizers."""


def import_streaming() -> types.ModuleType:
    """Import ``streaming`` (mosaicml-streaming) without running its example-dataset
    subpackages until something uses them; the module.

    ``streaming/__init__.py`` imports ``streaming.text``, ``.vision`` and ``.multimodal``,
    whose C4 and Pile datasets import transformers' tokenizer registry (and, with DBR 17.3
    LTS ML's transformers, ``torch._dynamo``): more than twice the CPU time and 200 MB more
    peak memory than this way (docs/performance.md).
    Each unused subpackage is a placeholder in ``sys.modules`` until a public attribute of
    it is read; then the real one is imported and takes its place. Nothing changes if
    ``streaming`` is imported already. (``importlib.util.LazyLoader`` loads on any attribute
    access, dunders included: the example datasets then loaded in the middle of torch's own
    import, which failed with a circular import.)

    Raises:
        ImportError: mosaicml-streaming is not installed, or does not import.
    """
    if "streaming" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        if spec is None:
            raise ImportError("No module named 'streaming'", name="streaming")
        root = Path(next(iter(spec.submodule_search_locations or ["."])))
        for name in UNUSED_SUBPACKAGES:
            sys.modules.setdefault(f"streaming.{name}", _placeholder(name, root / name))
    return importlib.import_module("streaming")


TASK_MODULES = ("streaming.base.converters",)
"""What the loader cache's Spark tasks import: ``dataframe_to_mds``'s module, which each
Python worker imports when it unpickles the MDS conversion's function."""


def import_task_libraries() -> list[str]:
    """Import :data:`TASK_MODULES` after :func:`import_streaming`, so without Streaming's
    example datasets (which bring in transformers' tokenizer registry and scikit-learn;
    ``streaming.base`` itself imports two of transformers' base classes): what the
    Python workers' daemon runs before it forks (:mod:`flowers_job.cluster.python_daemon`).

    Returns:
        The modules imported; none where Streaming is not installed.

    Raises:
        ImportError: Streaming is installed but does not import.
    """
    if importlib.util.find_spec("streaming") is None:
        return []
    import_streaming()
    for name in TASK_MODULES:
        importlib.import_module(name)
    return list(TASK_MODULES)


def _placeholder(name: str, folder: Path) -> types.ModuleType:
    """A module standing in for ``streaming.<name>`` (whose files are in ``folder``) until a
    public attribute is read; its ``__path__`` lets ``import streaming.<name>.<module>``
    work meanwhile."""
    full = f"streaming.{name}"
    module = types.ModuleType(full, f"placeholder for {full}: imported on first use")
    module.__path__ = [str(folder)]

    def __getattr__(attr: str) -> Any:  # noqa: N807 (a module's __getattr__, PEP 562)
        if attr.startswith("__"):  # introspection (hasattr(m, "__file__")) imports nothing
            raise AttributeError(f"module {full!r} has no attribute {attr!r}")
        if sys.modules.get(full) is module:
            del sys.modules[full]
        real = importlib.import_module(full)
        setattr(sys.modules["streaming"], name, real)
        return getattr(real, attr)

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module
