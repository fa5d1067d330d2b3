"""The images tree, listed by us: every entry under the root, and whether ingest may read it.

Pure Python (``os``, ``stat``), no Spark: :func:`list_entry` runs on the executors, one
top-level entry of the images root, or one shard of it (:func:`entry_shard`), per call, and
:func:`read_listed_file` reads a file for the decode UDF.

An object-store root (``s3a://bucket/photos``) is handed over to
:mod:`flowers_job.photos.object_listing`: the same contract, for keys. Why not Spark's
``binaryFile`` source (it skips hidden and empty files silently and follows links out of the
root): docs/architecture.md, "Nothing is lost". Every entry is given either no reason
(ingest reads and decodes it) or a ``reason_code`` (it goes to quarantine, never opened):

======================== ================================================================
reason_code              entry
======================== ================================================================
``symlink_outside_root`` a symbolic link whose target resolves outside the images root
``broken_symlink``       a symbolic link to nothing
``symlinked_directory``  a symbolic link to a directory inside the root (not followed: it
                         could loop, or list the same files twice)
``not_a_regular_file``   a FIFO, socket or device
``unreadable_directory`` a directory that cannot be listed (its files are unknown)
``hidden_path``          a file or folder name on the path starts with ``.`` or ``_``
                         (skipped: counted apart, not towards ``data.max_bad_fraction``)
``not_in_label_folder``  a file directly in the images root, not in ``<label>/``
``bad_file_name``        a name that is not valid UTF-8 (shown with ``\\xNN`` escapes)
======================== ================================================================

Hidden entries are skipped, not bad (:data:`~flowers_job.photos.verdicts.SKIPPED_REASONS`).
Links to files inside the root are followed: the file is ingested under the link's path and
label.
"""

from __future__ import annotations

import os
import stat
import zlib
from collections.abc import Iterator

from flowers_job.location import Location, is_remote
from flowers_job.photos.verdicts import (
    LISTING_REASONS,
    SKIPPED_REASONS,
    ListedFile,
    display_name,
    is_hidden,
    path_verdict,
)
from flowers_job.vision.limits import ImageRejected

__all__ = [
    "LISTING_REASONS",
    "SKIPPED_REASONS",
    "ListedFile",
    "display_name",
    "entry_shard",
    "images_root",
    "is_hidden",
    "label_folders",
    "list_entry",
    "listing_units",
    "path_verdict",
    "read_listed_file",
]


def _inside(path: str, real_root: str) -> bool:
    return os.path.commonpath([path, real_root]) == real_root


def images_root(images: str | os.PathLike[str] | None) -> str:
    """The root that the listing and the decode are given for ``data.images``: the real path
    of a local directory (links resolved; a ``Path`` is always local), or an object-store URI
    (a string with a scheme) as given, less a trailing ``/``.

    Raises:
        ValueError: ``images`` is None (``data.images`` not set).
    """
    if images is None:
        raise ValueError("data.images: not set")
    if isinstance(images, str) and is_remote(images):
        return Location.of(images).url
    return os.path.realpath(images)


def listing_units(root: str, labels: list[str], others: list[str]) -> list[str]:
    """The names :func:`list_entry` takes, one listing unit each, for a root whose
    top-level entries are ``labels`` and ``others`` (:func:`label_folders`): those names for
    a local root; :func:`~flowers_job.photos.object_listing.object_units` for an object store."""
    if is_remote(root):
        from flowers_job.photos.object_listing import object_units

        return object_units(root, labels, others)
    return labels + others


def label_folders(root: str) -> tuple[list[str], list[str]]:
    """The label folders of ``root`` and its other top-level entries, each sorted.

    A label folder is a real directory (not a link) whose name is valid UTF-8 and not
    hidden (:func:`is_hidden`); for an object-store root, a top-level prefix whose name is
    not hidden (:func:`~flowers_job.photos.object_listing.object_label_folders`).

    Raises:
        OSError: ``root`` cannot be listed (``FileNotFoundError``: an object-store root with
            no key under it).
    """
    if is_remote(root):
        from flowers_job.photos.object_listing import object_label_folders

        return object_label_folders(root)
    labels, others = [], []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        name = entry.name
        if (
            entry.is_dir(follow_symlinks=False)
            and not is_hidden(name)
            and display_name(name) == name
        ):
            labels.append(name)
        else:
            others.append(name)
    return labels, others


