"""An images root in an object store (``data.images = s3a://bucket/photos``): the listing
contract of :mod:`flowers_job.photos.listing` for keys, through pyarrow's file systems
(:func:`flowers_job.location.filesystem`). The driver finds the label folders
(:func:`object_label_folders`) and splits each into key ranges (:func:`object_units`, a skip
scan on S3); the executors LIST the ranges (:func:`list_object_unit`) and read each object
with one GET (:func:`read_object`). The verdicts that apply to keys, folder markers, and why
the ranges: docs/architecture.md, "An images root in an object store".
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlparse

from flowers_job.errors import ObjectStoreError
from flowers_job.location import S3_SCHEMES, filesystem
from flowers_job.photos.verdicts import ListedFile, is_hidden, path_verdict
from flowers_job.vision.limits import ImageRejected

__all__ = [
    "MAX_RANGES",
    "ObjectStoreError",
    "key_ranges",
    "list_object_unit",
    "object_label_folders",
    "object_units",
    "read_object",
]

ROOT_FILES = ""
"""The listing unit of the keys directly under the root (one LIST without recursion)."""
PREFIX_RANGE = "\x00"
"""In a listing unit, ``<label>/`` + this + ``c``: the keys that start with ``<label>/c``
(one LIST of that prefix). No S3 key holds U+0000 (the API's XML 1.0 cannot carry it)."""
TAIL_RANGE = "\x01"
"""In a listing unit, ``<label>/`` + this + ``after``: the keys of ``<label>/`` after the key
``<label>/after`` that do not start with its first character (the last range, past
:data:`MAX_RANGES`)."""
MAX_RANGES = 64
"""Key ranges per label folder at most: the driver's skip scan costs one request per range."""
_PAST = "\U0010ffff"
"""After every key that starts with a given prefix (the largest code point, so the largest
UTF-8 bytes: S3 orders keys by their UTF-8 bytes, as Python orders ``str`` by code point)."""


def _selector(path: str, recursive: bool) -> Any:
    import pyarrow.fs as pafs

    return pafs.FileSelector(path, recursive=recursive)


def object_label_folders(root: str) -> tuple[list[str], list[str]]:
    """The label folders of the object-store root ``root`` (a URI without a trailing ``/``)
    and its other top-level entries, each sorted, from one LIST of its first level.

    A label folder is a top-level prefix whose name is not hidden. ``others`` holds the keys
    directly under the root (by name) and the other prefixes (hidden ones, with a trailing
    ``/``; ``/`` for keys that start with an empty segment, ``<root>//a.jpg``, which pyarrow
    shows as a prefix named like the root itself).

    Raises:
        FileNotFoundError: no key under ``root``.
        OSError: the store refused or failed the LIST (no such bucket, credentials, network).
    """
    import pyarrow.fs as pafs

    fs, base = filesystem(root)
    labels, others = [], []
    for info in sorted(fs.get_file_info(_selector(base, False)), key=lambda i: i.path):
        name = info.base_name
        if info.type == pafs.FileType.File:
            others.append(name)
        elif info.type == pafs.FileType.Directory:
            if info.path.rstrip("/") == base.rstrip("/"):
                others.append("/")
            elif is_hidden(name):
                others.append(f"{name}/")
            else:
                labels.append(name)
    return labels, others


def object_units(root: str, labels: list[str], others: list[str]) -> list[str]:
    """The listing units of the root ``root`` with these top-level entries
    (:func:`object_label_folders`): each label folder's key ranges (:func:`key_ranges`) on
    S3 with boto3, else ``<prefix>/`` (every key under it); ``<prefix>/`` for each hidden
    prefix; :data:`ROOT_FILES` once for the keys directly under the root.

    Raises:
        ObjectStoreError: a LIST of the skip scan failed (naming ``data.images``).
    """
    client = _s3_client(root)
    if client is None:
        units = [f"{label}/" for label in labels]
    else:
        bucket, base = _bucket_key(root)
        with ThreadPoolExecutor(max_workers=min(8, max(1, len(labels)))) as pool:
            ranges = pool.map(lambda label: key_ranges(client, bucket, f"{base}{label}/"), labels)
            units = [f"{label}/{r}" for label, rs in zip(labels, ranges, strict=True) for r in rs]
    units += [o for o in others if o.endswith("/")]
    if any(not o.endswith("/") for o in others):
        units.append(ROOT_FILES)
    return units


def key_ranges(client: Any, bucket: str, prefix: str) -> list[str]:
    """The key ranges of the keys under ``prefix`` (``<root key>/<label>/``), each a unit
    suffix: :data:`PREFIX_RANGE` + ``c`` for each first character ``c`` after ``prefix``
    (in order), and past :data:`MAX_RANGES` of them one :data:`TAIL_RANGE` + the rest.
    A skip scan: one ``ListObjectsV2`` (``MaxKeys=1``) per range, plus one that finds no key.
    The key ``prefix`` itself (a folder marker) is in no range, as pyarrow lists it as the
    folder.

    Raises:
        ObjectStoreError: a LIST failed.
    """
    ranges: list[str] = []
    after = prefix
    while True:
        try:
            listed = client.list_objects_v2(
                Bucket=bucket, Prefix=prefix, StartAfter=after, MaxKeys=1
            ).get("Contents", [])
        except Exception as exc:  # botocore's errors: credentials, network, no bucket
            raise ObjectStoreError(
                f"data.images: cannot list s3://{bucket}/{prefix}: {exc}"
            ) from None
        if not listed:
            return ranges
        key = str(listed[0]["Key"])
        first = key[len(prefix)]
        if ranges and ranges[-1] == PREFIX_RANGE + first:  # a key past _PAST: the same range
            after = key
            continue
        if len(ranges) == MAX_RANGES:
            return [*ranges, TAIL_RANGE + after[len(prefix) :]]
        ranges.append(PREFIX_RANGE + first)
        after = prefix + first + _PAST


def _s3_client(root: str) -> Any:
    """A boto3 S3 client for ``root`` (standard credential chain, ``AWS_ENDPOINT_URL``), or
    None: not an S3 URI, or no boto3 here."""
    if urlparse(root).scheme not in S3_SCHEMES:
        return None
    try:
        import boto3
    except ImportError:
        return None
    return boto3.client("s3")


def _bucket_key(root: str) -> tuple[str, str]:
    """``(bucket, key prefix with a trailing /)`` of the root URI ``root``."""
    parsed = urlparse(root)
    path = parsed.path.strip("/")
    return parsed.netloc, f"{path}/" if path else ""


def list_object_unit(
    root: str, unit: str, labels: frozenset[str] | set[str]
) -> Iterator[ListedFile]:
    """Every key of one listing unit (:func:`object_units`) of the object-store root
    ``root``, sorted: for ``<prefix>/`` one recursive LIST of the prefix, for
    :data:`ROOT_FILES` one LIST of the root's first level. Directories (and empty folder
    markers, which pyarrow lists as directories) are skipped; nothing is read. The unit
    ``/`` (keys with an empty first segment, ``<root>//a.jpg``) LISTs the whole root and
    keeps those keys: it exists only where such keys do.

    Yields:
        One :class:`~flowers_job.photos.listing.ListedFile` per key (``kind`` ``file``).

    Raises:
        ObjectStoreError: the LIST failed (naming ``data.images`` and the URI).
    """
    import pyarrow.fs as pafs

    label, mark, rest = unit.partition(f"/{PREFIX_RANGE}")
    if not mark:
        label, mark, rest = unit.partition(f"/{TAIL_RANGE}")
    if mark:
        yield from _list_range(root, label, mark[1:], rest, labels)
        return
    fs, base = filesystem(root)
    prefix = unit[:-1] if unit.endswith("/") else ""
    path = f"{base}/{prefix}" if unit else base
    try:
        infos = fs.get_file_info(_selector(path, recursive=bool(unit)))
    except FileNotFoundError:
        return  # every key under it removed since the root was listed: nothing to account for
    except OSError as exc:
        raise ObjectStoreError(f"data.images: cannot list {root}/{unit}: {exc}") from None
    start = len(base.rstrip("/")) + 1
    for info in sorted(infos, key=lambda i: i.path):
        rel = info.path[start:]
        if info.type != pafs.FileType.File or not rel.startswith(unit):
            continue
        code, reason = _verdict(rel)
        parts = rel.split("/")
        owner = parts[0] if len(parts) > 1 and parts[0] in labels else None
        yield ListedFile(rel, owner, "file", int(info.size), info.mtime_ns, code, reason)


def _list_range(
    root: str, label: str, kind: str, rest: str, labels: frozenset[str] | set[str]
) -> Iterator[ListedFile]:
    """The keys of one key range of ``<label>/`` (:func:`key_ranges`), sorted: one paginated
    ``ListObjectsV2``. As pyarrow lists them: an empty key ending in ``/`` is a folder marker
    (skipped), a non-empty one is the file named without its ``/``; ``LastModified`` to the
    millisecond in ns."""
    client = _s3_client(root)
    if client is None:  # the driver had boto3 and planned key ranges; this executor has not
        raise ObjectStoreError(
            f"data.images: {root}: the driver listed key ranges with boto3, which this "
            "executor lacks: install flowers-job[s3] on every node"
        )
    bucket, base = _bucket_key(root)
    folder = f"{base}{label}/"
    if kind == PREFIX_RANGE:
        pages = {"Prefix": folder + rest}
        skip = None
    else:
        pages = {"Prefix": folder, "StartAfter": folder + rest}
        skip = folder + rest[:1]
    found = []
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, **pages):
            for obj in page.get("Contents", []):
                key, size = str(obj["Key"]), int(obj["Size"])
                if (skip is not None and key.startswith(skip)) or key == folder:
                    continue
                if key.endswith("/"):
                    if size == 0:
                        continue
                    key = key[:-1]
                modified = obj["LastModified"]
                found.append(
                    (key[len(base) :], size, round(modified.timestamp() * 1000) * 1_000_000)
                )
    except Exception as exc:  # botocore's errors: credentials, network, no bucket
        raise ObjectStoreError(
            f"data.images: cannot list {root}/{label}/ (the keys from {rest!r}): {exc}"
        ) from None
    for rel, size, mtime_ns in sorted(found):
        code, reason = _verdict(rel)
        yield ListedFile(
            rel, label if label in labels else None, "file", size, mtime_ns, code, reason
        )


