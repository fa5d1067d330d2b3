"""Secrets in the configuration: which names are secret, and credentials inside a URI.

A value is shown in no error, log or dump when its setting is secret: a
:class:`~pydantic.SecretStr` field (``tracking.password``, ``tracking.token``), a name close
to one (a misspelt ``tracking.pasword``), or any name with one of :data:`SECRET_WORDS` in it.
Credentials inside a URI (``https://alice:pw@host``) are shown as ``https://alice:***@host``
(:func:`redact_uri`) and taken out of ``tracking.tracking_uri``
(:func:`credentials_out_of_uri`), to be sent by MLflow's own variables; a password given by
a variable or a file is read when the job starts (:func:`read_password`).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import SecretStr

from flowers_job.errors import ConfigError

__all__ = [
    "SECRET_WORDS",
    "credentials_out_of_uri",
    "is_secret_name",
    "read_password",
    "redact_uri",
    "shows_secret",
    "split_userinfo",
]

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


def credentials_out_of_uri(data: Any) -> Any:
    """The raw ``tracking`` section ``data`` with a server URI's credentials taken out (any other
    value is returned as it is): ``https://alice:pw@host`` -> ``tracking_uri="https://host"``,
    ``username="alice"``, ``password="pw"``: MLflow then sends them from
    MLFLOW_TRACKING_USERNAME/PASSWORD (``mlflow.utils.credentials.get_default_host_creds``), and the
    URI the job stores, logs and hands to the ranks holds no secret. A password in the URI of
    another store (a database: SQLAlchemy would need it in the URI) is refused: its driver reads it
    from its own files or variables (libpq's ``PGPASSWORD`` and ``~/.pgpass``).

    Raises:
        ValueError: an invalid URI, a password in another store's URI, or a user name or
            password given both in the URI and in its own setting (pydantic reports it as
            the setting's error; the message shows no secret).
    """
    if not isinstance(data, dict) or not isinstance(data.get("tracking_uri"), str):
        return data
    uri = data["tracking_uri"]
    head, sep, _ = uri.partition("://")
    try:
        bare, user, password = split_userinfo(uri)
        scheme = urlsplit(uri).scheme.lower()
        if sep and scheme != head.lower():  # "[https://a:pw@h]": no userinfo found
            raise ValueError
    except ValueError:
        raise ValueError("tracking_uri: not a valid URI (scheme://host...)") from None
    if user is None and password is None:
        return data
    if scheme not in ("http", "https"):
        if password is None:
            return data  # postgresql://user@host/db: the driver finds the password
        raise ValueError(
            f"tracking_uri: a password in the URI of the store {redact_uri(uri)} is "
            "refused (it would show in the params, summary.json and logs); take it out "
            "and give it to the database driver: PGPASSWORD or a ~/.pgpass file for "
            "PostgreSQL, an option file (?read_default_file=...) for MySQL"
        )
    if user is not None and data.get("username") not in (None, user):
        raise ValueError(
            "username: differs from the user name in tracking.tracking_uri; give it once"
        )
    given = [k for k in ("password", "password_env", "password_file") if data.get(k)]
    if password is not None and given:
        raise ValueError(
            f"password: given both in tracking.tracking_uri and as tracking.{given[0]}; "
            "give it once"
        )
    out = {**data, "tracking_uri": bare}
    if user is not None:
        out["username"] = user
    if password is not None:
        out["password"] = password
    return out


def read_password(
    password: SecretStr | None, password_env: str | None, password_file: Path | None
) -> SecretStr | None:
    """The basic-auth password of ``tracking``: ``password``, else the variable ``password_env``
    names, else the text of ``password_file`` without its trailing line break; None when
    none is set.

    Raises:
        ConfigError: the variable is not set or empty, or the file cannot be read or is
            empty; the message names the setting and the variable or file, never a value.
    """
    if password is not None:
        return password
    if password_env:
        value = os.environ.get(password_env)
        if not value:
            raise ConfigError(
                f"tracking.password_env: the environment variable {password_env} is "
                "not set or empty"
            )
        return SecretStr(value)
    if password_file is not None:
        path = password_file.expanduser()
        try:
            value = path.read_text(encoding="utf-8").rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ConfigError(f"tracking.password_file: cannot read {path}: {why}") from None
        if not value:
            raise ConfigError(f"tracking.password_file: {path} is empty")
        return SecretStr(value)
    return None
