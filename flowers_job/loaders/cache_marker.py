"""A loader cache entry's marker (driver side): its layout, its key, and the checks that an
entry was written by this job (:func:`check_entry`). :mod:`flowers_job.loaders.cache_dir`
publishes and reads entries through it; the layout is described there."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from flowers_job.errors import DataError

if TYPE_CHECKING:
    from flowers_job.loaders.base import Loader
    from flowers_job.location import Location

__all__ = [
    "DATA_PREFIX",
    "ENTRIES",
    "ENTRY_FILE",
    "LEGACY_PLAN_FILE",
    "ROOT_MARK",
    "check_entry",
    "entry_info",
    "entry_key",
    "entry_segments",
    "read_json",
    "rebase",
    "referenced_segments",
]

ENTRIES = "entries"
ENTRY_FILE = "entry.json"
"""The marker of a published entry (module doc)."""
LEGACY_PLAN_FILE = "plan.json"
"""An entry of layout 2 was published when this existed."""
DATA_PREFIX = "data-"
ROOT_MARK = "{cache}"
"""Stands for the cache root in a stored plan: its paths are inside the entry's segments."""


def read_json(loc: Location) -> Any:
    """``loc``'s JSON, or None when it is missing or unreadable."""
    try:
        return json.loads(loc.read_text())
    except (OSError, ValueError):
        return None


def entry_key(fields: dict[str, Any]) -> str:
    """The key of an entry: the first 20 hex digits of the SHA-256 of ``fields`` as sorted
    JSON (80 bits: a collision among a million entries has probability ~1e-12)."""
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def rebase(obj: Any, old: str, new: str) -> Any:
    """``obj`` (plain data) with every string that starts with ``old`` starting with ``new``."""
    if isinstance(obj, str):
        return new + obj[len(old) :] if obj.startswith(old) else obj
    if isinstance(obj, list):
        return [rebase(x, old, new) for x in obj]
    if isinstance(obj, dict):
        return {k: rebase(v, old, new) for k, v in obj.items()}
    return obj


def entry_info(entry: Location) -> dict[str, Any] | None:
    """A published entry's marker; None when the entry is not published. Layout 2 entries
    (``plan.json`` beside ``entry.json``) count, for eviction."""
    info = read_json(entry / ENTRY_FILE)
    if not isinstance(info, dict):
        return None
    if "data" in info or (entry / LEGACY_PLAN_FILE).is_file():
        return info
    return None


def entry_segments(info: dict[str, Any]) -> list[tuple[str, str]]:
    """The ``(entry, data folder)`` pairs whose files a marker's plan reads, oldest first
    (the entry's own data folder last)."""
    pairs = info.get("segments")
    if not isinstance(pairs, list):
        return []
    return [(str(p[0]), str(p[1])) for p in pairs if isinstance(p, list) and len(p) == 2]


def referenced_segments(root: Location) -> set[tuple[str, str]]:
    """Every ``(entry, data folder)`` that a published marker under ``root`` reads."""
    used: set[tuple[str, str]] = set()
    for entry in (root / ENTRIES).iterdir():
        info = entry_info(entry)
        if info is not None:
            used.update(entry_segments(info))
    return used


def check_entry(
    entry: Location, info: dict[str, Any], loader: Loader, fields: dict[str, Any]
) -> None:
    """Refuse a published entry that this job did not write for ``fields``, before any of
    its files is read.

    The job's marker holds the ``fields`` the entry's name is the key of, the name of a data
    folder of this entry, the segments it reads (data folders of entries of the root), and
    a plan whose every path is inside one of them (written from :data:`ROOT_MARK`). A marker
    that names other fields, another loader's plan, a data folder elsewhere or any path
    outside its segments was put there by someone else (a cache root on a shared path such
    as ``/dbfs/tmp``) and is not read. Someone who can write the cache root can
    forge it: what the loaders open is checked again where they open it (the Petastorm ranks
    open only the plan's own files, never a folder whose metadata Petastorm would unpickle:
    :func:`~flowers_job.loaders.petastorm.cache_files.check_cache_files`).

    Raises:
        DataError: naming the entry and what is wrong; the entry is left as it is.
    """
    expected = json.loads(json.dumps(fields, default=str))
    stored = info.get("plan")
    data = info.get("data")
    segments = entry_segments(info)
    problem = None
    if info.get("fields") != expected:
        problem = f"its {ENTRY_FILE} does not describe the key {entry_key(fields)}"
    elif not (isinstance(data, str) and _is_name(data) and data.startswith(DATA_PREFIX)):
        problem = f"its {ENTRY_FILE} names no data folder of its own"
    elif (
        not segments
        or segments[-1] != (entry.name, data)
        or not all(_is_name(e) and _is_name(d) and d.startswith(DATA_PREFIX) for e, d in segments)
    ):
        problem = f"its {ENTRY_FILE} names segments that are not data folders of the cache"
    elif not isinstance(stored, dict) or stored.get("loader") != loader.name:
        problem = f"its {ENTRY_FILE} holds no {loader.name} plan"
    else:
        prefixes = [f"{ROOT_MARK}/{ENTRIES}/{e}/{d}" for e, d in segments]
        outside = [
            p
            for k, v in stored.items()
            if k != "loader"
            for p in _strings(v)
            if not _inside(p, prefixes)
        ]
        if outside:
            problem = f"its plan names {outside[0]!r}, outside the entry's segments"
    if problem:
        raise DataError(
            f"the loader cache entry {entry} was not written by this job: {problem}; "
            "remove it (it is written again), and keep the cache root (paths.cache_url) "
            "where only this job writes"
        )


def _strings(obj: Any) -> list[str]:
    """Every string in ``obj`` (plain data)."""
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, list):
        return [s for x in obj for s in _strings(x)]
    if isinstance(obj, dict):
        return [s for x in obj.values() for s in _strings(x)]
    return []


def _is_name(text: str) -> bool:
    """A plain file name: no separator, not ``.`` or ``..``, not empty."""
    return bool(text) and "/" not in text and text not in (".", "..")


def _inside(text: str, prefixes: list[str]) -> bool:
    """Whether a stored plan's string is one of ``prefixes`` or a path below one (no
    ``..``)."""
    if ".." in text.split("/"):
        return False
    return any(text == p or text.startswith(p + "/") for p in prefixes)
