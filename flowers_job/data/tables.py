"""The job's Delta tables: their names and schemas, the metadata each commit carries, the
overwrite that records it, and the checks that five tables are one complete ingest.

Each table's Delta commit carries, in its ``userMetadata``, a fingerprint of the listing and
of the ingest settings, plus the ``run_id`` of the ingest that wrote it
(:mod:`flowers_job.data.ingest`). The five tables form one ingest only if their latest
commits carry the same fingerprint and run id (:func:`tables_mismatch`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T
from pyspark.sql.types import StructType

from flowers_job.config import JobConfig
from flowers_job.errors import DataError

__all__ = [
    "SPLITS",
    "TABLE_NAMES",
    "TABLE_SCHEMAS",
    "CheckedTables",
    "checked_tables",
    "latest_commit",
    "read_table_metadata",
    "tables_mismatch",
    "write_table",
]

TABLE_NAMES = ("images", "train", "val", "test", "quarantine")
SPLITS = ("train", "val", "test")
META_KEY = "flowers_job"
"""The key of the job's metadata in a commit's ``userMetadata`` JSON."""

_IMAGE_COLUMNS = T.StructType(
    [
        T.StructField("row_id", T.LongType()),
        T.StructField("path", T.StringType()),
        T.StructField("relative_path", T.StringType()),
        T.StructField("label", T.StringType()),
        T.StructField("label_index", T.IntegerType()),
        T.StructField("split", T.StringType()),
        T.StructField("image", T.BinaryType()),
        T.StructField("width", T.IntegerType()),
        T.StructField("height", T.IntegerType()),
        T.StructField("content_sha256", T.StringType()),
        T.StructField("num_bytes", T.LongType()),
        T.StructField("notes", T.StringType()),
    ]
)
TABLE_SCHEMAS: dict[str, T.StructType] = {
    "images": _IMAGE_COLUMNS,
    "train": _IMAGE_COLUMNS,
    "val": _IMAGE_COLUMNS,
    "test": _IMAGE_COLUMNS,
    "quarantine": T.StructType(
        [
            T.StructField("path", T.StringType()),
            T.StructField("relative_path", T.StringType()),
            T.StructField("label", T.StringType()),
            T.StructField("reason_code", T.StringType()),
            T.StructField("reason", T.StringType()),
            T.StructField("num_bytes", T.LongType()),
            T.StructField("content_sha256", T.StringType()),
        ]
    ),
}
"""Columns and types of each table (nullability aside): what training expects to read."""


def latest_commit(spark: SparkSession, path: Path) -> tuple[int, dict[str, object] | None] | None:
    """The version of the latest commit of the Delta table at ``path`` and the flowers_job
    metadata it carries (``fingerprint``, ``run_id``, ``label_names``, ``settings``; None
    when that commit is not flowers_job's); None if there is no Delta table there. One
    ``history(1)`` read."""
    from delta.tables import DeltaTable

    if not DeltaTable.isDeltaTable(spark, str(path)):
        return None
    last = DeltaTable.forPath(spark, str(path)).history(1).select("version", "userMetadata")
    row = last.first()
    if row is None:
        return None
    meta = json.loads(row["userMetadata"]) if row["userMetadata"] else None
    value = meta.get(META_KEY) if isinstance(meta, dict) else None
    return int(row["version"]), value if isinstance(value, dict) else None


def read_table_metadata(spark: SparkSession, path: Path) -> dict[str, object] | None:
    """The flowers_job metadata stored in the latest commit of the Delta table at ``path``
    (:func:`latest_commit`); None if there is no Delta table there or its latest commit is
    not flowers_job's."""
    commit = latest_commit(spark, path)
    return None if commit is None else commit[1]


def tables_mismatch(metas: Mapping[str, Mapping[str, object] | None]) -> str | None:
    """Why the tables' latest commits are not one complete ingest; None when they are.

    One ingest writes all five tables with the same fingerprint and ``run_id``, so equal
    pairs mean that one run wrote every table and no other run wrote any since.

    Args:
        metas: table name -> :func:`read_table_metadata`.

    Returns:
        None, or a description naming each table's fingerprint and run.
    """
    missing = sorted(name for name, meta in metas.items() if meta is None)
    if missing:
        return f"no flowers_job commit in {missing}"
    runs = {name: (str(m.get("fingerprint")), str(m.get("run_id"))) for name, m in metas.items()}  # type: ignore[union-attr]
    if len(set(runs.values())) == 1:
        return None
    return "; ".join(f"{name}: fingerprint {fp[:12]} run {run}" for name, (fp, run) in runs.items())


def write_table(spark: SparkSession, df: DataFrame, path: Path, meta: dict[str, object]) -> None:
    """Overwrite the Delta table at ``path`` with ``df``, committing ``meta``.

    Delta skips the commit of an empty overwrite of an empty table (for example a clean
    quarantine), which would leave the previous run's metadata in place; that is switched off
    for the write, and the commit is checked.

    Raises:
        DataError: the latest commit does not carry ``meta['run_id']`` (another writer
            committed at the same time).
    """
    skip_empty = "spark.databricks.delta.skipRecordingEmptyCommits"
    before = spark.conf.get(skip_empty, None)
    spark.conf.set(skip_empty, "false")
    try:
        (
            df.write.format("delta")
            .mode("overwrite")
            .option("overwriteSchema", "true")
            .option("userMetadata", json.dumps({META_KEY: meta}, sort_keys=True))
            .save(str(path))
        )
    finally:
        if before is None:
            spark.conf.unset(skip_empty)
        else:
            spark.conf.set(skip_empty, before)
    if (read_table_metadata(spark, path) or {}).get("run_id") != meta["run_id"]:
        raise DataError(
            f"the commit to {path} does not carry this write's metadata (run_id "
            f"{meta['run_id']}): another job wrote the table at the same time"
        )


@dataclass(frozen=True)
class CheckedTables:
    """Five tables found to be one complete ingest (:func:`checked_tables`)."""

    label_names: list[str]
    """The label names recorded at ingest; a label's index is its position."""
    versions: dict[str, int]
    """Table name -> the Delta version that was checked: the one a run reads
    (``versionAsOf``) and records as its lineage."""
    meta: dict[str, object]
    """The ingest's metadata (the images table's latest commit; every table carries the same
    fingerprint and run id)."""


def checked_tables(spark: SparkSession, cfg: JobConfig) -> CheckedTables:
    """Check that the five tables are one complete ingest that training can read.

    Runs before any loader cache is written. Each table's latest commit is read once
    (:func:`latest_commit`), and everything after reads that version, so the version that
    was checked is the one a run trains on. Checks, in order: every table is a
    flowers_job Delta table; all five come from the same ingest run (:func:`tables_mismatch`);
    each has the expected columns and types; ``images`` and the three splits have rows; and
    the labels in the splits are the ``label_names`` recorded at ingest, with their
    recorded indices.

    Returns:
        The recorded label names, the checked version of each table and the ingest's
        metadata.

    Raises:
        DataError: naming the table path and the problem (missing tables, tables from
            different ingests, missing/extra/wrongly typed columns, an empty table, or labels
            that differ from the recorded ones, naming both sets).
    """
    paths = {name: cfg.paths.table(name) for name in TABLE_NAMES}
    commits = {name: latest_commit(spark, path) for name, path in paths.items()}
    metas = {name: None if c is None else c[1] for name, c in commits.items()}
    missing = [paths[n] for n, m in metas.items() if m is None]
    if missing:
        raise DataError(
            f"no flowers_job Delta table at {', '.join(map(str, missing))}; run `flowers-job "
            "ingest` (or `run`) first"
        )
    mismatch = tables_mismatch(metas)
    if mismatch:
        raise DataError(
            f"the tables under {cfg.paths.tables_dir} come from different ingests ({mismatch}); "
            "an ingest was interrupted or another one wrote since: run `flowers-job ingest` "
            "again, it rewrites all five"
        )
    versions = {name: c[0] for name, c in commits.items() if c is not None}
    tables = {
        name: spark.read.format("delta").option("versionAsOf", versions[name]).load(str(path))
        for name, path in paths.items()
    }
    for name, df in tables.items():
        _check_schema(name, paths[name], df.schema)
    # A split's (label, label_index) pairs, one query each: none means an empty split.
    pairs = {split: _label_pairs(tables[split]) for split in SPLITS}
    empty = ["images"] if tables["images"].isEmpty() else []
    empty += [split for split in SPLITS if not pairs[split]]
    if empty:
        raise DataError(
            f"the {empty[0]} table {paths[empty[0]]} is empty; training needs rows in images, "
            "train, val and test: add photos (or change data.val_fraction or "
            "data.test_fraction) and ingest again"
        )
    meta = metas["images"]
    assert meta is not None
    label_names = [str(x) for x in meta["label_names"]]  # type: ignore[attr-defined]
    _check_labels(set().union(*pairs.values()), label_names, cfg.paths.tables_dir)
    return CheckedTables(label_names, versions, dict(meta))


def _check_schema(name: str, path: Path, schema: StructType) -> None:
    """Raise ``DataError`` naming the missing, extra and wrongly typed columns of a table."""
    expected = {f.name: f.dataType for f in TABLE_SCHEMAS[name].fields}
    actual = {f.name: f.dataType for f in schema.fields}
    problems = []
    if missing := [c for c in expected if c not in actual]:
        problems.append(f"missing columns {missing}")
    if extra := [c for c in actual if c not in expected]:
        problems.append(f"extra columns {extra}")
    if wrong := [
        f"{c} is {actual[c].simpleString()}, expected {t.simpleString()}"
        for c, t in expected.items()
        if c in actual and actual[c] != t
    ]:
        problems.append("wrong types: " + ", ".join(wrong))
    if problems:
        raise DataError(
            f"the {name} table {path} does not have the expected schema: "
            + "; ".join(problems)
            + "; run `flowers-job ingest` again to rewrite it"
        )


def _label_pairs(df: DataFrame) -> set[tuple[str, int]]:
    """The distinct (label, label_index) pairs of a split table (at most 10,000)."""
    rows = df.select("label", "label_index").distinct().limit(10_000).collect()
    return {(r["label"], r["label_index"]) for r in rows}


def _check_labels(pairs: set[tuple[str, int]], label_names: list[str], where: Path) -> None:
    """Raise ``DataError`` if the (label, label_index) pairs of the split tables differ from
    ``label_names`` (a label's index is its position), naming both label sets."""
    found = sorted({str(label) for label, _ in pairs})
    if found != sorted(label_names):
        raise DataError(
            f"the labels in the split tables under {where}, {found}, differ from the "
            f"label_names recorded at ingest, {label_names} (missing "
            f"{sorted(set(label_names) - set(found))}, unexpected "
            f"{sorted(set(found) - set(label_names))}); run `flowers-job ingest` again"
        )
    wrong = sorted(
        f"{label}: {index} (expected {label_names.index(label)})"
        for label, index in pairs
        if index != label_names.index(label)
    )
    if wrong:
        raise DataError(
            f"label_index in the split tables under {where} does not match the "
            f"label_names recorded at ingest, {label_names}: {', '.join(wrong)}; run "
            "`flowers-job ingest` again"
        )
