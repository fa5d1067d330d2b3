"""The loader cache's publish protocol on its two stores, a disk and a real S3 API server
(moto, with S3's conditional writes): an entry is written under its writer's own prefix and
published by one put-if-absent of its marker; a second run reuses it and writes nothing;
two drivers writing the same entry at once publish one entry and both read it; eviction
spares leased entries and puts a marker back under a reader that came meanwhile; a dead
writer's folder is swept and a published one never is.

The loader here is a small real one (:class:`FileLoader`: it writes a few files through
:class:`~flowers_job.location.Location`, with no Spark), so that the protocol is tested
apart from Spark's writers; ``tests/integration/test_cache_object_store.py`` runs the CLI
with both loaders on S3.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from flowers_job.config import JobConfig, load_config
from flowers_job.loaders.base import Loader, Sharding, ShardPlan
from flowers_job.loaders.cache_dir import CacheUse, LoaderCache
from flowers_job.loaders.cache_eviction import USERS, evict, remove_entry
from flowers_job.loaders.cache_marker import ENTRIES, ENTRY_FILE
from flowers_job.loaders.cache_sweep import OWNER_FILE, sweep_orphaned_caches
from flowers_job.location import Location
from flowers_job.runtime.parent_watch import driver_identity
from tests.support.s3 import S3Store, fresh_bucket, s3_server  # noqa: F401 (fixture)

pytestmark = [pytest.mark.timeout(300), pytest.mark.tier("gate")]

FIELDS = {"table": "/t/images", "table_id": "t-1", "version": 7, "split": "train"}
FILES = 3
FILE_BYTES = 1000


class FileLoader(Loader):
    """Writes :data:`FILES` files of :data:`FILE_BYTES` bytes into the cache folder."""

    name = "files"
    distribution = "flowers-job"
    module = "flowers_job"
    extra = "flowers-job"
    before_write: ClassVar[Callable[[], None] | None] = None

    def write(self, spark: Any, df: Any, cache_dir: Location, split: str) -> ShardPlan:
        folder = cache_dir / f"files-{split}"
        for i in range(FILES):
            (folder / f"part-{i}").write_bytes(bytes([i]) * FILE_BYTES)
        return ShardPlan(
            loader=self.name,
            cache_dir_url=folder.as_uri(),
            dataset_size=FILES,
            checksum=0,
            rows_per_shard=[FILES],
            checksum_per_shard=None,
            steps_per_epoch=1,
            per_device_batch_size=FILES,
        )

    @classmethod
    def open(cls, plan: ShardPlan, transform: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the protocol tests read no rows")


@pytest.fixture(params=["disk", "s3"])
def root(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """A cache root on a disk, or in a fresh bucket of the session's moto server."""
    if request.param == "disk":
        yield (tmp_path / "cache").as_uri()
        return
    store: S3Store = fresh_bucket(request.getfixturevalue("s3_server"))
    for key, value in store.env().items():
        monkeypatch.setenv(key, value)
    yield store.url("cache")


def _cfg(root: str) -> JobConfig:
    return load_config(None, [f"paths.cache_url={root}"], **{"paths.output_dir": "/tmp/unused"})


def _cache(root: str, run_id: str) -> LoaderCache:
    cfg = _cfg(root)
    run = Location.of(root) / run_id
    (run / OWNER_FILE).write_text(json.dumps(driver_identity()))
    return LoaderCache(cfg.cache, Location.of(root), run_id, run)


def _split(
    cache: LoaderCache, frame: Callable[[], Any] = lambda: None
) -> tuple[ShardPlan, CacheUse]:
    loader = FileLoader(Sharding(2, 2, 8), str(FIELDS["table"]))
    return cache.split(None, loader, "train", dict(FIELDS), frame, 0)  # type: ignore[arg-type]


def _keys(root: str) -> list[str]:
    """Every file under the root, relative to it."""
    base = Location.of(root)
    return [f.url[len(base.url) + 1 :] for f in base.walk()]


def test_an_entry_is_published_once_and_reused_without_a_byte_written(root: str) -> None:
    plan, first = _split(_cache(root, "run-a"))
    assert not first.reused and first.bytes_written == FILES * FILE_BYTES
    entry = Location.of(root) / ENTRIES / first.entry
    marker = json.loads((entry / ENTRY_FILE).read_text())
    assert marker["data"] == "data-run-a" and marker["bytes"] == FILES * FILE_BYTES
    assert plan.cache_dir_url == (entry / "data-run-a" / "files-train").as_uri()
    assert Location.of(plan.cache_dir_url).is_dir()

    before = {k: (Location.of(root) / k).read_bytes() for k in _keys(root) if "data-" in k}

    def never() -> Any:
        raise AssertionError("a published entry is never written again")

    again, second = _split(_cache(root, "run-b"), never)
    assert again == plan
    assert second.reused and second.bytes_written == 0 and not second.lost_publish
    after = {k: (Location.of(root) / k).read_bytes() for k in _keys(root) if "data-" in k}
    assert after == before
    leases = sorted(f.name for f in (entry / USERS).iterdir())
    assert leases == ["run-a.json", "run-b.json"]


