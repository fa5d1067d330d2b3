"""Where the job's shared files live: a local (or mounted) directory, or an object store.

``paths.output_dir`` (tables, checkpoints, failure reports, summary), ``paths.cache_url``
(the loader cache) and ``data.images`` may each be a local path (``/Volumes/...``, NFS,
``file:///...``) or an object-store URI (``s3a://bucket/prefix``, ``gs://...``,
``abfss://...``). Spark reads and writes the tables and the Parquet cache through its
Hadoop file systems (``s3a`` with ``org.apache.hadoop:hadoop-aws``); the job's own Python,
on the driver and on each rank, goes through pyarrow's file systems
(:func:`filesystem`): ``s3``/``s3a``/``s3n`` are the same bucket to
``pyarrow.fs.S3FileSystem``; other schemes are pyarrow's or fsspec's.

Credentials come from the standard places only: pyarrow's S3 file system reads the AWS SDK's
default chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``,
``~/.aws``, instance profiles); Spark's ``s3a`` its ``fs.s3a.*`` settings (and the same
environment variables). The job never reads, copies or logs them.

A :class:`Location` is a small pathlib-like value (``/``, ``name``, ``parent``,
``exists``, ``read_bytes``, ``write_bytes``, ``iterdir``...). A local one is also an
``os.PathLike``, so ``open()``, ``shutil`` and ``torch.save`` take it; a remote one is not,
and code that needs a POSIX path (``Location.local_path``) says so with an error naming
the URI.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlparse

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

__all__ = [
    "S3_SCHEMES",
    "Location",
    "LocationValue",
    "conditional_writes_missing",
    "copy_files_up",
    "filesystem",
    "is_remote",
    "to_location",
]

S3_SCHEMES = frozenset({"s3", "s3a", "s3n"})
"""Schemes of one S3 bucket: Hadoop's connectors (``s3a``; ``s3n`` and ``s3`` on EMR) and
the AWS SDKs' ``s3``."""


def is_remote(value: str | os.PathLike[str]) -> bool:
    """``value`` names an object store (a URI with a scheme other than ``file``)."""
    text = os.fspath(value)
    scheme = urlparse(text).scheme
    # "C:" is a drive, "my:photos" a file name: a URI has a scheme and "://"
    return len(scheme) > 1 and scheme != "file" and f"{scheme}://" in text


@functools.lru_cache(maxsize=16)
def _filesystem(scheme: str, netloc: str) -> Any:
    import pyarrow.fs as pafs

    if scheme in S3_SCHEMES:
        # One S3 file system per bucket, its region and endpoint from the environment.
        fs, _ = pafs.FileSystem.from_uri(f"s3://{netloc}")
        return fs
    try:
        fs, _ = pafs.FileSystem.from_uri(f"{scheme}://{netloc}")
        return fs
    except (ValueError, NotImplementedError, OSError):
        import fsspec  # gcsfs, adlfs... where installed

        return pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem(scheme)))


def filesystem(url: str) -> tuple[Any, str]:
    """The pyarrow file system of ``url`` and the path on it.

    Returns:
        ``(pyarrow.fs.FileSystem, path)``: ``LocalFileSystem`` and an absolute path for a
        local path or ``file:`` URL; for ``s3a://bucket/key`` an ``S3FileSystem`` and
        ``bucket/key``.

    Raises:
        ValueError: a scheme that neither pyarrow nor an installed fsspec package serves.
    """
    loc = Location.of(url)
    if loc.is_local:
        import pyarrow.fs as pafs

        return pafs.LocalFileSystem(), loc.url
    parsed = urlparse(loc.url)
    return _filesystem(parsed.scheme, parsed.netloc), f"{parsed.netloc}{parsed.path}"


