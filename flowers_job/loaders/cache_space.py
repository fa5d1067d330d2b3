"""Room for a split's loader cache: estimated from the Delta table's size, checked against
the disk's free space before any byte is written."""

from __future__ import annotations

import math
import shutil

from flowers_job.errors import DataError
from flowers_job.location import Location

__all__ = [
    "CACHE_SPACE_FACTOR",
    "CACHE_SPACE_HEADROOM_BYTES",
    "cache_bytes_needed",
    "check_cache_space",
]

CACHE_SPACE_FACTOR = 1.1
CACHE_SPACE_HEADROOM_BYTES = 1 << 20
"""A split's cache needs ``table size x 1.1 + 1 MiB``: the images are JPEG in both the Delta
table and the uncompressed cache, plus Parquet footers and Hadoop's .crc files."""


def cache_bytes_needed(table_bytes: int, fraction: float = 1.0) -> int:
    """Bytes the loader cache of ``fraction`` of the rows of a Delta table of
    ``table_bytes`` (``DESCRIBE DETAIL``'s ``sizeInBytes``) needs: an estimate, rows being
    about the same size, of ``table_bytes x fraction x`` :data:`CACHE_SPACE_FACTOR` ``+``
    :data:`CACHE_SPACE_HEADROOM_BYTES`."""
    return math.ceil(table_bytes * fraction * CACHE_SPACE_FACTOR) + CACHE_SPACE_HEADROOM_BYTES


def check_cache_space(cache_dir: Location, needed_bytes: int, what: str) -> None:
    """Fail before writing when the cache's file system has less than ``needed_bytes`` free.

    Raises:
        DataError: not enough space; names the directory, the bytes needed and free.
    """
    folder = cache_dir.local_path if cache_dir.is_local else None
    if folder is None:
        return  # object stores and DBFS report no meaningful free space
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent  # the volume it will be on
    free = shutil.disk_usage(folder).free
    if free < needed_bytes:
        raise DataError(
            f"no space for the loader cache of {what} in {folder}: needs about "
            f"{needed_bytes / 2**20:.1f} MiB, {free / 2**20:.1f} MiB free; free some space or "
            "set paths.cache_url to a larger volume"
        )
