"""Where one Delta table lives: a path (``<output_dir>/tables/<name>``, the default) or a
name in a catalog (``catalog.schema.table``, with ``tables.schema``).

Every read, write, existence check and Delta command of the job's tables goes through a
:class:`TableRef`, so that the two kinds share one code path: a path table is read with
``spark.read.format("delta").load(path)`` and written with ``.save(path)``; a catalog table
with ``spark.read.table(name)`` and ``.saveAsTable(name)`` (a managed table: the catalog
decides where its files go). Time travel is the same ``versionAsOf`` reader option for both
(Delta's documentation, "Query an older snapshot of a table"). Spark's own catalog
(``spark_catalog``, tables under ``spark.sql.warehouse.dir``) and Unity Catalog are reached
the same way, through the session's catalogs (``spark.sql.catalog.spark_catalog`` is Delta's
``DeltaCatalog``: :func:`flowers_job.cluster.session.get_spark`).

Delta's commands (``DESCRIBE DETAIL``, ``DESCRIBE HISTORY``, ``VACUUM``, ``MERGE INTO``) run
as Spark SQL on :attr:`TableRef.sql_name` (``delta.`<path>``` or the quoted catalog name;
Delta's documentation, "Table utility commands"), one implementation for classic Spark and
Spark Connect alike: any Spark with Delta's jar and ``io.delta.sql.DeltaSparkSessionExtension``
runs them. delta-spark's Python ``DeltaTable`` is not used: given a Connect session it
either reads ``spark._sc`` (``AttributeError: 'SparkSession' object has no attribute '_sc'``,
seen with delta-spark 4.0.1) or, where pyspark's ``is_remote()`` holds, goes through
``delta.connect.tables``, which needs Delta Connect's server plugin
(``io.delta:delta-connect-server_2.13`` with ``DeltaRelationPlugin``), a jar not published on
Maven Central for Delta 4.0.1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pyspark.sql import DataFrame, Row, SparkSession

from flowers_job.config import JobConfig
from flowers_job.errors import DataError
from flowers_job.location import Location, is_remote

__all__ = ["DELTA_FORMAT", "TableRef", "ensure_schema", "table_ref"]

DELTA_FORMAT = "delta"
"""The tables' format: Spark's data source name, and ``DESCRIBE DETAIL``'s ``format``."""

_NOT_DELTA = frozenset(
    {"DELTA_ONLY_OPERATION", "DELTA_TABLE_ONLY_OPERATION", "DELTA_MISSING_DELTA_TABLE"}
)
"""Delta's error conditions for a Delta command on a table that is not a Delta table."""


