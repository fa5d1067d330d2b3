"""Is the job's storage shared by the driver and every executor? A probe, before any work.

On a cluster, executors write the Delta tables and the loader cache, rank 0 (on an
executor) writes checkpoints and the failure reports that the driver reads, and the
driver reads them all back. A directory that is local to each host (a node's own disk,
a mount only the driver has) breaks this in ways that surface late and obscurely. The
probe: the driver writes a token into each directory, and one task per task slot (a
barrier stage, so every executor runs one at the same time) reads it back.
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from flowers_job.config import ConfigError, JobConfig
from flowers_job.spark import run_probe, task_slots

__all__ = ["PROBE_TIMEOUT_SECONDS", "check_shared_storage", "is_local_master", "shared_dirs"]

PROBE_TIMEOUT_SECONDS = 120.0
"""Bound on the probe's Spark job (seconds); it takes about a second on a live cluster."""

_TOKEN_PREFIX = ".flowers-shared-probe-"


def is_local_master(spark: SparkSession) -> bool:
    """A ``local[...]`` master: every task runs in the driver's JVM, on the driver's host."""
    return str(spark.sparkContext.master).startswith("local")


def shared_dirs(cfg: JobConfig) -> dict[str, Path]:
    """The directories the driver and the executors both use, by the setting that names
    them: the output dir, its checkpoints, the loader cache (a ``file:`` URL), and a
    ``sqlite:`` tracking store declared shared (``tracking.store_is_shared``)."""
    from urllib.parse import urlparse

    dirs = {
        "paths.output_dir": cfg.paths.output_dir,
        "paths.output_dir (checkpoints)": cfg.paths.checkpoint_dir,
    }
    cache = urlparse(cfg.paths.cache_parent_url)
    if cache.scheme == "file":
        dirs["paths.petastorm_cache_url"] = Path(cache.path)
    uri = cfg.tracking_uri
    if uri.startswith("sqlite:///"):
        dirs["tracking.tracking_uri"] = Path(uri.removeprefix("sqlite:///")).parent
    elif uri.startswith("file:"):
        dirs["tracking.tracking_uri"] = Path(urlparse(uri).path)
    return {setting: path.resolve() for setting, path in dirs.items()}


def _read_tokens(token: str, paths: list[str]) -> Any:
    def task(_: Any) -> Any:
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        address = ctx.getTaskInfos()[ctx.partitionId()].address.rsplit(":", 1)[0]
        missing = []
        for p in paths:
            try:
                ok = (Path(p) / f"{_TOKEN_PREFIX}{token}").read_text() == token
            except OSError:
                ok = False
            if not ok:
                missing.append(p)
        yield {"host": socket.gethostname(), "address": address, "missing": missing}

    return task


def check_shared_storage(
    spark: SparkSession, cfg: JobConfig, timeout_seconds: float = PROBE_TIMEOUT_SECONDS
) -> list[dict[str, Any]]:
    """Check that every executor sees what the driver writes in :func:`shared_dirs`.

    A no-op on a local master. Otherwise the directories are created, a token file is
    written in each, and a barrier stage of one task per task slot reads them back.

    Returns:
        One ``{"host", "address", "missing"}`` per task (empty on a local master).

    Raises:
        ConfigError: an executor cannot read a token; names the setting, the directory and
            the executor's host and address.
        RuntimeError: the probe's Spark job did not end within ``timeout_seconds``.
    """
    if is_local_master(spark):
        return []
    dirs = shared_dirs(cfg)
    token = uuid.uuid4().hex
    written = []
    try:
        for path in dirs.values():
            path.mkdir(parents=True, exist_ok=True)
            f = path / f"{_TOKEN_PREFIX}{token}"
            f.write_text(token)
            written.append(f)
        sc = spark.sparkContext
        n = max(1, task_slots(spark))
        rdd = (
            sc.parallelize(range(n), n)
            .barrier()
            .mapPartitions(_read_tokens(token, [str(p) for p in dirs.values()]))
        )
        results = run_probe(spark, rdd, "shared-storage probe", timeout_seconds)
    finally:
        for f in written:
            with contextlib.suppress(OSError):
                os.unlink(f)
    problems = []
    for setting, path in dirs.items():
        blind = [r for r in results if str(path) in r["missing"]]
        if blind:
            where = ", ".join(sorted({f"{r['host']} ({r['address']})" for r in blind}))
            problems.append(
                f"{setting}: {path} is not shared with the executors: executor host {where} "
                "cannot read a file the driver wrote there"
            )
    if problems:
        raise ConfigError(
            "invalid configuration:\n  "
            + "\n  ".join(problems)
            + "\n  On a cluster, the output dir, the loader cache and the checkpoints must be "
            "on storage that the driver and every executor see at the same path (NFS, a FUSE "
            "mount of object storage, /dbfs or /Volumes on Databricks)"
        )
    return results
