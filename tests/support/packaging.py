"""uv and the package index, for the tests that install the project or resolve its
requirements."""

from __future__ import annotations

import os
import re

import pytest


def index_url() -> str:
    """The package index pip (and uv, in tests/project/test_clean_install.py) resolve against."""
    return os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")


def uv_bin() -> str:
    """``FLOWERS_UV`` (the DBR suite's: its environment, like the runtime, has no uv), else
    the uv of this environment (requirements/lock.txt has it)."""
    given = os.environ.get("FLOWERS_UV")
    if given:
        return given
    uv = pytest.importorskip("uv", reason="uv is not installed (requirements/lock.txt has it)")
    return str(uv.find_uv_bin())


def uv_failure(stderr: str) -> str:
    """uv's own error lines (``error:``, ``cause:``, ``hint:``) and any exception line of a
    build backend first, then the tail of ``stderr``: a failed sdist build prints its
    backend's whole output between uv's error and its hint, so the tail alone can miss the
    cause (a full disk, a failed download, the backend's exit status)."""
    cause = re.compile(r"^(error:|cause:|hint:|[\w.]*(Error|Exception)\b)")
    own = [line.strip() for line in stderr.splitlines() if cause.match(line.strip())]
    return " | ".join(own) + f"\n{stderr[-4000:]}"


def clean_env() -> dict[str, str]:
    """This process's environment less what would point a child at another environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    if "PIP_INDEX_URL" in os.environ:  # a mirror: uv resolves against the same index
        env["UV_DEFAULT_INDEX"] = index_url()
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    return env
