"""Where one Delta table lives: a path (``<output_dir>/tables/<name>``, the default) or a
name in a catalog (``catalog.schema.table``, with ``tables.schema``).

Every read, write, ``DeltaTable`` and existence check of the job's tables goes through a
:class:`TableRef`, so that the two kinds share one code path: a path table is read with
``spark.read.format("delta").load(path)`` and written with ``.save(path)``; a catalog table
with ``spark.read.table(name)`` and ``.saveAsTable(name)`` (a managed table: the catalog
decides where its files go), ``DeltaTable.forName`` instead of ``forPath``. Time travel is
the same ``versionAsOf`` reader option for both (Delta's documentation, "Query an older
snapshot of a table"). Spark's own catalog (``spark_catalog``, tables under
``spark.sql.warehouse.dir``) and Unity Catalog are reached the same way, through the
session's catalogs (``spark.sql.catalog.spark_catalog`` is Delta's ``DeltaCatalog``:
:func:`flowers_job.cluster.session.get_spark`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pyspark.sql import DataFrame, SparkSession

from flowers_job.config import JobConfig
from flowers_job.errors import DataError
from flowers_job.location import Location, is_remote

if TYPE_CHECKING:
    from delta.tables import DeltaTable

__all__ = ["TableRef", "ensure_schema", "table_ref"]


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

    def table_id(self, spark: SparkSession) -> str | None:
        """The Delta table's id (``DESCRIBE DETAIL``), the same whatever names the table (a
        catalog name or its location); None when there is no table."""
        if not self.exists(spark):
            return None
        row = self.delta(spark).detail().select("id").first()
        return None if row is None else str(row["id"])

    def exists(self, spark: SparkSession) -> bool:
        """Whether the table exists: a Delta table at the path, or any table of that name
        in the catalog (:meth:`delta` says when it is not a Delta table). False too when its
        catalog or schema does not exist: ingest creates the schema, and training's message
        asks for an ingest."""
        if self.parts:
            from pyspark.errors import AnalysisException

            try:
                return bool(spark.catalog.tableExists(self.quoted))
            except AnalysisException:  # e.g. CATALOG_NOT_FOUND
                return False
        from delta.tables import DeltaTable

        return bool(DeltaTable.isDeltaTable(spark, str(self.path)))

    def delta(self, spark: SparkSession) -> DeltaTable:
        """The ``DeltaTable`` (``forName`` or ``forPath``).

        Raises:
            DataError: a catalog table of that name that is not a Delta table.
            pyspark.errors.AnalysisException: no such table.
        """
        from delta.tables import DeltaTable

        if not self.parts:
            return DeltaTable.forPath(spark, str(self.path))
        from pyspark.errors import AnalysisException

        try:
            return DeltaTable.forName(spark, self.quoted)
        except AnalysisException as exc:
            if "not a Delta table" in str(exc) or "DELTA_MISSING_DELTA_TABLE" in str(exc):
                raise DataError(
                    f"the table {self.describe()} is not a Delta table: choose another "
                    f"tables.schema, or drop it (`DROP TABLE {self.quoted}`)"
                ) from exc
            raise

    def read(self, spark: SparkSession, version: int | None = None) -> DataFrame:
        """The table's rows, at Delta ``version`` (time travel) when given, else the latest."""
        reader = spark.read
        if version is not None:
            reader = reader.option("versionAsOf", int(version))
        if self.parts:
            return reader.table(self.quoted)
        return reader.format("delta").load(str(self.path))

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
            df.write.format("delta")
            .mode("overwrite")
            .option("overwriteSchema", "true")
            .options(**(properties or {}))
            .partitionBy(*partition_by)
        )
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
