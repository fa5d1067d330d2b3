"""Configuration keys renamed in a release: still read for one more, with a warning.

:func:`migrate_deprecated` moves each old key of a raw configuration tree (a YAML file,
``--set`` overrides, a dict given to :meth:`~flowers_job.config.JobConfig.model_validate`)
to its new place and warns with :class:`ConfigDeprecationWarning`, which names both keys.
A tree that sets an old key and its new one to different values is refused: which one
was meant cannot be known. A configuration dumped after validation holds only new keys, so
the ranks, checkpoints and MLflow params never see the old ones.

Not pydantic's ``AliasChoices``: an alias names another key of the same model, and these
keys moved between sections (``data`` to ``loaders.petastorm``); nor does an alias warn or
refuse two conflicting values. So the raw tree is rewritten before validation.

======================================= ================================================
old key (0.1)                           new key (0.2; the old one goes in 0.3)
======================================= ================================================
``data.reader_pool_type``               ``loaders.petastorm.reader_pool_type``
``data.shuffle_buffer_rows``            ``loaders.petastorm.shuffle_buffer_rows``
``data.prefetch_batches``               ``loaders.streaming.prefetch_batches``
``paths.petastorm_cache_url``           ``paths.cache_url``
======================================= ================================================
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

__all__ = ["REMOVED_IN", "RENAMED", "ConfigDeprecationWarning", "migrate_deprecated"]

RENAMED: dict[str, str] = {
    "data.reader_pool_type": "loaders.petastorm.reader_pool_type",
    "data.shuffle_buffer_rows": "loaders.petastorm.shuffle_buffer_rows",
    "data.prefetch_batches": "loaders.streaming.prefetch_batches",
    "paths.petastorm_cache_url": "paths.cache_url",
}
"""Old dotted key -> new dotted key."""
REMOVED_IN = "0.3"
"""The release that stops reading the old keys."""


class ConfigDeprecationWarning(FutureWarning):
    """A renamed configuration key was used. A ``FutureWarning``, so that Python shows it to
    the user by default (``DeprecationWarning`` is hidden outside ``__main__``)."""


_MISSING = object()


def _pop(tree: dict[str, Any], dotted: str) -> Any:
    *parents, leaf = dotted.split(".")
    node: Any = tree
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or leaf not in node:
        return _MISSING
    return node.pop(leaf)


def _get(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _put(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            return  # a malformed section: validation names it
        node = child
    node[leaf] = value


def migrate_deprecated(tree: dict[str, Any]) -> dict[str, Any]:
    """``tree`` with every old key of :data:`RENAMED` moved to its new key (a copy; the input
    is left as it is), warning once per key used.

    Raises:
        ValueError: ``"<new key>: ..."``, when an old key and its new key are both set to
            different values.
    """
    if not any(_get(tree, old) is not _MISSING for old in RENAMED):
        return tree
    tree = copy.deepcopy(tree)
    for old, new in RENAMED.items():
        value = _pop(tree, old)
        if value is _MISSING:
            continue
        current = _get(tree, new)
        if current is not _MISSING and current != value:
            raise ValueError(
                f"{new}: set to {current!r}, and the deprecated {old} to {value!r}; keep only {new}"
            )
        warnings.warn(
            f"configuration key {old} is deprecated: use {new} (the old key is read until "
            f"flowers-job {REMOVED_IN})",
            ConfigDeprecationWarning,
            stacklevel=2,
        )
        _put(tree, new, value)
    return tree
