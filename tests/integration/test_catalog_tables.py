"""Catalog tables (``tables.catalog``/``tables.schema``): the job's Delta tables as managed
tables written and read by name, with the same commits, versions, checks and lineage as path
tables.

Spark's own session catalog stands in for Unity Catalog: ``spark_catalog.<schema>.<table>``
is a three-level name like Unity Catalog's, resolved through the same catalog API
(``saveAsTable``, ``spark.read.table``, Delta SQL on the quoted name), with the managed tables'
files under the test session's temp ``spark.sql.warehouse.dir`` (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path

import mlflow
import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from flowers_job.config import ConfigError, JobConfig, load_config
from flowers_job.driver.lease import output_lease
from flowers_job.driver.pipeline import run_training
from flowers_job.errors import DataError
from flowers_job.ingest.job import ingest
from flowers_job.ingest.retention import vacuum_tables
from flowers_job.location import Location
from flowers_job.tables.delta_tables import checked_tables, latest_commit
from flowers_job.tables.table_ref import TableRef, ensure_schema, table_ref
from flowers_job.tracking.tags import TAG_IMAGES_TABLE, TAG_IMAGES_VERSION
from tests.support import PHOTOS
from tests.support.data import sample_photos

pytestmark = [pytest.mark.timeout(600), pytest.mark.tier("gate")]


def _cfg(tmp_path: Path, *overrides: str) -> JobConfig:
    return load_config(None, list(overrides), **{"paths.output_dir": tmp_path / "out"})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["tables.catalog=main"], "tables.schema: required with tables.catalog='main'"),
        (["tables.schema=main.flowers"], "tables.schema: 'main.flowers' holds '.'"),
        (["tables.schema=my flowers"], "tables.schema: 'my flowers' holds ' '"),
        (["tables.catalog=a/b", "tables.schema=s"], "tables.catalog: 'a/b' holds '/'"),
        (["tables.schema=a`b"], "tables.schema: 'a`b' holds '`'"),
        (["tables.schema=''"], "tables.schema: an empty name"),
        ([f"tables.schema={'s' * 256}"], "tables.schema: 256 characters"),
        (["tables.database=flowers"], "tables.database: Extra inputs"),
    ],
)
def test_bad_table_names_are_refused_naming_the_setting(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        _cfg(tmp_path, *overrides)


def test_table_names_follow_the_settings(tmp_path: Path) -> None:
    """Path tables by default; ``<catalog>.<schema>.<table>`` or ``<schema>.<table>`` by
    name; the section survives the ranks' ``model_dump`` -> ``model_validate``."""
    assert table_ref(_cfg(tmp_path), "images") == TableRef(
        path=Location.of(tmp_path / "out/tables/images")
    )
    cfg = _cfg(tmp_path, "tables.catalog=main", "tables.schema=flower-photos")
    images = table_ref(cfg, "images")
    assert images.describe() == "main.flower-photos.images" == str(images)
    assert images.quoted == "`main`.`flower-photos`.`images`" and images.table == "images"
    assert images.lineage() == {"name": "main.flower-photos.images"}
    assert TableRef.from_lineage({**images.lineage(), "version": 3}) == images
    assert JobConfig.model_validate(cfg.model_dump(mode="json")).tables == cfg.tables
    assert table_ref(_cfg(tmp_path, "tables.schema=flowers"), "quarantine").describe() == (
        "flowers.quarantine"
    )
    with pytest.raises(ValueError, match="a path or a name"):
        TableRef(path=Location.of(tmp_path), parts=("a", "b"))


