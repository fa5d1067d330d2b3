"""Building the configuration: defaults, a YAML file, command-line flags, ``--set`` overrides.

Precedence (lowest to highest): field defaults, the YAML file, command-line flags
(``--images``, ``--output-dir``), ``--set KEY=VALUE`` overrides. Keys renamed in a release
still work for one more, with a warning naming the new key
(:mod:`flowers_job.config.deprecated`).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, SecretStr, ValidationError

from flowers_job.config.model import JobConfig
from flowers_job.config.secrets import is_secret_name, redact_uri, shows_secret
from flowers_job.errors import ConfigError

__all__ = ["SECRET_FIELDS", "ConfigError", "load_config", "parse_overrides", "resolve_embeddings"]

log = logging.getLogger(__name__)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """Turn ``["train.epochs=3", "distributed.local_mode=false"]`` into a nested dict.

    A value for a text setting (a field typed ``str`` or ``SecretStr``) is kept as written:
    ``tracking.password=Secret #1``, ``*abc``, ``!x`` or ``~`` stay those characters (YAML
    would cut a comment, read an alias or a tag, or give None). The one exception is
    ``null`` (``Null``, ``NULL``) for an optional setting that is not a secret, which unsets it
    (``tracking.run_name=null``). Any other value is parsed as a YAML scalar (``3`` -> int,
    ``false`` -> bool, ``null`` -> None, ``[a, b]`` -> list). A secret given here is in the
    process list and the shell's history: a warning says so (use ``tracking.password_env``
    or ``tracking.password_file``).

    Raises:
        ConfigError: an item without ``=``, an empty key, or a value that is not valid YAML;
            the message names the key, and shows no value of a secret setting
            (:func:`flowers_job.config.secrets.is_secret_name`).
    """
    tree: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        secret = is_secret_name(key, SECRET_FIELDS)
        if not sep:
            shown = "<a secret setting>" if is_secret_name(item, SECRET_FIELDS) else repr(item)
            raise ConfigError(f"--set {shown}: expected KEY=VALUE, e.g. train.epochs=3")
        text = _text_field(key)
        if text is not None and not (text == "optional" and not secret and raw in _NULLS):
            value: Any = raw
        else:
            try:
                value = yaml.safe_load(raw) if raw.strip() else ""
            except yaml.YAMLError as exc:
                why = "" if secret else f": {' '.join(str(exc).split())}"
                raise ConfigError(f"--set {key}: the value is not valid YAML{why}") from None
        if raw and key.rpartition(".")[2] in SECRET_FIELDS:
            log.warning(
                "--set %s: a secret on the command line shows in the process list and the "
                "shell's history; use tracking.password_env, tracking.password_file or "
                "MLflow's MLFLOW_TRACKING_PASSWORD",
                key,
            )
        _set(tree, key, value)
    return tree


_NULLS = ("null", "Null", "NULL")


def _secret_fields(model: type[BaseModel]) -> set[str]:
    """The names of the ``SecretStr`` fields of ``model`` and its sections, at any depth."""
    names: set[str] = set()
    for name, info in model.model_fields.items():
        types = _types(info.annotation)
        if SecretStr in types:
            names.add(name)
        for t in types:
            if isinstance(t, type) and issubclass(t, BaseModel):
                names |= _secret_fields(t)
    return names


def _types(annotation: Any) -> tuple[Any, ...]:
    if get_origin(annotation) in (Union, UnionType):
        return get_args(annotation)
    return (annotation,)


def _text_field(dotted: str) -> str | None:
    """``"required"`` or ``"optional"`` (None allowed) when the setting ``dotted`` of
    :class:`JobConfig` is text (``str``, ``SecretStr``); None for any other setting or an
    unknown key."""
    model: type[BaseModel] = JobConfig
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        info = model.model_fields.get(part)
        if info is None:
            return None
        types = _types(info.annotation)
        if i < len(parts) - 1:
            sections = [t for t in types if isinstance(t, type) and issubclass(t, BaseModel)]
            if not sections:
                return None
            model = sections[0]
            continue
        values = [t for t in types if t is not type(None)]
        if values and all(t in (str, SecretStr) for t in values):
            return "optional" if len(values) < len(types) else "required"
    return None


SECRET_FIELDS: frozenset[str] = frozenset(_secret_fields(JobConfig))
"""The names of the configuration's ``SecretStr`` fields (``password``, ``token``)."""


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if not all(parts):
        raise ConfigError(f"--set {dotted!r}: empty key part")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted!r}: {part!r} is both a value and a section")
        node = child
    node[parts[-1]] = value


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


