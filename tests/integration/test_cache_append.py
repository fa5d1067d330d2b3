"""A loader cache that grows by appending, per loader, on real photos:
ingest, prepare, then a day's change (photos added, one removed, one rewritten in place),
ingest, prepare again. The second prepare appends to the first's entries: it writes a small
share of their bytes, keeps every older segment where it is, and its plans read every
current row once per epoch and no removed or replaced row, on every rank of real
TorchDistributor processes, with the ranks' own row checks. Past
``cache.compact_dead_fraction`` the split is written whole again, and eviction keeps the
segments a newer entry still reads.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from flowers_job.config import JobConfig, load_config
from flowers_job.driver.pipeline import run_ingest
from flowers_job.driver.prepare import prepare_data
from flowers_job.loaders import resolve_loader
from flowers_job.loaders.base import ShardPlan, wrap_int64
from flowers_job.loaders.cache_dir import cached_versions
from flowers_job.loaders.cache_eviction import evict
from flowers_job.loaders.cache_marker import ENTRIES, ENTRY_FILE
from flowers_job.tables.table_ref import table_ref
from flowers_job.train.metrics import PassSums, check_shard, check_totals
from tests.support.data import DAY_SAMPLE_PER_LABEL, day_change, sample_photos
from tests.support.shards import read_plan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.tier("full")]

PER_LABEL = DAY_SAMPLE_PER_LABEL
WORLD_SIZE = 2


def _cfg(images: Path, out: Path, loader: str, *overrides: str) -> JobConfig:
    return load_config(
        None,
        [
            "data.image_size=32",
            f"data.loader={loader}",
            f"distributed.num_processes={WORLD_SIZE}",
            "train.per_device_batch_size=8",
            *overrides,
        ],
        **{"data.images": images, "paths.output_dir": out},
    )


def _prepare(spark: SparkSession, cfg: JobConfig) -> tuple[dict[str, ShardPlan], dict[str, Any]]:
    with prepare_data(spark, *resolve_loader(cfg)) as data:
        return {s: getattr(data, s) for s in ("train", "val", "test")}, data.loader_cache


def _current(spark: SparkSession, cfg: JobConfig, split: str) -> list[int]:
    df = spark.read.format("delta").load(str(cfg.paths.table("images")))
    return sorted(r["row_id"] for r in df.where(f"split = '{split}'").select("row_id").collect())


def _check_epoch(plan: ShardPlan, cfg: JobConfig, expected: list[int], gone: set[int]) -> None:
    """Every rank reads its planned rows in the planned steps; over all ranks every current
    row once and no removed one; the ranks' own checks pass."""
    read = read_plan(plan, cfg, WORLD_SIZE, [1], seed=3)
    ids = [read["row_ids"][r][0] for r in range(WORLD_SIZE)]
    counts = Counter(i for rank in ids for i in rank)
    assert sorted(counts) == expected and set(counts.values()) == {1}
    assert not gone & set(counts)
    assert [read["steps"][r][0] for r in range(WORLD_SIZE)] == [plan.steps_per_epoch] * 2
    assert [read["rows_read"][r][0] for r in range(WORLD_SIZE)] == plan.rows_per_shard
    sums = [
        PassSums(0.0, 0, len(i), wrap_int64(sum(i)), read["rows_read"][r][0])
        for r, i in enumerate(ids)
    ]
    for rank in range(WORLD_SIZE):
        check_shard("train", plan, rank, sums[rank])
    check_totals(
        "train",
        plan,
        PassSums(0.0, 0, sum(s.rows for s in sums), wrap_int64(sum(s.checksum for s in sums)), 0),
    )


def test_a_day_appends_to_each_split_and_the_ranks_read_every_current_row_once(
    spark: SparkSession, loader: str, tmp_path: Path
) -> None:
    images = sample_photos(tmp_path / "images", per_label=PER_LABEL)
    cfg = _cfg(images, tmp_path / "out", loader)
    run_ingest(spark, cfg)
    _, first = _prepare(spark, cfg)
    assert all(not u["reused"] and u["appended_to"] is None for u in first.values()), first
    before = {s: set(_current(spark, cfg, s)) for s in first}

    day_change(images, 0)
    run_ingest(spark, cfg)
    plans, second = _prepare(spark, cfg)
    entries = tmp_path / "out" / "loader_cache" / ENTRIES
    for split, use in second.items():
        assert use["appended_to"] == first[split]["entry"], second
        marker = json.loads((entries / use["entry"] / ENTRY_FILE).read_text())
        assert marker["grown_from"] == first[split]["entry"]
        assert [s[0] for s in marker["segments"]] == [first[split]["entry"], use["entry"]]
    first_bytes = sum(u["bytes_written"] for u in first.values())
    second_bytes = sum(u["bytes_written"] for u in second.values())
    assert 0 < second_bytes <= 0.05 * first_bytes, (second_bytes, first_bytes)

    for split, plan in plans.items():
        expected = _current(spark, cfg, split)
        assert plan.dataset_size == len(expected)
        if split == "train":  # the ranks read it: every current row once, no removed one
            _check_epoch(plan, cfg, expected, before[split] - set(expected))

    # the first entries are superseded: unpublished (no run reads the older version, and
    # retention need not keep it), their segments kept for the second entries
    for split, use in first.items():
        assert not (entries / use["entry"] / ENTRY_FILE).exists()
        marker = json.loads((entries / second[split]["entry"] / ENTRY_FILE).read_text())
        assert (entries / use["entry"] / marker["segments"][0][1]).is_dir()
    versions = {
        json.loads((entries / u["entry"] / ENTRY_FILE).read_text())["fields"]["version"]
        for u in second.values()
    }
    assert len(versions) == 1
    assert cached_versions(cfg.paths.cache_root, table_ref(cfg, "images").describe()) == versions
    again, third = _prepare(spark, cfg)
    assert all(u["reused"] and u["bytes_written"] == 0 for u in third.values()), third
    _check_epoch(again["train"], cfg, _current(spark, cfg, "train"), set())

    # evicted in turn, the second entries take the segments no marker reads any more
    assert sorted(evict(entries.parent, 0, set(), "run-x")) == sorted(
        u["entry"] for u in second.values()
    )
    assert not [f for f in entries.rglob("*") if f.is_file() and f.suffix != ".json"]


def test_past_the_dead_share_the_split_is_written_whole_again(
    spark: SparkSession, loader: str, tmp_path: Path
) -> None:
    """``cache.compact_dead_fraction`` small: in a split where the day's change killed a
    row (removed, or rewritten in place), that passes it, and the split is written whole
    (one segment, no deletion list); the others still append (no row died there)."""
    images = sample_photos(tmp_path / "images", per_label=PER_LABEL)
    cfg = _cfg(images, tmp_path / "out", loader, "cache.compact_dead_fraction=0.001")
    run_ingest(spark, cfg)
    _, first = _prepare(spark, cfg)
    day_change(images, 0)
    run_ingest(spark, cfg)
    plans, second = _prepare(spark, cfg)
    whole = [s for s, u in second.items() if u["appended_to"] is None]
    assert whole and all(not second[s]["reused"] for s in whole), second  # the removal's split
    entries = tmp_path / "out" / "loader_cache" / ENTRIES
    for use in first.values():  # superseded, compacted or appended to: unpublished
        assert not (entries / use["entry"] / ENTRY_FILE).exists()
    for split, plan in plans.items():
        assert plan.deletions_url is None  # appended only where no row died
        assert not plan.segment_dirs if split in whole else plan.stored_rows == plan.dataset_size
