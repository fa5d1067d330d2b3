"""The embeddings table: a frozen backbone's features of every photo, computed by Spark tasks
once per photo and view, kept in step with ``images`` by what changed, never mixed across
backbones or transforms."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from flowers_job.config import JobConfig, load_config
from flowers_job.driver.pipeline import run_training
from flowers_job.ingest import embeddings as embeddings_module
from flowers_job.ingest.embeddings import EMBEDDINGS_SCHEMA, update_embeddings
from flowers_job.ingest.job import ingest
from flowers_job.tables.table_ref import TableRef, table_ref
from flowers_job.vision.backbones import build_model, preprocessing_for
from flowers_job.vision.images import open_rgb
from flowers_job.vision.precision import DeviceNormalize
from flowers_job.vision.views import (
    VIEWS,
    EmbeddingSpec,
    embed_views,
    weights_file,
    weights_id,
)
from tests.support import LABELS, PHOTOS
from tests.support.data import copy_tables, needs_loader, sample_photos

pytestmark = [pytest.mark.timeout(600), pytest.mark.tier("gate")]

SETTINGS = ("data.image_size=64", "data.val_fraction=0.3", "data.test_fraction=0.3")


def _cfg(images: Path, out: Path) -> JobConfig:
    return load_config(None, list(SETTINGS), **{"data.images": images, "paths.output_dir": out})


def _spec(cfg: JobConfig, views: tuple[str, ...], image_size: int = 64) -> EmbeddingSpec:
    path = weights_file("efficientnet_lite0", "package", None)
    return EmbeddingSpec(
        architecture="efficientnet_lite0",
        weights="package",
        weights_path=None,
        weights_id=weights_id(path),
        image_size=image_size,
        resize_size=cfg.data.stored_short_side,
        views=views,
    )


def _version(spark: SparkSession, table: TableRef) -> int:
    row = table.history(spark, 1).select("version").first()
    assert row is not None
    return int(row["version"])


Key = tuple[int, str, str]
"""(row_id, content_sha256, view)."""
Row = tuple[int, str, np.ndarray]
"""(label_index, split, features)."""


def _rows(
    spark: SparkSession, table: TableRef, model_key: str, views: tuple[str, ...]
) -> dict[Key, Row]:
    """(row_id, content_sha256, view) -> (label_index, split, features) of one model key's
    ``views``."""
    df = table.read(spark).where(f"model_key = '{model_key}'").where(F.col("view").isin(*views))
    return {
        (r["row_id"], r["content_sha256"], r["view"]): (
            r["label_index"],
            r["split"],
            np.asarray(r["features"], np.float32),
        )
        for r in df.collect()
    }


def _live(spark: SparkSession, cfg: JobConfig) -> dict[tuple[int, str], tuple[int, str, bytes]]:
    """(row_id, content_sha256) -> (label_index, split, stored image) of ``images``."""
    df = table_ref(cfg, "images").read(spark)
    return {
        (r["row_id"], r["content_sha256"]): (r["label_index"], r["split"], bytes(r["image"]))
        for r in df.collect()
    }


def _check_in_step(
    spark: SparkSession, cfg: JobConfig, table: TableRef, spec: EmbeddingSpec
) -> dict[Key, Row]:
    """Every live photo has each of ``spec``'s views with its label and split, and no other
    photo has one under ``spec.model_key``."""
    live, rows = _live(spark, cfg), _rows(spark, table, spec.model_key, spec.views)
    expected = {(rid, sha, v) for (rid, sha) in live for v in spec.views}
    assert set(rows) == expected
    for (rid, sha, _), (label, split, _) in rows.items():
        assert (label, split) == live[(rid, sha)][:2]
    return rows


@pytest.fixture
def small_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Embedding tasks of 4 photos: several tasks write each partition."""
    monkeypatch.setattr(embeddings_module, "ROWS_PER_TASK", 4)


