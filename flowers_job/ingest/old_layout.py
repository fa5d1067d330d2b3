"""The split tables of an older layout (full copies of ``images`` per split), which a full
ingest removes once the current tables are written, and only where ingest wrote them."""

from __future__ import annotations

import contextlib
import logging

from pyspark.sql import SparkSession

from flowers_job.errors import IngestError
from flowers_job.location import Location
from flowers_job.tables.delta_tables import is_ingest_metadata, latest_commit
from flowers_job.tables.table_ref import TableRef

__all__ = ["OLD_SPLIT_TABLES", "own_old_split_tables", "remove_old_split_tables"]

log = logging.getLogger(__name__)

OLD_SPLIT_TABLES = ("train", "val", "test")
"""The split tables of layout 3 and earlier (full copies of ``images``), removed after the
first rebuild in layout 4, and only when their commits carry ingest's metadata
(:func:`own_old_split_tables`)."""


def own_old_split_tables(
    spark: SparkSession, tables_dir: Location, in_catalog: bool
) -> list[Location]:
    """The split tables of an older layout (:data:`OLD_SPLIT_TABLES`) under ``tables_dir``
    (``<output_dir>/tables``) that a full ingest removes: those whose latest commit carries
    ingest's metadata (:func:`~flowers_job.tables.delta_tables.is_ingest_metadata`). Path
    tables only: none when the tables are catalog tables (``in_catalog``; they came after
    layout 4). Checked before anything is written.

    Raises:
        IngestError: a Delta table there that ingest did not write, naming its path and
            what to do; nothing is removed or written.
    """
    if in_catalog:
        return []
    own = []
    for name in OLD_SPLIT_TABLES:
        path = tables_dir / name
        if not (path / "_delta_log").is_dir():
            continue
        commit = latest_commit(spark, TableRef(path=path))
        if not is_ingest_metadata(None if commit is None else commit[1]):
            raise IngestError(
                f"{path} is a Delta table that flowers_job's ingest did not write (its latest "
                "commit carries no ingest metadata), where an older layout kept its "
                f"{name} split: a full ingest removes only the split tables it wrote. Move "
                f"that table out of {tables_dir}, or use another paths.output_dir; "
                "nothing was removed or written"
            )
        own.append(path)
    return own


def remove_old_split_tables(paths: list[Location]) -> None:
    """Remove the split tables of layout 3 (full copies of ``images``) that ingest wrote
    (:func:`own_old_split_tables`), once layout 4's tables are written: nothing reads them
    any more."""
    for path in paths:
        log.info("removing %s: a split table of an older layout (now a partition of images)", path)
        with contextlib.suppress(OSError):
            path.rmtree()