_NAMED = re.compile(r"^([A-Za-z_][\w.]*): (.*)$", re.DOTALL)
"""A cross-field check's message starts with the field it blames: ``"weights_path: ..."``."""


def _format(err: ValidationError) -> str:
    """One line per error, naming the field. The value it got is shown for a setting that
    cannot hold a secret only (:func:`flowers_job.config.secrets.shows_secret`: not a
    secret's name nor one close to it), and a URI's password never (``***``)."""
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "value_error" and (named := _NAMED.match(msg)):
            loc, msg = [*loc, named[1]], named[2]  # "model" + "weights_path: ..."
        field = ".".join(loc)
        value = e.get("input")
        if e["type"] in ("missing", "value_error"):
            got = ""
        elif shows_secret(loc, value, SECRET_FIELDS):
            got = " (value not shown: a secret setting)"
        else:
            got = f" (got {_redact(value)!r})"
        lines.append(f"  {field}: {msg}{got}" if field else f"  {msg}")
    return "invalid configuration:\n" + "\n".join(lines)


def _redact(value: Any) -> Any:
    if isinstance(value, str):
        return redact_uri(value)
    if isinstance(value, dict):
        return {k: _redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact(v) for v in value]
    return value


def _yaml_problem(path: Path, exc: yaml.YAMLError) -> str:
    """YAML's error in the file ``path``, without the problem's text (which may quote a value:
    ``found undefined alias 'hunter2'``) when the line it is on names a secret setting."""
    mark = getattr(exc, "problem_mark", None)
    if mark is None:
        return "not valid YAML"
    where = f"line {mark.line + 1}, column {mark.column + 1}"
    try:
        line = path.read_text(encoding="utf-8").splitlines()[mark.line]
    except (OSError, UnicodeDecodeError, IndexError):
        line = ""
    key = line.partition(":")[0].strip(" -\t")
    if not line or is_secret_name(key, SECRET_FIELDS):
        return f"not valid YAML at {where} (a secret setting's line: its value is not shown)"
    return f"not valid YAML at {where}: {getattr(exc, 'problem', None) or exc}"


def load_config(
    path: Path | str | None = None,
    overrides: list[str] | None = None,
    **flags: Any,
) -> JobConfig:
    """Build and validate the job configuration.

    Args:
        path: optional YAML file with any subset of the sections.
        overrides: ``KEY=VALUE`` strings with dotted keys (``train.epochs=3``).
        **flags: command-line shortcuts given as dotted keys, e.g.
            ``{"data.images": "photos", "paths.output_dir": "out"}``; None values are skipped.

    Returns:
        A validated, immutable :class:`JobConfig`.

    Raises:
        ConfigError: unreadable file, malformed override, or invalid values; the message
            names each field (``train.per_device_batch_size: ...``).
    """
    tree: dict[str, Any] = {}
    if path is not None:
        try:  # from a stream: YAML's errors then quote no line of the file (a password)
            with Path(path).open(encoding="utf-8") as stream:
                loaded = yaml.safe_load(stream)
        except OSError as exc:
            raise ConfigError(f"config file {path}: {exc}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path}: {_yaml_problem(Path(path), exc)}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: top level must be a mapping")
        tree = loaded or {}
    flag_tree: dict[str, Any] = {}
    for dotted, value in flags.items():
        if value is not None:
            _set(flag_tree, dotted, str(value) if isinstance(value, Path) else value)
    tree = _merge(tree, flag_tree)
    tree = _merge(tree, parse_overrides(overrides or []))
    try:
        return JobConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format(exc)) from None


def resolve_embeddings(cfg: JobConfig, reads_table: bool) -> JobConfig:
    """``cfg`` with ``embeddings.enabled: auto`` decided (:meth:`JobConfig.resolve_embeddings`;
    ``reads_table``: the resolved loader reads the tables).

    Raises:
        ConfigError: the configuration the decision rebuilds is refused (one line per
            setting, as :func:`load_config` words it).
    """
    try:
        return cfg.resolve_embeddings(reads_table)
    except ValidationError as exc:
        raise ConfigError(f"embeddings.enabled=auto: {_format(exc)}") from None
