"""flowers_job.cluster.python_daemon: the local session's Python workers are forked from a
daemon that has already imported the job's task libraries."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from flowers_job.cluster.python_daemon import PRELOAD, preload

pytestmark = pytest.mark.tier("gate")


def test_a_workers_first_task_finds_the_task_libraries_imported(spark: Any) -> None:
    def first_task(batches: Any) -> Any:
        import os
        import sys

        found = ",".join(name for name in PRELOAD if name in sys.modules)  # before any import
        for batch in batches:
            yield batch.assign(found=found, daemon=os.getppid())

    rows = (
        spark.range(2)
        .repartition(2)
        .mapInPandas(first_task, "id long, found string, daemon long")
        .collect()
    )
    installed = [name for name in PRELOAD if find_spec(name.partition(".")[0])]
    assert "pandas" in installed and {row.found for row in rows} == {",".join(installed)}, rows
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
