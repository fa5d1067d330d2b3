"""The loader cache: written once per (images version, split, loader, settings), reused by
later runs without writing a byte, published atomically, safe when two runs start at once,
and evicted least-recently-used beyond ``cache.max_bytes``."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from flowers_job.config import JobConfig, load_config
from flowers_job.driver.prepare import prepare_data
from flowers_job.loaders import resolve_loader
from flowers_job.loaders.cache_eviction import USERS
from flowers_job.loaders.cache_marker import ENTRIES, ENTRY_FILE
from flowers_job.runtime.parent_watch import driver_identity
from tests.support.data import SELECTED_LOADERS

pytestmark = [pytest.mark.timeout(900), pytest.mark.tier("full")]

LOADER = SELECTED_LOADERS[0]


def _cfg(tables: Path, cache: Path, *overrides: str) -> JobConfig:
    return load_config(
        None,
        [
            "data.image_size=32",
            f"data.loader={LOADER}",
            "train.per_device_batch_size=4",
            f"paths.cache_url={cache.resolve().as_uri()}",
            *overrides,
        ],
        **{"paths.output_dir": tables},
    )


def _prepare(spark: SparkSession, cfg: JobConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """(plans, loader_cache) of one prepare_data, as a run records them."""
    with prepare_data(spark, *resolve_loader(cfg)) as data:
        plans = {s: getattr(data, s).to_dict() for s in ("train", "val", "test")}
        return plans, data.loader_cache


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file of the entries but the LRU stamp and the readers: (size, mtime_ns)."""
    return {
        str(f.relative_to(folder)): (f.stat().st_size, f.stat().st_mtime_ns)
        for f in folder.rglob("*")
        if f.is_file() and f.name != "last_used" and USERS not in f.parts
    }


def test_a_second_run_reuses_every_entry_and_writes_nothing(
    spark: SparkSession, tables: Path, tmp_path: Path
) -> None:
    """The first run writes one entry per split, the second reuses them all: no byte
    written, the same plans, the entries' files untouched. An entry that was never
    published (no entry.json: its writer stopped half-way) is not read but written again,
    and the unpublished folder is swept by the writer."""
    cfg = _cfg(tables, tmp_path / "cache")
    plans, first = _prepare(spark, cfg)
    assert all(not u["reused"] and u["bytes_written"] > 0 for u in first.values()), first
    entries = tmp_path / "cache" / ENTRIES
    assert sorted(p.name for p in entries.iterdir()) == sorted(u["entry"] for u in first.values())
    before = _files(entries)
    again, second = _prepare(spark, cfg)
    assert again == plans
    assert all(u["reused"] and u["bytes_written"] == 0 for u in second.values()), second
    assert _files(entries) == before
    assert not list((tmp_path / "cache").glob("run-*"))  # staging folders are gone
    assert not list(entries.glob(f"*/{USERS}/*.json"))  # no reader left registered

    broken = entries / first["val"]["entry"]
    (broken / ENTRY_FILE).unlink()
    _, third = _prepare(spark, cfg)
    assert not third["val"]["reused"] and third["val"]["bytes_written"] > 0
    assert third["train"]["reused"] and third["test"]["reused"]
    assert (broken / ENTRY_FILE).is_file()
    marker = json.loads((broken / ENTRY_FILE).read_text())
    assert [p.name for p in broken.glob("data-*")] == [marker["data"]]


def test_two_runs_that_start_at_once_write_each_entry_once(
    spark: SparkSession, tables: Path, tmp_path: Path
) -> None:
    """Two drivers' prepare at the same time on the same version: one writes each split, the
    other waits for it and reuses it; both get the same plans."""
    cfg = _cfg(tables, tmp_path / "cache")
    results: list[tuple[dict[str, Any], dict[str, Any]]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(_prepare(spark, cfg))
        except BaseException as exc:  # reported below, with the other thread's result
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert len(results) == 2 and results[0][0] == results[1][0]
    for split in ("train", "val", "test"):
        uses = [r[1][split] for r in results]
        assert sorted(u["reused"] for u in uses) == [False, True], uses
    assert len(list((tmp_path / "cache" / ENTRIES).iterdir())) == 3


def test_eviction_is_least_recently_used_and_spares_entries_in_use(
    spark: SparkSession, tables: Path, tmp_path: Path
) -> None:
    """With ``cache.max_bytes=0`` a run keeps only its own entries: those of other settings
    are evicted after it, unless a live driver still reads them."""
    cache = tmp_path / "cache"
    _, old = _prepare(spark, _cfg(tables, cache, "cache.max_bytes=0"))
    entries = cache / ENTRIES
    busy = entries / old["val"]["entry"]  # another driver (this process) still reads it
    (busy / USERS).mkdir(exist_ok=True)
    (busy / USERS / "run-other.json").write_text(json.dumps(driver_identity()))
    _, new = _prepare(spark, _cfg(tables, cache, "cache.max_bytes=0", "train.seed=1"))
    assert all(u["reused"] for u in new.values())  # the seed is not in the key: reused
    _, other = _prepare(
        spark, _cfg(tables, cache, "cache.max_bytes=0", "train.per_device_batch_size=2")
    )
    assert not any(u["reused"] for u in other.values())
    left = sorted(p.name for p in entries.iterdir())
    assert left == sorted([busy.name, *(u["entry"] for u in other.values())])
