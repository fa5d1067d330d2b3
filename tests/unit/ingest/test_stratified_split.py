"""The split stratified per class (and stable under incremental
ingests), hidden files skipped and counted apart, split tables of an older layout removed
only when ingest wrote them, and predict refusing to overwrite the job's input tables."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from flowers_job.config import JobConfig, load_config
from flowers_job.errors import IngestError, UsageError
from flowers_job.ingest.job import ingest
from flowers_job.ingest.splits import split_quotas
from flowers_job.location import Location
from flowers_job.serving.batch_predict import check_output_table, predict
from flowers_job.serving.model_ref import ModelRef
from flowers_job.tables.delta_tables import write_table
from tests.support import LABELS, PHOTOS
from tests.support.data import sample_photos

pytestmark = [pytest.mark.timeout(600), pytest.mark.tier("gate")]

SIZES = {"daisy": 20, "dandelion": 3, "roses": 8, "sunflowers": 12, "tulips": 4}
"""Photos per class: very different sizes, the smallest at the minimum of 3."""
FRACTIONS = ("data.val_fraction=0.2", "data.test_fraction=0.1")


def _cfg(images: Path, out: Path, *overrides: str) -> JobConfig:
    return load_config(
        None,
        ["data.image_size=64", *FRACTIONS, *overrides],
        **{"data.images": images, "paths.output_dir": out},
    )


def _tree(root: Path, sizes: dict[str, int], offset: int = 0) -> Path:
    for label, n in sizes.items():
        (root / label).mkdir(parents=True, exist_ok=True)
        for src in sorted((PHOTOS / label).glob("*.jpg"))[offset : offset + n]:
            shutil.copy2(src, root / label / src.name)
    return root


def _splits(spark: SparkSession, table: str) -> dict[str, str]:
    rows = spark.read.format("delta").load(table).select("relative_path", "split").collect()
    return {r["relative_path"]: r["split"] for r in rows}


def test_split_quotas_are_in_proportion_and_refuse_a_tiny_class() -> None:
    quotas = split_quotas({"big": 100, "mid": 10, "min": 3, "odd": 4}, 0.2, 0.1)
    assert quotas == {"big": (20, 10), "mid": (2, 1), "min": (1, 1), "odd": (1, 1)}
    assert split_quotas({"x": 4}, 0.45, 0.45) == {"x": (1, 2)}  # one photo left for train
    with pytest.raises(IngestError, match=r"class 'lonely' has 1\b.*class 'pair' has 2"):
        split_quotas({"lonely": 1, "pair": 2, "ok": 30}, 0.2, 0.1)


@pytest.fixture(scope="module")
def stratified(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory):
    """A tree of classes of very different sizes with three hidden files, ingested with
    ``data.max_bad_fraction=0``."""
    root = _tree(tmp_path_factory.mktemp("stratified"), SIZES)
    (root / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    (root / "daisy" / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    (root / "roses" / "._a.jpg").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    cfg = _cfg(root, tmp_path_factory.mktemp("out"), "data.max_bad_fraction=0")
    return cfg, ingest(spark, cfg)


def test_hidden_files_are_skipped_not_counted_as_bad(spark: SparkSession, stratified) -> None:
    _, report = stratified
    assert report.hidden_skipped == 3
    assert report.quarantine_reasons == {"hidden_path": 3}  # recorded, nothing lost
    assert report.images_rows == sum(SIZES.values())
    assert report.files == report.images_rows + 3


def test_every_class_is_in_every_split_in_proportion(spark: SparkSession, stratified) -> None:
    _, report = stratified
    expected = split_quotas(SIZES, 0.2, 0.1)
    assert report.split_counts == {
        label: {"val": v, "test": t, "train": SIZES[label] - v - t}
        for label, (v, t) in expected.items()
    }
    assert report.split_counts["daisy"] == {"val": 4, "test": 2, "train": 14}
    assert report.split_counts["dandelion"] == {"val": 1, "test": 1, "train": 1}


def test_incremental_ingest_keeps_splits_and_proportions(
    spark: SparkSession, stratified, tmp_path: Path
) -> None:
    """New photos fill their class's quotas; no stored photo moves."""
    cfg, _ = stratified
    work = tmp_path / "images"
    shutil.copytree(cfg.data.images, work)
    out = tmp_path / "out"
    shutil.copytree(cfg.paths.output_dir.local_path, out)
    cfg2 = _cfg(work, out, "data.max_bad_fraction=0")
    before = _splits(spark, str(cfg2.paths.table("images")))
    _tree(work, {"dandelion": 7, "tulips": 6}, offset=SIZES["daisy"])  # 10 of each now
    again = ingest(spark, cfg2)
    assert again.mode == "incremental"
    after = _splits(spark, str(cfg2.paths.table("images")))
    assert {p: after[p] for p in before} == before
    for label in ("dandelion", "tulips"):
        assert again.split_counts[label] == {"val": 2, "test": 1, "train": 7}, label


