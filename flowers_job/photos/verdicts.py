"""What the listing of an images tree says of an entry, local or in an object store: the
entry (:class:`ListedFile`), the ``reason_code`` vocabulary of the entries ingest never
opens (:mod:`flowers_job.photos.listing` has the table), and the verdicts that depend on the
path alone. Shared by :mod:`~flowers_job.photos.listing` and
:mod:`~flowers_job.photos.object_listing`; pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "LISTING_REASONS",
    "SKIPPED_REASONS",
    "ListedFile",
    "display_name",
    "is_hidden",
    "path_verdict",
]


LISTING_REASONS = (
    "symlink_outside_root",
    "broken_symlink",
    "symlinked_directory",
    "not_a_regular_file",
    "unreadable_directory",
    "hidden_path",
    "not_in_label_folder",
    "bad_file_name",
)
"""The ``reason_code`` values the listing gives (the table above): entries never opened."""
SKIPPED_REASONS = ("hidden_path",)
"""Listing verdicts that mean "skipped", not "bad": hidden names (``.DS_Store``, macOS's
``._x.jpg``, ``.git/``), which Spark and Hadoop skip too. Such an entry is still recorded in
quarantine with its reason (nothing is lost), but ingest counts it apart, and not towards
``data.max_bad_fraction`` (:mod:`flowers_job.ingest.write`)."""


@dataclass(frozen=True)
class ListedFile:
    """One entry of the images tree.

    Attributes:
        relative_path: ``/``-separated path under the root, valid UTF-8 (see
            :func:`display_name`).
        label: the label folder it lies in, None outside the label folders.
        kind: ``file``, ``symlink`` (to a file inside the root), ``directory`` (only for a
            directory that is itself reported) or ``other``.
        num_bytes: size in bytes (of the target, for a link inside the root); None when the
            entry was not examined (a link out of the root is never followed).
        mtime_ns: modification time, nanoseconds since the epoch; None as for ``num_bytes``.
        reason_code: None if ingest may read the file, else why not (module docstring).
        reason: the reason in words, naming what was found.
    """

    relative_path: str
    label: str | None
    kind: str
    num_bytes: int | None
    mtime_ns: int | None
    reason_code: str | None = None
    reason: str | None = None


def is_hidden(name: str) -> bool:
    """True for names that Spark and Hadoop treat as hidden: starting with ``.`` or ``_``."""
    return name.startswith((".", "_"))


def display_name(name: str) -> str:
    """``name`` as valid UTF-8: bytes that are not UTF-8 (``os.fsdecode``'s surrogate
    escapes) are written ``\\xNN``."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def path_verdict(parts: list[str]) -> tuple[str | None, str | None]:
    """``(reason_code, reason)`` that the path of an entry gives it, whatever the entry:
    ``hidden_path`` (a hidden part, :func:`is_hidden`), then ``not_in_label_folder`` (one
    part: directly in the root); ``(None, None)`` otherwise. ``parts``: the path under the
    root, split at its separators (local and object-store listings alike)."""
    hidden = next((p for p in parts if is_hidden(p)), None)
    if hidden is not None:
        return "hidden_path", (
            f"{display_name(hidden)!r} starts with {hidden[0]!r}: a hidden name, which Spark and "
            "Hadoop skip; rename it to ingest the file"
        )
    if len(parts) == 1:
        return "not_in_label_folder", "lies directly in the images root, not in a <label>/ folder"
    return None, None
