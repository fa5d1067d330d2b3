"""The loader cache (driver side): each split written once per content, reused by later runs,
on a disk and on an object store alike.

A loader's copy of a split (Petastorm's Parquet, Streaming's MDS shards) is an **entry** of
the cache root ``paths.cache_url`` (default ``<output_dir>/loader_cache``), keyed by what
decides its bytes and its plan (:func:`entry_key`): the ``images`` table (path and Delta
table id), its Delta version, the split, the loader, the loader's settings
(:meth:`~flowers_job.loaders.base.Loader.cache_settings`) and the cache's layout
(:data:`CACHE_FORMAT`). A later ``run``, ``train`` or ``--resume`` on the same version reads
the entry and writes no byte of it.

Layout of the root (a local or mounted directory, or an ``s3a://`` prefix)::

    entries/<loader>-<split>-v<version>-<key>/
        entry.json          the marker: what it was built from, its bytes, its plan,
                            which data folder is the entry's and the segments it reads
                            (its own and, grown by appending, older entries' data
                            folders); written last, by one put-if-absent (the entry is
                            published when it exists)
        data-run-<id>/      one writer's files (the marker names the winner's): the
                            loader's files, and an appended entry's deletions.npy
        last_used           rewritten by every run that uses it: the LRU order
        users/run-<id>.json the drivers reading it now (host, pid, start time): leases
    locks/<key>.lock        a disk only: held while an entry is written (saves duplicate work)
    run-<id>/owner.json     a run's identity, while it runs (the sweep of dead writers)

A writer writes under its own ``data-run-<id>/`` and publishes by one put-if-absent of
``entry.json`` (:meth:`flowers_job.location.Location.create_bytes`); readers trust only a
published marker and lease the entry first, so a partial entry is never read and an entry is
never evicted under a reader. Why, and what a store without a put-if-absent gets:
docs/architecture.md, "A loader cache written once per content".

The marker's layout and checks are :mod:`flowers_job.loaders.cache_marker`; an entry grown by
appending to an older one is :mod:`flowers_job.loaders.cache_growth`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from flowers_job.config import CacheConfig
from flowers_job.errors import DataError
from flowers_job.loaders.base import Loader, ShardPlan
from flowers_job.loaders.cache_eviction import LAST_USED, USERS, evict, remove_entry
from flowers_job.loaders.cache_growth import Changes, Growth, grow
from flowers_job.loaders.cache_marker import (
    DATA_PREFIX,
    ENTRIES,
    ENTRY_FILE,
    ROOT_MARK,
    check_entry,
    entry_info,
    entry_key,
    entry_segments,
    read_json,
    rebase,
    referenced_segments,
)
from flowers_job.loaders.cache_space import check_cache_space
from flowers_job.loaders.cache_sweep import OWNER_FILE, owner_alive, run_cache
from flowers_job.location import Location
from flowers_job.runtime.parent_watch import driver_identity

__all__ = ["CACHE_FORMAT", "CacheUse", "LoaderCache", "cached_versions", "loader_cache"]

log = logging.getLogger(__name__)

CACHE_FORMAT = 4
"""The entries' layout, part of every key: 4 is a marker published by a put-if-absent over
a writer's own data folder and the segments of older entries it grew from, rows carrying
their segment (2 and before: a folder published by a rename)."""

LOCKS = "locks"


@dataclass
class CacheUse:
    """How a run got one split's cache: for ``summary.json`` (``loader_cache``)."""

    entry: str
    """The entry's folder name (or the staging folder's, for a store without publishing)."""
    reused: bool
    """True when this run reads an entry it did not publish: written by an earlier run, or
    by a concurrent one whose publish won."""
    bytes_written: int
    """Bytes this run wrote to the cache's store for it, on any store: 0 when the entry
    existed; a concurrent writer that lost the publish counts what it wrote (and removed)."""
    seconds: float
    """Time to find or write it, waiting for another writer's lock included (s)."""
    waited_seconds: float = 0.0
    """Of which waiting for the lock of another run writing the same entry (s; disk only)."""
    lost_publish: bool = False
    """This run wrote the entry too, and another run published it first."""
    appended_to: str | None = None
    """The older entry this one grew from by appending (None: written whole, or reused)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cached_versions(root: Location, table: str) -> set[int]:
    """The Delta versions of ``table`` (its path or catalog name, as the cache entries record
    it: :meth:`~flowers_job.tables.table_ref.TableRef.describe`) that published entries of
    the loader cache under ``root`` (``paths.cache_root``) were built from (what retention
    keeps readable), on any store."""
    versions = set()
    for entry in (root / ENTRIES).iterdir():
        info = entry_info(entry)
        if info is not None and info.get("fields", {}).get("table") == table:
            versions.add(int(info["fields"]["version"]))
    return versions


class LoaderCache:
    """One run's view of the loader cache (:func:`loader_cache` makes it)."""

    def __init__(
        self, settings: CacheConfig, root: Location, run_id: str, staging: Location
    ) -> None:
        self.settings = settings
        """The ``cache`` section: lock timeout, growth by append and its limits."""
        self.root = root
        self.run_id = run_id
        self.staging = staging
        self.used: list[Location] = []
        """Entries this run reads."""
        self.written: list[Location] = []
        """Data folders this run wrote (removed at the end unless published)."""
        self.superseded: list[Location] = []
        """Older entries of the lineages of the entries this run published, appended to or
        compacted (:meth:`unpublish_superseded`)."""
        self.publish_problem = self.root.create_problem()
        """Why entries cannot be published on this store (then written per run); None."""
        if self.publish_problem is not None:
            log.warning(
                "the loader cache %s is written for this run only and not reused: %s",
                root,
                self.publish_problem,
            )

    def split(
        self,
        spark: SparkSession,
        loader: Loader,
        split: str,
        fields: dict[str, Any],
        frame: Callable[[], DataFrame],
        needed_bytes: int,
        changes: Callable[[int], Changes] | None = None,
    ) -> tuple[ShardPlan, CacheUse]:
        """This run's plan of ``split``: from the entry keyed by ``fields`` if it is
        published; else grown from the newest older entry of the same lineage by appending
        (``changes``, ``cache.append``), or written whole (``frame()``'s rows, by
        ``loader``), and published.

        Args:
            fields: what the entry is built from (:func:`entry_key`, with
                :data:`CACHE_FORMAT` added); ``version`` among them, and the rest (the
                lineage) shared by the entries an entry can grow from.
            frame: the split's rows (``row_id``, ``image``, ``label_index``, ``segment``),
                built only when the entry must be written.
            needed_bytes: the space the write needs
                (:func:`~flowers_job.loaders.cache_space.cache_bytes_needed`).
            changes: given an older version of the lineage, the split's changes since
                (:class:`Changes`); None: no appending.

        Raises:
            DataError: no space for the write, another run held the entry's lock for
                longer than ``cache.lock_timeout_seconds``, or an entry not written by this
                job (:func:`check_entry`); as ``loader.write``.
        """
        t0 = time.perf_counter()
        fields = {**fields, "cache_format": CACHE_FORMAT}
        key = entry_key(fields)
        name = f"{loader.name}-{split}-v{fields['version']}-{key}"
        if self.publish_problem is not None:  # written for this run only
            staging = self.staging / name
            once = loader.write(spark, frame(), staging, split)
            size = staging.size_bytes()
            return once, CacheUse(name, False, size, round(time.perf_counter() - t0, 3))
        entry = self.root / ENTRIES / name
        plan = self._use(entry, loader, fields)
        waited = 0.0
        written, won, grown = 0, False, None
        if plan is None:
            # before the lock file is made: a volume without room is left as it was
            check_cache_space(self.root, needed_bytes, f"the {split} split")
            with self._lock(entry, key) as waited:
                plan = self._use(entry, loader, fields)  # published while this run waited
                if plan is None:
                    written, won, grown = self._write(
                        spark, loader, split, fields, frame, entry, needed_bytes, changes
                    )
                    plan = self._use(entry, loader, fields)
            if plan is None:
                raise DataError(
                    f"the loader cache entry {entry} was published and then removed before "
                    "this run could read it; run again"
                )
        use = CacheUse(
            entry.name,
            not won,
            written,
            round(time.perf_counter() - t0, 3),
            round(waited, 3),
            lost_publish=written > 0 and not won,
            appended_to=grown,
        )
        log.info(
            "%s: loader cache %s %s (%.1f MiB written%s%s, %.1f s)",
            split,
            "reused" if use.reused else "written:",
            entry.name,
            written / 2**20,
            f", appended to {grown}" if grown else "",
            ", another run published it first" if use.lost_publish else "",
            use.seconds,
        )
        return plan, use

    @contextmanager
    def _lock(self, entry: Location, key: str) -> Iterator[float]:
        """A disk's file lock of ``key`` (yields the seconds waited); nothing on S3."""
        if not self.root.is_local:
            yield 0.0
            return
        from filelock import FileLock, Timeout

        locks = self.root.local_path / LOCKS
        locks.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(locks / f"{key}.lock"))
        t_wait = time.perf_counter()
        try:
            lock.acquire(timeout=self.settings.lock_timeout_seconds)
        except Timeout:
            raise DataError(
                f"waited {self.settings.lock_timeout_seconds:.0f} s for another run writing "
                f"the loader cache entry {entry} (lock {lock.lock_file}); if no run is "
                "writing it, remove the lock file, or raise cache.lock_timeout_seconds"
            ) from None
        try:
            yield time.perf_counter() - t_wait
        finally:
            lock.release()

    def _lease(self, entry: Location) -> None:
        """Register this run as a reader of ``entry`` and mark it used (before its marker is
        read: :func:`~flowers_job.loaders.cache_eviction.remove_entry` relies on the order)."""
        (entry / USERS / f"{self.run_id}.json").write_text(json.dumps(driver_identity()))
        (entry / LAST_USED).write_text(f"{time.time():.3f}")

    def _leased_info(self, entry: Location) -> dict[str, Any] | None:
        """``entry``'s marker, with this run leased as its reader; None (and no lease) when
        it is not published."""
        if not isinstance(read_json(entry / ENTRY_FILE), dict):
            return None
        self._lease(entry)
        info = read_json(entry / ENTRY_FILE)  # read again after the lease: still published
        if not isinstance(info, dict):  # evicted meanwhile
            with contextlib.suppress(OSError):
                (entry / USERS / f"{self.run_id}.json").unlink()
            return None
        if entry not in self.used:
            self.used.append(entry)
        return info

    def _plan(self, info: dict[str, Any], loader: Loader) -> ShardPlan:
        """A checked marker's plan, its paths made absolute."""
        return loader.plan_type(**rebase(info["plan"], ROOT_MARK, self.root.as_uri()))

    def _use(self, entry: Location, loader: Loader, fields: dict[str, Any]) -> ShardPlan | None:
        """The entry's plan, with this run leased as a reader; None if not published.

        Raises:
            DataError: the entry was not written by this job for ``fields``
                (:func:`check_entry`).
        """
        info = self._leased_info(entry)
        if info is None:
            return None
        check_entry(entry, info, loader, fields)
        return self._plan(info, loader)

    def _base(
        self, loader: Loader, split: str, fields: dict[str, Any]
    ) -> tuple[Location, dict[str, Any], ShardPlan] | None:
        """The newest published entry of an older version of the same lineage (``fields``
        but ``version``), leased by this run; None when there is none."""
        version = int(fields["version"])
        prefix = f"{loader.name}-{split}-v"
        older = []
        for entry in (self.root / ENTRIES).glob(f"{prefix}*"):
            digits = entry.name[len(prefix) :].split("-", 1)[0]
            if digits.isdigit() and int(digits) < version:
                older.append((int(digits), entry))
        for number, entry in sorted(older, key=lambda e: -e[0]):
            candidate = {**fields, "version": number}
            info = read_json(entry / ENTRY_FILE)
            if not isinstance(info, dict) or info.get("fields") != json.loads(
                json.dumps(candidate, default=str)
            ):
                continue
            info = self._leased_info(entry)
            if info is None:
                continue
            try:
                check_entry(entry, info, loader, candidate)
            except DataError as exc:
                log.warning("%s: not appending to %s: %s", split, entry.name, exc)
                return None
            return entry, info, self._plan(info, loader)
        return None

    # Arguments: one cache entry's write: the loader, its split, its fields, its frame, where, how
    # big, and its changes.
    def _write(  # noqa: PLR0913
        self,
        spark: SparkSession,
        loader: Loader,
        split: str,
        fields: dict[str, Any],
        frame: Callable[[], DataFrame],
        entry: Location,
        needed_bytes: int,
        changes: Callable[[int], Changes] | None,
    ) -> tuple[int, bool, str | None]:
        """Write the entry's files in this run's data folder (a new segment over an older
        entry of the lineage, or the split whole) and publish them by one put-if-absent of
        the marker. Returns the bytes written, whether this run's publish won (if not, its
        folder is removed and the winner's is read), and the entry it grew from (None:
        written whole)."""
        data = entry / f"{DATA_PREFIX}{self.run_id}"
        self.written.append(data)
        referenced = referenced_segments(self.root)
        for stale in entry.glob(f"{DATA_PREFIX}*"):  # unpublished: whose writer is gone?
            owner = read_json(self.root / stale.name.removeprefix(DATA_PREFIX) / OWNER_FILE)
            alive = isinstance(owner, dict) and owner_alive(owner)
            if stale == data or not (alive or (entry.name, stale.name) in referenced):
                with contextlib.suppress(OSError):
                    stale.rmtree()
        check_cache_space(data, needed_bytes, f"the {split} split")
        t0 = time.perf_counter()
        segments: list[tuple[str, str]] = []
        grown = None
        plan = None
        base = self._base(loader, split, fields) if changes and self.settings.append else None
        if base is not None and changes is not None:
            plan = self._append(spark, loader, split, int(fields["version"]), base, changes, data)
            if plan is not None:
                segments, grown = entry_segments(base[1]), base[0].name
        if plan is None:
            with contextlib.suppress(OSError):
                data.rmtree()  # what a failed append left
            plan = loader.write(spark, frame(), data, split)
        seconds = time.perf_counter() - t0
        size = data.size_bytes()
        info = {
            "fields": fields,
            "bytes": size,
            "seconds": round(seconds, 3),
            "created": time.time(),
            "writer": driver_identity(),
            "data": data.name,
            "segments": [[e, d] for e, d in [*segments, (entry.name, data.name)]],
            "grown_from": grown,
            "plan": rebase(plan.to_dict(), self.root.as_uri(), ROOT_MARK),
        }
        self._lease(entry)  # before it is published: no evictor takes it from under us
        won = (entry / ENTRY_FILE).create_bytes(
            json.dumps(info, indent=1, sort_keys=True, default=str).encode()
        )
        if not won:
            with contextlib.suppress(OSError):
                data.rmtree()
        elif base is not None:  # appended to, or compacted: a newer entry of its lineage
            self.superseded.append(base[0])
        return size, won, grown

    def _append(
        self,
        spark: SparkSession,
        loader: Loader,
        split: str,
        version: int,
        base: tuple[Location, dict[str, Any], ShardPlan],
        changes: Callable[[int], Changes],
        data: Location,
    ) -> ShardPlan | None:
        """The plan of ``base`` grown to ``version``, its new segment and deletion list
        written under ``data`` (:func:`~flowers_job.loaders.cache_growth.grow`); None when
        the split should be written whole instead."""
        entry, info, plan = base
        return grow(
            self.settings,
            spark,
            loader,
            split,
            Growth(entry.name, int(info["fields"]["version"]), plan, len(entry_segments(info))),
            version,
            changes,
            data,
        )

    def unpublish_superseded(self) -> list[str]:
        """Unpublish the entries that this run's new entries grew from (or compacted), once
        no live run leases them (call after :meth:`release`): no run reads an older version
        of the table, and each published entry keeps its version readable (retention,
        :func:`cached_versions`), so without this a year of daily appends would keep a year
        of Delta versions. Their segments stay as long as a newer entry reads them.

        Returns:
            The names of the entries unpublished.
        """
        done = []
        for entry in self.superseded:
            info = entry_info(entry)
            if info is not None and remove_entry(entry, info, self.run_id):
                log.info(
                    "loader cache: %s is superseded by a newer entry of its lineage", entry.name
                )
                done.append(entry.name)
        return done

    def release(self) -> None:
        """This run no longer reads its entries; its unpublished data folders are removed."""
        for entry in self.used:
            with contextlib.suppress(OSError):
                (entry / USERS / f"{self.run_id}.json").unlink()
        referenced = referenced_segments(self.root) if self.written else set()
        for data in self.written:
            if (data.parent.name, data.name) not in referenced:
                with contextlib.suppress(OSError):
                    data.rmtree()


@contextmanager
def loader_cache(root: Location, settings: CacheConfig, loader: Loader) -> Iterator[LoaderCache]:
    """This run's :class:`LoaderCache` under ``root`` (``paths.cache_root``): a run folder
    ``run-<id>`` (after sweeping orphans), removed on exit whatever happens; then this run's
    entries are released, the loader's state on this host for them swept
    (:meth:`Loader.release`), and the cache evicted down to ``cache.max_bytes`` (keeping this
    run's entries)."""
    with run_cache(root) as (staging, _folder):
        cache = LoaderCache(settings, root, staging.name, staging)
        try:
            yield cache
        finally:
            cache.release()
            folders = [e.local_path for e in cache.used if e.is_local]
            for folder in [*folders, *([_folder] if _folder is not None else [])]:
                loader.release(folder)
            if cache.publish_problem is None:
                cache.unpublish_superseded()
                keep = {e.name for e in cache.used} - {e.name for e in cache.superseded}
                evict(cache.root, settings.max_bytes, keep, cache.run_id)
