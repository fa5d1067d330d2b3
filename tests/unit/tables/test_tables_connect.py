"""The job's Delta tables through Spark SQL, the same on Spark Connect as on classic
Spark. Over one real Connect server (``local[2]``, Delta's jar and SQL extension: the
``connect_url`` fixture) and the classic ``spark`` fixture: existence, ``DESCRIBE DETAIL``,
``DESCRIBE HISTORY``, the ingest's MERGE and VACUUM, with real Delta tables in tmp dirs."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import AnalysisException
from pyspark.sql import SparkSession
from pyspark.sql import types as T

from flowers_job.config import load_config
from flowers_job.config.data import SAFE_RETENTION_HOURS
from flowers_job.errors import DataError
from flowers_job.ingest.retention import retention_hours, sole_writer, vacuum_tables
from flowers_job.location import Location
from flowers_job.tables.delta_tables import (
    TABLE_NAMES,
    TABLE_SCHEMAS,
    merge_table,
    null_safe_differs,
    read_table_metadata,
    write_table,
)
from flowers_job.tables.table_ref import TableRef, table_ref
from tests.support.connect import connect_session

pytestmark = [pytest.mark.timeout(600), pytest.mark.tier("gate")]

QUARANTINE = TABLE_SCHEMAS["quarantine"]
SOURCE = T.StructType([*QUARANTINE.fields, T.StructField("_gone", T.BooleanType())])
KEEP = "NOT s._gone"
CHANGED = f"{KEEP} AND ({null_safe_differs('reason_code', 'reason', 'num_bytes', 'mtime_ns')})"


def _row(name: str, num_bytes: int, reason: str | None = "unreadable") -> tuple[Any, ...]:
    return (f"file:/photos/{name}", name, "daisy", "decode", reason, num_bytes, 7, "sha-" + name)


def _image_row(i: int) -> tuple[Any, ...]:
    """A row of the images table (:data:`TABLE_SCHEMAS`)."""
    path = (i, f"file:/photos/x{i}", f"x{i}", "daisy", 0, "train")
    return (*path, b"", 1, 1, f"sha{i}", i, 7, None)


def _merge_case(spark: Any, root: Path) -> tuple[list[tuple[Any, ...]], dict[str, int], str]:
    """A quarantine table of a, b, c, d (write_table), then one MERGE: a unchanged, b's size
    changed, c gone, d with a NULL reason in the source (NULL-safe: changed), e new, f gone
    and never there. Returns the table's rows, the MERGE's metrics and the run id of the
    latest commit's metadata."""
    table = TableRef(path=Location.of(root / "quarantine"))
    first = [_row("a", 1), _row("b", 2), _row("c", 3), _row("d", 4)]
    write_table(spark, spark.createDataFrame(first, QUARANTINE), table, {"run_id": "r1"})
    source = [
        (*_row("a", 1), False),
        (*_row("b", 20), False),
        (None, "c", None, None, None, None, None, None, True),
        (*_row("d", 4, reason=None), False),
        (*_row("e", 5), False),
        (None, "f", None, None, None, None, None, None, True),
    ]
    metrics = merge_table(
        spark,
        spark.createDataFrame(source, SOURCE),
        table,
        {"run_id": "r2"},
        keep=KEEP,
        changed=CHANGED,
    )
    rows = sorted(tuple(r) for r in table.read(spark).collect())
    meta = read_table_metadata(spark, table) or {}
    return rows, metrics, str(meta.get("run_id"))


@pytest.mark.tier("full")  # the gate runs exists/detail/history here, and the job
def test_merge_on_connect_equals_merge_on_classic(
    spark: SparkSession, connect_url: str, tmp_path: Path
) -> None:
    """The same MERGE (delete, update, insert, no-op) gives the same rows, the same operation
    metrics and the same commit metadata on a Connect session as on classic Spark; no temp
    view is left behind."""
    classic = _merge_case(spark, tmp_path / "classic")
    with connect_session(connect_url) as remote:
        connect = _merge_case(remote, tmp_path / "connect")
        assert not [t for t in remote.catalog.listTables() if t.name.startswith("flowers_job")]
    expected_rows = sorted([_row("a", 1), _row("b", 20), _row("d", 4, reason=None), _row("e", 5)])
    assert classic == (expected_rows, {"inserted": 1, "updated": 2, "deleted": 1}, "r2")
    assert connect == classic


