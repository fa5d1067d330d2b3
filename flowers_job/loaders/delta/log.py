"""The ``images`` table's log at one version, read with delta-rs (``deltalake``): which
Parquet files hold a split's rows, and which of their rows the version deletes.

Spark's Delta writes a deletion vector when a DELETE or MERGE removes rows from a file
without rewriting it; the file's rows then count only where the vector keeps them
(``DeltaTable.deletion_vectors()``: a keep-mask per file). Credentials and the object
store's endpoint come from the standard environment variables, as for every other read of
the job (:mod:`flowers_job.location`); nothing secret is put in a plan or a message.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from flowers_job.errors import DataError
from flowers_job.location import S3_SCHEMES, Location, filesystem

if TYPE_CHECKING:
    import numpy as np
    from deltalake import DeltaTable

__all__ = ["SplitFile", "delta_uri", "open_table", "split_files", "storage_options"]


def delta_uri(url: str) -> str:
    """``url`` as delta-rs names it: ``s3://`` for Hadoop's ``s3a://``/``s3n://``, a plain
    absolute path for a local path or ``file:`` URL."""
    loc = Location.of(url)
    if loc.is_local:
        return str(loc.local_path)
    parsed = urlparse(loc.url)
    if parsed.scheme in S3_SCHEMES:
        return "s3://" + loc.url.split("://", 1)[1]
    return loc.url


def storage_options(url: str) -> dict[str, str]:
    """delta-rs's options for ``url``'s store: for S3, the endpoint of ``AWS_ENDPOINT_URL_S3``
    or ``AWS_ENDPOINT_URL`` (and plain HTTP allowed when that endpoint is ``http://``) and a
    region where none is set; credentials stay in the environment, where delta-rs reads
    them. Empty for any other store."""
    if urlparse(delta_uri(url)).scheme != "s3":
        return {}
    options = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["AWS_ENDPOINT_URL"] = endpoint
        if endpoint.startswith("http://"):
            options["AWS_ALLOW_HTTP"] = "true"
    if not (os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")):
        options["AWS_REGION"] = "us-east-1"
    return options


def open_table(url: str, version: int) -> DeltaTable:
    """The Delta table at ``url`` as of ``version``.

    Raises:
        DataError: delta-rs cannot read it there (no table, the version vacuumed, a
            protocol feature delta-rs does not read), naming the table and the version.
    """
    from deltalake import DeltaTable

    try:
        return DeltaTable(delta_uri(url), version=version, storage_options=storage_options(url))
    except Exception as exc:
        raise DataError(
            f"data.loader=delta: delta-rs cannot read the table {url} at version {version}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


@dataclass(frozen=True)
class SplitFile:
    """One Parquet file of a split: ``url`` (what pyarrow's file systems open, through
    :func:`flowers_job.location.filesystem`), ``rows`` stored, and ``keep`` (bool
    ``[rows]``, the deletion vector's keep-mask) or None when every row is live."""

    url: str
    rows: int
    keep: np.ndarray | None

    @property
    def live_rows(self) -> int:
        return self.rows if self.keep is None else int(self.keep.sum())


def _table_url(url: str) -> str:
    """The table's root as the job's own file systems name it (``url``'s scheme kept)."""
    loc = Location.of(url)
    return loc.as_uri() if loc.is_local else loc.url


def _stored_rows(file_url: str) -> int:
    """Rows of a Parquet file whose add action has no ``numRecords`` statistic: its footer."""
    import pyarrow.parquet as pq

    fs, path = filesystem(file_url)
    with fs.open_input_file(path) as f:
        return int(pq.ParquetFile(f).metadata.num_rows)


def split_files(
    table: DeltaTable,
    url: str,
    split: str,
    model_key: str | None = None,
    views: list[str] | None = None,
) -> list[SplitFile]:
    """The files of ``split`` (the ``split`` partition) at the table's version, sorted by
    path, with their deletion vectors' keep-masks. With ``model_key`` (the ``embeddings``
    table), only that key's files of ``views``.

    Raises:
        DataError: the table is not partitioned by ``split`` (and, with ``model_key``, by
            ``model_key`` and ``view``), or a keep-mask's length is not its file's row count.
    """
    import numpy as np
    import pyarrow as pa

    actions = pa.table(table.get_add_actions(flatten=True))
    if "partition.split" not in actions.column_names:
        raise DataError(
            f"data.loader=delta: the table {url} is not partitioned by split (its files' "
            "partition columns are not given); only the job's images table can be read"
        )
    wanted = _partition_filter(actions, url, split, model_key, views)
    root = _table_url(url)
    masks = _keep_masks(table)
    found = []
    for path, rows, keep_file in zip(
        actions["path"].to_pylist(), actions["num_records"].to_pylist(), wanted, strict=True
    ):
        if not keep_file:
            continue
        file_url = f"{root}/{unquote(path)}"
        stored = int(rows) if rows is not None else _stored_rows(file_url)
        keep = masks.get(unquote(path))
        if keep is not None and len(keep) != stored:
            raise DataError(
                f"data.loader=delta: the deletion vector of {file_url} keeps {len(keep)} rows "
                f"of a file of {stored}"
            )
        found.append(SplitFile(file_url, stored, None if keep is None else np.asarray(keep)))
    return sorted(found, key=lambda f: f.url)


def _partition_filter(
    actions: Any, url: str, split: str, model_key: str | None, views: list[str] | None
) -> list[bool]:
    """Whether each add action's file holds rows of ``split`` (and of ``model_key`` and
    ``views``, when given).

    Raises:
        DataError: a partition column the filter needs is missing.
    """
    columns = {"split": [split]}
    if model_key is not None:
        columns |= {"model_key": [model_key], "view": list(views or [])}
    wanted = [True] * actions.num_rows
    for column, values in columns.items():
        name = f"partition.{column}"
        if name not in actions.column_names:
            raise DataError(f"data.loader=delta: the table {url} is not partitioned by {column}")
        wanted = [w and v in values for w, v in zip(wanted, actions[name].to_pylist(), strict=True)]
    return wanted


def _keep_masks(table: DeltaTable) -> dict[str, Any]:
    """Relative path (unquoted) -> the bool keep-mask of each file with a deletion vector."""
    import numpy as np
    import pyarrow as pa

    root = unquote(urlparse(table.table_uri).path).rstrip("/") + "/"
    masks = {}
    for batch in pa.RecordBatchReader.from_stream(table.deletion_vectors()):
        for uri, keep in zip(
            batch["filepath"].to_pylist(), batch["selection_vector"].to_pylist(), strict=True
        ):
            path = unquote(urlparse(uri).path)
            if not path.startswith(root):
                raise DataError(
                    f"data.loader=delta: a deletion vector names {uri}, outside the table "
                    f"{table.table_uri}"
                )
            masks[path[len(root) :]] = np.asarray(keep, dtype=bool)
    return masks
