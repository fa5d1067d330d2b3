"""Secrets in the configuration: which names are secret, and credentials inside a URI.

A value is shown in no error, log or dump when its setting is secret: a
:class:`~pydantic.SecretStr` field (``tracking.password``, ``tracking.token``), a name close
to one (a misspelt ``tracking.pasword``), or any name with one of :data:`SECRET_WORDS` in it.
Credentials inside a URI (``https://alice:pw@host``) are shown as ``https://alice:***@host``
(:func:`redact_uri`) and taken out of ``tracking.tracking_uri`` (:func:`split_userinfo`) by
:class:`flowers_job.config.model.TrackingConfig`, which sends them by MLflow's own variables.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

__all__ = ["SECRET_WORDS", "is_secret_name", "redact_uri", "shows_secret", "split_userinfo"]

SECRET_WORDS = ("password", "passwd", "secret", "token", "key", "credential")
"""A setting whose name holds one of these is taken for a secret wherever it is printed."""

CLOSE_MATCH = 0.75
"""``difflib.SequenceMatcher`` ratio from which a name counts as a misspelling of a secret
field's (``pasword``/``password``: 0.93; ``passwd``: 0.86)."""


def is_secret_name(name: str, secret_fields: Iterable[str] = ("password", "token")) -> bool:
    """Whether the setting ``name`` (one key, or a dotted path) may hold a secret: a part
    contains one of :data:`SECRET_WORDS` (case-insensitive), or is a close match
    (``difflib.get_close_matches``, cutoff :data:`CLOSE_MATCH`) to one of ``secret_fields``."""
    fields = list(secret_fields)
    for part in str(name).lower().split("."):
        if any(word in part for word in SECRET_WORDS):
            return True
        if difflib.get_close_matches(part, fields, n=1, cutoff=CLOSE_MATCH):
            return True
    return False


def shows_secret(
    loc: Iterable[Any], value: Any, secret_fields: Iterable[str] = ("password", "token")
) -> bool:
    """Whether printing ``value``, the input of the setting at ``loc`` (its path's parts),
    could show a secret: the path is secret (:func:`is_secret_name`), or ``value`` is a
    mapping or list holding, at any depth, a key that is."""
    fields = list(secret_fields)
    if any(is_secret_name(str(part), fields) for part in loc):
        return True
    if isinstance(value, dict):
        return any(shows_secret([k], v, fields) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(shows_secret([], v, fields) for v in value)
    return False


def _netloc(host: str | None, port: int | None, username: str | None = None) -> str:
    netloc = host or ""
    if ":" in netloc:  # an IPv6 address lost its brackets in urlsplit
        netloc = f"[{netloc}]"
    if port is not None:
        netloc += f":{port}"
    return f"{username}@{netloc}" if username else netloc


def redact_uri(text: str) -> str:
    """``text`` with the password of its URI, if it is one with credentials, replaced by
    ``***``: ``https://alice:pw@host/x`` -> ``https://alice:***@host/x``. Any other text is
    returned as it is."""
    try:
        parts = urlsplit(text)
        password = parts.password
    except ValueError:  # an invalid port or bracket: show no part of its userinfo
        head, sep, tail = text.rpartition("@")
        return f"***@{tail}" if sep and "://" in head else text
    if password is None:
        return text
    user, _, _ = parts.netloc.rpartition("@")[0].partition(":")
    netloc = f"{user}:***@{parts.netloc.rpartition('@')[2]}"
    return urlunsplit(parts._replace(netloc=netloc))


def split_userinfo(uri: str) -> tuple[str, str | None, str | None]:
    """``uri`` without its userinfo, and the user name and password it held (percent-decoded,
    RFC 3986 section 3.2.1), each None when absent.

    ``https://alice:S3cr3t@host:5000/x`` -> ``("https://host:5000/x", "alice", "S3cr3t")``.

    Raises:
        ValueError: an invalid port (the message shows no part of the URI).
    """
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri, None, None
    try:
        port = parts.port
    except ValueError:
        raise ValueError("the URI's port is not a number") from None
    user = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    bare = urlunsplit(parts._replace(netloc=_netloc(parts.hostname, port)))
    return bare, user, password