@dataclass(frozen=True)
class Location:
    """A local directory or file (``url`` is its absolute path) or an object-store key
    (``url`` is ``scheme://bucket/key``, no trailing slash). Build with :meth:`of`."""

    url: str

    @classmethod
    def of(cls, value: str | os.PathLike[str] | Location) -> Location:
        """A local path (made absolute), a ``file:`` URL or an object-store URI."""
        if isinstance(value, Location):
            return value
        text = os.fspath(value)
        if is_remote(text):
            return cls(text.rstrip("/"))
        if text.startswith("file:"):
            text = urlparse(text).path
        return cls(str(Path(text).expanduser().resolve()))

    # pathlib-like names ------------------------------------------------------------
    @property
    def is_local(self) -> bool:
        return not is_remote(self.url)

    @property
    def local_path(self) -> Path:
        """The POSIX path of a local location.

        Raises:
            ValueError: an object-store location.
        """
        if not self.is_local:
            raise ValueError(f"{self.url} is in an object store, and this needs a local path")
        return Path(self.url)

    def __fspath__(self) -> str:
        if not self.is_local:
            raise TypeError(f"{self.url} is in an object store: it has no local file path")
        return self.url

    def __str__(self) -> str:
        return self.url

    def __truediv__(self, name: str) -> Location:
        return Location(f"{self.url}/{name}")

    @property
    def name(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> Location:
        return Location(self.url.rsplit("/", 1)[0] or "/")

    @property
    def sdk_url(self) -> str:
        """The URI as the AWS SDKs (boto3) and Mosaic Streaming spell it: ``s3://`` for
        Hadoop's ``s3a://``/``s3n://``; other URIs and local paths unchanged."""
        scheme, sep, rest = self.url.partition("://")
        return f"s3://{rest}" if sep and scheme in S3_SCHEMES else self.url

    def as_uri(self) -> str:
        """``file:///...`` for a local location, else the URI itself."""
        return self.local_path.as_uri() if self.is_local else self.url

    # I/O ---------------------------------------------------------------------------
    def _fs(self) -> tuple[Any, str]:
        return filesystem(self.url)

    def _info(self) -> Any:
        fs, path = self._fs()
        return fs.get_file_info(path)

    def exists(self) -> bool:
        import pyarrow.fs as pafs

        if self.is_local:
            return self.local_path.exists()
        info = self._info()
        if info.type != pafs.FileType.NotFound:
            return True
        return bool(self.iterdir())  # a "directory" of an object store: a key prefix

    def is_file(self) -> bool:
        import pyarrow.fs as pafs

        return bool(self._info().type == pafs.FileType.File)

    def is_dir(self) -> bool:
        """A directory, or (object store) a prefix with at least one key under it."""
        import pyarrow.fs as pafs

        if self.is_local:
            return self.local_path.is_dir()
        return self._info().type == pafs.FileType.Directory or bool(self.iterdir())

    def mkdir(self, parents: bool = True, exist_ok: bool = True) -> None:
        """Create the directory (an object store has none to create: a no-op there)."""
        if self.is_local:
            self.local_path.mkdir(parents=parents, exist_ok=exist_ok)

    def read_bytes(self) -> bytes:
        """The whole file.

        Raises:
            FileNotFoundError: no such file (also for an object store's missing key).
        """
        fs, path = self._fs()
        with fs.open_input_stream(path) as f:  # pyarrow raises FileNotFoundError itself
            return bytes(f.read())

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes) -> None:
        """Write ``data`` so that a reader sees the old file or the whole new one: a local
        file through a temp file, ``fsync`` and ``os.replace`` in its directory; an object
        (one PUT, or a multipart upload completed in one request) is atomic by itself."""
        if not self.is_local:
            fs, path = self._fs()
            with fs.open_output_stream(path) as f:
                f.write(data)
            return
        self._publish_local(data, os.replace)

    def _publish_local(self, data: bytes, publish: Callable[[str, Path], None]) -> None:
        """Write ``data`` to a temp file beside this local file (``fsync``), then
        ``publish(temp, target)`` it (``os.replace``, or ``os.link``, which fails when the
        target exists); the temp file never stays."""
        target = self.local_path
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            publish(tmp, target)
        finally:
            Path(tmp).unlink(missing_ok=True)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def create_bytes(self, data: bytes) -> bool:
        """Write ``data`` only if nothing is there yet, in one atomic step: a put-if-absent.

        A local file: ``data`` goes to a temp file in the same directory (``fsync``), which
        ``os.link`` then names ``self`` (``link(2)`` fails with ``EEXIST`` when the name is
        taken, atomically, on POSIX file systems and NFS). S3: one ``PutObject`` with
        ``If-None-Match: *`` (S3's conditional write, 2024-08; boto3's standard credential
        chain and ``AWS_ENDPOINT_URL``). Of several concurrent callers exactly one gets True,
        and a reader sees no file or the whole of it.

        Returns:
            True when this call created it; False when it existed already.

        Raises:
            NotImplementedError: a store without a put-if-absent here
                (:meth:`create_problem` says why).
            botocore.exceptions.ClientError: S3 refused the put for another reason.
        """
        if self.is_local:
            try:
                self._publish_local(data, os.link)
            except FileExistsError:
                return False
            return True
        problem = self.create_problem()
        if problem is not None:
            raise NotImplementedError(problem)
        return _s3_put_if_absent(self.sdk_url, data)

    def create_problem(self) -> str | None:
        """Why :meth:`create_bytes` cannot run on this location's store; None when it can
        (local and mounted paths; S3 with a botocore that has conditional writes)."""
        if self.is_local:
            return None
        scheme = urlparse(self.url).scheme
        if scheme not in S3_SCHEMES:
            return f"{scheme}:// has no put-if-absent in this job (only S3 and local paths)"
        return conditional_writes_missing()

    def iterdir(self) -> list[Location]:
        """The direct children, sorted by name; empty for a missing directory."""
        import pyarrow.fs as pafs

        fs, path = self._fs()
        try:
            infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted((self / i.base_name for i in infos), key=lambda loc: loc.url)

    def walk(self) -> list[Location]:
        """Every file under this directory, at any depth, sorted; empty when missing."""
        import pyarrow.fs as pafs

        fs, path = self._fs()
        selector = pafs.FileSelector(path, recursive=True, allow_not_found=True)
        infos = fs.get_file_info(selector)
        base = len(path.rstrip("/")) + 1
        files = [self / i.path[base:] for i in infos if i.type == pafs.FileType.File]
        return sorted(files, key=lambda loc: loc.url)

    def glob(self, pattern: str) -> list[Location]:
        """The direct children whose name matches ``pattern`` (``fnmatch``), sorted."""
        return [c for c in self.iterdir() if fnmatch.fnmatchcase(c.name, pattern)]

    def size_bytes(self) -> int:
        """Bytes of the file, or of every file under the directory (0 when missing)."""
        import pyarrow.fs as pafs

        fs, path = self._fs()
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.File:
            return int(info.size or 0)
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
        return sum(int(i.size or 0) for i in infos if i.type == pafs.FileType.File)

    def mtime(self) -> float:
        """Modification time, seconds since the epoch.

        Raises:
            FileNotFoundError: no such file.
        """
        info = self._info()
        if info.mtime is None:
            raise FileNotFoundError(self.url)
        return float(info.mtime.timestamp())

    def unlink(self, missing_ok: bool = False) -> None:
        fs, path = self._fs()
        try:
            fs.delete_file(path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rmtree(self) -> None:
        """Remove the directory and everything under it; nothing when it is missing."""
        import pyarrow.fs as pafs

        fs, path = self._fs()
        if fs.get_file_info(path).type == pafs.FileType.File:
            fs.delete_file(path)
        elif self.is_local:
            if self.local_path.exists():
                fs.delete_dir(path)
        else:
            fs.delete_dir_contents(path, missing_dir_ok=True)
            if fs.get_file_info(path).type == pafs.FileType.Directory:
                fs.delete_dir(path)


def conditional_writes_missing() -> str | None:
    """Why this Python cannot make S3 conditional writes (no boto3, or a botocore older than
    ``PutObject``'s ``If-None-Match`` and ``If-Match``, botocore 1.35, 2024); None: it can."""
    try:
        import botocore.session
    except ImportError:
        return "boto3 is not installed (pip install 'flowers-job[s3]')"
    put = botocore.session.get_session().get_service_model("s3").operation_model("PutObject")
    if not {"IfNoneMatch", "IfMatch"} <= set(put.input_shape.members):
        return f"botocore {botocore.__version__} predates S3's conditional writes"
    return None


CONFLICT_RETRIES = 5
"""Tries of a conditional put that S3 answers 409 ConditionalRequestConflict (another
conditional write to the same key in flight: AWS's advice is to retry)."""


def _s3_put_if_absent(sdk_url: str, data: bytes) -> bool:
    """``PutObject`` with ``If-None-Match: *`` of ``s3://bucket/key``: True if created,
    False on 412 Precondition Failed (the key exists)."""
    import time

    import boto3
    from botocore.exceptions import ClientError

    bucket, _, key = sdk_url.removeprefix("s3://").partition("/")
    client = boto3.client("s3")  # the standard chain: AWS_*, ~/.aws, a profile
    for attempt in range(CONFLICT_RETRIES):
        try:
            client.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
            return True
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 412:
                return False
            if status != 409 or attempt == CONFLICT_RETRIES - 1:
                raise
            time.sleep(0.1 * 2**attempt)
    return False


def to_location(value: Any) -> Location:
    """A setting's value as a :class:`Location` (pydantic's validator of
    :data:`LocationValue`).

    Raises:
        ValueError: not a path or URI, or a URI with credentials in it.
    """
    if isinstance(value, Location):
        return value
    if isinstance(value, str | os.PathLike) and os.fspath(value):
        if urlparse(os.fspath(value)).password is not None:  # never echo the value itself
            raise ValueError(
                "credentials in the URI are refused (they would show in logs and in the "
                "summary): use AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or fs.s3a.* settings"
            )
        return Location.of(value)
    raise ValueError("expected a directory path or an object-store URI (s3a://bucket/prefix)")


LocationValue = Annotated[
    Location,
    BeforeValidator(to_location),
    PlainSerializer(str, return_type=str),
    WithJsonSchema({"type": "string"}),
]
"""A setting that is a local path (made absolute) or an object-store URI
(:class:`flowers_job.location.Location`); dumped as its string."""


def copy_files_up(local_dir: str | os.PathLike[str], url: str, remove: bool = False) -> list[str]:
    """Copy every non-empty file directly in ``local_dir`` to ``<url>/<name>`` (a rank's
    failure reports, from its host's disk to the run's report dir in an object store);
    with ``remove``, then remove ``local_dir``.

    Returns:
        The names copied (empty when ``local_dir`` is missing).
    """
    folder = Path(local_dir)
    copied = []
    for f in sorted(folder.iterdir()) if folder.is_dir() else []:
        if f.is_file() and not f.name.startswith(".") and f.stat().st_size > 0:
            (Location.of(url) / f.name).write_bytes(f.read_bytes())
            copied.append(f.name)
    if remove:
        shutil.rmtree(folder, ignore_errors=True)
    return copied


if __name__ == "__main__":  # python -m flowers_job.location LOCAL_DIR URL (watchdog.py)
    import sys

    copy_files_up(sys.argv[1], sys.argv[2], remove=True)
