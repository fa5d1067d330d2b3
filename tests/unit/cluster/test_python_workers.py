"""flowers_job.cluster.python_workers: the zip importer's lazy invalidation (CPython gh-103200), in a
fresh interpreter as a PySpark worker uses it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.skipif(
        sys.version_info >= (3, 12), reason="Python 3.12 invalidates zip directories lazily itself"
    ),
    pytest.mark.tier("gate"),
]

SCRIPT = textwrap.dedent(
    """
    import importlib, sys, zipfile, zipimport
    archive = sys.argv[1]
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("first.py", "VALUE = 1")
    reads = []
    original = zipimport._read_directory
    zipimport._read_directory = lambda path: reads.append(path) or original(path)
    from flowers_job.cluster.python_workers import lazy_zip_directories
    assert lazy_zip_directories() and not lazy_zip_directories()  # once per process
    sys.path.insert(0, archive)
    import first
    before = len(reads)
    for _ in range(100):  # what a PySpark worker does before every task
        importlib.invalidate_caches()
    assert len(reads) == before, (before, reads)  # no directory read at invalidation
    with zipfile.ZipFile(archive, "a") as z:  # the archive changes on disk
        z.writestr("second.py", "VALUE = 2")
    importlib.invalidate_caches()
    import second  # found: the directory is read again at the next lookup
    assert (first.VALUE, second.VALUE) == (1, 2) and len(reads) == before + 1, reads
    print("ok")
    """
)


def test_invalidation_reads_nothing_and_a_changed_archive_is_still_seen(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "modules.zip")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
