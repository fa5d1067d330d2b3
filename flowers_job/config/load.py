"""Building the configuration: defaults, a YAML file, command-line flags, ``--set`` overrides.

Precedence (lowest to highest): field defaults, the YAML file, command-line flags
(``--images``, ``--output-dir``), ``--set KEY=VALUE`` overrides. Keys renamed in a release
still work for one more, with a warning naming the new key
(:mod:`flowers_job.config.deprecated`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from flowers_job.config.model import JobConfig
from flowers_job.errors import ConfigError

__all__ = ["ConfigError", "load_config", "parse_overrides"]


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """Turn ``["train.epochs=3", "distributed.local_mode=false"]`` into a nested dict.

    Values are parsed as YAML scalars (``3`` -> int, ``false`` -> bool, ``null`` -> None).

    Raises:
        ConfigError: an item without ``=`` or with an empty key.
    """
    tree: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. train.epochs=3")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item!r}: value is not valid YAML: {exc}") from None
        _set(tree, key.strip(), value)
    return tree


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
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "value_error" and (named := _NAMED.match(msg)):
            loc, msg = [*loc, named[1]], named[2]  # "model" + "weights_path: ..."
        field = ".".join(loc)
        got = "" if e["type"] in ("missing", "value_error") else f" (got {e.get('input')!r})"
        lines.append(f"  {field}: {msg}{got}" if field else f"  {msg}")
    return "invalid configuration:\n" + "\n".join(lines)


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
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"config file {path}: {exc}") from exc
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
