"""The file MLflow runs to load the model ("models from code"), today's and the one every
model registered before the package's re-layout carries: both load in a fresh
interpreter where this version of the package is the one imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flowers_job.serving import model_code

pytestmark = pytest.mark.tier("gate")

OLD_ENTRY = '''"""MLflow "models from code" entry: the file logged as the pyfunc model's ``python_model``."""

from mlflow.models import set_model

from flowers_job.serving import FlowersClassifierModel

set_model(FlowersClassifierModel())
'''
"""``flowers_job/serving_entry.py`` as models registered up to 690ac85 carry it."""


@pytest.mark.parametrize("entry", ["today", "before the re-layout"])
def test_the_entry_file_sets_the_pyfunc_model(entry: str, tmp_path: Path) -> None:
    path = Path(str(model_code.__file__))
    if entry != "today":
        path = tmp_path / "serving_entry.py"
        path.write_text(OLD_ENTRY)
    code = (
        "import runpy, sys\n"
        "from mlflow.models import model\n"
        "runpy.run_path(sys.argv[1])\n"
        "from flowers_job.serving.pyfunc_model import FlowersClassifierModel\n"
        "assert isinstance(model.__mlflow_model__, FlowersClassifierModel), model.__mlflow_model__\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
