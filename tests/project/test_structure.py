"""The package's shape, checked on its source (no Spark): short functions (on the rank side with
their docstrings, elsewhere without), each loader in its own sub-package, no private name crossing
modules, and every test file with its tier. The import rules and the module sizes:
tests/project/test_imports.py.

These hold the design of docs/architecture.md in place: a loader is one sub-package behind
:class:`flowers_job.loaders.base.Loader`, resolved once, and the pipeline and the training
loop never ask which loader they have.
"""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest

from flowers_job.config.data import LoaderName
from flowers_job.loaders import LOADERS
from tests.support import ROOT_DIR

pytestmark = pytest.mark.tier("gate")

PACKAGE = ROOT_DIR / "flowers_job"
MAX_TRAIN_FUNCTION_LINES = 60
MAX_FUNCTION_LINES = 60
LIBRARIES = {"petastorm": "petastorm", "streaming": "streaming", "delta": "deltalake"}
"""Loader name -> the top-level package of its library."""


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _name(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


def test_the_configs_loader_names_are_the_registered_loaders() -> None:
    """``data.loader`` is checked by the config without importing the registry: its
    ``Literal`` names what :data:`~flowers_job.loaders.LOADERS` registers, and 'auto'."""
    assert set(typing.get_args(LoaderName)) == {"auto", *LOADERS}


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


def _docstring_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = node.body[0] if node.body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
        and first.end_lineno is not None
    ):
        return first.end_lineno - first.lineno + 1
    return 0


def test_no_function_of_the_package_is_over_60_lines_without_its_docstring() -> None:
    long = {
        f"{_name(path)}:{node.name}": size
        for path in _modules()
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and (size := node.end_lineno - node.lineno + 1 - _docstring_lines(node))
        > MAX_FUNCTION_LINES
    }
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines besides their docstring: {long}"


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
    own = PACKAGE / "loaders" / loader
    library = LIBRARIES[loader]
    outside = [
        _name(path)
        for path in _modules()
        if own not in path.parents
        and any(m == library or m.startswith(f"{library}.") for m in _imports(_tree(path)))
    ]
    assert not outside, f"{library} is imported outside {_name(own)}: {outside}"


def test_the_pipeline_and_the_loop_never_ask_which_loader_they_have() -> None:
    """No comparison with a loader's name and no import of a loader module outside
    ``loaders/``: they go through the resolved loader and its interface."""
    names = set(LOADERS)
    offenders = []
    for path in _modules():
        if PACKAGE / "loaders" in path.parents:
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
            if any(module.startswith(f"flowers_job.loaders.{n}") for n in names):
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
    tests = Path(__file__).resolve().parents[1]
    missing = {}
    for path in sorted(tests.rglob("test_*.py")):
        tree = _tree(path)
        marks = [
            tier
            for node in tree.body
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
            for tier in _tier_marks(node.value)
        ]
        if len(marks) != 1 or marks[0] not in ("gate", "full"):
            missing[str(path.relative_to(tests))] = marks
    assert not missing, f"test files without exactly one module tier (gate or full): {missing}"
