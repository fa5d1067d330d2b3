"""What the tests share beyond pytest's fixtures (tests/conftest.py): where the repository and
the real photos are, and helpers in one module per concern: :mod:`.data` (photo samples,
tables, loaders), :mod:`.processes` (the CLI, servers, the processes a run leaves),
:mod:`.packaging` (uv and the package index), :mod:`.faults` (the fault injector),
:mod:`.model_registry` (MLflow servers and registered models), :mod:`.s3` (an S3 API server),
:mod:`.leftovers` (the pytest plugin that fails a session leaving a process behind).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT_DIR = Path(__file__).resolve().parents[2]
"""The folder that holds ``tests/``: the repository, or the DBR suite's copy of ``tests/``,
``configs/`` and ``pyproject.toml`` (Makefile, dbr-suite)."""
REPO = Path(os.environ.get("FLOWERS_REPO_ROOT") or ROOT_DIR)
"""The repository (``FLOWERS_REPO_ROOT`` when the tests run from a copy): its tools/, jobs/
and deployment files."""
PHOTOS = Path(
    os.environ.get("FLOWERS_PHOTOS", ROOT_DIR.parent / "shared" / "data" / "flower_photos")
)
LABELS = ["daisy", "dandelion", "roses", "sunflowers", "tulips"]
