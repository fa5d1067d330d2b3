"""The job's Delta tables: their names and schemas, the metadata each commit carries, the
writes that record it, and the checks that the tables are one complete ingest.

Two tables, each image stored once:

- ``images``: every photo that decoded, **partitioned by** ``split`` (``train``, ``val``,
  ``test``). A split is read as ``images`` at one Delta version where ``split = <name>``
  (:func:`split_frame`): partition pruning reads only that split's files, and one pinned
  version of one table fixes all three splits at once. (Split tables holding row ids only
  would need a join of every read against ``images``; full copies, as before version 4 of
  the layout, stored every image twice and grew by a copy per re-ingest.)
- ``quarantine``: every other entry under the images root, with its reason.

Each table's Delta commit carries, in its ``userMetadata``, a fingerprint of the listing and
of the ingest settings, plus the ``run_id`` of the ingest that wrote it
(:mod:`flowers_job.ingest.job`). The tables form one ingest only if their latest commits
carry the same fingerprint and run id (:func:`tables_mismatch`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.types import StructType

from flowers_job.config import JobConfig
from flowers_job.errors import DataError
from flowers_job.tables.table_ref import TableRef, table_ref

__all__ = [
    "SPLITS",
    "TABLE_NAMES",
    "TABLE_SCHEMAS",
    "CheckedTables",
    "checked_tables",
    "commit_metadata",
    "delete_then_append",
    "ensure_properties",
    "is_ingest_metadata",
    "latest_commit",
    "merge_changes",
    "merge_into",
    "merge_table",
    "null_safe_differs",
    "read_table_metadata",
    "session_settings",
    "split_frame",
    "tables_mismatch",
    "write_table",
]

TABLE_NAMES = ("images", "quarantine")
SPLITS = ("train", "val", "test")
META_KEY = "flowers_job"
"""The key of the job's metadata in a commit's ``userMetadata`` JSON."""

_IMAGE_COLUMNS = T.StructType(
    [
        T.StructField("row_id", T.LongType()),
        T.StructField("source_path", T.StringType()),
        T.StructField("relative_path", T.StringType()),
        T.StructField("label", T.StringType()),
        T.StructField("label_index", T.IntegerType()),
        T.StructField("split", T.StringType()),
        T.StructField("image", T.BinaryType()),
        T.StructField("width", T.IntegerType()),
        T.StructField("height", T.IntegerType()),
        T.StructField("content_sha256", T.StringType()),
        T.StructField("num_bytes", T.LongType()),
        T.StructField("mtime_ns", T.LongType()),
        T.StructField("notes", T.StringType()),
    ]
)
TABLE_SCHEMAS: dict[str, T.StructType] = {
    "images": _IMAGE_COLUMNS,
    "quarantine": T.StructType(
        [
            T.StructField("source_path", T.StringType()),
            T.StructField("relative_path", T.StringType()),
            T.StructField("label", T.StringType()),
            T.StructField("reason_code", T.StringType()),
            T.StructField("reason", T.StringType()),
            T.StructField("num_bytes", T.LongType()),
            T.StructField("mtime_ns", T.LongType()),
            T.StructField("content_sha256", T.StringType()),
        ]
    ),
}
"""Columns and types of each table (nullability aside): what training expects to read.
``num_bytes`` and ``mtime_ns`` are the source file's size (bytes) and modification time
(nanoseconds since the epoch) when it was ingested: with ``relative_path``, what the next
ingest compares to know whether a file changed."""
PARTITION_COLUMNS: dict[str, list[str]] = {"images": ["split"], "quarantine": []}
"""The Delta partition columns of each table."""
TABLE_PROPERTIES = {"delta.enableDeletionVectors": "true"}
"""Delta table properties of ``images`` and ``quarantine``, set when ingest writes them in
full. Deletion vectors: a MERGE that deletes or replaces a row marks it deleted in a small
bitmap file beside its data file instead of rewriting that file with every other row of it
(Delta's documentation, "What are deletion vectors?"), so an incremental ingest writes about
what changed, not every file a changed photo shares. Readers need Delta 2.3 or later
(reader version 3, the ``deletionVectors`` table feature); Databricks Runtime 12.2 LTS and
later. The column that holds the source file's URI is ``source_path``, not ``path``: Delta
4.0's MERGE with deletion vectors fails on a table with a column named ``path``
(``AMBIGUOUS_REFERENCE filePath``, delta-io/delta#2943, fixed in Delta 4.3)."""


IMAGES_PROPERTIES = {**TABLE_PROPERTIES, "delta.enableChangeDataFeed": "true"}
"""``images``' Delta table properties: :data:`TABLE_PROPERTIES`, and Delta's change data feed
(Delta's documentation, "Use Delta Lake change data feed"), from which the embeddings update
reads what changed since its last update instead of comparing the tables. Recording it costs
ingest's writes nothing here: an append's rows are its new files, and a DELETE with deletion
vectors writes no change file (a reader derives the deleted rows from the vectors it
replaced); only a MERGE (past ``MAX_DELETE_PATHS`` deletions) writes its changed rows
again, under ``_change_data``. The feature adds the ``changeDataFeed`` writer feature, no
reader feature."""


MAINTENANCE_OPERATIONS = frozenset(
    {"VACUUM START", "VACUUM END", "OPTIMIZE", "SET TBLPROPERTIES", "UNSET TBLPROPERTIES"}
)
"""Delta operations that change no row: the retention's VACUUM, a compaction, a property."""
_HISTORY_DEPTH = 50


def latest_commit(
    spark: SparkSession, table: TableRef
) -> tuple[int, dict[str, object] | None] | None:
    """The latest version of the Delta ``table`` and the flowers_job metadata of its
    latest commit that changed rows (``fingerprint``, ``run_id``, ``label_names``,
    ``settings``; None when that commit is not flowers_job's); None if there is no Delta
    table there. Maintenance commits after it (:data:`MAINTENANCE_OPERATIONS`: VACUUM,
    OPTIMIZE) change no row, so the latest version holds the rows that commit wrote, and it
    is the one to read (an OPTIMIZE's older files may be vacuumed). One ``history`` read
    of the last 50 commits.

    Raises:
        DataError: a catalog table of that name that is not a Delta table.
    """
    if not table.exists(spark):
        return None
    rows = (
        table.history(spark, _HISTORY_DEPTH)
        .select("version", "operation", "userMetadata")
        .collect()
    )
    if not rows:
        return None
    latest = int(rows[0]["version"])
    for row in rows:  # newest first
        if row["operation"] in MAINTENANCE_OPERATIONS:
            continue
        return latest, commit_metadata(row["userMetadata"])
    return latest, None


def commit_metadata(user_metadata: str | None) -> dict[str, object] | None:
    """The flowers_job metadata in a commit's ``userMetadata`` (``DESCRIBE HISTORY``'s
    column, the JSON text :func:`write_table` and kin commit); None when the commit is not
    flowers_job's."""
    meta = json.loads(user_metadata) if user_metadata else None
    value = meta.get(META_KEY) if isinstance(meta, dict) else None
    return value if isinstance(value, dict) else None


def ensure_properties(
    spark: SparkSession, table: TableRef, properties: Mapping[str, str]
) -> list[str]:
    """Set on the existing Delta ``table`` those of ``properties`` it lacks or holds with
    another value: one ``ALTER TABLE ... SET TBLPROPERTIES`` commit (a maintenance one,
    :data:`MAINTENANCE_OPERATIONS`), none when all are set. What a table written before a
    property became the job's gets on its next incremental write.

    Returns:
        The keys set, sorted (empty: nothing committed).

    Raises:
        DataError: a catalog table of that name that is not a Delta table.
    """
    held = table.detail(spark)["properties"] or {}
    missing = {k: v for k, v in properties.items() if str(held.get(k, "")).lower() != v.lower()}
    if missing:
        assignments = ", ".join(f"'{k}' = '{v}'" for k, v in sorted(missing.items()))
        spark.sql(f"ALTER TABLE {table.sql_name} SET TBLPROPERTIES ({assignments})")
    return sorted(missing)


def is_ingest_metadata(meta: Mapping[str, object] | None) -> bool:
    """Whether ``meta`` (a commit's flowers_job metadata, :func:`latest_commit`) is ingest's:
    it names the labels and the listing's fingerprint (``label_names``, ``fingerprint``),
    which every ingest commit has carried since layout 3 (its split tables included), and is
    not another command's (``kind``, e.g. predict's ``predictions``). What makes a table the
    job's own input: ingest removes only such split tables of an older layout, and predict
    refuses to overwrite such a table."""
    return (
        meta is not None
        and "label_names" in meta
        and "fingerprint" in meta
        and meta.get("kind", "ingest") == "ingest"
    )


def read_table_metadata(spark: SparkSession, table: TableRef) -> dict[str, object] | None:
    """The flowers_job metadata stored in the latest commit of the Delta ``table``
    (:func:`latest_commit`); None if there is no such Delta table or its latest commit is
    not flowers_job's."""
    commit = latest_commit(spark, table)
    return None if commit is None else commit[1]


def tables_mismatch(
    metas: Mapping[str, Mapping[str, object] | None], *, allow_partial: bool = False
) -> str | None:
    """Why the tables' latest commits are not one complete ingest; None when they are.

    One ingest writes both tables with the same fingerprint and ``run_id``, so equal
    pairs mean that one run wrote every table and no other run wrote any since. An ingest
    that had nothing to change in a table other than ``images`` does not commit to it: its
    ``images`` commit names, under ``kept`` (table -> ``run_id``), the run whose commit of
    that table it kept (:func:`merge_changes`), and that table matches when its latest commit
    is still that run's. A run that was stopped after committing to such a table and before
    ``images`` leaves a newer ``run_id`` there: a mismatch, as before.

    ``images`` changed by :func:`delete_then_append` takes two commits or more: the deletes
    carry ``partial`` (and no fingerprint), the append the run's metadata. A run stopped
    between them leaves ``partial`` last: a mismatch for training, always; with
    ``allow_partial`` (ingest) those tables are still a base for an incremental ingest, as
    every path is in at most one table and only rows are missing (the next ingest decodes
    their files again), so the runs are compared without the fingerprint.

    Args:
        metas: table name -> :func:`read_table_metadata`.
        allow_partial: accept an ``images`` table whose last commit is ``partial``.

    Returns:
        None, or a description naming each table's fingerprint and run.
    """
    missing = sorted(name for name, meta in metas.items() if meta is None)
    if missing:
        return f"no flowers_job commit in {missing}"
    images = metas.get("images") or {}
    if images.get("partial"):
        if not allow_partial:
            return (
                f"images: ingest run {images.get('run_id')} was stopped between its commits "
                f"to that table ({images.get('partial')} committed, not its append)"
            )
        metas = {name: {**(m or {}), "fingerprint": None} for name, m in metas.items()}
    runs = {name: (str(m.get("fingerprint")), str(m.get("run_id"))) for name, m in metas.items()}  # type: ignore[union-attr]
    kept = images.get("kept")
    kept = kept if isinstance(kept, Mapping) else {}
    expected = runs.get("images")
    if expected is not None and all(
        run == expected or (name in kept and run[1] == str(kept[name]))
        for name, run in runs.items()
    ):
        return None
    if expected is None and len(set(runs.values())) == 1:
        return None
    return "; ".join(f"{name}: fingerprint {fp[:12]} run {run}" for name, (fp, run) in runs.items())


@contextmanager
def _commit_metadata(spark: SparkSession, meta: dict[str, object]) -> Iterator[None]:
    """Session settings for one commit that carries ``meta``: its ``userMetadata``, and no
    skipped empty commit (Delta skips the commit of a write that changes nothing, for example
    an empty overwrite of an empty quarantine, which would leave the previous run's metadata
    in place)."""
    settings = {
        "spark.databricks.delta.skipRecordingEmptyCommits": "false",
        "spark.databricks.delta.commitInfo.userMetadata": json.dumps(
            {META_KEY: meta}, sort_keys=True
        ),
    }
    with session_settings(spark, settings):
        yield


@contextmanager
def session_settings(spark: SparkSession, settings: dict[str, str]) -> Iterator[None]:
    """The Spark session's ``settings`` for the block; each key's value before, or its
    absence, restored after."""
    before = {key: spark.conf.get(key, None) for key in settings}
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, old in before.items():
            if old is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, old)


def _check_commit(spark: SparkSession, table: TableRef, meta: dict[str, object]) -> None:
    if (read_table_metadata(spark, table) or {}).get("run_id") != meta["run_id"]:
        raise DataError(
            f"the commit to {table} does not carry this write's metadata (run_id "
            f"{meta['run_id']}): another job wrote the table at the same time"
        )


def write_table(
    spark: SparkSession,
    df: DataFrame,
    table: TableRef,
    meta: dict[str, object],
    partition_by: Sequence[str] = (),
    properties: Mapping[str, str] | None = None,
) -> None:
    """Overwrite the Delta ``table`` (path or name; created if need be) with ``df``
    (partitioned by ``partition_by``, with the table ``properties``), committing ``meta``;
    one commit, also when ``df`` is empty.

    Raises:
        DataError: the latest commit does not carry ``meta['run_id']`` (another writer
            committed at the same time).
    """
    with _commit_metadata(spark, meta):
        table.overwrite(df, partition_by, properties)
    _check_commit(spark, table, meta)


def null_safe_differs(*columns: str) -> str:
    """A SQL condition for :func:`merge_table`: true where the target row ``t`` and the
    source row ``s`` differ in any of ``columns`` (NULL-safe, ``<=>``); ``false`` for none."""
    return " OR ".join(f"NOT (t.`{c}` <=> s.`{c}`)" for c in columns) or "false"


DELETE_CHUNK = 5_000
"""Paths per ``DELETE`` statement of :func:`delete_then_append` (one literal each)."""


def _string_literal(text: str) -> str:
    """``text`` as a Spark SQL expression of its value that no text can escape from: its
    UTF-8 bytes as a hex binary literal, cast to a string. Not a SQL parameter: Delta 4.4's
    DELETE on Spark 4.2 leaves parameters unbound (docs/known-issues.md#delta); not a quoted
    literal: its escapes depend on ``spark.sql.parser.escapedStringLiterals``."""
    return f"CAST(X'{text.encode('utf-8').hex()}' AS STRING)"


def delete_then_append(
    spark: SparkSession,
    table: TableRef,
    paths: Sequence[str],
    rows: DataFrame,
    meta: dict[str, object],
    after_deletes: Callable[[], None] | None = None,
) -> None:
    """Remove the rows of ``table`` at ``paths`` (``relative_path``) and append ``rows``:
    one ``DELETE ... WHERE relative_path IN (...)`` (the paths as hex literals,
    :func:`_string_literal`) per :data:`DELETE_CHUNK` paths, each
    committed as ``partial`` (``meta`` without its fingerprint), then one append that
    carries ``meta``. ``after_deletes`` is called between them (a test hook).

    Why not one MERGE: on a table with deletion vectors a DELETE reads only the
    ``relative_path`` column of the files it may touch, and marks the rows in their
    deletion vectors; Delta 4.0's MERGE also rewrites its matched rows from the touched
    files ("Writing modified data"), so its cost follows the bytes of every file that holds
    a changed row, and a day's deletions are spread over every file. Measured at 30x
    (110,100 photos, 33 files of 2.4 GB; 114 deletions, 1,098 new rows; 2-core machine,
    docs/performance.md): MERGE 10.7-15.7 s, MERGE of the deletions alone 4.6-7.5 s,
    DELETE 3.2-3.5 s plus the append 0.7 s. A run stopped between the commits leaves
    ``partial`` last (:func:`tables_mismatch` says what that means).

    Raises:
        DataError: the last commit does not carry ``meta['run_id']`` (another writer).
    """
    partial = {k: v for k, v in meta.items() if k != "fingerprint"}
    partial["partial"] = "delete"
    for start in range(0, len(paths), DELETE_CHUNK):
        chunk = paths[start : start + DELETE_CHUNK]
        values = ", ".join(_string_literal(path) for path in chunk)
        with _commit_metadata(spark, partial):
            spark.sql(f"DELETE FROM {table.sql_name} WHERE relative_path IN ({values})")
        _check_commit(spark, table, meta)
    if after_deletes is not None:
        after_deletes()
    with _commit_metadata(spark, meta):
        table.append(rows)
    _check_commit(spark, table, meta)


def merge_changes(source: DataFrame, target: DataFrame, *, keep: str, changed: str) -> int:
    """How many rows :func:`merge_table` of ``source`` into the table read as ``target``
    would delete, replace or insert (same arguments), without writing: one left join of
    ``source`` with ``target``'s columns on ``relative_path``, counted. Ingest skips a MERGE
    that would change nothing (a Delta MERGE reads and commits even then: about 5 s of an
    incremental ingest at 30x, docs/performance.md)."""
    s, t = source.alias("s"), target.alias("t")
    matched = F.col("t.relative_path").isNotNull()
    keeps = F.expr(keep)
    joined = s.join(t, F.col("s.relative_path") == F.col("t.relative_path"), "left")
    return int(
        joined.where(
            (matched & (F.col("s._gone") | ~keeps | F.expr(changed)))
            | (~matched & keeps & ~F.col("s._gone"))
        ).count()
    )


def merge_table(
    spark: SparkSession,
    source: DataFrame,
    table: TableRef,
    meta: dict[str, object],
    *,
    keep: str,
    changed: str,
) -> dict[str, int]:
    """MERGE the changes in ``source`` into the Delta ``table`` (path or name), keyed by
    ``relative_path``, in one commit that carries ``meta``.

    ``source`` has the table's columns plus ``_gone`` (boolean: the path must leave the
    table). ``keep`` and ``changed`` are SQL conditions over the target alias ``t`` and the
    source alias ``s`` (e.g. ``NOT s._gone``, :func:`null_safe_differs`). For each source row:

    - matched, and ``keep`` is false or ``_gone``: the row is deleted;
    - matched, ``keep`` and ``changed``: the row is replaced;
    - not matched, ``keep`` and not ``_gone``: the row is inserted.

    One SQL ``MERGE INTO <table> t USING <source view> s ...`` (Delta's documentation,
    "Upsert into a Delta Lake table using merge"), the same statement on classic Spark and
    Spark Connect: ``source`` is registered as a temp view of a unique name for it and dropped
    after. Rows of the table without a source row are not read beyond the join key. On a
    table with deletion vectors (:data:`TABLE_PROPERTIES`) no file is rewritten: deleted and
    replaced rows are marked in a deletion vector of their file, and the new rows written
    to new files; without them, each file that holds a matched row is rewritten whole.

    Returns:
        Delta's ``operationMetrics`` of the commit: ``inserted``, ``updated``, ``deleted``.

    Raises:
        TypeError: ``keep`` or ``changed`` is not SQL text (a ``Column``).
        DataError: as :func:`write_table`.
    """
    if not isinstance(keep, str) or not isinstance(changed, str):
        raise TypeError(
            "merge_table: keep and changed are SQL conditions over the aliases t and s "
            f"(text), got {type(keep).__name__} and {type(changed).__name__}"
        )
    names = [f.name for f in TABLE_SCHEMAS[table.table].fields]
    assignments = ", ".join(f"`{c}` = s.`{c}`" for c in names)
    inserted = ", ".join(f"`{c}`" for c in names)
    values = ", ".join(f"s.`{c}`" for c in names)
    metrics = merge_into(
        spark,
        table,
        source,
        "ON t.relative_path = s.relative_path "
        f"WHEN MATCHED AND (s._gone OR NOT ({keep})) THEN DELETE "
        f"WHEN MATCHED AND ({changed}) THEN UPDATE SET {assignments} "
        f"WHEN NOT MATCHED AND (({keep}) AND NOT s._gone) THEN INSERT ({inserted}) "
        f"VALUES ({values})",
        meta,
    )
    return {
        key: int(metrics.get(name, 0))
        for key, name in (
            ("inserted", "numTargetRowsInserted"),
            ("updated", "numTargetRowsUpdated"),
            ("deleted", "numTargetRowsDeleted"),
        )
    }


def merge_into(
    spark: SparkSession, table: TableRef, source: DataFrame, clauses: str, meta: dict[str, object]
) -> dict[str, str]:
    """``MERGE INTO <table> t USING <source> s <clauses>`` in one commit that carries
    ``meta``: ``source`` registered as a temp view of a unique name for the statement (the
    same SQL on classic Spark and Spark Connect) and dropped after.

    Returns:
        Delta's ``operationMetrics`` of the commit (``numTargetRowsInserted``, ...).

    Raises:
        DataError: the commit does not carry ``meta['run_id']`` (another writer).
    """
    view = f"flowers_job_merge_{uuid.uuid4().hex}"
    source.createOrReplaceTempView(view)
    try:
        with _commit_metadata(spark, meta):
            spark.sql(f"MERGE INTO {table.sql_name} t USING {view} s {clauses}")
    finally:
        spark.catalog.dropTempView(view)
    _check_commit(spark, table, meta)
    commit = table.history(spark, 1).select("operationMetrics").first()
    return dict((commit["operationMetrics"] if commit is not None else None) or {})


def split_frame(spark: SparkSession, images: TableRef, version: int, split: str) -> DataFrame:
    """The rows of ``split`` in the ``images`` Delta table at Delta ``version``: a
    partition filter, so only that split's files are read. (The column comes from the
    DataFrame, ``df["split"]``, not ``pyspark.sql.functions``, whose columns are classic ones
    on a Connect session made by Connect's own builder: pyspark's ``is_remote()`` is false
    there.)"""
    df = images.read(spark, version)
    return df.where(df["split"] == split)


@dataclass(frozen=True)
class CheckedTables:
    """The tables, found to be one complete ingest (:func:`checked_tables`)."""

    label_names: list[str]
    """The label names recorded at ingest; a label's index is its position."""
    versions: dict[str, int]
    """Table name -> the Delta version that was checked: the one a run reads
    (``versionAsOf``) and records as its lineage."""
    meta: dict[str, object]
    """The ingest's metadata (the images table's latest commit; every table carries the same
    fingerprint and run id)."""
    split_rows: dict[str, int]
    """Rows of each split in ``images`` at the checked version."""
    split_row_id_sums: dict[str, int]
    """The exact sum of each split's ``row_id`` values at that version (a Python int, not
    wrapped to int64): what a loader that reads the table checks its ranks' reads against."""


def checked_tables(spark: SparkSession, cfg: JobConfig) -> CheckedTables:
    """Check that the tables are one complete ingest that training can read.

    Runs before any loader cache is written. Each table's latest commit is read once
    (:func:`latest_commit`), and everything after reads that version, so the version that
    was checked is the one a run trains on. Checks, in order: every table is a flowers_job
    Delta table; both come from the same ingest run (:func:`tables_mismatch`); each has the
    expected columns and types; the three splits of ``images`` have rows; and the labels in
    ``images`` are the ``label_names`` recorded at ingest, with their recorded indices.

    Returns:
        The recorded label names, the checked version of each table, the ingest's metadata,
        and the rows and the ``row_id`` sum of each split (from one aggregation).

    Raises:
        DataError: naming the table (path or name) and the problem (missing tables, tables from
            different ingests, missing/extra/wrongly typed columns, an empty split, or labels
            that differ from the recorded ones, naming both sets).
    """
    paths = {name: table_ref(cfg, name) for name in TABLE_NAMES}
    commits = {name: latest_commit(spark, path) for name, path in paths.items()}
    metas = {name: None if c is None else c[1] for name, c in commits.items()}
    missing = [paths[n] for n, m in metas.items() if m is None]
    if missing:
        raise DataError(
            f"no flowers_job Delta table {', '.join(map(str, missing))}; run `flowers-job "
            "ingest` (or `run`) first"
        )
    mismatch = tables_mismatch(metas)
    if mismatch:
        raise DataError(
            f"the tables {', '.join(map(str, paths.values()))} come from different ingests "
            f"({mismatch}); "
            "an ingest was interrupted or another one wrote since: run `flowers-job ingest` "
            "again, it repairs them"
        )
    versions = {name: c[0] for name, c in commits.items() if c is not None}
    tables = {name: path.read(spark, versions[name]) for name, path in paths.items()}
    for name, df in tables.items():
        _check_schema(name, paths[name], df.schema)
    # (split, label, label_index) with counts and row_id sums, one query: a split without
    # rows is empty. The sum is exact as decimal(38,0), which Spark 4's ANSI mode never
    # overflows below ~10**19 rows (a long sum would raise).
    groups = (
        tables["images"]
        .groupBy("split", "label", "label_index")
        .agg(
            F.count(F.lit(1)).alias("count"),
            F.sum(F.col("row_id").cast("decimal(38,0)")).alias("row_id_sum"),
        )
        .collect()
    )
    split_rows = {split: 0 for split in SPLITS}
    split_sums = {split: 0 for split in SPLITS}
    for g in groups:
        split_rows[g["split"]] = split_rows.get(g["split"], 0) + int(g["count"])
        split_sums[g["split"]] = split_sums.get(g["split"], 0) + int(g["row_id_sum"] or 0)
    empty = [split for split in SPLITS if not split_rows[split]]
    if empty:
        raise DataError(
            f"the {empty[0]} split of the images table {paths['images']} (version "
            f"{versions['images']}) is empty; training needs rows in train, val and test: add "
            "photos (or change data.val_fraction or data.test_fraction) and ingest again"
        )
    meta = metas["images"]
    assert meta is not None
    label_names = [str(x) for x in meta["label_names"]]  # type: ignore[attr-defined]
    pairs = {(g["label"], g["label_index"]) for g in groups}
    _check_labels(pairs, label_names, paths["images"])
    return CheckedTables(label_names, versions, dict(meta), split_rows, split_sums)


def _check_schema(name: str, path: TableRef, schema: StructType) -> None:
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


def _check_labels(pairs: set[tuple[str, int]], label_names: list[str], where: TableRef) -> None:
    """Raise ``DataError`` if the (label, label_index) pairs of the images table differ from
    ``label_names`` (a label's index is its position), naming both label sets."""
    found = sorted({str(label) for label, _ in pairs})
    if found != sorted(label_names):
        raise DataError(
            f"the labels in the images table {where}, {found}, differ from the "
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
            f"label_index in the images table {where} does not match the "
            f"label_names recorded at ingest, {label_names}: {', '.join(wrong)}; run "
            "`flowers-job ingest` again"
        )
