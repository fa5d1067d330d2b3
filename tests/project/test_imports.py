"""The package's import rules (docs/architecture.md, "Imports one way"), read from the source
with :mod:`ast`: every import counts, at module level, inside a function or under
``TYPE_CHECKING``.

- no import cycle between the package's modules, nor between its folders, which import
  down documented layers (:data:`LAYERS`);
- the rank side (``runtime/``, ``train/``, ``vision/``) imports neither ``driver/`` nor
  ``cluster/``, and importing the rank's entry module loads no pyspark;
- ``config/`` imports, of the package, only the storage location type (and the error base
  classes, which import nothing), and neither torch nor a loader;
- ``serving/`` imports neither ``train/`` nor ``ingest/``;
- at most 8 modules directly in ``flowers_job/``, no two modules with one stem, none over
  800 lines.

Each rule is a function of the import graph; the ``*_finds_*`` tests give each one a graph
that breaks it, so that a rule that stopped seeing anything would fail here too.
"""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

from tests.support import ROOT_DIR

pytestmark = pytest.mark.tier("gate")

PACKAGE = ROOT_DIR / "flowers_job"
RANK_SIDE = ("flowers_job.runtime", "flowers_job.train", "flowers_job.vision")
DRIVER_SIDE = ("flowers_job.driver", "flowers_job.cluster")
CONFIG_MAY_IMPORT = ("flowers_job.location", "flowers_job.errors")
CONFIG_MUST_NOT_IMPORT = ("torch", "flowers_job.loaders")
SERVING_MUST_NOT_IMPORT = ("flowers_job.train", "flowers_job.ingest")
RANK_ENTRY = "flowers_job.train.rank"
LAYERS = (
    ("__main__",),
    ("cli",),
    ("driver",),
    ("train", "ingest"),
    ("serving",),
    ("photos",),
    ("cluster",),
    ("loaders", "tracking"),
    ("vision", "tables"),
    ("config", "runtime"),
    ("location", "errors"),
)
"""The package's folders (and top-level modules) from the top down, as docs/architecture.md
lists them: each imports only from layers below its own."""
MAX_TOP_LEVEL_MODULES = 8
MAX_MODULE_LINES = 800
"""A backstop against a file that grows unnoticed, not a reason to split one: a module splits
where its content has two jobs."""

Graph = dict[str, set[str]]
"""Module -> the modules and packages it imports (dotted names; third-party ones too)."""


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path) -> Graph:
    """Every module of ``package`` and what it imports, as dotted names: ``from a.b import c``
    counts as ``a.b.c`` when that is a module of the package, else as ``a.b``."""
    modules = {_module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    graph: Graph = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*up, *([base] if base else [])])
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.add(full if full in modules else base)
        found.discard(name)
        graph[name] = found
    return graph


def _inside(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(f"{p}.") for p in prefixes)


def cycle(graph: Graph) -> list[str] | None:
    """One import cycle among the graph's own modules (``[a, b, ..., a]``), or None."""
    own = {m: {d for d in deps if d in graph} for m, deps in graph.items()}
    try:
        graphlib.TopologicalSorter(own).prepare()
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return None


def package_graph(graph: Graph) -> Graph:
    """The graph of the package's folders: a module counts as its folder under
    ``flowers_job/`` (``flowers_job.loaders.petastorm.balanced`` -> ``flowers_job.loaders``),
    a top-level module as itself; the package's own ``__init__`` is left out."""

    def folder(name: str) -> str:
        return ".".join(name.split(".")[:2])

    packages: Graph = {}
    for m, deps in graph.items():
        if m == "flowers_job":
            continue
        mine = packages.setdefault(folder(m), set())
        mine.update(
            folder(d) for d in deps if d in graph and d != "flowers_job" and folder(d) != folder(m)
        )
    return packages


def crossings(graph: Graph, sources: Iterable[str], banned: Iterable[str]) -> list[str]:
    """``"a -> b"`` for every module under ``sources`` that imports something under
    ``banned``."""
    sources, banned = tuple(sources), tuple(banned)
    return sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if _inside(m, sources)
        for d in deps
        if _inside(d, banned)
    )


def config_imports(graph: Graph) -> list[str]:
    """What ``config/`` imports that it may not: of the package anything but
    :data:`CONFIG_MAY_IMPORT` and itself, and anything under :data:`CONFIG_MUST_NOT_IMPORT`."""
    return sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if _inside(m, ["flowers_job.config"])
        for d in deps
        if _inside(d, CONFIG_MUST_NOT_IMPORT)
        or (
            _inside(d, ["flowers_job"])
            and not _inside(d, ["flowers_job.config", *CONFIG_MAY_IMPORT])
        )
    )


@pytest.fixture(scope="module")
def graph() -> Graph:
    return import_graph(PACKAGE)