def test_a_one_photo_class_stops_ingest_naming_it(spark: SparkSession, tmp_path: Path) -> None:
    root = _tree(tmp_path / "images", {**SIZES, "tulips": 1})
    with pytest.raises(IngestError, match=r"class 'tulips' has 1 .*nothing was written"):
        ingest(spark, _cfg(root, tmp_path / "out"))
    assert not (tmp_path / "out" / "tables" / "images").exists()


def test_a_foreign_table_where_a_split_table_was_is_refused_and_kept(
    spark: SparkSession, tmp_path: Path
) -> None:
    root = sample_photos(tmp_path / "images", per_label=3)
    cfg = _cfg(root, tmp_path / "out")
    foreign = cfg.paths.table("train").local_path
    spark.range(5).write.format("delta").save(str(foreign))
    with pytest.raises(IngestError, match=rf"{foreign} is a Delta table that flowers_job"):
        ingest(spark, cfg)
    assert spark.read.format("delta").load(str(foreign)).count() == 5
    assert not cfg.paths.table("images").exists()


def test_a_split_table_that_ingest_wrote_is_replaced_on_a_full_ingest(
    spark: SparkSession, tmp_path: Path
) -> None:
    from flowers_job.tables.table_ref import TableRef

    root = sample_photos(tmp_path / "images", per_label=3)
    cfg = _cfg(root, tmp_path / "out")
    old = cfg.paths.table("val")
    meta: dict[str, object] = {
        "fingerprint": "f" * 64,
        "run_id": "old",
        "label_names": sorted(LABELS),
    }
    write_table(spark, spark.range(5), TableRef(path=old), meta)  # as layout 3 wrote it
    report = ingest(spark, cfg)
    assert report.mode.startswith("full") and not old.exists()
    assert report.images_rows == 15


def test_predict_refuses_the_job_input_tables_as_output(
    spark: SparkSession, stratified, tmp_path: Path
) -> None:
    """Through the real ``predict``: refused (exit 2) before the model is touched."""
    from flowers_job.tables.table_ref import TableRef, table_ref

    cfg, _ = stratified
    images = table_ref(cfg, "images")
    model = ModelRef("models:/none/1", "none", 1, "sqlite:///nowhere.db")
    with pytest.raises(UsageError, match=rf"--output-table {images} is the input table") as err:
        predict(spark, model, images, table=images)
    assert err.value.exit_code == 2
    same = TableRef.from_arg(str(images) + "/")  # the same table, spelt otherwise
    with pytest.raises(UsageError, match=r"is the input table"):
        predict(spark, model, same, table=images)
    quarantine = table_ref(cfg, "quarantine")
    with pytest.raises(UsageError, match=rf"{quarantine} is one of the job's input tables"):
        predict(spark, model, quarantine, table=images)
    with pytest.raises(UsageError, match=r"flowers-job ingest wrote it"):
        check_output_table(spark, images)
    check_output_table(
        spark, TableRef(path=Location.of(tmp_path / "predictions")), images
    )  # allowed
