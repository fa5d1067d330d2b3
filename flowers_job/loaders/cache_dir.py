"""The loader cache (driver side): each split written once per content, reused by later runs.

A loader's copy of a split (Petastorm's Parquet, Streaming's MDS shards) is an **entry** of
the cache root ``paths.cache_url`` (default ``<output_dir>/loader_cache``), keyed by what
decides its bytes and its plan (:func:`entry_key`): the ``images`` table (path and Delta
table id), its Delta version, the split, the loader, and the loader's settings
(:meth:`~flowers_job.loaders.base.Loader.cache_settings`). A later ``run``, ``train`` or
``--resume`` on the same version reads the entry and writes no byte of it.

Layout of the root::

    entries/<loader>-<split>-v<version>-<key>/   a complete entry:
        <the loader's files>
        entry.json        what it was built from, its bytes, when, how long it took
        plan.json         its ShardPlan, written last (with paths relative to the entry)
        last_used         touched by every run that uses it: the LRU order
        users/<run>.json  the drivers reading it now (host, pid, start time)
    locks/<key>.lock      held while an entry is written
    run-<id>/             one run's staging folder, with owner.json

**Safe under concurrency.** An entry is written in the run's staging folder and published
by one ``rename`` into ``entries/`` (atomic on a POSIX file system), so a partly written
entry is never read. Writers of the same key take its file lock (``filelock``) first; the
loser waits (``cache.lock_timeout_seconds``), then finds the entry published and reuses it.

**Bounded.** When a run's entries are ready, entries are evicted least-recently-used first
while the cache holds more than ``cache.max_bytes``, except this run's and any that a live
driver is reading (its ``users/`` file). A staging folder whose driver is dead (killed with
SIGKILL, say) is swept at the next start (:func:`sweep_orphaned_caches`), with what each
loader left on this host outside it (:meth:`~flowers_job.loaders.base.Loader.sweep`).
Before a split is written, the free space of the cache's file system is checked against
the split's size (:func:`check_cache_space`).

A cache root in an object store (``s3a://...``) is written per run under the run's staging
folder and never reused (an object store has no atomic rename to publish an entry by, nor
file locks); the folder is removed when the run ends, whatever happens, and a folder left
by a driver that was killed is swept at a later start, like a local one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from flowers_job.config import JobConfig
from flowers_job.errors import DataError
from flowers_job.loaders import registered_loaders
from flowers_job.loaders.base import Loader, ShardPlan, local_dir
from flowers_job.location import Location
from flowers_job.runtime.parent_watch import driver_identity, process_alive

__all__ = [
    "CACHE_SPACE_FACTOR",
    "CACHE_SPACE_HEADROOM_BYTES",
    "ORPHAN_AGE_SECONDS",
    "OWNER_FILE",
    "CacheUse",
    "LoaderCache",
    "cache_bytes_needed",
    "cached_versions",
    "check_cache_space",
    "check_entry",
    "entry_key",
    "evict",
    "loader_cache",
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


def sweep_orphaned_caches(cache_parent_url: str) -> list[Location]:
    """Remove the ``run-*`` cache folders whose driver is dead (local or object store).

    A folder is orphaned when its ``owner.json`` names a driver on this host that no
    longer exists, or a driver elsewhere that started more than :data:`ORPHAN_AGE_SECONDS`
    ago. Folders without ``owner.json`` are not ours and are left alone. For a local folder
    of this host, each registered loader also removes what its readers left outside it.

    Returns:
        The folders removed.
    """
    parent = Location.of(cache_parent_url)
    for trash in parent.glob("trash-*"):  # an evicted entry whose removal was cut short
        with contextlib.suppress(OSError):
            trash.rmtree()
    removed = []
    for folder in parent.glob("run-*"):
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
            with contextlib.suppress(OSError):
                folder.rmtree()
            if here and folder.is_local:
                for registered in registered_loaders():
                    registered.sweep(folder.local_path)
            removed.append(folder)
    return removed


def cache_bytes_needed(table_bytes: int, fraction: float = 1.0) -> int:
    """Bytes the loader cache of ``fraction`` of the rows of a Delta table of
    ``table_bytes`` (``DESCRIBE DETAIL``'s ``sizeInBytes``) needs: an estimate, rows being
    about the same size, of ``table_bytes x fraction x`` :data:`CACHE_SPACE_FACTOR` ``+``
    :data:`CACHE_SPACE_HEADROOM_BYTES`."""
    return math.ceil(table_bytes * fraction * CACHE_SPACE_FACTOR) + CACHE_SPACE_HEADROOM_BYTES


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
    ``owner.json`` (after sweeping orphans), removed on exit whatever happens (in an
    object store too: every key under it).

    Yields:
        ``(cache_url, local_folder)``; the folder is None for a cache that is not local.
    """
    sweep_orphaned_caches(cache_parent_url)
    cache_url = f"{cache_parent_url}/run-{uuid.uuid4().hex[:12]}"
    run = Location.of(cache_url)
    folder = run.local_path if run.is_local else None
    if folder is not None:
        folder.mkdir(parents=True)
    (run / OWNER_FILE).write_text(json.dumps(driver_identity()))
    try:
        yield cache_url, folder
    finally:
        try:
            run.rmtree()  # local or in an object store
        except OSError as exc:
            log.warning("could not remove this run's loader cache %s: %s", cache_url, exc)


ENTRIES = "entries"
LOCKS = "locks"
ENTRY_FILE = "entry.json"
PLAN_FILE = "plan.json"
LAST_USED = "last_used"
USERS = "users"
_HERE = "{entry}"
"""Stands for the entry's own URL in a stored plan: entries are published by a rename."""


def entry_key(fields: dict[str, Any]) -> str:
    """The key of an entry: the first 20 hex digits of the SHA-256 of ``fields`` as sorted
    JSON (80 bits: a collision among a million entries has probability ~1e-12)."""
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _rebase(obj: Any, old: str, new: str) -> Any:
    """``obj`` (plain data) with every string that starts with ``old`` starting with ``new``."""
    if isinstance(obj, str):
        return new + obj[len(old) :] if obj.startswith(old) else obj
    if isinstance(obj, list):
        return [_rebase(x, old, new) for x in obj]
    if isinstance(obj, dict):
        return {k: _rebase(v, old, new) for k, v in obj.items()}
    return obj


@dataclass
class CacheUse:
    """How a run got one split's cache: for ``summary.json`` (``loader_cache``)."""

    entry: str
    """The entry's folder name (or the staging folder's, for a cache that is not local)."""
    reused: bool
    """True when the entry existed and nothing was written."""
    bytes_written: int
    """Bytes this run wrote for it (0 when reused)."""
    seconds: float
    """Time to find or write it, waiting for another writer's lock included (s)."""
    waited_seconds: float = 0.0
    """Of which waiting for the lock of another run writing the same entry (s)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _users_alive(entry: Path, skip: str) -> list[str]:
    """The runs other than ``skip`` whose drivers read ``entry`` and still run (a driver on
    another host counts as alive for :data:`ORPHAN_AGE_SECONDS`)."""
    alive = []
    for f in sorted((entry / USERS).glob("*.json")):
        if f.stem == skip:
            continue
        try:
            owner = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        here = owner.get("host") == socket.gethostname()
        if (
            process_alive(owner)
            if here
            else time.time() - float(owner.get("create_time", 0.0)) < ORPHAN_AGE_SECONDS
        ):
            alive.append(f.stem)
        else:
            with contextlib.suppress(OSError):
                f.unlink()  # a reader that died: it no longer holds the entry
    return alive


def _remove_entry(entry: Path) -> None:
    """Unpublish (``plan.json`` first, so the entry is never read half removed), then
    delete."""
    with contextlib.suppress(OSError):
        (entry / PLAN_FILE).unlink()
    trash = entry.parent.parent / f"trash-{uuid.uuid4().hex[:12]}"
    try:
        entry.rename(trash)
    except OSError:
        trash = entry
    shutil.rmtree(trash, ignore_errors=True)


def _entry_info(entry: Path) -> dict[str, Any] | None:
    try:
        info = json.loads((entry / ENTRY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and (entry / PLAN_FILE).is_file() else None


def check_entry(entry: Path, stored: Any, loader: Loader, fields: dict[str, Any]) -> None:
    """Refuse a published entry that this job did not write for ``fields``, before any of
    its files is read.

    The job writes ``entry.json`` with the ``fields`` the entry's name is the key of, and a
    plan whose every path is inside the entry (written as :data:`_HERE`). An entry whose
    ``entry.json`` is missing or names other fields, or whose ``plan.json`` names another
    loader or any path outside the entry, was put there by someone else (a cache root on a
    shared path such as ``/dbfs/tmp``) and is not read. Someone who can write the cache root
    can forge both files: what the loaders open is checked again where they open it (the
    Petastorm ranks open only the plan's own files, never a folder whose metadata Petastorm
    would unpickle: :func:`~flowers_job.loaders.petastorm.petastorm_loader.check_cache_files`).

    Raises:
        DataError: naming the entry and what is wrong; the entry is left as it is.
    """
    info = _entry_info(entry)
    expected = json.loads(json.dumps(fields, default=str))
    problem = None
    if info is None or info.get("fields") != expected:
        problem = f"its {ENTRY_FILE} does not describe the key {entry_key(fields)}"
    elif not isinstance(stored, dict) or stored.get("loader") != loader.name:
        problem = f"its {PLAN_FILE} is not a {loader.name} plan"
    else:
        outside = [
            p for k, v in stored.items() if k != "loader" for p in _strings(v) if not _inside(p)
        ]
        if outside:
            problem = f"its {PLAN_FILE} names {outside[0]!r}, outside the entry"
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


def _inside(text: str) -> bool:
    """Whether a stored plan's string is :data:`_HERE` or a path below it (no ``..``)."""
    return text == _HERE or (text.startswith(_HERE + "/") and ".." not in text.split("/"))


def evict(root: Path, max_bytes: int, keep: set[str], run_id: str) -> list[str]:
    """Evict entries under ``root`` least-recently-used first until they hold at most
    ``max_bytes``; never those named in ``keep`` nor those a live driver reads.

    Returns:
        The names of the entries removed.
    """
    entries = []
    for entry in (root / ENTRIES).glob("*"):
        info = _entry_info(entry)
        if info is None:
            continue
        try:
            used = (entry / LAST_USED).stat().st_mtime
        except OSError:
            used = 0.0
        entries.append((used, entry, int(info.get("bytes", 0))))
    total = sum(size for _, _, size in entries)
    removed = []
    for _, entry, size in sorted(entries, key=lambda e: e[0]):
        if total <= max_bytes:
            break
        if entry.name in keep or _users_alive(entry, run_id):
            continue
        log.info(
            "evicting loader cache entry %s (%.1f MiB, least recently used): the cache holds "
            "%.1f MiB, more than cache.max_bytes=%d",
            entry.name,
            size / 2**20,
            total / 2**20,
            max_bytes,
        )
        _remove_entry(entry)
        total -= size
        removed.append(entry.name)
    return removed


def cached_versions(cfg: JobConfig, table: str) -> set[int]:
    """The Delta versions of ``table`` (its path or catalog name, as the cache entries record
    it: :meth:`~flowers_job.tables.table_ref.TableRef.describe`) that complete entries of the
    loader cache were built from (what retention keeps readable)."""
    root = local_dir(cfg.paths.cache_parent_url)
    if root is None:
        return set()
    versions = set()
    for entry in (root / ENTRIES).glob("*"):
        info = _entry_info(entry)
        if info is not None and info.get("fields", {}).get("table") == table:
            versions.add(int(info["fields"]["version"]))
    return versions


class LoaderCache:
    """One run's view of the loader cache (:func:`loader_cache` makes it)."""

    def __init__(self, cfg: JobConfig, root_url: str, run_id: str, staging_url: str) -> None:
        self.cfg = cfg
        self.root_url = root_url
        self.root = local_dir(root_url)
        self.run_id = run_id
        self.staging_url = staging_url
        self.used: list[Path] = []
        """Entry folders this run reads."""

    def split(
        self,
        spark: SparkSession,
        loader: Loader,
        split: str,
        fields: dict[str, Any],
        frame: Callable[[], DataFrame],
        needed_bytes: int,
    ) -> tuple[ShardPlan, CacheUse]:
        """This run's plan of ``split``: from the entry keyed by ``fields`` if it exists,
        else written now (``frame()``'s rows, by ``loader``) and published.

        Args:
            fields: what the entry is built from (:func:`entry_key`); ``version`` among them.
            frame: the split's rows (``row_id``, ``image``, ``label_index``), built only when
                the entry must be written.
            needed_bytes: the space the write needs (:func:`cache_bytes_needed`).

        Raises:
            DataError: no space for the write, or another run held the entry's lock for
                longer than ``cache.lock_timeout_seconds``; as ``loader.write``.
        """
        t0 = time.perf_counter()
        key = entry_key(fields)
        name = f"{loader.name}-{split}-v{fields['version']}-{key}"
        if self.root is None:  # not a local or mounted path: written for this run only
            staging = f"{self.staging_url}/{name}"
            plan = loader.write(spark, frame(), staging, split)
            return plan, CacheUse(name, False, 0, round(time.perf_counter() - t0, 3))
        entry = self.root / ENTRIES / name
        reused = self._use(entry, loader, fields)
        waited = 0.0
        written = 0
        if reused is None:
            from filelock import FileLock, Timeout

            # before the lock file is made: a volume without room is left as it was
            check_cache_space(self.staging_url, needed_bytes, f"the {split} split")
            (self.root / LOCKS).mkdir(parents=True, exist_ok=True)
            lock = FileLock(str(self.root / LOCKS / f"{key}.lock"))
            t_wait = time.perf_counter()
            try:
                lock.acquire(timeout=self.cfg.cache.lock_timeout_seconds)
            except Timeout:
                raise DataError(
                    f"waited {self.cfg.cache.lock_timeout_seconds:.0f} s for another run writing "
                    f"the loader cache entry {entry} (lock {lock.lock_file}); if no run is "
                    "writing it, remove the lock file, or raise cache.lock_timeout_seconds"
                ) from None
            waited = time.perf_counter() - t_wait
            try:
                reused = self._use(entry, loader, fields)  # published while this run waited
                if reused is None:
                    written = self._write(spark, loader, split, fields, frame, entry, needed_bytes)
                    reused = self._use(entry, loader, fields)
            finally:
                lock.release()
            assert reused is not None
        use = CacheUse(
            entry.name,
            written == 0,
            written,
            round(time.perf_counter() - t0, 3),
            round(waited, 3),
        )
        log.info(
            "%s: loader cache %s %s (%.1f MiB written, %.1f s)",
            split,
            "reused" if use.reused else "written:",
            entry.name,
            written / 2**20,
            use.seconds,
        )
        return reused, use

    def _use(self, entry: Path, loader: Loader, fields: dict[str, Any]) -> ShardPlan | None:
        """The entry's plan, with this run registered as a reader; None if not published.

        Raises:
            DataError: the entry was not written by this job for ``fields``
                (:func:`check_entry`).
        """
        try:
            stored = json.loads((entry / PLAN_FILE).read_text())
        except (OSError, ValueError):
            return None
        check_entry(entry, stored, loader, fields)
        (entry / USERS).mkdir(exist_ok=True)
        (entry / USERS / f"{self.run_id}.json").write_text(json.dumps(driver_identity()))
        (entry / LAST_USED).touch()
        self.used.append(entry)
        return loader.plan_type(**_rebase(stored, _HERE, entry.resolve().as_uri()))

    def _write(
        self,
        spark: SparkSession,
        loader: Loader,
        split: str,
        fields: dict[str, Any],
        frame: Callable[[], DataFrame],
        entry: Path,
        needed_bytes: int,
    ) -> int:
        """Write the entry in the staging folder and publish it by a rename; its bytes."""
        staging_dir = local_dir(self.staging_url)
        assert staging_dir is not None
        staging = staging_dir / entry.name
        staging_url = staging.resolve().as_uri()
        check_cache_space(self.staging_url, needed_bytes, f"the {split} split")
        t0 = time.perf_counter()
        plan = loader.write(spark, frame(), staging_url, split)
        seconds = time.perf_counter() - t0
        size = Location.of(staging).size_bytes()
        info = {
            "fields": fields,
            "bytes": size,
            "seconds": round(seconds, 3),
            "created": time.time(),
            "writer": driver_identity(),
        }
        (staging / ENTRY_FILE).write_text(json.dumps(info, indent=1, sort_keys=True, default=str))
        stored = _rebase(plan.to_dict(), staging_url, _HERE)
        (staging / PLAN_FILE).write_text(json.dumps(stored, sort_keys=True))
        entry.parent.mkdir(parents=True, exist_ok=True)
        if (entry / PLAN_FILE).is_file():  # published by a writer that took no lock: keep it
            shutil.rmtree(staging, ignore_errors=True)
            return 0
        if entry.exists():  # never published (its writer stopped half-way): replaced
            _remove_entry(entry)
        os.rename(staging, entry)
        return size

    def release(self) -> None:
        """This run no longer reads its entries."""
        for entry in self.used:
            with contextlib.suppress(OSError):
                (entry / USERS / f"{self.run_id}.json").unlink()


@contextmanager
def loader_cache(cfg: JobConfig, loader: Loader) -> Iterator[LoaderCache]:
    """This run's :class:`LoaderCache`: a staging folder ``run-<id>`` (after sweeping
    orphans), removed on exit whatever happens; then this run's entries are released, the
    loader's state on this host for them swept (:meth:`Loader.release`), and the cache
    evicted down to ``cache.max_bytes`` (keeping this run's entries)."""
    root_url = cfg.paths.cache_parent_url
    with run_cache(root_url) as (staging_url, _folder):
        run_id = staging_url.rsplit("/", 1)[-1]
        cache = LoaderCache(cfg, root_url, run_id, staging_url)
        try:
            yield cache
        finally:
            cache.release()
            for entry in [*cache.used, *([_folder] if _folder is not None else [])]:
                loader.release(entry)
            if cache.root is not None:
                evict(cache.root, cfg.cache.max_bytes, {e.name for e in cache.used}, run_id)