def test_no_import_cycle_between_the_modules(graph: Graph) -> None:
    assert cycle(graph) is None, f"import cycle: {' -> '.join(cycle(graph) or [])}"


def test_no_import_cycle_between_the_packages(graph: Graph) -> None:
    """Imports point one way between the folders too (docs/architecture.md has the order)."""
    found = cycle(package_graph(graph))
    assert found is None, f"import cycle between packages: {' -> '.join(found or [])}"


def upward(graph: Graph, layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """``"a -> b"`` for every import of the folders' graph (:func:`package_graph`) that does
    not go to a lower layer of ``layers``, and ``"a: no layer"`` for a folder not in them."""
    level = {f"flowers_job.{name}": i for i, names in enumerate(layers) for name in names}
    found = [f"{m}: no layer" for m in sorted(graph) if m not in level]
    found += [
        f"{m} -> {d}"
        for m, deps in sorted(graph.items())
        for d in sorted(deps)
        if m in level and d in level and level[d] <= level[m]
    ]
    return found


def test_the_folders_import_down_the_documented_layers(graph: Graph) -> None:
    assert not upward(package_graph(graph), LAYERS)


def test_the_rank_side_imports_neither_the_driver_nor_the_cluster(graph: Graph) -> None:
    assert not crossings(graph, RANK_SIDE, DRIVER_SIDE)


def test_config_imports_only_the_location_type_and_neither_torch_nor_a_loader(
    graph: Graph,
) -> None:
    assert not config_imports(graph)


def test_serving_imports_neither_training_nor_ingest(graph: Graph) -> None:
    assert not crossings(graph, ["flowers_job.serving"], SERVING_MUST_NOT_IMPORT)


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


# The rules see what they forbid: a package of a few files that breaks each one.


def _write(root: Path, files: dict[str, str]) -> Path:
    package = root / "flowers_job"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        for parent in path.relative_to(package).parents:
            (package / parent / "__init__.py").touch()
    return package


def test_cycle_finds_a_cycle_made_by_an_import_inside_a_function(tmp_path: Path) -> None:
    package = _write(
        tmp_path,
        {
            "a.py": "from flowers_job.b import x\n",
            "b.py": "def x():\n    from flowers_job import a\n",
            "c.py": "import flowers_job.a\n",
        },
    )
    assert cycle(import_graph(package)) in (
        ["flowers_job.a", "flowers_job.b", "flowers_job.a"],
        ["flowers_job.b", "flowers_job.a", "flowers_job.b"],
    )


def test_package_graph_finds_two_packages_that_import_each_other(tmp_path: Path) -> None:
    package = _write(
        tmp_path,
        {
            "tracking/run.py": "def log():\n    from flowers_job.serving.model import M\n",
            "serving/model.py": "M = 1\n",
            "serving/ref.py": "from flowers_job.tracking import run\n",
        },
    )
    graph = import_graph(package)
    assert cycle(graph) is None  # no cycle between modules
    assert cycle(package_graph(graph)) in (
        ["flowers_job.tracking", "flowers_job.serving", "flowers_job.tracking"],
        ["flowers_job.serving", "flowers_job.tracking", "flowers_job.serving"],
    )


def test_upward_finds_an_import_up_a_layer_and_a_folder_without_one() -> None:
    graph = {
        "flowers_job.config": {"flowers_job.errors"},
        "flowers_job.errors": {"flowers_job.config"},
        "flowers_job.extra": set(),
    }
    assert upward(graph, (("config",), ("errors",))) == [
        "flowers_job.extra: no layer",
        "flowers_job.errors -> flowers_job.config",
    ]


def test_crossings_find_the_rank_side_importing_the_driver(tmp_path: Path) -> None:
    package = _write(
        tmp_path,
        {
            "train/loop.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from flowers_job.driver.restarts import R\n",
            "driver/restarts.py": "R = 1\n",
            "serving/scorer.py": "from ..ingest import job\n",
            "ingest/job.py": "",
        },
    )
    graph = import_graph(package)
    assert crossings(graph, RANK_SIDE, DRIVER_SIDE) == [
        "flowers_job.train.loop -> flowers_job.driver.restarts"
    ]
    assert crossings(graph, ["flowers_job.serving"], SERVING_MUST_NOT_IMPORT) == [
        "flowers_job.serving.scorer -> flowers_job.ingest.job"
    ]


def test_config_imports_finds_a_loader_and_torch(tmp_path: Path) -> None:
    package = _write(
        tmp_path,
        {
            "config/data.py": "import torch\nfrom flowers_job.location import L\n"
            "def f():\n    from flowers_job.loaders import LOADERS\n",
            "location.py": "L = 1\n",
            "loaders/__init__.py": "LOADERS = {}\n",
        },
    )
    assert config_imports(import_graph(package)) == [
        "flowers_job.config.data -> flowers_job.loaders",
        "flowers_job.config.data -> torch",
    ]
