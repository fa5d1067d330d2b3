"""The loader cache on an object store, as a user meets it, in one scenario (each of its CLI
runs costs a Spark start and an ingest on S3): `flowers-job run` with its output (the tables,
the loader cache, the summary) in a bucket of a real S3 API server (moto, with S3's
conditional writes), then `flowers-job train` on the unchanged tables, which writes no byte of
cache and says it reused each split, in its summary and its log; then a day's change of the
photos, appended to the cache in the bucket by the next `run`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowers_job.loaders import loader_problem
from flowers_job.loaders.cache_marker import ENTRIES, ENTRY_FILE
from tests.support.data import DAY_SAMPLE_PER_LABEL, day_change, sample_photos
from tests.support.data import LOADERS as CACHE_LOADERS
from tests.support.processes import run_cli
from tests.support.s3 import S3Store, fresh_bucket, s3_jars, s3_server  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.timeout(900), pytest.mark.tier("full")]  # real runs: minutes each

FAST = [
    "data.image_size=32",
    "train.per_device_batch_size=8",
    "train.epochs=1",
    "distributed.timeout_seconds=300",
]
RUN_TIMEOUT = 600.0
"""Bound on one CLI run (seconds)."""


def _sets(settings: list[str]) -> list[str]:
    return [a for s in settings for a in ("--set", s)]


def _check_published(store: S3Store, written: dict[str, dict]) -> None:
    """Each split's entry is published in the bucket (its marker names its split and bytes),
    its data folder beside it, and no run folder left behind."""
    assert sorted(written) == ["test", "train", "val"]
    assert all(not u["reused"] and u["bytes_written"] > 0 for u in written.values()), written
    markers = [k for k in store.keys(f"out/loader_cache/{ENTRIES}/") if k.endswith(ENTRY_FILE)]
    assert len(markers) == 3
    for split, use in written.items():
        marker = json.loads(store.read(f"out/loader_cache/{ENTRIES}/{use['entry']}/{ENTRY_FILE}"))
        assert marker["fields"]["split"] == split and marker["bytes"] == use["bytes_written"]
    assert [k for k in store.keys("out/loader_cache/") if "/data-run-" in k]
    assert not [k for k in store.keys("out/loader_cache/") if "/run-" in k.split(ENTRIES)[0]]


@pytest.mark.slow
@pytest.mark.parametrize("loader", sorted(CACHE_LOADERS))
def test_on_s3_a_second_train_reuses_the_cache_and_a_day_appends_to_it(
    s3_server: str,  # noqa: F811
    s3_jars: Path,  # noqa: F811
    tmp_path: Path,
    loader: str,
) -> None:
    """The output in the bucket: `run` publishes one entry per split; `train` on the unchanged
    tables reuses each and writes no byte of cache (summary, log, the bucket's keys); then a
    day's change of the photos (two added, one removed, one rewritten in place) and `run` again
    (ingest, then train in one Spark session) append to each split's entry: at most 5% of the
    first run's cache bytes; its ranks check every epoch that they read every current row once
    (count and checksum), and the run passes. Each loader wherever it can run (the local stack
    has Streaming, the legacy environment Petastorm; the DBR suites have no S3 server)."""
    if (problem := loader_problem(loader)) is not None:
        pytest.skip(f"data.loader={loader} cannot run on this stack: {problem}")
    images = sample_photos(tmp_path / "images", per_label=DAY_SAMPLE_PER_LABEL)
    store: S3Store = fresh_bucket(s3_server)
    output = store.url("out")
    settings = _sets(
        [*FAST, f"data.loader={loader}", f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db"]
    )
    env = store.cli_env()
    first = run_cli(
        "run", "--images", str(images), "--output-dir", output, *settings,
        timeout=RUN_TIMEOUT, env=env,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-5000:]
    written = json.loads(store.read("out/summary.json"))["loader_cache"]
    _check_published(store, written)
    data_keys = [k for k in store.keys("out/loader_cache/") if "/data-run-" in k]

    second = run_cli("train", "--output-dir", output, *settings, timeout=RUN_TIMEOUT, env=env)
    assert second.returncode == 0, second.stderr[-5000:]
    reused = json.loads(store.read("out/summary.json"))["loader_cache"]
    assert {s: u["entry"] for s, u in reused.items()} == {s: u["entry"] for s, u in written.items()}
    assert all(u["reused"] and u["bytes_written"] == 0 for u in reused.values()), reused
    for split in ("train", "val", "test"):
        assert f"{split}: loader cache reused" in second.stderr
    assert [k for k in store.keys("out/loader_cache/") if "/data-run-" in k] == data_keys

    day_change(images, 0)
    day_run = run_cli(
        "run", "--images", str(images), "--output-dir", output, *settings,
        timeout=RUN_TIMEOUT, env=env,
    )  # fmt: skip
    assert day_run.returncode == 0, day_run.stderr[-5000:]
    summary = json.loads(store.read("out/summary.json"))
    day = summary["loader_cache"]
    assert {s: u["appended_to"] for s, u in day.items()} == {
        s: u["entry"] for s, u in written.items()
    }
    first_bytes = sum(u["bytes_written"] for u in written.values())
    day_bytes = sum(u["bytes_written"] for u in day.values())
    assert 0 < day_bytes <= 0.05 * first_bytes, (day_bytes, first_bytes)
    assert summary["epochs_completed"] == 1  # the ranks' row checks passed every epoch
    markers = [k for k in store.keys("out/loader_cache/entries/") if k.endswith(ENTRY_FILE)]
    assert sorted(k.split("/")[-2] for k in markers) == sorted(u["entry"] for u in day.values())