@dataclass(frozen=True)
class TableRef:
    """One Delta table: by ``path``, or by catalog name ``parts`` (``(catalog, schema,
    table)`` or ``(schema, table)``; each part free of periods and backticks,
    :func:`flowers_job.config.data.check_identifier`). Exactly one of the two is set."""

    path: Location | None = None
    parts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.path is None) == (not self.parts):
            raise ValueError("TableRef: give a path or a name, not both or neither")
        if self.path is not None and not isinstance(self.path, Location):
            object.__setattr__(self, "path", Location.of(self.path))  # a str or Path given

    @classmethod
    def from_lineage(cls, entry: Mapping[str, object]) -> TableRef:
        """The table of a lineage entry (:meth:`lineage`): its ``name`` or ``path``."""
        if entry.get("name"):
            return cls(parts=tuple(str(entry["name"]).split(".")))
        return cls(path=Location.of(str(entry["path"])))

    @classmethod
    def from_arg(cls, text: str) -> TableRef:
        """A table as the command line names it (``predict --table``/``--output-table``):
        ``<schema>.<table>`` or ``<catalog>.<schema>.<table>`` (Unity Catalog's form, no
        ``/``) is a catalog table; anything else (a path with ``/``, an object-store URI,
        one bare word) is a path table.

        Raises:
            ValueError: a name with a part :func:`~flowers_job.config.data.check_identifier`
                refuses (an empty part, whitespace, a backtick...), naming it.
        """
        from flowers_job.config.data import check_identifier

        parts = tuple(text.split("."))
        if "/" in text or is_remote(text) or len(parts) not in (2, 3):
            return cls(path=Location.of(text))
        for part in parts:
            check_identifier(part)
        return cls(parts=parts)

    @property
    def in_catalog(self) -> bool:
        return bool(self.parts)

    @property
    def table(self) -> str:
        """The table's own name: ``images``, ``quarantine`` (a path's last component)."""
        return self.parts[-1] if self.parts else Location.of(str(self.path)).name

    @property
    def quoted(self) -> str:
        """The name for Spark's SQL parser, every part quoted: ```main`.`flowers`.`images```."""
        return ".".join(f"`{p}`" for p in self.parts)

    def describe(self) -> str:
        """The table for messages, MLflow tags and cache keys: ``main.flowers.images``, or
        the path as given (the form runs recorded before catalog tables existed)."""
        return ".".join(self.parts) if self.parts else str(self.path)

    def lineage(self) -> dict[str, str]:
        """``{"name": "main.flowers.images"}`` or ``{"path": "<path>"}``: how a run's
        lineage names the table (:meth:`from_lineage` reads it back)."""
        return {"name": self.describe()} if self.parts else {"path": str(self.path)}

    def __str__(self) -> str:
        return self.describe()

    def key(self, spark: SparkSession | None = None) -> str:
        """What makes two references the same table: ``path:<url>`` for a path table (a
        local path made absolute with its links resolved, :meth:`Location.of`; ``s3://`` for
        Hadoop's ``s3a://``), ``name:<catalog>.<schema>.<table>`` for a catalog table, lower
        case (Spark's identifiers are case-insensitive), a two-part name completed with the
        session's current catalog when ``spark`` is given."""
        if not self.parts:
            assert self.path is not None
            location = Location.of(str(self.path))
            url = location.url if location.is_local else location.sdk_url
            return f"path:{url.rstrip('/')}"
        parts = self.parts
        if len(parts) == 2 and spark is not None:
            parts = (spark.catalog.currentCatalog(), *parts)
        return "name:" + ".".join(parts).lower()

    @property
    def sql_name(self) -> str:
        """The table in Spark SQL: ``delta.`<path>``` for a path table (Delta's path
        identifier; a backtick in the path doubled), the quoted name (:attr:`quoted`) for a
        catalog table."""
        if self.parts:
            return self.quoted
        return "delta.`" + str(self.path).replace("`", "``") + "`"

    def table_id(self, spark: SparkSession) -> str | None:
        """The Delta table's id (``DESCRIBE DETAIL``), the same whatever names the table (a
        catalog name or its location); None when there is no table.

        Raises:
            DataError: a catalog table of that name that is not a Delta table.
        """
        if not self.exists(spark):
            return None
        row = self.detail(spark)
        return None if row["id"] is None else str(row["id"])

    def exists(self, spark: SparkSession) -> bool:
        """Whether the table exists: a Delta table at the path, or any table of that name
        in the catalog (:meth:`detail` says when it is not a Delta table). False too when its
        catalog or schema does not exist: ingest creates the schema, and training's message
        asks for an ingest.

        A path is a Delta table when ``DESCRIBE DETAIL delta.`<path>``` succeeds with format
        ``delta`` (what ``DeltaTable.isDeltaTable`` answers, through SQL: one read of the
        table's log, on classic Spark and Spark Connect alike). A missing path, a folder of
        Parquet files, an empty folder or a folder inside a Delta table fail with
        ``[DELTA_MISSING_DELTA_TABLE] ... is not a Delta table`` (an ``AnalysisException``):
        False. Any other error (e.g. an object store refusing access) is raised.
        """
        from pyspark.errors import AnalysisException

        if self.parts:
            try:
                return bool(spark.catalog.tableExists(self.quoted))
            except AnalysisException:  # e.g. CATALOG_NOT_FOUND
                return False
        try:
            row = spark.sql(f"DESCRIBE DETAIL {self.sql_name}").first()
        except AnalysisException:
            return False
        return row is not None and str(row["format"]).lower() == DELTA_FORMAT

    def detail(self, spark: SparkSession) -> Row:
        """``DESCRIBE DETAIL``: one row of ``format``, ``id`` (str), ``location``,
        ``createdAt``/``lastModified`` (datetime, the session's time zone, naive),
        ``numFiles``, ``sizeInBytes`` (bytes), ``properties``... (Delta's documentation,
        "Retrieve Delta table details").

        Raises:
            DataError: a catalog table of that name that is not a Delta table.
            pyspark.errors.AnalysisException: no such table (``DELTA_MISSING_DELTA_TABLE``
                for a path, ``TABLE_OR_VIEW_NOT_FOUND`` for a name).
        """
        row = self._sql(spark, f"DESCRIBE DETAIL {self.sql_name}").first()
        assert row is not None  # DESCRIBE DETAIL gives one row or fails
        if str(row["format"]).lower() != DELTA_FORMAT:  # a catalog table in another format
            raise self._not_delta()
        return row

    def history(self, spark: SparkSession, limit: int | None = None) -> DataFrame:
        """``DESCRIBE HISTORY``: the table's commits, newest first (``version``,
        ``timestamp``, ``operation``, ``operationParameters``, ``userMetadata``,
        ``operationMetrics`` as a string map...), the latest ``limit`` when given (Delta's
        documentation, "Retrieve Delta table history"). Run when called.

        Raises:
            DataError: a catalog table of that name that is not a Delta table.
            pyspark.errors.AnalysisException: no such table.
        """
        limit_sql = "" if limit is None else f" LIMIT {int(limit)}"
        return self._sql(spark, f"DESCRIBE HISTORY {self.sql_name}{limit_sql}")

    def vacuum(self, spark: SparkSession, retain_hours: float) -> None:
        """``VACUUM ... RETAIN <retain_hours> HOURS``: remove the files the table no longer
        uses that were removed from it more than ``retain_hours`` ago, as
        ``DeltaTable.vacuum(retain_hours)`` does (both are Delta's ``VacuumCommand``, which
        rounds the hours to whole ones). Below Delta's safe minimum (168 h) Delta 4.0 refuses
        unless ``spark.databricks.delta.retentionDurationCheck.enabled`` is false (an
        ``IllegalArgumentException``: "Are you sure you would like to vacuum files with such
        a low retention period?"), exactly as the Python API does; Delta 4.4 refuses on
        neither path (docs/known-issues.md, "Delta"), so callers keep the 168 h themselves
        (:func:`flowers_job.ingest.retention.retention_hours`).

        Raises:
            ValueError: ``retain_hours`` negative or not finite.
            DataError: a catalog table of that name that is not a Delta table.
            pyspark.errors.AnalysisException: no such table.
        """
        hours = float(retain_hours)
        if not math.isfinite(hours) or hours < 0:
            raise ValueError(f"vacuum {self}: retain_hours must be >= 0, got {retain_hours!r}")
        self._sql(spark, f"VACUUM {self.sql_name} RETAIN {hours:.6f} HOURS")

    def _not_delta(self) -> DataError:
        return DataError(
            f"the table {self.describe()} is not a Delta table: choose another "
            f"tables.schema, or drop it (`DROP TABLE {self.quoted}`)"
        )

    def _sql(self, spark: SparkSession, statement: str) -> DataFrame:
        """``spark.sql(statement)``, a Delta command on this table; a catalog table that is
        not a Delta table (``DELTA_ONLY_OPERATION`` and kin) raised as ``DataError``."""
        from pyspark.errors import AnalysisException

        try:
            return spark.sql(statement)
        except AnalysisException as exc:
            condition = exc.getCondition() or ""
            if self.parts and (condition in _NOT_DELTA or "not a Delta table" in str(exc)):
                raise self._not_delta() from exc
            raise

    def read(self, spark: SparkSession, version: int | None = None) -> DataFrame:
        """The table's rows, at Delta ``version`` (time travel) when given, else the latest."""
        reader = spark.read
        if version is not None:
            reader = reader.option("versionAsOf", int(version))
        if self.parts:
            return reader.table(self.quoted)
        return reader.format(DELTA_FORMAT).load(str(self.path))

    def changes(self, spark: SparkSession, start: int, end: int) -> DataFrame:
        """Delta's change data feed from version ``start`` to ``end``, both included: the
        table's columns plus ``_change_type`` (``insert``, ``delete``, ``update_preimage``,
        ``update_postimage``), ``_commit_version`` and ``_commit_timestamp`` (Delta's
        documentation, "Use Delta Lake change data feed"). A filter on ``_change_type``
        reaches the reader: ``insert`` rows read only the files their commits added.

        Raises (when the plan is analysed or run):
            pyspark.errors.AnalysisException: ``DELTA_MISSING_CHANGE_DATA``, a version of
                the range did not record its changes (``delta.enableChangeDataFeed`` off),
                or a file it needs was vacuumed.
        """
        reader = (
            spark.read.option("readChangeFeed", "true")
            .option("startingVersion", int(start))
            .option("endingVersion", int(end))
        )
        if self.parts:
            return reader.table(self.quoted)
        return reader.format(DELTA_FORMAT).load(str(self.path))

    def overwrite(
        self,
        df: DataFrame,
        partition_by: Sequence[str] = (),
        properties: Mapping[str, str] | None = None,
    ) -> None:
        """Overwrite the table with ``df`` (schema too), partitioned by ``partition_by``,
        with the table ``properties``; creates it when it does not exist. By name this is
        ``saveAsTable`` in mode overwrite: Delta commits it as ``CREATE OR REPLACE TABLE AS
        SELECT``, a new version of the same table with its history kept."""
        writer = (
            df.write.format(DELTA_FORMAT)
            .mode("overwrite")
            .option("overwriteSchema", "true")
            .options(**(properties or {}))
            .partitionBy(*partition_by)
        )
        if self.parts:
            writer.saveAsTable(self.quoted)
        else:
            writer.save(str(self.path))

    def append(self, df: DataFrame) -> None:
        """Append ``df`` (the table's columns) to the existing table: one commit, new files
        only (partitioned as the table is)."""
        writer = df.write.format(DELTA_FORMAT).mode("append")
        if self.parts:
            writer.saveAsTable(self.quoted)
        else:
            writer.save(str(self.path))


