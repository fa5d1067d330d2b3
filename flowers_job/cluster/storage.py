"""Is the job's storage shared by the driver and every executor? A probe, before any work.

On a cluster, executors write the Delta tables and the loader cache, rank 0 (on an
executor) writes checkpoints and the failure reports that the driver reads, and the
driver reads them all back. A directory that is local to each host (a node's own disk,
a mount only the driver has) breaks this in ways that surface late and obscurely. The
probe: the driver writes a token into each directory (:func:`tokens`), and one task per
task slot reads it back (:func:`unreadable`), in the executor probe's barrier stage
(:func:`flowers_job.cluster.executor_probe.check_executors`).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from flowers_job.cluster.connect import spark_master
from flowers_job.config import PathsConfig
from flowers_job.location import Location

__all__ = [
    "STORE_VARIABLES",
    "is_local_master",
    "shared_dirs",
    "storage_problems",
    "store_variables",
    "tokens",
    "unreadable",
]

_TOKEN_PREFIX = ".flowers-shared-probe-"


def is_local_master(spark: SparkSession) -> bool:
    """A ``local[...]`` master: every task runs in the driver's JVM, on the driver's host
    (on Spark Connect, the server's driver: :func:`~flowers_job.cluster.connect.spark_master`)."""
    return spark_master(spark).startswith("local")


def shared_dirs(paths: PathsConfig, tracking_uri: str) -> dict[str, Location]:
    """The directories the driver and the executors both use, by the setting that names
    them: the output dir, its checkpoints, the loader cache, and the folder of a ``sqlite:``
    or ``file:`` tracking store (``tracking_uri``, the job's resolved one). Each a local path
    or an object-store URI."""
    dirs = {
        "paths.output_dir": paths.output_dir,
        "paths.output_dir (checkpoints)": paths.checkpoint_dir,
        "paths.cache_url": paths.cache_root,
    }
    uri = tracking_uri
    if uri.startswith("sqlite:///"):
        dirs["tracking.tracking_uri"] = Location.of(Path(uri.removeprefix("sqlite:///")).parent)
    elif uri.startswith("file:"):
        dirs["tracking.tracking_uri"] = Location.of(uri)
    return dirs


def unreadable(token: str, paths: list[str]) -> list[str]:
    """Run on an executor: those of ``paths`` where the driver's token file cannot be read
    (missing, or the object store refuses this executor: no credentials, no endpoint)."""
    missing = []
    for p in paths:
        try:
            ok = (Location.of(p) / f"{_TOKEN_PREFIX}{token}").read_text() == token
        except Exception:  # OSError, or pyarrow's errors for a refused or unreachable store
            ok = False
        if not ok:
            missing.append(p)
    return missing


@contextmanager
def tokens(dirs: dict[str, Location]) -> Iterator[str]:
    """Create ``dirs`` and write a fresh token file into each; yields the token, and
    removes the files on exit."""
    token = uuid.uuid4().hex
    written = []
    try:
        for path in dirs.values():
            path.mkdir(parents=True, exist_ok=True)
            f = path / f"{_TOKEN_PREFIX}{token}"
            f.write_text(token)
            written.append(f)
        yield token
    finally:
        for f in written:
            with contextlib.suppress(Exception):
                f.unlink(missing_ok=True)


STORE_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
)
"""The standard variables an object store's clients (pyarrow, boto3, s3a) read: only their
names ever travel between hosts or into a message."""


def store_variables() -> list[str]:
    """The names of :data:`STORE_VARIABLES` set in this process's environment."""
    return [name for name in STORE_VARIABLES if os.environ.get(name)]


def storage_problems(dirs: dict[str, Location], reports: list[dict[str, Any]]) -> list[str]:
    """The directories some executor cannot read, by setting, and how to fix it.

    Args:
        dirs: :func:`shared_dirs`.
        reports: ``{"host", "address", "missing", "store_variables"}`` per probe task,
            ``missing`` being :func:`unreadable`'s list, ``store_variables``
            :func:`store_variables` there.

    Returns:
        One line per directory, naming the setting, the directory and the executor hosts
        and addresses that cannot read it, then the fix; empty when every executor can.
    """
    problems = []
    remote = False
    ours = set(store_variables())
    for setting, path in dirs.items():
        blind = [r for r in reports if str(path) in r["missing"]]
        if blind:
            remote = remote or not path.is_local
            where = ", ".join(sorted({f"{r['host']} ({r['address']})" for r in blind}))
            lacking = sorted(
                set().union(*(ours - set(r.get("store_variables", ())) for r in blind))
            )
            problems.append(
                f"{setting}: {path} is not shared with the executors: executor host {where} "
                "cannot read a file the driver wrote there"
                + (f" ({', '.join(lacking)} set on the driver, missing there)" if lacking else "")
            )
    if problems:
        problems.append(
            "On a cluster, the output dir, the loader cache and the checkpoints must be "
            "on storage that the driver and every executor see at the same path (NFS, a FUSE "
            "mount of object storage, /dbfs or /Volumes on Databricks), or in an object "
            "store (s3a://...) that every executor can reach"
        )
    if remote:
        problems.append(
            "An object store needs credentials and its endpoint on every executor, from the "
            "standard places: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL "
            "for a store other than AWS) set with spark.executorEnv.*, or an instance profile "
            "(docs/cluster.md)"
        )
    return problems
