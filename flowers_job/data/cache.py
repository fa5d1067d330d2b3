"""The loader cache of a run (driver side): one ``run-<id>`` folder, gone when the run ends.

Every loader writes its per-run cache (Petastorm's Parquet, Streaming's MDS shards) into
one folder under ``paths.cache_url``. The folder holds an ``owner.json`` (host, pid and
start time of the driver); :func:`run_cache` removes it when the run ends, however it ends,
and a folder whose driver is dead (killed with SIGKILL, say) is swept at the next start
(:func:`sweep_orphaned_caches`), with what each loader left on this host outside it
(:meth:`~flowers_job.loaders.base.Loader.sweep`). Before each split is written, the free
space of the cache's file system is checked against the size of the Delta table
(:func:`check_cache_space`).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pyspark.sql import SparkSession

from flowers_job.errors import DataError
from flowers_job.loaders import LOADERS, loader_class
from flowers_job.loaders.base import local_dir
from flowers_job.processes import driver_identity, process_alive

__all__ = [
    "CACHE_SPACE_FACTOR",
    "CACHE_SPACE_HEADROOM_BYTES",
    "ORPHAN_AGE_SECONDS",
    "OWNER_FILE",
    "cache_bytes_needed",
    "check_cache_space",
    "run_cache",
    "sweep_orphaned_caches",
]

log = logging.getLogger(__name__)

OWNER_FILE = "owner.json"
ORPHAN_AGE_SECONDS = 7 * 24 * 3600.0
"""A cache folder of a driver on another host is swept once it is this old (seconds): its
driver cannot be checked from here, and no training run lasts a week."""
CACHE_SPACE_FACTOR = 1.1
CACHE_SPACE_HEADROOM_BYTES = 1 << 20
"""A split's cache needs ``table size x 1.1 + 1 MiB``: the images are JPEG in both the Delta
table and the uncompressed cache, plus Parquet footers and Hadoop's .crc files."""


def sweep_orphaned_caches(cache_parent_url: str) -> list[Path]:
    """Remove the ``run-*`` cache folders whose driver is dead; local file systems only.

    A folder is orphaned when its ``owner.json`` names a driver on this host that no
    longer exists, or a driver elsewhere that started more than :data:`ORPHAN_AGE_SECONDS`
    ago. Folders without ``owner.json`` are not ours and are left alone. For a folder of
    this host, each registered loader also removes what its readers left outside it.

    Returns:
        The folders removed.
    """
    parent = local_dir(cache_parent_url)
    if parent is None or not parent.is_dir():
        return []
    removed = []
    for folder in sorted(parent.glob("run-*")):
        try:
            owner = json.loads((folder / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        here = owner.get("host") == socket.gethostname()
        dead = (
            not process_alive(owner)
            if here
            else time.time() - float(owner.get("create_time", 0.0)) > ORPHAN_AGE_SECONDS
        )
        if dead:
            log.warning(
                "removing the loader cache %s of a run that was killed (driver pid %s on %s)",
                folder,
                owner.get("pid"),
                owner.get("host"),
            )
            shutil.rmtree(folder, ignore_errors=True)
            if here:
                for name in LOADERS:
                    loader_class(name).sweep(folder)
            removed.append(folder)
    return removed


def cache_bytes_needed(spark: SparkSession, table: Path) -> int:
    """Bytes the loader cache of the Delta table at ``table`` needs (an upper estimate).

    ``sizeInBytes`` of ``DESCRIBE DETAIL`` x :data:`CACHE_SPACE_FACTOR` +
    :data:`CACHE_SPACE_HEADROOM_BYTES`.
    """
    from delta.tables import DeltaTable

    row = DeltaTable.forPath(spark, str(table)).detail().select("sizeInBytes").first()
    size = int(row["sizeInBytes"]) if row is not None else 0
    return math.ceil(size * CACHE_SPACE_FACTOR) + CACHE_SPACE_HEADROOM_BYTES


def check_cache_space(cache_dir_url: str, needed_bytes: int, what: str) -> None:
    """Fail before writing when the cache's file system has less than ``needed_bytes`` free.

    Raises:
        DataError: not enough space; names the directory, the bytes needed and free.
    """
    folder = local_dir(cache_dir_url)
    if folder is None:
        return  # object stores and DBFS report no meaningful free space
    free = shutil.disk_usage(folder).free
    if free < needed_bytes:
        raise DataError(
            f"no space for the loader cache of {what} in {folder}: needs about "
            f"{needed_bytes / 2**20:.1f} MiB, {free / 2**20:.1f} MiB free; free some space or "
            "set paths.cache_url to a larger volume"
        )


@contextmanager
def run_cache(cache_parent_url: str) -> Iterator[tuple[str, Path | None]]:
    """This run's cache folder ``<cache_parent_url>/run-<id>``: created with its
    ``owner.json`` (after sweeping orphans), removed on exit whatever happens.

    Yields:
        ``(cache_url, local_folder)``; the folder is None for a cache that is not local.
    """
    sweep_orphaned_caches(cache_parent_url)
    cache_url = f"{cache_parent_url}/run-{uuid.uuid4().hex[:12]}"
    folder = local_dir(cache_url)
    if folder is not None:
        folder.mkdir(parents=True)
        (folder / OWNER_FILE).write_text(json.dumps(driver_identity()))
    try:
        yield cache_url, folder
    finally:
        if folder is not None and folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