def test_predict_takes_a_table_by_name_or_by_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``predict --table``/``--output-table``: ``catalog.schema.table`` or ``schema.table``
    is a catalog table, a path (or a URI, or one bare word) a path table; a bad name is a
    usage error (exit 2) naming it."""
    from flowers_job.cli import build_parser

    argv = ["predict", "--model", "models:/m/1", "--output-table", "main.flowers.preds"]
    args = build_parser().parse_args([*argv, "--table", "main.flowers.images"])
    assert args.table == TableRef(parts=("main", "flowers", "images"))
    assert args.output_table == TableRef(parts=("main", "flowers", "preds"))
    assert TableRef.from_arg("flowers.images") == TableRef(parts=("flowers", "images"))
    for path in (str(tmp_path / "tables" / "images"), "s3a://bucket/out/tables/images", "t"):
        assert TableRef.from_arg(path) == TableRef(path=Location.of(path))
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*argv, "--table", "main.flo wers.images"])
    assert exit_info.value.code == 2
    assert "'main.flo wers.images'" in capsys.readouterr().err


def test_missing_and_foreign_tables_are_named(spark: SparkSession, tmp_path: Path) -> None:
    """Training on a schema that does not exist, or on a table of the job's name that is not
    a Delta table, fails before any work, naming the table."""
    schema = f"nothing_{uuid.uuid4().hex[:8]}"
    cfg = _cfg(tmp_path, "tables.catalog=spark_catalog", f"tables.schema={schema}")
    with pytest.raises(DataError, match=rf"no flowers_job Delta table spark_catalog\.{schema}\."):
        checked_tables(spark, cfg)
    assert not TableRef(parts=("no_such_catalog", schema, "images")).exists(spark)
    ensure_schema(spark, cfg)
    assert spark.catalog.databaseExists(f"spark_catalog.{schema}")
    spark.range(3).write.format("parquet").saveAsTable(f"spark_catalog.{schema}.images")
    with pytest.raises(DataError, match=rf"spark_catalog\.{schema}\.images is not a Delta table"):
        checked_tables(spark, cfg)


@pytest.mark.slow
@pytest.mark.tier("full")
def test_ingest_merge_and_training_by_name(spark: SparkSession, tmp_path: Path) -> None:
    """Ingest into ``spark_catalog.<schema>`` (created by the job), change one photo and
    ingest again (a DELETE and an append by name, the version advances by two, the old one
    still readable by time travel), train one epoch from the tables by name: the lineage, the MLflow run's
    dataset inputs and tags name the tables and their versions; VACUUM by name keeps the
    version the run's loader cache was built from."""
    images = sample_photos(tmp_path / "images", per_label=12)
    schema = f"flowers_{uuid.uuid4().hex[:8]}"
    cfg = load_config(
        None,
        [
            "data.image_size=32",
            "train.per_device_batch_size=8",
            "train.epochs=1",
            "distributed.timeout_seconds=300",
            "tracking.registered_model_name=null",  # not needed here: saves the registration
            "tables.catalog=spark_catalog",
            f"tables.schema={schema}",
        ],
        **{"data.images": images, "paths.output_dir": tmp_path / "out"},
    )
    names = {t: f"spark_catalog.{schema}.{t}" for t in ("images", "quarantine")}

    first = ingest(spark, cfg)
    assert first.mode.startswith("full") and first.images_rows == 60
    assert first.tables == names
    for name in names.values():
        table = spark.catalog.getTable(name)
        assert table.tableType == "MANAGED" and table.catalog == "spark_catalog"
    assert not (tmp_path / "out" / "tables" / "images").exists()  # no path table
    v0 = latest_commit(spark, table_ref(cfg, "images"))
    assert v0 is not None

    changed = images / "roses" / sorted(p.name for p in (images / "roses").iterdir())[0]
    changed.write_bytes(sorted((PHOTOS / "roses").glob("*.jpg"))[40].read_bytes())
    os.utime(changed, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    second = ingest(spark, cfg)
    assert (second.mode, second.files_decoded, second.rows_updated) == ("incremental", 1, 1)
    images_ref = table_ref(cfg, "images")
    v1 = latest_commit(spark, images_ref)
    assert v1 is not None and v1[0] == v0[0] + 2  # the DELETE, then the append
    assert v1[1] is not None and v0[1] is not None and v1[1]["run_id"] != v0[1]["run_id"]
    last = images_ref.history(spark, 2).select("operation").collect()
    assert [r["operation"] for r in last] == ["WRITE", "DELETE"]
    relative = f"roses/{changed.name}"
    sha = {
        v: images_ref.read(spark, v).where(F.col("relative_path") == relative).first()
        for v in (v0[0], v1[0])
    }
    assert sha[v0[0]]["content_sha256"] != sha[v1[0]]["content_sha256"]  # type: ignore[index]

    summary = run_training(spark, cfg)
    lineage = summary["lineage"]
    assert lineage["tables"]["images"] == {"name": names["images"], "version": v1[0]}
    assert lineage["splits"]["train"]["name"] == names["images"]
    assert summary["tables"] == names and summary["epochs_completed"] == 1
    run = mlflow.MlflowClient(cfg.tracking_uri).get_run(summary["mlflow_run_id"])
    assert run.data.tags[TAG_IMAGES_TABLE] == names["images"]
    assert run.data.tags[TAG_IMAGES_VERSION] == str(v1[0])
    assert run.inputs is not None
    sources = [json.loads(d.dataset.source) for d in run.inputs.dataset_inputs]
    assert sources and all(s["delta_table_name"] == names["images"] for s in sources)
    assert {s.get("delta_table_version") for s in sources} == {v1[0]}

    # retention 0 (allowed, and used under the output's lease): quarantine is vacuumed to
    # nothing but its latest version; images keeps ceil(age of v1) + 1 = 2 hours: the loader
    # cache's entries name v1 by the table's name
    short = cfg.data.model_copy(update={"retention_hours": 0, "allow_short_retention": True})
    with output_lease(cfg.paths.output_dir, "ingest"):
        hours = vacuum_tables(spark, cfg.model_copy(update={"data": short}))
    assert hours == {"images": 2, "quarantine": 0}
    assert images_ref.read(spark, v1[0]).count() == 60
