"""The packages that the end of a run needs are checked before training starts.

Real import failures, no stand-ins: ``None`` in ``sys.modules`` is how Python itself marks
a module that must not be imported (``import`` raises ModuleNotFoundError), and a package on
``sys.path`` whose ``__init__`` raises is what a broken install looks like. The CLI case runs
``flowers-job train`` in a child process with scikit-learn hidden the same way.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flowers_job.config import ConfigError
from flowers_job.tracking.packages import RUN_PACKAGES, check_run_packages

pytestmark = [pytest.mark.timeout(120), pytest.mark.tier("gate")]


def _forget(monkeypatch: pytest.MonkeyPatch, top: str) -> None:
    """Drop ``top`` and its submodules from ``sys.modules`` for this test (restored after)."""
    for name in [n for n in sys.modules if n == top or n.startswith(f"{top}.")]:
        monkeypatch.delitem(sys.modules, name)


def test_passes_where_everything_is_installed() -> None:
    check_run_packages()


def test_names_a_missing_and_a_broken_package_with_the_pip_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _forget(monkeypatch, "sklearn")
    monkeypatch.setitem(sys.modules, "sklearn", None)  # not installed
    broken = tmp_path / "matplotlib"
    broken.mkdir()
    (broken / "__init__.py").write_text(
        "raise ImportError('numpy.core.multiarray failed to import')\n"
    )
    _forget(monkeypatch, "matplotlib")
    monkeypatch.syspath_prepend(str(tmp_path))  # a broken install shadows the real one

    with pytest.raises(ConfigError) as info:
        check_run_packages()

    message = str(info.value)
    assert "nothing has started" in message
    lines = message.splitlines()[1:]
    assert len(lines) == 2, message  # one line per distribution, not per module
    sklearn, matplotlib = lines
    assert sklearn.lstrip().startswith("scikit-learn (the test report's scores)")
    assert "`import sklearn.metrics` fails: ModuleNotFoundError" in sklearn
    assert "pip install 'scikit-learn" in sklearn
    assert matplotlib.lstrip().startswith("matplotlib (the test report's figures)")
    assert "ImportError: numpy.core.multiarray failed to import" in matplotlib
    assert "pip install 'matplotlib" in matplotlib


def test_every_distribution_checked_is_one_the_wheel_requires() -> None:
    """The pip command names a floor when the installed flowers-job declares the package."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        requires = [Requirement(r) for r in metadata.requires("flowers-job") or []]
    except metadata.PackageNotFoundError:
        pytest.skip("flowers-job is not installed (a source checkout)")
    unconditional = {r.name for r in requires if r.marker is None}  # not an extra's
    assert {dist for dist, _, _ in RUN_PACKAGES} <= unconditional, requires


def test_cli_train_exits_2_before_anything_starts(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["sklearn"] = None  # scikit-learn is not installed
        from flowers_job.cli import main
        sys.exit(main(["train", "--output-dir", {str(out)!r}, "--set", "data.loader=auto"]))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "scikit-learn (the test report's scores)" in proc.stderr
    assert "pip install 'scikit-learn" in proc.stderr
    assert not out.exists()  # no MLflow preflight, no Spark, no tables


OVERRIDDEN = {("petastorm", "setuptools")}
"""Requirements that ``make setup`` overrides on purpose: petastorm 0.13.1 pins
setuptools<70, which torch's setuptools>=77.0.3 contradicts (requirements/lock.txt)."""


def test_the_environment_meets_every_installed_requirement() -> None:
    """The lock file is complete: every requirement of every installed distribution (its
    markers evaluated here, extras not asked for left out) is met by what is installed.
    ``uv pip sync`` installs exactly the lock's list without resolving, so a package that a
    lock leaves out (pip freeze omits setuptools) is otherwise found only by a later failure."""
    from importlib.metadata import distributions

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in distributions()}
    unmet = []
    for dist in distributions():
        name = canonicalize_name(dist.metadata["Name"])
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            need = canonicalize_name(req.name)
            if (name, need) in OVERRIDDEN:
                continue
            have = installed.get(need)
            if have is None or not req.specifier.contains(have, prereleases=True):
                unmet.append(f"{name} requires {req}, installed: {have or 'nothing'}")
    assert not unmet, "\n".join(sorted(set(unmet)))
