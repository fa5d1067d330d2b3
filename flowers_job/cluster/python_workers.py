"""What the job's code does first in a PySpark Python worker (:func:`prepare_worker`): give
the zip importer Python 3.12's lazy cache invalidation on Python 3.10 and 3.11.

A PySpark worker calls :func:`importlib.invalidate_caches` before every task
(``pyspark.worker_util.setup_spark_files``). On Python 3.10 and 3.11 that makes every
:class:`zipimport.zipimporter` read its archive's whole directory again, at once, and a
worker's path holds ``pyspark.zip`` (1,220 entries) and py4j's zip: most of the CPU time
of tasks that do little goes to ``zipimporter._read_directory`` under
``invalidate_caches`` (py-spy on a worker), and the fix below cuts it to a fraction
(docs/performance.md).
An ingest lists in up to 2 tasks per slot and decodes in 4 or more. CPython fixed it in 3.12
(gh-103200, reported by a Spark developer): invalidation drops the cached directory, and
the next lookup in that archive reads it again.

The job's listing, decoding and batch-scoring functions (the ``mapInPandas`` functions
that run in Python workers) call :func:`prepare_worker` first. Workers
are reused (``spark.python.worker.reuse``), so the first task of a worker pays the old cost
once and its later tasks do not. Nothing changes on Python 3.12 and later (Databricks
Runtime 17.3 LTS runs 3.12), nor in a process that never calls it.
"""

from __future__ import annotations

import sys
import zipimport
from typing import Any

__all__ = ["lazy_zip_directories", "prepare_worker"]


def prepare_worker() -> None:
    """Run first by every function of the job that Spark calls in a Python worker."""
    lazy_zip_directories()


def lazy_zip_directories() -> bool:
    """Give :class:`zipimport.zipimporter` the invalidation of Python 3.12 (gh-103200):
    ``invalidate_caches`` drops the archive's cached directory (shared by every importer
    of that archive), and the next lookup reads it again.

    Returns:
        True if the class was changed now (Python < 3.12, not done before in this process).
    """
    cls: Any = zipimport.zipimporter
    if sys.version_info >= (3, 12) or getattr(cls, "_flowers_lazy", False):
        return False
    cache: dict[str, Any] = getattr(zipimport, "_zip_directory_cache")  # noqa: B009
    read = getattr(zipimport, "_read_directory")  # noqa: B009

    def files(self: Any) -> Any:
        archive = self.__dict__.get("archive")
        if archive is None:  # in __init__, before the archive is set
            return self.__dict__.get("_flowers_files", {})
        try:
            return cache[archive]
        except KeyError:
            try:
                found = cache[archive] = read(archive)
            except zipimport.ZipImportError:
                found = {}
            return found

    def keep(self: Any, value: Any) -> None:
        # __init__ assigns the directory it has just read into the shared cache
        self.__dict__["_flowers_files"] = value

    def invalidate_caches(self: Any) -> None:
        """Drop the archive's cached directory; the next lookup reads it again."""
        cache.pop(self.archive, None)

    cls._files = property(files, keep)
    cls.invalidate_caches = invalidate_caches
    cls._flowers_lazy = True
    return True