def entry_shard(relative_path: str, shards: int) -> int:
    """Which of ``shards`` listing units reports the entry at ``relative_path`` (the path
    under the root as ``os`` gives it, ``os.sep``-separated): ``crc32`` of its bytes modulo
    ``shards``. Stable across processes and hosts (unlike ``hash``), so that the units of a
    listing split the entries between them: each entry is reported by exactly one unit."""
    return zlib.crc32(os.fsencode(relative_path)) % shards


def list_entry(
    root: str,
    name: str,
    labels: frozenset[str] | set[str],
    shard: tuple[int, int] = (0, 1),
) -> Iterator[ListedFile]:
    """Every entry under the top-level entry ``name`` of the images root, depth first, sorted;
    with ``shard = (index, shards)``, only the entries whose :func:`entry_shard` is
    ``index``.

    Directories are descended into (hidden ones too, so that their files are reported);
    links to directories are not. Nothing is opened: only ``scandir``, and ``lstat`` and
    ``stat`` (of links whose target is inside the root) of the entries reported. Every
    unit of a sharded listing walks the whole tree under ``name`` (``scandir`` tells
    directories apart without a ``stat``) but examines only its own entries, so that
    ``shards`` units list one large folder in parallel and, together, report each entry
    exactly once (an unreadable directory too: by the unit that owns its path).

    An object-store root (:func:`images_root`) is listed by
    :func:`~flowers_job.photos.object_listing.list_object_unit`: ``name`` is then one of its
    :func:`listing_units`, and ``shard`` must be ``(0, 1)``.

    Args:
        root: the images root (a link is resolved first), or an object-store URI.
        name: a top-level entry of ``root``, as ``os.listdir`` returns it.
        labels: the label folder names (:func:`label_folders`).
        shard: ``(index, shards)``, ``0 <= index < shards``; ``(0, 1)``: every entry.

    Yields:
        One :class:`ListedFile` per file, link, special file or unlistable directory.

    Raises:
        ValueError: an object-store root with a ``shard`` other than ``(0, 1)``.
    """
    index, shards = shard
    if is_remote(root):
        if shards != 1:
            raise ValueError(f"{root}: an object-store root is listed one unit per prefix")
        from flowers_job.photos.object_listing import list_object_unit

        yield from list_object_unit(root, name, labels)
        return
    real_root = os.path.realpath(root)
    try:
        top_is_dir = stat.S_ISDIR(os.lstat(os.path.join(real_root, name)).st_mode)
    except FileNotFoundError:
        return  # removed since the root was listed: nothing to account for
    stack = [(name, top_is_dir)]
    while stack:
        rel, is_dir = stack.pop()
        mine = shards == 1 or entry_shard(rel, shards) == index
        if not is_dir:
            if mine:
                entry = _examine(real_root, rel, labels)
                if entry is not None:
                    yield entry
            continue
        path = os.path.join(real_root, rel)
        try:
            with os.scandir(path) as it:
                children = sorted((e.name, _is_real_dir(e)) for e in it)
        except FileNotFoundError:
            continue
        except OSError as exc:
            if mine:
                entry = _unreadable_directory(real_root, rel, labels, exc)
                if entry is not None:
                    yield entry
            continue
        stack.extend((os.path.join(rel, c), d) for c, d in reversed(children))


def _is_real_dir(entry: os.DirEntry[str]) -> bool:
    """A directory, not a link to one (``d_type``: no ``stat`` on most file systems)."""
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False  # examined with lstat, as a file, and given its verdict there


def _label(rel: str, labels: frozenset[str] | set[str]) -> tuple[list[str], str | None]:
    parts = rel.split(os.sep)
    return parts, parts[0] if len(parts) > 1 and parts[0] in labels else None


def _examine(real_root: str, rel: str, labels: frozenset[str] | set[str]) -> ListedFile | None:
    """The verdict on the non-directory entry ``rel``; None if it vanished."""
    try:
        st = os.lstat(os.path.join(real_root, rel))
    except FileNotFoundError:
        return None  # removed since its directory was listed: nothing to account for
    parts, label = _label(rel, labels)
    if stat.S_ISDIR(st.st_mode):  # a file replaced by a directory since: listed as one, empty
        return None
    return _classify(real_root, rel, display_name(rel), parts, label, st)