def _verdict(rel: str) -> tuple[str | None, str | None]:
    """``(reason_code, reason)`` of the key ``rel`` (relative to the root), in the order of
    the local listing's verdicts; ``(None, None)``: read it."""
    parts = rel.split("/")
    code, reason = path_verdict(parts)
    if code is None and "" in parts:
        return "bad_file_name", (
            "the key has an empty segment ('//'), which no file-system path can name; "
            "rename the object"
        )
    return code, reason


def read_object(root: str, relative_path: str, max_bytes: int | None = None) -> bytes:
    """The bytes of the object ``<root>/<relative_path>`` that :func:`list_object_unit`
    found readable: one GET through pyarrow; at most ``max_bytes + 1`` bytes when
    ``max_bytes`` is given (:func:`~flowers_job.photos.listing.read_listed_file`).

    Raises:
        ImageRejected: ``unreadable``: no object under that key (deleted since the listing,
            or listed from a non-empty key ending in ``/``).
        ObjectStoreError: any other failure (credentials, permissions, network).
    """
    fs, base = filesystem(root)
    try:
        with fs.open_input_stream(f"{base}/{relative_path}") as f:
            return bytes(f.read() if max_bytes is None else f.read(max_bytes + 1))
    except FileNotFoundError:
        raise ImageRejected(
            "unreadable",
            "no object under this key when read (deleted since the listing, or a key "
            "ending in '/', which is not a file)",
        ) from None
    except OSError as exc:
        raise ObjectStoreError(f"data.images: cannot read {root}/{relative_path}: {exc}") from None
