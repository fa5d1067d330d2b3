"""An images root in an object store (``data.images = s3a://bucket/photos``): the listing
contract of :mod:`flowers_job.photos.listing`, through pyarrow's file systems
(:func:`flowers_job.location.filesystem`), never through a local path or Spark's file
sources.

Every key under the root ends either readable (ingest reads and decodes it) or with a
``reason_code`` (quarantine), as for a local root. An object store has no symbolic links,
special files or unreadable directories, so of the listing's reasons only these apply:

- ``hidden_path``: a segment of the key (between ``/``) starts with ``.`` or ``_``
  (skipped, as a local root's hidden files: not counted towards ``data.max_bad_fraction``);
- ``not_in_label_folder``: a key directly under the root;
- ``bad_file_name``: a key with an empty segment (``daisy//a.jpg``), which no file-system
  path (pyarrow's, Hadoop's, a mounted volume's) can name. Keys are UTF-8 by the S3 API, so
  the local meaning (a name that is not UTF-8) cannot arise.

A zero-length object is listed like a zero-length file: it goes to decode, which gives it
``empty_file``. ``num_bytes`` and ``mtime_ns`` are the object's size and ``LastModified``
(pyarrow's ``FileInfo.size`` and ``mtime_ns``), so incremental ingest compares path, size and
time as for files; S3 gives ``LastModified`` to the millisecond in a listing (some servers,
moto among them, to the second): an object rewritten within that time with the same size is
seen as unchanged, and ``--full`` reads it again.

Keys ending in ``/`` are folder markers (the S3 console's "Create folder", Hadoop's ``s3a``
directories), not files: pyarrow lists an empty one as a directory and the listing skips it
silently, only because it is a directory marker. A non-empty key ending in ``/`` (no tool
makes one as a marker) is listed by pyarrow as a file under the name without the ``/``; it
cannot be read under that name and is quarantined as ``unreadable``.

**Where the listing runs.** On the executors, like a local root's, and for the same reason:
neither the listing nor any image passes through the driver, which collects only counts per
label and reason. The driver makes one LIST of the root's first level (with a delimiter:
:func:`object_label_folders`) to find the label folders; each listing unit is then one
recursive LIST of one top-level prefix (:func:`list_object_unit`), one unit per prefix, in
parallel across the executors. Units are not split further as a local folder's are
(:func:`~flowers_job.photos.listing.entry_shard`): a LIST returns a prefix's keys in key order,
1,000 per page, one page after the other, so a unit that keeps a hash share of the keys would
still LIST them all, and ``shards`` units of one folder would make ``shards`` times the
requests for no gain. One recursive LIST on the driver instead would be as many requests,
but would bring the whole listing to the driver.

The decode reads each object on the executors with :func:`read_object` (one GET through
pyarrow).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from flowers_job.errors import ObjectStoreError
from flowers_job.location import filesystem
from flowers_job.photos.verdicts import ListedFile, is_hidden, path_verdict
from flowers_job.vision.images import ImageRejected

__all__ = [
    "ObjectStoreError",
    "list_object_unit",
    "object_label_folders",
    "object_units",
    "read_object",
]

ROOT_FILES = ""
"""The listing unit of the keys directly under the root (one LIST without recursion)."""


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


def object_units(labels: list[str], others: list[str]) -> list[str]:
    """The listing units of a root with these top-level entries
    (:func:`object_label_folders`): ``<prefix>/`` for each prefix (every key under it) and
    :data:`ROOT_FILES` once for the keys directly under the root."""
    units = [f"{label}/" for label in labels] + [o for o in others if o.endswith("/")]
    if any(not o.endswith("/") for o in others):
        units.append(ROOT_FILES)
    return units


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
        label = parts[0] if len(parts) > 1 and parts[0] in labels else None
        yield ListedFile(rel, label, "file", int(info.size), info.mtime_ns, code, reason)


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
