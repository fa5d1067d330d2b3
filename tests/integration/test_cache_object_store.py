"""The loader cache reused on an object store, as a user meets it: `flowers-job run` with its
output (the tables, the loader cache, the summary) in a bucket of a real S3 API server
(moto, with S3's conditional writes), then `flowers-job train` on the unchanged tables: the
second writes no byte of cache and says it reused each split, in its summary and its log;
and (full tier) a day's change of the photos appended to the cache in the bucket.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowers_job.loaders import loader_problem
from flowers_job.loaders.cache_marker import ENTRIES, ENTRY_FILE
from tests.support.data import DAY_SAMPLE_PER_LABEL, SELECTED_LOADERS, day_change, sample_photos
from tests.support.data import LOADERS as CACHE_LOADERS
from tests.support.processes import run_cli
from tests.support.s3 import S3Store, fresh_bucket, s3_jars, s3_server  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.timeout(900), pytest.mark.tier("full")]  # real runs: minutes each

LOADER = SELECTED_LOADERS[0]
FAST = [
    "data.image_size=32",
    f"data.loader={LOADER}",
    "train.per_device_batch_size=8",
    "train.epochs=1",
    "distributed.timeout_seconds=300",
]
RUN_TIMEOUT = 600.0
"""Bound on one CLI run (seconds)."""


def _sets(settings: list[str]) -> list[str]:
    return [a for s in settings for a in ("--set", s)]


def _run(store: S3Store, images: Path, settings: list[str], env: dict[str, str]) -> dict:
    """``flowers-job run`` of ``images`` into the bucket's ``out`` (exit 0 asserted); the
    summary's ``loader_cache``."""
    proc = run_cli(
        "run", "--images", str(images), "--output-dir", store.url("out"), *settings,
        timeout=RUN_TIMEOUT, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(store.read("out/summary.json"))["loader_cache"]


def test_a_second_train_on_s3_reuses_every_split_and_writes_no_cache_byte(
    s3_server: str,  # noqa: F811
    s3_jars: Path,  # noqa: F811
    photos: Path,
    tmp_path: Path,
) -> None:
    store: S3Store = fresh_bucket(s3_server)
    output = store.url("out")
    settings = _sets([*FAST, f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db"])
    temp = tmp_path / "temp"  # the CLI's temp folder: its Spark tasks' and its ranks'
    temp.mkdir()
    env = {**store.cli_env(), "TMPDIR": str(temp)}

    written = _run(store, photos, settings, env)
    # the tasks uploaded their shards and kept no copy; the ranks removed their downloads
    assert not [p for p in temp.rglob("*") if p.is_file() and p.suffix in (".mds", ".json")]
    assert sorted(written) == ["test", "train", "val"]
    assert all(not u["reused"] and u["bytes_written"] > 0 for u in written.values()), written
    markers = [k for k in store.keys(f"out/loader_cache/{ENTRIES}/") if k.endswith(ENTRY_FILE)]
    assert len(markers) == 3
    for split, use in written.items():
        marker = json.loads(store.read(f"out/loader_cache/{ENTRIES}/{use['entry']}/{ENTRY_FILE}"))
        assert marker["fields"]["split"] == split and marker["bytes"] == use["bytes_written"]
    data_keys = [k for k in store.keys("out/loader_cache/") if "/data-run-" in k]
    assert data_keys and not [
        k for k in store.keys("out/loader_cache/") if "/run-" in k.split(ENTRIES)[0]
    ]

    second = run_cli("train", "--output-dir", output, *settings, timeout=RUN_TIMEOUT, env=env)
    assert second.returncode == 0, second.stderr[-5000:]
    reused = json.loads(store.read("out/summary.json"))["loader_cache"]
    assert {s: u["entry"] for s, u in reused.items()} == {s: u["entry"] for s, u in written.items()}
    assert all(u["reused"] and u["bytes_written"] == 0 for u in reused.values()), reused
    for split in ("train", "val", "test"):
        assert f"{split}: loader cache reused" in second.stderr
    assert [k for k in store.keys("out/loader_cache/") if "/data-run-" in k] == data_keys


@pytest.mark.slow
@pytest.mark.parametrize("day_loader", sorted(CACHE_LOADERS))
def test_a_day_on_s3_appends_to_the_cache_and_the_ranks_read_every_current_row(
    s3_server: str,  # noqa: F811
    s3_jars: Path,  # noqa: F811
    tmp_path: Path,
    day_loader: str,
) -> None:
    """The output in the bucket: `run`, then a day's change of the photos (two added, one removed,
    one rewritten in place), `run` again (ingest, then train). The train appends to each split's
    entry: at most 5% of the first run's cache bytes; its ranks check every epoch that they read
    every current row once (count and checksum), and the run passes. Both loaders wherever they can
    run (the local stack has both; the DBR suite has no S3 server)."""
    if (problem := loader_problem(day_loader)) is not None:
        pytest.skip(f"data.loader={day_loader} cannot run on this stack: {problem}")
    images = sample_photos(tmp_path / "images", per_label=DAY_SAMPLE_PER_LABEL)
    store: S3Store = fresh_bucket(s3_server)
    fast = [s for s in FAST if not s.startswith("data.loader=")]
    settings = _sets(
        [
            *fast,
            f"data.loader={day_loader}",
            f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        ]
    )
    env = store.cli_env()
    written = _run(store, images, settings, env)

    day_change(images, 0)
    # `run` ingests the day's change, then trains: one Spark start for both
    day = _run(store, images, settings, env)
    summary = json.loads(store.read("out/summary.json"))
    assert {s: u["appended_to"] for s, u in day.items()} == {
        s: u["entry"] for s, u in written.items()
    }
    first_bytes = sum(u["bytes_written"] for u in written.values())
    day_bytes = sum(u["bytes_written"] for u in day.values())
    assert 0 < day_bytes <= 0.05 * first_bytes, (day_bytes, first_bytes)
    assert summary["epochs_completed"] == 1  # the ranks' row checks passed every epoch
    markers = [k for k in store.keys("out/loader_cache/entries/") if k.endswith(ENTRY_FILE)]
    assert sorted(k.split("/")[-2] for k in markers) == sorted(u["entry"] for u in day.values())
