"""The files a Petastorm plan may name: nothing of the cache is unpickled. Petastorm's readers
unpickle a ``Unischema`` from the ``dataset-toolkit.unischema.v1`` key of a dataset's
``_common_metadata`` (or ``_metadata``) file (``petastorm.etl.dataset_metadata.get_schema``, whose
"restricted" unpickler still allows ``builtins.exec``); ``make_batch_reader`` tries that first, then
infers the schema from Arrow. pyarrow's legacy ``ParquetDataset`` reads those files only when it is
given a directory; given a list of files, it reads only their footers, and Petastorm infers the
schema from Arrow (``Unischema.from_arrow_schema``). So the ranks open only a plan's own list of
Parquet files, and :func:`check_cache_files` refuses a plan that names a directory, a file outside
its cache folder or a file that is not a Spark ``part-*.parquet`` before Petastorm sees it: a cache
folder on a shared path (``/dbfs/tmp``, which Petastorm's docs suggest) cannot run code in the job,
whatever was planted in it.
"""

from __future__ import annotations

import re

from flowers_job.errors import DataError
from flowers_job.loaders.base import local_dir
from flowers_job.loaders.petastorm.balanced import url_path
from flowers_job.loaders.petastorm.plan import PetastormPlan
from flowers_job.location import Location

__all__ = ["CACHE_FILE_PATTERN", "check_cache_files"]


CACHE_FILE_PATTERN = re.compile(r"part-[0-9]+[^/]*\.parquet")
"""The name of a file of a Petastorm cache: Spark's ``part-<partition>-<uuid>-c000.parquet``."""


def check_cache_files(plan: PetastormPlan) -> None:
    """Refuse a plan whose files Petastorm could read a pickle from, before it opens them.

    Every entry of ``plan.file_urls`` must be a ``part-*.parquet`` file
    (:data:`CACHE_FILE_PATTERN`) directly inside ``plan.cache_dir_url`` or one of its
    ``segment_dirs``, named once; a local
    one must be a regular file (a directory, or a link to one, would make pyarrow read its
    ``_common_metadata`` and Petastorm unpickle its schema from it), and an object-store
    one an object (one ``HEAD`` each: entries are reused on object stores too).

    Raises:
        DataError: no files, or a file that breaks these rules, naming it and the folder.
    """
    folders = {url_path(u).rstrip("/") for u in [plan.cache_dir_url, *plan.segment_dirs]}
    if not plan.file_urls:
        raise DataError(f"the Petastorm plan of {plan.cache_dir_url} names no Parquet files")
    seen: set[str] = set()
    for url in plan.file_urls:
        problem = _cache_file_problem(url, folders, seen)
        if problem:
            raise DataError(
                f"the Petastorm cache's plan names {url}, which {problem}: the ranks open only "
                "the plan's own Parquet files (Petastorm would unpickle a schema from the "
                "metadata file of a folder); remove the cache entry so that it is written again"
            )
        seen.add(url_path(url))


def _cache_file_problem(url: str, folders: set[str], seen: set[str]) -> str | None:
    """What is wrong with ``url`` as a file of one of the cache folders ``folders`` (paths:
    the plan's and its older segments'), or None."""
    path = url_path(url)
    parent, _, name = path.rpartition("/")
    if not CACHE_FILE_PATTERN.fullmatch(name):
        return "is not a Parquet file of the cache (part-*.parquet)"
    if parent.rstrip("/") not in folders:
        return f"lies outside the cache folders {sorted(folders)}"
    if path in seen:
        return "is named twice"
    local = local_dir(url)
    if not (local.is_file() if local is not None else Location.of(url).is_file()):
        return "is not a regular file"
    return None