def table_ref(cfg: JobConfig, name: str) -> TableRef:
    """The job's table ``name`` (``images``, ``quarantine``): ``<namespace>.<name>`` when
    ``tables.schema`` is set, else ``<output_dir>/tables/<name>``."""
    namespace = cfg.tables.namespace()
    if namespace:
        return TableRef(parts=(*namespace, name))
    return TableRef(path=cfg.paths.table(name))


def ensure_schema(spark: SparkSession, cfg: JobConfig) -> None:
    """Create the schema ``tables.schema`` (in ``tables.catalog``) when the tables are catalog
    tables and it does not exist yet; nothing for path tables.

    Raises:
        DataError: the schema cannot be created (no such catalog, no privilege to create a
            schema in it), naming the settings.
    """
    namespace = cfg.tables.namespace()
    if not namespace:
        return
    quoted = ".".join(f"`{p}`" for p in namespace)
    if spark.catalog.databaseExists(quoted):
        return
    from pyspark.errors import PySparkException

    try:
        spark.sql(f"CREATE SCHEMA IF NOT EXISTS {quoted}")
    except PySparkException as exc:
        raise DataError(
            f"tables.schema: the schema {'.'.join(namespace)} does not exist and cannot be "
            f"created ({type(exc).__name__}: {str(exc).splitlines()[0]}); create it, or grant "
            "CREATE SCHEMA on the catalog (tables.catalog), or set tables.schema to one that "
            "exists"
        ) from exc