def test_two_drivers_writing_one_entry_at_once_publish_one_and_both_read_it(root: str) -> None:
    """On S3 both write before either publishes (a barrier in the rows' callable): one put
    wins, the loser removes its folder and reads the winner's. On a disk the second waits
    for the key's file lock and reuses the entry, writing nothing."""
    both_writing = threading.Barrier(2, timeout=60)
    local = Location.of(root).is_local
    results: dict[str, tuple[ShardPlan, CacheUse]] = {}
    errors: list[BaseException] = []

    def frame() -> None:
        if not local:  # S3 has no lock: both write at once
            both_writing.wait()

    def run(run_id: str) -> None:
        try:
            results[run_id] = _split(_cache(root, run_id), frame)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in ("run-a", "run-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    (plan_a, use_a), (plan_b, use_b) = results["run-a"], results["run-b"]
    assert plan_a == plan_b
    assert sorted([use_a.reused, use_b.reused]) == [False, True]
    loser = use_a if use_a.reused else use_b
    if local:
        assert loser.bytes_written == 0 and not loser.lost_publish  # it waited for the lock
    else:
        assert loser.lost_publish and loser.bytes_written == FILES * FILE_BYTES
    entries = (Location.of(root) / ENTRIES).iterdir()
    assert len(entries) == 1
    marker = json.loads((entries[0] / ENTRY_FILE).read_text())
    assert [d.name for d in entries[0].glob("data-*")] == [marker["data"]]
    assert Location.of(plan_a.cache_dir_url).is_dir()


def test_eviction_is_lru_and_spares_leased_entries_and_puts_a_marker_back(root: str) -> None:
    cache = _cache(root, "run-a")
    _, use = _split(cache)
    entry = Location.of(root) / ENTRIES / use.entry
    info = json.loads((entry / ENTRY_FILE).read_text())

    assert evict(root, 0, set(), "run-z") == []  # run-a still leases it
    assert not remove_entry(entry, info, "run-z")  # a reader: the marker is put back
    assert json.loads((entry / ENTRY_FILE).read_text()) == info

    cache.release()
    assert evict(root, 0, set(), "run-z") == [use.entry]
    assert not (entry / ENTRY_FILE).exists() and not (entry / info["data"]).exists()
    _, again = _split(_cache(root, "run-b"))  # written again after eviction
    assert not again.reused and again.bytes_written == FILES * FILE_BYTES


def _dead_identity() -> dict[str, Any]:
    """The identity of a process of this host that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return {**driver_identity(), "pid": proc.pid, "create_time": 1.0}


def test_a_dead_writers_folder_is_swept_and_a_published_one_never_is(root: str) -> None:
    _, use = _split(_cache(root, "run-a"))
    entry = Location.of(root) / ENTRIES / use.entry
    half = entry / "data-run-dead" / "files-train" / "part-0"
    half.write_bytes(b"half written")
    # run-a's driver "died" too: its published folder must stay
    for run_id in ("run-dead", "run-a"):
        (Location.of(root) / run_id / OWNER_FILE).write_text(json.dumps(_dead_identity()))
    swept = sorted(f.name for f in sweep_orphaned_caches(Location.of(root)))
    assert swept == ["run-a", "run-dead"]
    assert not (entry / "data-run-dead").exists()
    assert (entry / "data-run-a" / "files-train" / "part-0").is_file()
    _, again = _split(_cache(root, "run-b"))
    assert again.reused


def test_a_marker_is_created_by_exactly_one_of_many_writers(root: str) -> None:
    marker = Location.of(root) / "marker.json"
    wins: list[bool] = []
    start = threading.Barrier(6, timeout=60)

    def put(i: int) -> None:
        start.wait()
        wins.append(marker.create_bytes(json.dumps({"writer": i}).encode()))

    threads = [threading.Thread(target=put, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(wins) == [False] * 5 + [True]
    assert json.loads(marker.read_text())["writer"] in range(6)
    assert _keys(root) == ["marker.json"]  # no temp file left behind
