"""flowers_job.cluster.python_daemon: the local session's Python workers are forked from a
daemon that has already imported the job's task libraries."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from flowers_job import loaders
from flowers_job.cluster.python_daemon import PRELOAD, preload, preload_loaders
from flowers_job.loaders.streaming.library import TASK_MODULES

EXPECTED = (*PRELOAD, *TASK_MODULES)
"""What a worker forked from the daemon finds imported (Streaming's, where it is installed)."""

pytestmark = pytest.mark.tier("gate")


def test_a_workers_first_task_finds_the_task_libraries_imported(spark: Any) -> None:
    def first_task(batches: Any) -> Any:
        import os
        import sys

        found = ",".join(name for name in EXPECTED if name in sys.modules)  # before any import
        # Streaming without its example datasets (import_streaming): they import transformers'
        # tokenizer registry and scikit-learn
        heavy = ",".join(m for m in ("transformers.models.auto", "sklearn") if m in sys.modules)
        for batch in batches:
            yield batch.assign(found=found, heavy=heavy, daemon=os.getppid())

    rows = (
        spark.range(2)
        .repartition(2)
        .mapInPandas(first_task, "id long, found string, heavy string, daemon long")
        .collect()
    )
    installed = [name for name in EXPECTED if find_spec(name.partition(".")[0])]
    assert "pandas" in installed and {row.found for row in rows} == {",".join(installed)}, rows
    assert {row.heavy for row in rows} == {""}, rows
    assert len({row.daemon for row in rows}) == 1, rows  # both forked by the one daemon


def test_a_library_not_installed_is_skipped_and_one_that_fails_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "flowers_broken_library.py").write_text("raise RuntimeError('broken here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    names = ("json", "flowers_no_such_library", "flowers_broken_library")
    assert preload(names) == ["json"]
    err = capsys.readouterr().err
    assert "flowers_no_such_library" not in err
    assert "flowers_broken_library not preloaded: RuntimeError('broken here')" in err


def test_a_loader_whose_libraries_fail_to_import_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "flowers_broken_loader.py").write_text(
        "def load():\n    raise ImportError('broken here')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(loaders, "TASK_LIBRARIES", {"broken": "flowers_broken_loader:load"})
    assert preload_loaders() == []
    err = capsys.readouterr().err
    assert "broken's libraries not preloaded: ImportError('broken here')" in err
