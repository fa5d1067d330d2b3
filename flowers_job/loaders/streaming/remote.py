"""Mosaic Streaming over object storage: ``remote=`` the loader cache, ``local=`` each host's disk.

With the loader cache in an object store (``paths.cache_url`` or ``paths.output_dir`` =
``s3a://...``), the driver's Spark tasks write the MDS shards straight to it
(``dataframe_to_mds`` with a remote ``out``: each task writes locally and uploads), and each
rank's ``StreamingDataset`` gets ``remote=`` that prefix and ``local=`` a directory on its
host's own disk, shared by the ranks of that host (Streaming coordinates them through
shared memory keyed by ``local``), where it downloads the shards it reads, within
``loaders.streaming.local_cache_limit_bytes``. This is Streaming's own design (its docs:
"remote" is the source of truth, "local" a cache), rather than reading a FUSE mount of the
store one random read at a time.

Streaming speaks ``s3://`` (boto3), and reads the standard AWS settings
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_ENDPOINT_URL``; ``S3_ENDPOINT_URL``
is its own older name for the endpoint); ``s3a://`` is rewritten for it
(:attr:`flowers_job.location.Location.sdk_url`).

The host's ``local`` directory is removed by the last rank of the host to close its reader
(:func:`leave_host_cache`): each reader registers under ``<local>/.readers/<pid>``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from flowers_job.location import Location

if TYPE_CHECKING:
    from flowers_job.config.model import StreamingConfig

__all__ = ["dataset_source", "enter_host_cache", "leave_host_cache", "mds_out"]

_READERS = ".readers"


def mds_out(url: str) -> str:
    """``dataframe_to_mds``'s ``out`` for the split folder ``url``: its local path, or the
    object-store URI as Streaming spells it."""
    loc = Location.of(url)
    return str(loc.local_path) if loc.is_local else loc.sdk_url


def dataset_source(url: str, settings: StreamingConfig | None) -> dict[str, Any]:
    """``StreamingDataset``'s ``local``, and for an object store ``remote`` and
    ``cache_limit`` (bytes), for the MDS split folder ``url``.

    The host's ``local`` is ``<loaders.streaming.local_cache_dir>/<16 hex digits of the
    SHA-256 of url>`` (default ``<temp dir>/flowers-streaming/...``): one per split and
    cache entry, the same for every rank of the host.
    """
    loc = Location.of(url)
    if loc.is_local:
        return {"local": str(loc.local_path)}
    chosen = settings.local_cache_dir if settings is not None else None
    root = Path(chosen) if chosen else Path(tempfile.gettempdir()) / "flowers-streaming"
    local = root / hashlib.sha256(loc.url.encode()).hexdigest()[:16]
    limit = settings.local_cache_limit_bytes if settings is not None else None
    return {"remote": loc.sdk_url, "local": str(local), "cache_limit": limit}


def enter_host_cache(source: dict[str, Any]) -> None:
    """Register this process as a reader of the host's ``local`` copy (remote sources only)."""
    if "remote" in source:
        readers = Path(source["local"]) / _READERS
        readers.mkdir(parents=True, exist_ok=True)
        (readers / str(os.getpid())).touch()


def leave_host_cache(source: dict[str, Any]) -> bool:
    """Unregister this process; the last reader of the host removes the ``local`` copy.

    Returns:
        Whether this call removed it.
    """
    if "remote" not in source:
        return False
    local = Path(source["local"])
    with contextlib.suppress(OSError):
        (local / _READERS / str(os.getpid())).unlink()
    try:  # a reader that was killed left its file: only live ones count
        left = any(
            p.name.isdigit() and psutil.pid_exists(int(p.name))
            for p in (local / _READERS).iterdir()
        )
    except OSError:
        return False
    if left:
        return False
    shutil.rmtree(local, ignore_errors=True)
    with contextlib.suppress(OSError):
        local.parent.rmdir()  # the root too, once no split of any run is left in it
    return True