@pytest.mark.tier("full")
@pytest.mark.usefixtures("small_tasks")
def test_embeddings_follow_the_images_table_and_never_mix_backbones(
    spark: SparkSession, tmp_path: Path
) -> None:
    """The first update embeds each photo's views once, with the features the backbone gives
    the stored image; a second one changes nothing (no commit). After 2 photos deleted, 1
    added and 1 copied into another label's folder, only the new photo is embedded, the
    copy's features are copied from its twin, and the deleted photos' rows leave: found from
    ``images``' change data feed. A third view embeds only that view; another transform is
    another key beside the first. The next day's change is found from the feed again, past
    the other key's commit; a row deleted while the feed was off is found by comparing the
    tables, and the next ingest turns the feed back on."""
    images = sample_photos(tmp_path / "images", per_label=5)
    cfg = _cfg(images, tmp_path / "out")
    v0 = ingest(spark, cfg)
    assert v0.images_rows == 25
    table = table_ref(cfg, "embeddings")
    spec = _spec(cfg, ("centre", "mirror"))
    version = _version(spark, table_ref(cfg, "images"))

    first = update_embeddings(spark, table_ref(cfg, "images"), version, table, spec, "run-1")
    assert (first.embedded, first.copied, first.deleted, first.method) == (50, 0, 0, "write")
    # 7 embedding tasks of 4 photos: the optimized write leaves a file per (view, split)
    assert table.read(spark).schema.simpleString() == EMBEDDINGS_SCHEMA.simpleString() and (
        table.detail(spark)["numFiles"] <= 6
    )
    rows = _check_in_step(spark, cfg, table, spec)
    model = build_model("efficientnet_lite0", 1, "package").eval()
    pre = preprocessing_for("efficientnet_lite0")
    normalize = DeviceNormalize(pre.mean, pre.std, torch.device("cpu"))
    for (rid, sha), (_, _, content) in list(_live(spark, cfg).items())[:3]:
        img = open_rgb(content)[0]
        [want] = embed_views(model.backbone, [img], spec, [list(spec.views)], normalize)
        for i, view in enumerate(spec.views):
            got = rows[(rid, sha, view)][2]
            assert got.shape == (1280,)
            np.testing.assert_allclose(got, want[i], rtol=1e-4, atol=1e-4)
    assert not np.allclose(
        rows[(rid, sha, "centre")][2],
        rows[(rid, sha, "mirror")][2],
    )

    again = update_embeddings(spark, table_ref(cfg, "images"), version, table, spec, "run-2")
    assert not again.changed and again.version == first.version and again.method == "log"

    gone = sorted((images / "roses").glob("*.jpg"))[:2]
    for path in gone:
        path.unlink()
    twin = sorted((images / "daisy").glob("*.jpg"))[0]
    shutil.copy2(twin, images / "tulips" / "twin.jpg")
    shutil.copy2(sorted((PHOTOS / "sunflowers").glob("*.jpg"))[-1], images / "sunflowers")
    ingest(spark, cfg)
    version = _version(spark, table_ref(cfg, "images"))
    day = update_embeddings(spark, table_ref(cfg, "images"), version, table, spec, "run-3")
    assert (day.embedded, day.copied, day.updated, day.deleted, day.method) == (
        2,
        2,
        0,
        4,
        "feed",
    )
    rows_after = _check_in_step(spark, cfg, table, spec)
    live = _live(spark, cfg)
    sha = hashlib.sha256(twin.read_bytes()).hexdigest()
    twins = {k: v for k, v in rows_after.items() if k[1] == sha}
    assert len(twins) == 4  # two rows (daisy, tulips), two views each
    for view in spec.views:
        a, b = (v[2] for k, v in twins.items() if k[2] == view)
        np.testing.assert_array_equal(a, b)

    three = _spec(cfg, ("centre", "mirror", "zoom"))
    zoom = update_embeddings(spark, table_ref(cfg, "images"), version, table, three, "run-4")
    assert (zoom.embedded, zoom.copied, zoom.deleted, zoom.method) == (len(live), 0, 0, "tables")
    assert _check_in_step(spark, cfg, table, three).keys() >= rows_after.keys()

    other = _spec(cfg, ("centre",), image_size=56)
    assert other.model_key != spec.model_key
    apart = update_embeddings(spark, table_ref(cfg, "images"), version, table, other, "run-5")
    assert apart.embedded == len(live)
    _check_in_step(spark, cfg, table, other)
    assert table.read(spark).count() == 3 * len(live) + len(live)

    _later_days(spark, cfg, images, table, spec)


def _later_days(
    spark: SparkSession, cfg: JobConfig, images: Path, table: TableRef, spec: EmbeddingSpec
) -> None:
    """After another key's commit: a day's change found from the feed since this key's own
    last update; a row deleted outside the job while the feed was off, found by comparing
    the tables; the next ingest turns the feed back on and writes the photo back."""
    images_t = table_ref(cfg, "images")
    sorted((images / "daisy").glob("*.jpg"))[-1].unlink()
    shutil.copy2(sorted((PHOTOS / "tulips").glob("*.jpg"))[-1], images / "tulips")
    ingest(spark, cfg)
    version = _version(spark, images_t)
    next_day = update_embeddings(spark, images_t, version, table, spec, "run-6")
    assert (next_day.embedded, next_day.copied, next_day.deleted) == (2, 0, 4)
    assert next_day.method == "feed"  # since run-4's images version, past run-5's commit
    _check_in_step(spark, cfg, table, spec)

    # a row deleted outside the job while the feed was off: the tables are compared
    spark.sql(
        f"ALTER TABLE {images_t.sql_name} SET TBLPROPERTIES (delta.enableChangeDataFeed = false)"
    )
    (rid, sha), _ = sorted(_live(spark, cfg).items())[0]
    spark.sql(f"DELETE FROM {images_t.sql_name} WHERE row_id = {rid}")
    outside = update_embeddings(spark, images_t, _version(spark, images_t), table, spec, "run-7")
    assert (outside.embedded, outside.deleted, outside.method) == (0, 4, "tables")
    _check_in_step(spark, cfg, table, spec)
    # the next ingest writes the photo back (its file is still listed), the feed on first
    ingest(spark, cfg)
    assert images_t.detail(spark)["properties"].get("delta.enableChangeDataFeed") == "true"
    back = update_embeddings(spark, images_t, _version(spark, images_t), table, spec, "run-8")
    assert (back.embedded, back.copied, back.deleted, back.method) == (2, 0, 0, "feed")
    assert {k[:2] for k in _check_in_step(spark, cfg, table, spec)} >= {(rid, sha)}


