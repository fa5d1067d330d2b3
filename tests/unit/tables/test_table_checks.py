"""Training from existing tables: bad tables are refused, naming the problem, before any
loader cache is written. Each test damages a copy of one real ingest's tables."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from flowers_job.config import JobConfig, load_config
from flowers_job.driver.prepare import example_images, prepare_data
from flowers_job.errors import DataError
from flowers_job.ingest.job import ingest
from flowers_job.loaders import resolve_loader
from flowers_job.tables.delta_tables import (
    PARTITION_COLUMNS,
    TABLE_NAMES,
    checked_tables,
    read_table_metadata,
    tables_mismatch,
)
from flowers_job.tables.table_ref import table_ref
from tests.support.data import sample_photos

pytestmark = [pytest.mark.timeout(600), pytest.mark.tier("gate")]


def _cfg(out: Path, images: Path | None = None) -> JobConfig:
    return load_config(
        None, ["data.image_size=32"], **{"data.images": images, "paths.output_dir": out}
    )


@pytest.fixture(scope="module")
def source(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(images root, output dir) of one ingest of 4 real photos per label."""
    images = sample_photos(tmp_path_factory.mktemp("checks") / "images", per_label=4)
    out = images.parent / "out"
    ingest(spark, _cfg(out, images))
    return images, out


@pytest.fixture
def tables(source: tuple[Path, Path], tmp_path: Path) -> JobConfig:
    """A config whose output dir holds a private copy of the ingested tables."""
    shutil.copytree(source[1] / "tables", tmp_path / "tables")
    return _cfg(tmp_path)


def _rewrite(spark: SparkSession, cfg: JobConfig, name: str, df: DataFrame) -> None:
    """Overwrite a table with ``df`` (its partitioning kept), keeping its flowers_job commit
    metadata (so that only the damage done here is wrong)."""
    path = cfg.paths.table(name)
    meta = read_table_metadata(spark, table_ref(cfg, name))
    (
        df.localCheckpoint()
        .write.format("delta")
        .mode("overwrite")
        .option("overwriteSchema", "true")
        .option("userMetadata", json.dumps({"flowers_job": meta}))
        .partitionBy(*PARTITION_COLUMNS[name])
        .save(str(path))
    )


def _read(spark: SparkSession, cfg: JobConfig, name: str) -> DataFrame:
    return spark.read.format("delta").load(str(cfg.paths.table(name)))


def test_intact_tables_pass_and_the_checked_versions_are_the_ones_read(
    spark: SparkSession, tables: JobConfig
) -> None:
    """The versions checked are each table's latest, and what prepare reads at them stays
    what was checked when a table gets a new commit after the check."""
    from delta.tables import DeltaTable

    checked = checked_tables(spark, tables)
    assert checked.label_names == ["daisy", "dandelion", "roses", "sunflowers", "tulips"]
    latest = {
        name: DeltaTable.forPath(spark, str(tables.paths.table(name))).history(1).collect()[0]
        for name in TABLE_NAMES
    }
    assert checked.versions == {name: int(row["version"]) for name, row in latest.items()}
    assert checked.meta == read_table_metadata(spark, table_ref(tables, "images"))
    assert sum(checked.split_rows.values()) == 20 and all(checked.split_rows.values())
    version = checked.versions["images"]
    images = table_ref(tables, "images")
    examples = example_images(spark, images, version)
    assert len(examples) == 2
    _rewrite(spark, tables, "images", _read(spark, tables, "images").where("split != 'val'"))
    assert example_images(spark, images, version) == examples
    assert example_images(spark, images, version + 1) == []


def test_a_label_set_that_differs_from_the_recorded_one(
    spark: SparkSession, tables: JobConfig
) -> None:
    images = _read(spark, tables, "images")
    relabelled = images.withColumn(
        "label", F.when(F.col("label") == "tulips", "orchids").otherwise(F.col("label"))
    )
    _rewrite(spark, tables, "images", relabelled)
    with pytest.raises(DataError) as err:
        checked_tables(spark, tables)
    message = str(err.value)
    assert "['daisy', 'dandelion', 'orchids', 'roses', 'sunflowers']" in message
    assert "['daisy', 'dandelion', 'roses', 'sunflowers', 'tulips']" in message
    assert "missing ['tulips'], unexpected ['orchids']" in message


