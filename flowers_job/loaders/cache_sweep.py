"""What runs whose driver died left in the loader cache: every run's folder carries its
driver's identity (``owner.json``), and the next start removes the folders, and the
unpublished writer folders, of drivers that no longer run."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flowers_job.loaders import registered_loaders
from flowers_job.loaders.cache_marker import DATA_PREFIX, ENTRIES, read_json, referenced_segments
from flowers_job.location import Location
from flowers_job.runtime.parent_watch import driver_identity, process_alive

__all__ = ["ORPHAN_AGE_SECONDS", "OWNER_FILE", "owner_alive", "run_cache", "sweep_orphaned_caches"]

log = logging.getLogger(__name__)

OWNER_FILE = "owner.json"
ORPHAN_AGE_SECONDS = 7 * 24 * 3600.0
"""A cache folder of a driver on another host is swept once it is this old (seconds): its
driver cannot be checked from here, and no training run lasts a week."""


def owner_alive(owner: dict[str, Any]) -> bool:
    """Whether the driver ``owner`` (:func:`driver_identity`) still runs: checked on this
    host; a driver on another host counts as alive for :data:`ORPHAN_AGE_SECONDS`."""
    if owner.get("host") == socket.gethostname():
        return process_alive(owner)
    return time.time() - float(owner.get("create_time", 0.0)) < ORPHAN_AGE_SECONDS


def sweep_orphaned_caches(parent: Location) -> list[Location]:
    """Remove what runs whose driver is dead left in the cache root (local or object store):
    their ``run-*`` folder and their unpublished writer folders under ``entries/``.

    A run is dead when its ``owner.json`` names a driver on this host that no longer
    exists, or a driver elsewhere that started more than :data:`ORPHAN_AGE_SECONDS` ago.
    Folders without ``owner.json`` are not ours and are left alone; a data folder that a
    published marker names is never removed here. For a local folder of this host, each
    registered loader also removes what its readers left outside it.

    Returns:
        The ``run-*`` folders removed.
    """
    for trash in parent.glob("trash-*"):  # an evicted layout-2 entry, its removal cut short
        with contextlib.suppress(OSError):
            trash.rmtree()
    removed = []
    for folder in parent.glob("run-*"):
        owner = read_json(folder / OWNER_FILE)
        if not isinstance(owner, dict) or owner_alive(owner):
            continue
        log.warning(
            "removing the loader cache %s of a run that was killed (driver pid %s on %s)",
            folder,
            owner.get("pid"),
            owner.get("host"),
        )
        referenced = referenced_segments(parent)
        for entry in (parent / ENTRIES).iterdir():
            data = entry / f"{DATA_PREFIX}{folder.name}"
            if (entry.name, data.name) not in referenced:
                with contextlib.suppress(OSError):
                    data.rmtree()
        with contextlib.suppress(OSError):
            folder.rmtree()
        if folder.is_local and owner.get("host") == socket.gethostname():
            for registered in registered_loaders():
                registered.sweep(folder.local_path)
        removed.append(folder)
    return removed


@contextmanager
def run_cache(parent: Location) -> Iterator[tuple[Location, Path | None]]:
    """This run's folder ``<parent>/run-<id>``: created with its ``owner.json``
    (after sweeping orphans), removed on exit whatever happens (in an object store too:
    every key under it).

    Yields:
        ``(run folder, local_folder)``; the folder is None for a cache that is not local.
    """
    sweep_orphaned_caches(parent)
    run = parent / f"run-{uuid.uuid4().hex[:12]}"
    folder = run.local_path if run.is_local else None
    if folder is not None:
        folder.mkdir(parents=True)
    (run / OWNER_FILE).write_text(json.dumps(driver_identity()))
    try:
        yield run, folder
    finally:
        try:
            run.rmtree()  # local or in an object store
        except OSError as exc:
            log.warning("could not remove this run's loader cache %s: %s", run, exc)
