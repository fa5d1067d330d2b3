"""Ingest on real photos: Delta tables, label map, deterministic split, quarantine, idempotence."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from delta.tables import DeltaTable
from pyspark.sql import SparkSession

from flowers_job.config import JobConfig, load_config
from flowers_job.data.ingest import IngestError, ingest

from .conftest import LABELS, PHOTOS, sample_photos

pytestmark = pytest.mark.timeout(600)


def _cfg(images: Path, out: Path, *overrides: str) -> JobConfig:
    return load_config(
        None,
        ["data.image_size=64", *overrides],
        **{"data.images": images, "paths.output_dir": out},
    )


def _version(spark: SparkSession, path: str) -> int:
    row = DeltaTable.forPath(spark, path).history(1).first()
    assert row is not None
    return int(row["version"])


def _rows(spark: SparkSession, path: str, *cols: str) -> list[tuple[object, ...]]:
    return sorted(tuple(r) for r in spark.read.format("delta").load(path).select(*cols).collect())


@pytest.fixture(scope="module")
def dirty_photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 real photos per label plus three bad files and a byte-identical duplicate."""
    root = sample_photos(tmp_path_factory.mktemp("dirty"), per_label=12)
    (root / "roses" / "empty.jpg").write_bytes(b"")
    (root / "tulips" / "notes.jpg").write_text("not an image\n")
    good = sorted((root / "daisy").glob("*.jpg"))[0]
    (root / "daisy" / "truncated.jpg").write_bytes(good.read_bytes()[:3000])
    shutil.copy2(good, root / "daisy" / "copy of first.jpg")  # space in name, same bytes
    (root / "README.txt").write_text("top-level files are not images\n")
    return root


@pytest.fixture(scope="module")
def ingested(spark: SparkSession, dirty_photos: Path, tmp_path_factory: pytest.TempPathFactory):
    cfg = _cfg(dirty_photos, tmp_path_factory.mktemp("out"), "data.max_bad_fraction=0.1")
    return cfg, ingest(spark, cfg)


def test_every_file_is_in_a_table_or_quarantined(spark: SparkSession, ingested) -> None:
    cfg, report = ingested
    assert report.files == 60 + 5
    assert report.images_rows == 61 and report.quarantined_rows == 4
    assert report.train_rows + report.val_rows == report.images_rows
    assert report.quarantine_reasons == {
        "empty_file": 1,
        "not_an_image": 1,
        "corrupt": 1,
        "not_in_label_folder": 1,
    }
    images = {r[0] for r in _rows(spark, report.tables["images"], "relative_path")}
    bad = _rows(spark, report.tables["quarantine"], "relative_path", "reason_code")
    assert bad == [
        ("README.txt", "not_in_label_folder"),
        ("daisy/truncated.jpg", "corrupt"),
        ("roses/empty.jpg", "empty_file"),
        ("tulips/notes.jpg", "not_an_image"),
    ]
    on_disk = {str(p.relative_to(cfg.data.images)) for p in Path(cfg.data.images).rglob("*")}
    on_disk -= set(LABELS)
    assert images | {b[0] for b in bad} == on_disk
    assert not images & {b[0] for b in bad}


def test_label_map_is_sorted_and_stored(spark: SparkSession, ingested) -> None:
    _, report = ingested
    assert report.label_names == sorted(LABELS)
    pairs = set(_rows(spark, report.tables["images"], "label", "label_index"))
    assert pairs == {(label, i) for i, label in enumerate(sorted(LABELS))}


def test_images_table_schema_and_pixels(spark: SparkSession, ingested) -> None:
    import io

    from PIL import Image

    _, report = ingested
    df = spark.read.format("delta").load(report.tables["images"])
    for col in ("path", "label", "label_index", "image", "width", "height", "split", "row_id"):
        assert col in df.columns
    row = df.where("relative_path = 'daisy/100080576_f52e8ee070_n.jpg'").first()
    assert row is not None and (row["width"], row["height"]) == (320, 263)  # MANIFEST.tsv
    img = Image.open(io.BytesIO(row["image"]))
    assert img.mode == "RGB" and min(img.size) == 73  # round(64 * 256 / 224)