def test_exists_detail_history_and_errors_on_connect(
    spark: SparkSession, connect_url: str, tmp_path: Path
) -> None:
    """On Connect: a Delta path table exists; a missing path, a Parquet folder and an empty
    folder do not (also with a backtick in the path); DESCRIBE DETAIL and HISTORY read it; a
    catalog table that is not Delta is a DataError naming it."""
    delta_dir = tmp_path / "we`ird" / "images"
    with connect_session(connect_url) as remote:
        remote.range(4).write.format("delta").save(str(delta_dir))
        remote.range(4).write.format("delta").mode("overwrite").save(str(delta_dir))
        remote.range(2).write.parquet(str(tmp_path / "plain"))
        (tmp_path / "empty").mkdir()
        table = TableRef(path=Location.of(delta_dir))
        assert table.sql_name == f"delta.`{str(delta_dir).replace('`', '``')}`"
        assert table.exists(remote)
        for other in ("missing", "plain", "empty"):
            assert not TableRef(path=Location.of(tmp_path / other)).exists(remote), other
        detail = table.detail(remote)
        assert detail["format"] == "delta"
        assert table.table_id(remote) == detail["id"]
        assert TableRef(path=Location.of(tmp_path / "missing")).table_id(remote) is None
        ops = [r["operation"] for r in table.history(remote).collect()]
        assert ops == ["WRITE", "WRITE"]
        assert [r["version"] for r in table.history(remote, 1).collect()] == [1]
        with pytest.raises(AnalysisException, match="DELTA_MISSING_DELTA_TABLE"):
            TableRef(path=Location.of(tmp_path / "plain")).detail(remote)
        schema = f"h1_{uuid.uuid4().hex[:8]}"
        remote.sql(f"CREATE SCHEMA {schema}")
        remote.range(2).write.format("parquet").saveAsTable(f"{schema}.images")
        foreign = TableRef(parts=(schema, "images"))
        assert foreign.exists(remote)
        for read in (foreign.detail, foreign.history):
            with pytest.raises(DataError, match=rf"{schema}\.images is not a Delta table"):
                read(remote)
    # the same answers on classic Spark, through the same SQL
    assert TableRef(path=Location.of(delta_dir)).exists(spark)
    assert not TableRef(path=Location.of(tmp_path / "plain")).exists(spark)
    assert TableRef(path=Location.of(delta_dir)).detail(spark)["id"] == detail["id"]


def _parquet_files(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("*.parquet")}


@pytest.mark.tier("full")  # the gate runs exists/detail/history here, and the job
def test_vacuum_on_connect(connect_url: str, tmp_path: Path) -> None:
    """VACUUM through SQL on Connect: the job keeps Delta's safe 168 h unless it holds the
    output's lease (Delta 4.4 no longer refuses less itself: docs/known-issues.md); its
    ``vacuum_tables`` (retention 0 under the lease, the listing parallelism from the Connect
    session) removes the files the latest version no longer uses and keeps the others, on
    both tables."""
    cfg = load_config(
        None,
        ["data.retention_hours=0", "data.allow_short_retention=true"],
        **{"paths.output_dir": tmp_path / "out"},
    )
    with connect_session(connect_url) as remote:
        refs = {name: table_ref(cfg, name) for name in TABLE_NAMES}
        for version in range(2):  # v1 replaces every file of v0
            for name, ref in refs.items():
                rows = [
                    _image_row(i) if name == "images" else _row(f"x{i}", i, f"v{version}")
                    for i in range(3)
                ]
                df = remote.createDataFrame(rows, TABLE_SCHEMAS[name])
                write_table(remote, df, ref, {"run_id": f"v{version}"})
        before = {n: _parquet_files(Path(str(r.path))) for n, r in refs.items()}
        assert (
            retention_hours(cfg.data, cfg.paths.output_dir) == SAFE_RETENTION_HOURS
        )  # no lease: the job's guard
        with sole_writer(cfg.paths.output_dir):
            assert vacuum_tables(remote, cfg) == {"images": 0, "quarantine": 0}
        for name, ref in refs.items():
            after = _parquet_files(Path(str(ref.path)))
            assert after < before[name], name
            assert len(after) == ref.detail(remote)["numFiles"], name
            assert ref.read(remote).count() == 3
            assert {"VACUUM START", "VACUUM END"} <= {
                r["operation"] for r in ref.history(remote, 3).collect()
            }
