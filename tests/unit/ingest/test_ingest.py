"""Ingest on real photos: Delta tables, label map, deterministic split, quarantine, idempotence."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from delta.tables import DeltaTable
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from flowers_job.config import JobConfig, load_config
from flowers_job.ingest import write as ingest_write
from flowers_job.ingest.job import IngestError, ingest
from flowers_job.tables.delta_tables import SPLITS, TABLE_NAMES
from tests.support import LABELS, PHOTOS
from tests.support.data import sample_photos
from tests.support.faults import kill_ingest_at_pause

pytestmark = [pytest.mark.timeout(600), pytest.mark.tier("gate")]


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


def _contents(spark: SparkSession, path: str) -> list[tuple[object, ...]]:
    """Every row and column of a Delta table, binary columns as SHA-256, in a fixed order."""
    df = spark.read.format("delta").load(path)
    cols = [F.sha2(c, 256).alias(c) if t == "binary" else F.col(c) for c, t in df.dtypes]
    return sorted((tuple(r) for r in df.select(*cols).collect()), key=repr)


def _history_lengths(spark: SparkSession, tables: dict[str, str]) -> dict[str, int]:
    return {n: DeltaTable.forPath(spark, p).history().count() for n, p in tables.items()}


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
    assert report.train_rows + report.val_rows + report.test_rows == report.images_rows
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
    for col in ("source_path", "label", "label_index", "image", "width", "height", "split"):
        assert col in df.columns
    assert "row_id" in df.columns and "path" not in df.columns  # delta-io/delta#2943
    for path in report.tables.values():  # an incremental MERGE marks rows, not rewrites files
        detail = DeltaTable.forPath(spark, path).detail().first()
        assert detail is not None and "deletionVectors" in detail["tableFeatures"]
        assert detail["properties"]["delta.enableDeletionVectors"] == "true"
    row = df.where("relative_path = 'daisy/100080576_f52e8ee070_n.jpg'").first()
    assert row is not None and (row["width"], row["height"]) == (320, 263)  # MANIFEST.tsv
    img = Image.open(io.BytesIO(row["image"]))
    assert img.mode == "RGB" and min(img.size) == 73  # round(64 * 256 / 224)


def test_split_is_deterministic_whatever_the_partitioning(
    spark: SparkSession,
    ingested,
    dirty_photos: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another ingest of the same files, decoded in many more partitions, writes the same
    tables: every row, every column, the image bytes included."""
    _, report = ingested
    before = _rows(spark, report.tables["images"], "relative_path", "split")
    monkeypatch.setattr(ingest_write, "FILES_PER_PARTITION", 5)  # 13 partitions, not 4
    again = ingest(spark, _cfg(dirty_photos, tmp_path, "data.max_bad_fraction=0.1"))
    for name in TABLE_NAMES:
        assert _contents(spark, again.tables[name]) == _contents(spark, report.tables[name]), name
    splits: dict[object, object] = dict(before)  # type: ignore[arg-type]
    # byte-identical photos share a split: no leakage from train into val
    assert (
        splits["daisy/copy of first.jpg"]
        == splits[str(sorted((dirty_photos / "daisy").glob("1*.jpg"))[0].relative_to(dirty_photos))]
    )
    assert set(splits.values()) == {"train", "val", "test"}


def test_splits_are_partitions_of_the_one_images_table(spark: SparkSession, ingested) -> None:
    """Each image is stored once: ``images`` is partitioned by ``split``, a split is read by
    partition pruning, and the report's counts are the partitions' rows."""
    from delta.tables import DeltaTable

    from flowers_job.tables.delta_tables import split_frame
    from flowers_job.tables.table_ref import table_ref

    cfg, report = ingested
    detail = DeltaTable.forPath(spark, report.tables["images"]).detail().first()
    assert detail is not None and list(detail["partitionColumns"]) == ["split"]
    assert set(report.tables) == {"images", "quarantine"}
    version = _version(spark, report.tables["images"])
    rows = {s: _rows(spark, report.tables["images"], "relative_path", "split") for s in SPLITS}
    for split in SPLITS:
        df = split_frame(spark, table_ref(cfg, "images"), version, split)
        assert "PartitionFilters: [isnotnull(split" in df._jdf.queryExecution().toString()
        assert sorted((r["relative_path"], split) for r in df.collect()) == [
            r for r in rows[split] if r[1] == split
        ]
    assert (report.train_rows, report.val_rows, report.test_rows) == tuple(
        df.count()
        for df in (split_frame(spark, table_ref(cfg, "images"), version, s) for s in SPLITS)
    )