def test_split_is_deterministic_whatever_the_partitioning(
    spark: SparkSession, ingested, dirty_photos: Path, tmp_path: Path
) -> None:
    _, report = ingested
    before = _rows(spark, report.tables["images"], "relative_path", "split")
    spark.conf.set("spark.sql.files.maxPartitionBytes", "1m")  # many more input partitions
    spark.conf.set("spark.sql.files.openCostInBytes", "1")
    try:
        again = ingest(spark, _cfg(dirty_photos, tmp_path, "data.max_bad_fraction=0.1"))
    finally:
        spark.conf.unset("spark.sql.files.maxPartitionBytes")
        spark.conf.unset("spark.sql.files.openCostInBytes")
    assert _rows(spark, again.tables["images"], "relative_path", "split") == before
    splits: dict[object, object] = dict(before)  # type: ignore[arg-type]
    # byte-identical photos share a split: no leakage from train into val
    assert (
        splits["daisy/copy of first.jpg"]
        == splits[str(sorted((dirty_photos / "daisy").glob("1*.jpg"))[0].relative_to(dirty_photos))]
    )
    assert set(splits.values()) == {"train", "val"}


def test_split_tables_partition_the_images_table(spark: SparkSession, ingested) -> None:
    _, report = ingested
    train = _rows(spark, report.tables["train"], "relative_path", "split")
    val = _rows(spark, report.tables["val"], "relative_path", "split")
    assert {s for _, s in train} == {"train"} and {s for _, s in val} == {"val"}
    assert sorted(train + val) == _rows(spark, report.tables["images"], "relative_path", "split")


def test_reingest_of_unchanged_input_writes_nothing(spark: SparkSession, ingested) -> None:
    cfg, report = ingested
    versions = {n: _version(spark, p) for n, p in report.tables.items()}
    again = ingest(spark, cfg)
    assert again.written is False
    assert again.fingerprint == report.fingerprint
    assert (again.images_rows, again.quarantined_rows) == (
        report.images_rows,
        report.quarantined_rows,
    )
    after = {n: _version(spark, p) for n, p in report.tables.items()}
    assert after == versions


def test_too_many_bad_files_fails_before_writing(
    spark: SparkSession, dirty_photos: Path, tmp_path: Path
) -> None:
    cfg = _cfg(dirty_photos, tmp_path, "data.max_bad_fraction=0.01")
    with pytest.raises(IngestError, match=r"4 of 65 files") as err:
        ingest(spark, cfg)
    message = str(err.value)
    assert "corrupt 1, empty_file 1, not_an_image 1, not_in_label_folder 1" in message
    assert "README.txt: lies directly in the images root" in message
    assert "Nothing was written" in message and "data.max_bad_fraction=0.01" in message
    assert not (tmp_path / "tables").exists()


def test_missing_root_and_empty_root(spark: SparkSession, tmp_path: Path) -> None:
    with pytest.raises(IngestError, match="not a directory"):
        ingest(spark, _cfg(tmp_path / "nope", tmp_path / "out"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(IngestError, match="no label folders"):
        ingest(spark, _cfg(tmp_path / "empty", tmp_path / "out"))
    assert PHOTOS.is_dir()


def test_changed_clean_input_is_reingested_consistently(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Both ingests have an empty quarantine. Delta skips an empty overwrite of an empty
    table by default, which would leave the first run's metadata on the quarantine table and
    tables that training refuses however often ingest is re-run."""
    from flowers_job.data.prepare import _check_tables

    images = sample_photos(tmp_path / "images", per_label=1)
    cfg = _cfg(images, tmp_path / "out")
    first = ingest(spark, cfg)
    sample_photos(images, per_label=1, offset=1)  # one more photo per label
    second = ingest(spark, cfg)
    assert second.written and second.fingerprint != first.fingerprint
    assert (second.images_rows, second.quarantined_rows) == (10, 0)
    assert _version(spark, second.tables["quarantine"]) == 1
    assert _check_tables(spark, cfg) == sorted(LABELS)
