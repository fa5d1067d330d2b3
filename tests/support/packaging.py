"""uv and the package index, for the tests that install the project or resolve its
requirements."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

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


def run(
    args: list[str], timeout: float, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``args`` run in ``cwd`` with output captured, bounded by ``timeout`` seconds; never
    raises on exit."""
    return subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env, check=False
    )


def project_wheel(uv: str, tmp_path: Path) -> Path:
    """``FLOWERS_WHEEL``, or the wheel built from a copy of the sources (no build/ or
    egg-info left in the checkout)."""
    from tests.support import ROOT_DIR

    given = os.environ.get("FLOWERS_WHEEL")
    if given:
        return Path(given).resolve()
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT_DIR / name, src / name)
    shutil.copytree(
        ROOT_DIR / "flowers_job", src / "flowers_job", ignore=shutil.ignore_patterns("__pycache__")
    )
    out = tmp_path / "dist"
    proc = run([uv, "build", "--wheel", "--out-dir", str(out), str(src)], 300, tmp_path)
    assert proc.returncode == 0, uv_failure(proc.stderr)
    (built,) = out.glob("flowers_job-*.whl")
    return built
