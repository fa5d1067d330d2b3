"""The package's shape, checked on its source (no imports, no Spark): small modules, short
functions on the rank side, each loader in one module, and no private name crossing modules.

These hold the design of docs/architecture.md in place: a loader is one module behind
:class:`flowers_job.loaders.base.Loader`, and the pipeline and the training loop never ask
which loader they have.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from flowers_job.loaders import LOADERS

pytestmark = pytest.mark.tier("gate")

PACKAGE = Path(__file__).resolve().parents[1] / "flowers_job"
MAX_MODULE_LINES = 500
MAX_TRAIN_FUNCTION_LINES = 60
LIBRARIES = {"petastorm": "petastorm", "streaming": "streaming"}
"""Loader name -> the top-level package of its library."""


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _name(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


def test_no_module_of_the_package_is_over_500_lines() -> None:
    long = {_name(p): n for p in _modules() if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_of_the_rank_side_is_over_60_lines() -> None:
    long = {
        f"{_name(path)}:{node.name}": node.end_lineno - node.lineno + 1
        for path in sorted((PACKAGE / "train").glob("*.py"))
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_TRAIN_FUNCTION_LINES
    }
    assert not long, f"functions in train/ over {MAX_TRAIN_FUNCTION_LINES} lines: {long}"


def _imports(tree: ast.Module) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("loader", sorted(LIBRARIES))
def test_each_loader_library_is_imported_by_its_own_module_only(loader: str) -> None:
    assert loader in LOADERS
    own = PACKAGE / "loaders" / f"{loader}.py"
    library = LIBRARIES[loader]
    outside = [
        _name(path)
        for path in _modules()
        if path != own
        and any(m == library or m.startswith(f"{library}.") for m in _imports(_tree(path)))
    ]
    assert not outside, f"{library} is imported outside {_name(own)}: {outside}"


def test_the_pipeline_and_the_loop_never_ask_which_loader_they_have() -> None:
    """No comparison with a loader's name and no import of a loader module outside
    ``loaders/``: they go through the registry and the interface."""
    names = set(LOADERS)
    offenders = []
    for path in _modules():
        if path.parent.name == "loaders":
            continue
        tree = _tree(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                strings = {
                    c.value
                    for c in [node.left, *node.comparators]
                    if isinstance(c, ast.Constant) and isinstance(c.value, str)
                }
                if strings & names:
                    offenders.append(f"{_name(path)}:{node.lineno} compares with {strings & names}")
        for module in _imports(tree):
            if module in {f"flowers_job.loaders.{n}" for n in names}:
                offenders.append(f"{_name(path)} imports {module}")
    assert not offenders, offenders


def test_no_private_name_crosses_modules() -> None:
    crossing = [
        f"{_name(path)}:{node.lineno} imports {node.module}.{alias.name}"
        for path in _modules()
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flowers_job")
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert not crossing, crossing


def _tier_marks(node: ast.AST) -> list[str]:
    """The tiers named by ``pytest.mark.tier("...")`` calls anywhere under ``node``."""
    return [
        str(call.args[0].value)
        for call in ast.walk(node)
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "tier"
        and call.args
        and isinstance(call.args[0], ast.Constant)
    ]


def test_every_test_file_names_its_tier() -> None:
    """Each test file's module-level ``pytestmark`` names its tier, ``gate`` or ``full``
    (docs/testing.md); a test may override it with its own mark. (tests/conftest.py also
    refuses, at collection, any test without one.)"""
    tests = Path(__file__).resolve().parent
    missing = {}
    for path in sorted(tests.glob("test_*.py")):
        tree = _tree(path)
        marks = [
            tier
            for node in tree.body
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
            for tier in _tier_marks(node.value)
        ]
        if len(marks) != 1 or marks[0] not in ("gate", "full"):
            missing[path.name] = marks
    assert not missing, f"test files without exactly one module tier (gate or full): {missing}"