def test_reingest_of_unchanged_input_writes_nothing(spark: SparkSession, ingested) -> None:
    """A second run on the same input: no new Delta commit anywhere, identical tables."""
    cfg, report = ingested
    history = _history_lengths(spark, report.tables)
    contents = {n: _contents(spark, p) for n, p in report.tables.items()}
    again = ingest(spark, cfg)
    assert again.written is False
    this_run = {"written", "mode", "seconds", "files_decoded", "rows_inserted", "rows_quarantined"}
    assert {k: v for k, v in again.to_dict().items() if k not in this_run} == {
        k: v for k, v in report.to_dict().items() if k not in this_run
    }
    assert (again.mode, again.files_decoded, again.rows_inserted) == ("unchanged", 0, 0)
    assert _history_lengths(spark, report.tables) == history
    assert {n: _contents(spark, p) for n, p in report.tables.items()} == contents


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


SMALL_SPLITS = ("data.val_fraction=0.3", "data.test_fraction=0.3")
"""Splits of a sample of 3-4 photos per class (each class needs 3: one per split)."""


# full: two more ingests (about 40 s); the gate's incremental tests (DBR suite) cover changes
@pytest.mark.tier("full")
def test_changed_clean_input_is_reingested_consistently(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Both ingests have an empty quarantine. Delta skips an empty overwrite of an empty
    table by default, which would leave the first run's metadata on the quarantine table and
    tables that training refuses however often ingest is re-run."""
    from flowers_job.tables.delta_tables import checked_tables

    images = sample_photos(tmp_path / "images", per_label=3)
    cfg = _cfg(images, tmp_path / "out", *SMALL_SPLITS)
    first = ingest(spark, cfg)
    sample_photos(images, per_label=1, offset=3)  # one more photo per label
    second = ingest(spark, cfg)
    assert second.written and second.fingerprint != first.fingerprint
    assert (second.images_rows, second.quarantined_rows) == (20, 0)
    assert (second.mode, second.files_decoded, second.rows_inserted) == ("incremental", 5, 5)
    checked = checked_tables(spark, cfg)  # the quarantine's commit carries the second run's id
    assert checked.label_names == sorted(LABELS)
    assert checked.meta["fingerprint"] == second.fingerprint


@pytest.mark.slow
@pytest.mark.tier("full")
@pytest.mark.timeout(900)
def test_an_interrupted_ingest_is_refused_by_training_and_repaired_by_a_rerun(
    spark: SparkSession, tmp_path: Path
) -> None:
    """`flowers-job ingest` is killed with SIGKILL (with its JVM) after MERGEing the changes of
    the input into the quarantine table (a new bad file: a quarantine with nothing to change
    is not MERGEd): the images table is unchanged, training refuses the mix, and a re-run
    writes the same tables as a fresh ingest."""
    from flowers_job.errors import DataError
    from flowers_job.tables.delta_tables import checked_tables

    images = sample_photos(tmp_path / "images", per_label=3)
    (images / "roses" / "notes.jpg").write_text("not an image\n")  # a non-empty quarantine
    overrides = ("data.max_bad_fraction=0.2", *SMALL_SPLITS)
    cfg = _cfg(images, tmp_path / "out", *overrides)
    first = ingest(spark, cfg)
    images_before = (
        _version(spark, first.tables["images"]),
        _contents(spark, first.tables["images"]),
    )
    sample_photos(images, per_label=1, offset=3)  # the input changes: one more photo per label
    (images / "tulips" / "notes.jpg").write_text("not an image either\n")  # and one bad file

    kill_ingest_at_pause(
        images, cfg.paths.output_dir, "quarantine", ("data.image_size=64", *overrides)
    )

    assert (
        _version(spark, first.tables["images"]),
        _contents(spark, first.tables["images"]),
    ) == images_before
    with pytest.raises(DataError, match="come from different ingests"):
        checked_tables(spark, cfg)

    again = ingest(spark, cfg)
    assert again.written and (again.images_rows, again.quarantined_rows) == (20, 2)
    assert again.mode.startswith("full: the tables are not one complete ingest")
    assert checked_tables(spark, cfg).label_names == sorted(LABELS)
    fresh = ingest(spark, _cfg(images, tmp_path / "fresh", *overrides))
    for name in TABLE_NAMES:
        assert _contents(spark, again.tables[name]) == _contents(spark, fresh.tables[name]), name