def _unreadable_directory(
    real_root: str, rel: str, labels: frozenset[str] | set[str], exc: OSError
) -> ListedFile | None:
    """The report of a directory that cannot be listed; None if it vanished."""
    try:
        st = os.lstat(os.path.join(real_root, rel))
    except FileNotFoundError:
        return None
    _, label = _label(rel, labels)
    return ListedFile(
        display_name(rel),
        label,
        "directory",
        None,
        st.st_mtime_ns,
        "unreadable_directory",
        f"cannot list the directory: {exc.strerror or exc}",
    )


def _classify(
    real_root: str, rel: str, shown: str, parts: list[str], label: str | None, st: os.stat_result
) -> ListedFile:
    """The verdict on one non-directory entry (see the module docstring for the order)."""
    kind = "file"
    if stat.S_ISLNK(st.st_mode):
        refused, target_st = _follow_link(real_root, rel, shown, label)
        if refused is not None:
            return refused
        assert target_st is not None
        kind, st = "symlink", target_st
    code, reason = _file_verdict(rel, shown, parts, st)
    if code == "not_a_regular_file":
        kind = "other"
    size = st.st_size if stat.S_ISREG(st.st_mode) else None
    return ListedFile(shown, label, kind, size, st.st_mtime_ns, code, reason)


def _follow_link(
    real_root: str, rel: str, shown: str, label: str | None
) -> tuple[ListedFile | None, os.stat_result | None]:
    """A link's verdict when it is refused, else its target's ``stat`` (a file in the root)."""
    path = os.path.join(real_root, rel)
    target = os.path.realpath(path)
    shown_target = display_name(target)

    def refuse(code: str, reason: str, mtime: int | None = None) -> tuple[ListedFile, None]:
        return ListedFile(shown, label, "symlink", None, mtime, code, reason), None

    if not _inside(target, real_root):
        return refuse(
            "symlink_outside_root",
            f"symbolic link to {shown_target}, outside the images root "
            f"{display_name(real_root)}: refused, never read",
        )
    try:
        st = os.stat(path)
    except OSError:
        return refuse("broken_symlink", f"symbolic link to {shown_target}, which does not exist")
    if stat.S_ISDIR(st.st_mode):
        return refuse(
            "symlinked_directory",
            f"symbolic link to the directory {shown_target}: links to directories are not "
            "followed (they can loop or list files twice); link the files instead",
            st.st_mtime_ns,
        )
    return None, st


def _file_verdict(
    rel: str, shown: str, parts: list[str], st: os.stat_result
) -> tuple[str | None, str | None]:
    """``(reason_code, reason)`` of a file or special file; ``(None, None)``: read it."""
    if not stat.S_ISREG(st.st_mode):
        what = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket or device"
        return "not_a_regular_file", f"{what}, not a regular file; never read"
    code, reason = path_verdict(parts)
    if code is not None:
        return code, reason
    if shown != rel:
        return "bad_file_name", (
            "the name is not valid UTF-8 (undecodable bytes shown as \\xNN); rename the file"
        )
    return None, None


def read_listed_file(root: str, relative_path: str, max_bytes: int | None = None) -> bytes:
    """The bytes of a file that :func:`list_entry` found readable: all of them, or at most
    ``max_bytes + 1`` (bytes) when ``max_bytes`` is given, so that a caller sees that the
    file is larger than its limit without holding more than the limit in memory.

    The path is resolved again just before reading: a file that became a link out of the
    root since the listing is refused, and a FIFO put in its place is not waited on.

    An object-store root is read by :func:`~flowers_job.photos.object_listing.read_object`
    (one GET through pyarrow; a missing key is ``unreadable``, any other failure raises its
    ``ObjectStoreError``).

    Raises:
        ImageRejected: ``symlink_outside_root``, ``not_a_regular_file`` or ``unreadable``
            (the file vanished or cannot be opened; the message has the OS error).
    """
    if is_remote(root):
        from flowers_job.photos.object_listing import read_object

        return read_object(root, relative_path, max_bytes)
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, relative_path))
    if not _inside(real, real_root):
        raise ImageRejected(
            "symlink_outside_root",
            f"resolves to {real}, outside the images root {real_root}: refused, never read",
        )
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise ImageRejected("unreadable", f"cannot open: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ImageRejected("not_a_regular_file", "not a regular file when read")
        try:
            return f.read() if max_bytes is None else f.read(max_bytes + 1)
        except OSError as exc:
            raise ImageRejected("unreadable", f"cannot read: {exc.strerror or exc}") from None
