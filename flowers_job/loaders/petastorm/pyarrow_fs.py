"""Petastorm over an object store: the file system it reads the loader cache through.

Petastorm 0.13 reads with pyarrow's legacy ``ParquetDataset``, which takes a legacy
``pyarrow.filesystem`` object, and resolves any scheme but ``file``/``hdfs`` with fsspec
(``s3fs`` for S3, which is not installed here and knows no ``s3a://``). The cache written
by Spark to ``s3a://...`` is read instead through pyarrow's own S3 file system
(:func:`flowers_job.location.filesystem`: the standard AWS credentials and endpoint), in
the legacy interface.
"""

from __future__ import annotations

import warnings
from typing import Any

from fsspec.implementations.arrow import ArrowFSWrapper

from flowers_job.location import Location, filesystem

__all__ = ["ArrowObjectStore", "legacy_filesystem"]


class ArrowObjectStore(ArrowFSWrapper):
    """fsspec's interface over pyarrow's file system of one bucket (picklable: Petastorm's
    process pool sends it to its workers)."""

    def __init__(self, scheme: str = "s3a", bucket: str = "", **kwargs: Any) -> None:
        super().__init__(filesystem(f"{scheme}://{bucket}")[0], **kwargs)

    @classmethod
    def _get_kwargs_from_urls(cls, path: str) -> dict[str, Any]:
        scheme, _, rest = path.partition("://")
        return {"scheme": scheme, "bucket": rest.split("/", 1)[0]}


def legacy_filesystem(file_urls: list[str]) -> Any:
    """The file system Petastorm reads ``file_urls`` through: None (its own) for local files;
    for an object store, pyarrow's (:func:`flowers_job.location.filesystem`, which reads the
    standard credentials) in the legacy ``pyarrow.filesystem`` interface that Petastorm's
    ``ParquetDataset`` calls need (``S3FSWrapper`` over fsspec's ``ArrowFSWrapper``). That
    class is also registered as fsspec's for the scheme in this process, in place of s3fs
    (not a dependency; it would not read the standard endpoint variable either), for
    Petastorm's own existence checks of the files."""
    if not file_urls or Location.of(file_urls[0]).is_local:
        return None
    import fsspec
    import pyarrow.filesystem as legacy

    # Petastorm also checks that the files exist through fsspec's class for the scheme.
    fsspec.register_implementation(file_urls[0].split("://", 1)[0], ArrowObjectStore, clobber=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # pyarrow.filesystem's deprecation
        store = ArrowObjectStore(**ArrowObjectStore._get_kwargs_from_urls(file_urls[0]))
        return legacy.S3FSWrapper(store)
