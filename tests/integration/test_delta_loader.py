"""The Delta loader against tables that Spark's Delta writes: the driver's plan
(:func:`flowers_job.driver.prepare.prepare_data` with ``data.loader=delta``) writes nothing
and counts each split with Spark; the ranks read the table with delta-rs at the planned
version, deletion vectors applied, every live row once.

Real components: the session's local Spark with Delta (the ``spark`` fixture), the tables of
an ingest of the 60-photo sample (``tables``), an incremental ingest that Delta records as
deletion vectors,
the ranks' readers in this process (the ranks themselves: tests/integration/test_job_e2e.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from flowers_job.config import load_config
from flowers_job.driver.pipeline import run_training
from flowers_job.driver.prepare import prepare_data
from flowers_job.loaders import resolve_loader
from flowers_job.tables.table_ref import table_ref
from tests.integration.test_job_e2e import FAST
from tests.support.data import copy_tables, needs_loader

pytestmark = [
    pytest.mark.tier("gate"),
    pytest.mark.timeout(600),
    needs_loader("delta"),
]


@pytest.mark.tier("full")  # an incremental ingest (the gate's Delta run: the test below)
def test_ranks_read_each_live_row_once_through_deletion_vectors_and_nothing_is_written(
    spark: SparkSession, photos: Path, tables: Path, tmp_path: Path
) -> None:
    """An incremental ingest after three photos were removed (Delta marks their rows in
    deletion vectors and rewrites no file); then 3 ranks read every live row of each split
    once, per the driver's plan, and the loader cache is never created."""
    import shutil

    from deltalake import DeltaTable

    from flowers_job.config.data import DeltaConfig
    from flowers_job.driver.pipeline import run_ingest
    from flowers_job.loaders.delta.file_reader import DeltaReader
    from flowers_job.vision.decode_transform import DecodeTransform

    out = copy_tables(tables, tmp_path / "out")
    images_dir = tmp_path / "photos"
    shutil.copytree(photos, images_dir)
    for label in ("daisy", "roses", "tulips"):
        sorted((images_dir / label).glob("*.jpg"))[0].unlink()
    cfg = load_config(
        None,
        [
            "data.image_size=32",
            "data.loader=delta",
            "train.per_device_batch_size=4",
            "distributed.num_processes=3",
        ],
        **{"data.images": images_dir, "paths.output_dir": out},
    )
    report = run_ingest(spark, cfg)
    assert (report.mode, report.rows_deleted, report.images_rows) == ("incremental", 3, 57)
    images = table_ref(cfg, "images")
    location = str(images.detail(spark)["location"])
    assert DeltaTable(location).deletion_vectors().read_all().num_rows > 0  # not rewritten
    cfg, loader = resolve_loader(cfg)
    with prepare_data(spark, cfg, loader) as data:
        assert data.loader.name == "delta"
        assert {u["bytes_written"] for u in data.loader_cache.values()} == {0}
        for split in ("train", "val", "test"):
            plan = getattr(data, split)
            want = sorted(
                int(r["row_id"])
                for r in images.read(spark, plan.version)
                .where(f"split = '{split}'")
                .select("row_id")
                .collect()
            )
            assert plan.dataset_size == len(want) and plan.cache_dir_url == location
            read: list[int] = []
            for rank in range(3):
                reader = DeltaReader(
                    plan,
                    DecodeTransform(split == "train", 32, 36),
                    rank=rank,
                    shuffle=split == "train",
                    seed=0,
                    settings=DeltaConfig(),
                )
                for batch in reader.epoch(1):
                    read += batch["row_id"][batch["valid"]].tolist()
            assert sorted(read) == want, split
    assert not cfg.paths.cache_root.exists()


def test_training_reads_the_table_with_real_ranks_and_writes_no_cache(
    spark: SparkSession, tables: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``train`` with ``data.loader=delta`` on the ingested tables: TorchDistributor's two
    ranks read the table (each checks every epoch that the ranks read every row once, by
    count and checksum), score the test split, and the model is registered; the summary
    says no byte of a cache was written, and none was, and the log says so with the plan's
    seconds (what ``benchmarks/scale.py`` reads from a stopped train)."""
    import re

    out = copy_tables(tables, tmp_path / "out")
    cfg = load_config(
        None, [*FAST, "train.epochs=1", "data.loader=delta"], **{"paths.output_dir": out}
    )
    with caplog.at_level("INFO", logger="flowers_job.driver.prepare"):
        summary = run_training(spark, cfg)
    # the test split's plan reads ``images`` (train and val read the embeddings table here)
    line = re.compile(
        rf"^test: {summary['test_rows']} rows read from the table at version \d+ "
        r"\(no loader cache, 0 bytes written, [\d.]+ s\)$"
    )
    assert any(line.match(m) for m in caplog.messages), caplog.messages
    assert summary["loader"] == "delta" and len(summary["ranks"]) == 2
    assert summary["epochs_completed"] == 1 and 0.0 <= summary["test_accuracy"] <= 1.0
    assert summary["test"]["rows"] == summary["test_rows"] > 0
    assert summary["registered_model_version"] >= 1
    assert {u["bytes_written"] for u in summary["loader_cache"].values()} == {0}
    assert not cfg.paths.cache_root.exists()


@pytest.mark.tier("full")  # three ingests
def test_vacuum_keeps_the_version_a_running_run_reads(spark: SparkSession, tmp_path: Path) -> None:
    """With ``data.retention_hours=0`` an ingest under the output's lease removes the files
    of older versions, but not those of a version that a run still ``RUNNING`` in the
    experiment reads (as a Delta-loader run reads the table itself until it ends); once
    that run has ended, the next ingest removes them. The changes are full rebuilds, which
    replace every file of the older version."""
    import os

    import mlflow

    from flowers_job.driver.pipeline import run_ingest
    from flowers_job.tables.delta_tables import checked_tables
    from flowers_job.tracking.tags import TAG_IMAGES_TABLE, TAG_IMAGES_VERSION
    from tests.integration.test_incremental import SHORT_RETENTION, _cfg, version_readable
    from tests.support.data import sample_photos

    images = sample_photos(tmp_path / "images", per_label=4)
    cfg = _cfg(images, tmp_path / "out", *SHORT_RETENTION)
    first = run_ingest(spark, cfg)
    kept = checked_tables(spark, cfg).versions["images"]
    client = mlflow.MlflowClient(cfg.tracking_uri)
    experiment = client.create_experiment(cfg.tracking.experiment_name)
    table = table_ref(cfg, "images").describe()
    run = client.create_run(
        experiment, tags={TAG_IMAGES_TABLE: table, TAG_IMAGES_VERSION: str(kept)}
    )

    def readable(version: int) -> bool:
        return version_readable(spark, first.tables["images"], version)

    rebuild = _cfg(images, tmp_path / "out", *SHORT_RETENTION, "data.full_ingest=true")
    (images / "daisy" / sorted(os.listdir(images / "daisy"))[0]).unlink()
    assert run_ingest(spark, rebuild).mode.startswith("full")
    assert readable(kept)  # the running run's version
    client.set_terminated(run.info.run_id, "FINISHED")
    (images / "roses" / sorted(os.listdir(images / "roses"))[0]).unlink()
    run_ingest(spark, rebuild)
    assert not readable(kept)