def test_a_label_index_that_differs_from_the_recorded_one(
    spark: SparkSession, tables: JobConfig
) -> None:
    images = _read(spark, tables, "images")
    shifted = F.when(F.col("split") == "val", (F.col("label_index") + 1) % 5).otherwise(
        F.col("label_index")
    )
    _rewrite(spark, tables, "images", images.withColumn("label_index", shifted))
    with pytest.raises(
        DataError, match=r"label_index in the images table .*: \w+: \d \(expected \d\)"
    ):
        checked_tables(spark, tables)


def test_an_empty_split(spark: SparkSession, tables: JobConfig) -> None:
    _rewrite(spark, tables, "images", _read(spark, tables, "images").where("split != 'val'"))
    with pytest.raises(
        DataError, match=rf"the val split of the images table {tables.paths.table('images')} "
    ):
        checked_tables(spark, tables)


def test_a_table_with_the_wrong_schema(spark: SparkSession, tables: JobConfig) -> None:
    images = _read(spark, tables, "images")
    damaged = (
        images.drop("notes")
        .withColumn("extra", F.lit(1))
        .withColumn("width", F.col("width").cast("string"))
    )
    _rewrite(spark, tables, "images", damaged)
    with pytest.raises(DataError) as err:
        checked_tables(spark, tables)
    message = str(err.value)
    assert f"the images table {tables.paths.table('images')} does not have" in message
    assert "missing columns ['notes']" in message
    assert "extra columns ['extra']" in message
    assert "wrong types: width is string, expected int" in message


def test_tables_written_by_different_runs(
    spark: SparkSession, source: tuple[Path, Path], tables: JobConfig, tmp_path: Path
) -> None:
    """Same input, same fingerprint, but the quarantine table comes from another ingest run (a
    concurrent writer): refused; ingesting again rewrites both and training accepts."""
    other = tmp_path / "other"
    ingest(spark, _cfg(other, source[0]))
    shutil.rmtree(tables.paths.table("quarantine"))
    shutil.copytree(other / "tables" / "quarantine", tables.paths.table("quarantine"))
    with pytest.raises(DataError, match=r"come from different ingests .* run `flowers-job ingest`"):
        checked_tables(spark, tables)
    assert ingest(spark, _cfg(Path(tables.paths.output_dir), source[0])).written
    assert len(checked_tables(spark, tables).label_names) == 5


def test_prepare_fails_before_writing_any_cache(spark: SparkSession, tables: JobConfig) -> None:
    _rewrite(spark, tables, "images", _read(spark, tables, "images").drop("image"))
    with (
        pytest.raises(DataError, match="missing columns \\['image'\\]"),
        prepare_data(spark, *resolve_loader(tables)),
    ):
        pass
    cache = Path(tables.paths.output_dir / "loader_cache")
    assert not cache.exists() or not any(cache.rglob("*.parquet"))


def test_a_kept_commit_matches_only_while_it_is_the_latest() -> None:
    """An ingest that had nothing to change in ``quarantine`` names the run whose commit it
    kept there (``kept``); a later run's commit there (stopped before ``images``) is a
    mismatch, as is a ``kept`` that names another run."""
    a = {"fingerprint": "f1", "run_id": "a"}
    b = {"fingerprint": "f2", "run_id": "b", "kept": {"quarantine": "a"}}
    assert tables_mismatch({"images": a, "quarantine": a}) is None
    assert tables_mismatch({"images": b, "quarantine": a}) is None
    c = {"fingerprint": "f3", "run_id": "c"}
    assert tables_mismatch({"images": b, "quarantine": c}) is not None  # stopped after it
    assert tables_mismatch({"images": {**b, "kept": {"quarantine": "z"}}, "quarantine": a})
    assert tables_mismatch({"images": {**b, "kept": "a"}, "quarantine": a})
    assert tables_mismatch({"images": a, "quarantine": c}) is not None
