"""The package's import rules (docs/architecture.md, "Imports one way").

The layer rules are import-linter contracts (``[tool.importlinter]`` in pyproject.toml),
which ``make lint`` checks with ``lint-imports``: the folders import down the documented
layers, no cycle between sibling modules or folders, the rank side imports neither
``driver/`` nor ``cluster/``, ``config/`` imports only the location type and the errors
(and neither torch nor a loader), ``serving/`` imports neither ``train/`` nor ``ingest/``.
Here: that each contract sees what it forbids (a copy of the package with one import added
breaks it), and what a contract cannot say: importing the rank's entry module
loads no pyspark at runtime; at most 8 modules directly in ``flowers_job/``, no two modules
with one stem, none over 800 lines.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT_DIR

pytestmark = pytest.mark.tier("gate")

PACKAGE = ROOT_DIR / "flowers_job"
RANK_ENTRY = "flowers_job.train.rank"
MAX_TOP_LEVEL_MODULES = 8
MAX_MODULE_LINES = 800
"""A backstop against a file that grows unnoticed, not a reason to split one: a module splits
where its content has two jobs."""
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the package under ``root`` with this repository's contracts."""
    if root != ROOT_DIR:
        shutil.copy(ROOT_DIR / "pyproject.toml", root / "pyproject.toml")
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo"],
        cwd=root,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_contracts_hold() -> None:
    """``make lint`` runs the same; here too, so that a test run alone sees a broken rule."""
    done = _lint_imports(ROOT_DIR)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "Contracts: 5 kept, 0 broken." in done.stdout, done.stdout[-3000:]


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        (
            "train/loop.py",
            "import flowers_job.cluster.session",
            "the rank side imports neither the driver nor the cluster",
        ),
        ("config/data.py", "import torch", "neither torch nor a loader"),
        (
            "serving/batch_predict.py",
            "from flowers_job.ingest import job",
            "the served model imports neither training nor ingest",
        ),
        (
            "tables/table_ref.py",
            "import flowers_job.photos.listing",
            "the folders import down the documented layers",
        ),
        (
            "loaders/position.py",
            "def _later() -> None:\n    import flowers_job.loaders.base",
            "no import cycle between sibling modules or folders",
        ),
    ],
    ids=["rank-side", "config", "serving", "layers", "acyclic"],
)
def test_each_contract_sees_the_import_it_forbids(
    tmp_path: Path, module: str, line: str, broken: str
) -> None:
    """One import added by hand (inside a function counts too) breaks its contract."""
    shutil.copytree(PACKAGE, tmp_path / "flowers_job")
    with (tmp_path / "flowers_job" / module).open("a") as f:
        f.write(f"\n{line}\n")
    done = _lint_imports(tmp_path)
    assert done.returncode != 0, done.stdout[-3000:]
    verdicts = [v for v in done.stdout.splitlines() if v.endswith(("KEPT", "BROKEN"))]
    assert [v for v in verdicts if v.endswith("BROKEN")], done.stdout[-3000:]
    assert any(broken in v for v in verdicts if v.endswith("BROKEN")), verdicts


def test_importing_the_rank_entry_loads_no_pyspark() -> None:
    """The module TorchDistributor's ranks import (its launcher may load pyspark itself)."""
    code = (
        f"import sys, {RANK_ENTRY}\n"
        "loaded = sorted(m for m in sys.modules if m == 'pyspark' or m.startswith('pyspark.'))\n"
        "assert not loaded, loaded"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_top_level_holds_few_modules_and_no_two_modules_share_a_stem() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    stems: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            stems.setdefault(path.stem, []).append(str(path.relative_to(PACKAGE)))
    assert not {s: p for s, p in stems.items() if len(p) > 1}


def test_no_module_is_over_the_backstop() -> None:
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
