"""The ``tables`` section: path tables under the output dir (the default) or managed tables
in a catalog.

Kept apart from :mod:`flowers_job.config.model` (the line limit of a module) and imported
into it as :attr:`JobConfig.tables <flowers_job.config.model.JobConfig>`.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

__all__ = ["TablesConfig", "check_identifier"]

_MAX_NAME = 255
_FORBIDDEN = re.compile(r"[.\s/`\x00-\x1f\x7f]")
"""Characters a catalog or schema name may not hold: Unity Catalog refuses a period, a
space, a forward slash and the ASCII control characters (Databricks' documentation, "Names":
"Object names cannot exceed 255 characters" and the characters "not allowed"); a backtick is
refused as well, so that every part can be quoted as ```part``` in SQL and a name never needs
an escape. Any other whitespace is refused with the space."""


def check_identifier(value: str) -> str:
    """``value``, checked as one part of a catalog name (a catalog or a schema).

    Returns:
        ``value`` unchanged (Unity Catalog stores names in lower case; Spark's own catalog
        is case-insensitive: the job does not change the case).

    Raises:
        ValueError: empty, longer than 255 characters, or holding a period, whitespace, a
            forward slash, a backtick or a control character, naming the first one found.
    """
    if not value:
        raise ValueError("an empty name; leave the setting out (null) for path tables")
    if len(value) > _MAX_NAME:
        raise ValueError(f"{len(value)} characters, more than Unity Catalog's {_MAX_NAME}")
    if bad := _FORBIDDEN.search(value):
        raise ValueError(
            f"{value!r} holds {bad.group()!r}: a name part may not hold a period, whitespace, "
            "'/', '`' or a control character (give the catalog and the schema as separate "
            "settings, not 'catalog.schema')"
        )
    return value


class TablesConfig(BaseModel):
    """Where the job's Delta tables (``images``, ``quarantine``) live.

    By default they are path tables under ``<output_dir>/tables``. With ``schema`` set they
    are managed tables in a catalog, written and read by name: ``<catalog>.<schema>.images``
    (Unity Catalog's three-level name, the form for Databricks) or ``<schema>.images`` in the
    session's current catalog when ``catalog`` is left out (Spark's own catalog, with
    ``spark.sql.warehouse.dir``, locally).
    """

    # The field cannot be named ``schema`` (it would shadow BaseModel.schema; pydantic warns):
    # it is ``schema_name`` with the alias ``schema``, the only key accepted, and dumps use
    # the alias (:meth:`_dump_schema_as_alias`), so the ranks rebuild the section from
    # model_dump(). Not ``serialize_by_alias``: pydantic 2.11 added it, and Databricks
    # Runtime 17.3 and 18 ship 2.10.6, which ignores it.
    model_config = ConfigDict(extra="forbid", frozen=True)

    catalog: str | None = None
    """The catalog of the tables (Unity Catalog: e.g. ``main``); None: the session's current
    catalog. Needs ``schema``."""
    schema_name: str | None = Field(None, alias="schema")
    """The schema (database) of the tables, written ``tables.schema``; None: path tables
    under ``<output_dir>/tables``. Ingest creates it when it does not exist."""

    @model_serializer(mode="wrap")
    def _dump_schema_as_alias(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict) and "schema_name" in data:
            data["schema"] = data.pop("schema_name")
        return data

    @field_validator("catalog", "schema_name")
    @classmethod
    def _identifier(cls, value: str | None) -> str | None:
        return None if value is None else check_identifier(value)

    @model_validator(mode="after")
    def _check(self) -> TablesConfig:
        if self.catalog is not None and self.schema_name is None:
            raise ValueError(
                f"schema: required with tables.catalog={self.catalog!r} (tables are named "
                "<catalog>.<schema>.<table>)"
            )
        return self

    @property
    def in_catalog(self) -> bool:
        """Whether the tables are catalog tables (by name) rather than path tables."""
        return self.schema_name is not None

    def namespace(self) -> tuple[str, ...]:
        """``(catalog, schema)`` or ``(schema,)``: the parts before a table's own name;
        empty for path tables."""
        if self.schema_name is None:
            return ()
        return (self.catalog, self.schema_name) if self.catalog else (self.schema_name,)