@needs_loader("delta")
def test_the_head_trains_on_the_embeddings_and_the_registered_model_takes_photos(
    spark: SparkSession, tables: Path, tmp_path: Path
) -> None:
    """``embeddings.enabled: auto`` (the default) on the Delta loader: the run embeds each
    photo's views once (Spark tasks), the ranks read the train split's views and the val
    split's evaluation crop from the embeddings table as features (nothing written outside
    the tables), the test split's photos are scored by the whole model, and the registered
    model predicts from photos.
    A second run embeds nothing and reads the same rows."""
    out = copy_tables(tables, tmp_path / "out")
    cfg = load_config(
        None,
        [
            "data.image_size=32",
            "train.per_device_batch_size=8",
            "train.epochs=2",
            "embeddings.views=2",
            "distributed.timeout_seconds=300",
        ],
        **{"paths.output_dir": out},
    )
    assert cfg.embeddings.view_names == VIEWS[:2]
    first = run_training(spark, cfg)
    assert first["loader"] == "delta"
    images = table_ref(cfg, "images").read(spark)
    photos = {r["split"]: r["count"] for r in images.groupBy("split").count().collect()}
    assert first["train_rows"] == 2 * photos["train"]  # (photo, view) rows
    assert first["val_rows"] == photos["val"]
    assert first["test_rows"] == photos["test"] == first["test"]["rows"]
    embedded = first["embeddings"]
    assert embedded["embedded"] == 2 * sum(photos.values())
    assert embedded["views"] == ["centre", "mirror"]
    assert {u["bytes_written"] for u in first["loader_cache"].values()} == {0}
    assert not (out / "loader_cache").exists()

    second = run_training(spark, cfg)
    assert second["embeddings"]["embedded"] == 0
    assert second["embeddings"]["method"] == "log"
    assert second["embeddings"]["version"] == embedded["version"]
    assert second["train_rows"] == first["train_rows"]
    mlflow.set_tracking_uri(second["mlflow_tracking_uri"])
    name, version = second["registered_model_name"], second["registered_model_version"]
    model = mlflow.pyfunc.load_model(f"models:/{name}/{version}")
    files = [sorted((PHOTOS / label).glob("*.jpg"))[-1] for label in LABELS]
    scores = model.predict(pd.DataFrame({"image": [f.read_bytes() for f in files]}))
    assert scores.shape == (5, 5) and (scores.sum(axis=1) - 1.0).abs().max() < 1e-5


@pytest.mark.tier("full")
def test_the_embeddings_update_runs_on_spark_connect_as_on_classic_spark(
    spark: SparkSession, tables: Path, connect_url: str, tmp_path: Path
) -> None:
    """The same update through a Spark Connect session (the server's Python workers embed)
    writes the rows a classic session writes, features equal; a second one reads nothing;
    a photo deleted and a copy of another added are found from the change data feed."""
    from tests.support.connect import classic_mode, connect_session

    classic_out = copy_tables(tables, tmp_path / "classic")
    remote_out = copy_tables(tables, tmp_path / "remote")
    cfgs = {
        out: load_config(None, ["data.image_size=32"], **{"paths.output_dir": out})
        for out in (classic_out, remote_out)
    }
    spec = _spec(cfgs[classic_out], ("centre",), image_size=32)
    got = {}
    with connect_session(connect_url) as remote:
        for out, session in ((remote_out, remote), (classic_out, spark)):
            cfg = cfgs[out]
            with classic_mode() if session is spark else contextlib.nullcontext():
                images, table = table_ref(cfg, "images"), table_ref(cfg, "embeddings")
                version = _version(session, images)
                first = update_embeddings(session, images, version, table, spec, "run-1")
                again = update_embeddings(session, images, version, table, spec, "run-2")
                assert first.embedded == len(_live(session, cfg)) and not again.changed
                (gone, _), (kept, _) = sorted(_live(session, cfg).items())[:2]
                session.sql(f"DELETE FROM {images.sql_name} WHERE row_id = {gone[0]}")
                images.append(
                    images.read(session)
                    .where(F.col("row_id") == kept[0])
                    .withColumn("row_id", F.lit(-1).cast("long"))
                    .withColumn("relative_path", F.lit("daisy/copy.jpg"))
                )
                day = update_embeddings(
                    session, images, _version(session, images), table, spec, "day"
                )
                assert (day.embedded, day.copied, day.deleted, day.method) == (0, 1, 1, "feed")
                got[out] = _rows(session, table, spec.model_key, spec.views)
    assert got[remote_out].keys() == got[classic_out].keys()
    for key, (label, split, features) in got[classic_out].items():
        assert got[remote_out][key][:2] == (label, split)
        np.testing.assert_allclose(got[remote_out][key][2], features, rtol=1e-5, atol=1e-5)
