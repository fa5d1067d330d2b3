"""Test data: samples of the real photos, copies of Delta tables, the loaders a test runs with."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.support import LABELS, PHOTOS

LOADERS = ("petastorm", "streaming")
"""The loaders that write a loader cache: the ``loader`` fixture's (tests/conftest.py), whose
tests run each loader's cache, fault and end-to-end paths."""
TABLE_LOADERS = ("delta",)
"""The loaders whose ranks read the table itself (no cache): their own tests
(tests/unit/loaders/test_delta_reader.py, tests/integration/test_delta_loader.py), and the
end-to-end and restart tests that name them. They run wherever they can run, whatever
``FLOWERS_TEST_LOADERS`` selects (it selects among the cache loaders)."""
ALL_LOADERS = (*LOADERS, *TABLE_LOADERS)
SELECTED_LOADERS = tuple(
    name.strip()
    for name in os.environ.get("FLOWERS_TEST_LOADERS", ",".join(LOADERS)).split(",")
    if name.strip()
)
"""Loaders the loader-parametrized tests run with: ``FLOWERS_TEST_LOADERS`` (comma-separated),
all of them by default. The Makefile's local, DBR and cluster suites run streaming and the
Petastorm suite, in its own environment, petastorm, so that each loader's end-to-end and
fault tests run once per environment that can run it."""
DELTA_STATE_CONF = {"spark.databricks.delta.snapshotPartitions": "2"}
"""Spark settings of a session the tests start outside the job's local one (a Connect
server, a cluster's spark-submit): Delta rebuilds a table's state in 2 partitions, as the
job's local session does (``flowers_job.cluster.session``), not 50, which on the tests' few
cores is waves of empty tasks per read or commit (a VACUUM of a 3-row table over Connect:
12 s -> 2-3 s; a cluster fault run on two 1-core executors: some 800 tasks of nothing)."""
SMALL_TABLES_CONF = {**DELTA_STATE_CONF, "spark.sql.shuffle.partitions": "2"}
""":data:`DELTA_STATE_CONF`, and the tests' small tables' shuffles in 2 partitions, not 200."""


def sample_photos(dest: Path, per_label: int, offset: int = 0) -> Path:
    """Copy ``per_label`` photos of each label (sorted by name, from ``offset``) into ``dest``."""
    if not PHOTOS.is_dir():
        pytest.fail(f"the real photos are missing: {PHOTOS} (set FLOWERS_PHOTOS)")
    for label in LABELS:
        (dest / label).mkdir(parents=True, exist_ok=True)
        for src in sorted((PHOTOS / label).glob("*.jpg"))[offset : offset + per_label]:
            shutil.copy2(src, dest / label / src.name)
    return dest


def copy_tables(tables: Path, out: Path) -> Path:
    """``out`` (an output dir) holding a copy of the Delta tables of ``tables``, for a test
    that trains on them without ingesting again: a Delta table's paths are relative to its
    folder, so a copied folder is the same table (same versions and commit metadata)."""
    shutil.copytree(tables / "tables", out / "tables")
    return out


def loader_skip_reason(name: str) -> str | None:
    """Why the tests of loader ``name`` do not run here (None: they do)."""
    from flowers_job.loaders import loader_problem

    problem = loader_problem(name)
    if problem is not None:
        return f"data.loader={name} cannot run on this stack: {problem}"
    if name not in SELECTED_LOADERS and name not in TABLE_LOADERS:
        return f"FLOWERS_TEST_LOADERS={','.join(SELECTED_LOADERS)} leaves out {name}"
    return None


def needs_loader(name: str) -> pytest.MarkDecorator:
    """Skip, naming why, where loader ``name`` cannot run on this stack (whatever
    ``FLOWERS_TEST_LOADERS`` selects: for the tests of one loader's own parts)."""
    from flowers_job.loaders import loader_problem

    problem = loader_problem(name)
    return pytest.mark.skipif(
        problem is not None, reason=f"data.loader={name} cannot run on this stack: {problem}"
    )


DAY_SAMPLE_PER_LABEL = 40
"""Photos per label of the sample a day's change is made to (:func:`day_change`): 200 in
all, so that its 4 files are 2% of them."""


def day_change(images: Path, day: int) -> None:
    """A day's change: two photos added (in two labels), one removed, one rewritten in
    place with another photo's bytes (the same path and row id, new content)."""
    for label in LABELS[:2]:
        src = sorted((PHOTOS / label).glob("*.jpg"))[DAY_SAMPLE_PER_LABEL + day]
        shutil.copy(src, images / label / f"day{day}-{src.name}")
    removed = sorted((images / LABELS[2]).glob("*.jpg"))[day]
    removed.unlink()
    rewritten = sorted((images / LABELS[3]).glob("*.jpg"))[day]
    rewritten.write_bytes(
        sorted((PHOTOS / LABELS[3]).glob("*.jpg"))[DAY_SAMPLE_PER_LABEL + 10 + day].read_bytes()
    )
