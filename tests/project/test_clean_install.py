"""The built wheel, installed as a new user installs it, runs a job end to end.

A fresh virtual environment gets ``<wheel>[local,streaming]`` and nothing else: no lock
file, no constraints, so the resolver picks the newest versions that the wheel's declared
requirements allow. That environment's ``flowers-job run`` then trains on a sample of the
real photos in local mode (2 processes, Mosaic Streaming: Petastorm cannot run on the
pyarrow >= 15 and NumPy 2 that a fresh resolve brings) and rank 0 writes the test report.
A requirement missing from the wheel's metadata, or a release that breaks the job, fails
here before a user finds it. (A module the package imports without declaring it can still
pass here when another requirement pulls it in, as the full mlflow of ``[local]`` pulls
scikit-learn and matplotlib: tests/project/test_bundle.py's import walk catches that.)

uv creates and fills the environment (``requirements/lock.txt`` has it), from its default
cache (``~/.cache/uv``), with symbolic links into that cache (``--link-mode symlink``): the
same files a user's install holds, in about 0.25 GB of the test's temp dir wherever that
is. uv's default, hard links, falls back to a full copy (6.7 GB) where the temp dir is on
another file system than the cache (a tmpfs ``/tmp``): a cause that fits a CI run that
failed in both suites at once, this test among them. Measured on the 2-core machine, shared
(load 5-7), with hard links: the fixture (wheel build, venv,
install, ``uv pip check``) 48-81 s with a cold uv cache and 38 s with a warm one (``uv pip
install`` alone: 56 s and 30 s; pyspark is an sdist, which uv downloads and builds again
every time: the index's responses here revalidate as modified), the job 144-192 s, the
whole test 228-284 s (6-11 s of it removing the environment). With symbolic links, alone
on the quiet machine: 107 s in all, 30 s of it the fixture, 4 s the removal.
``FLOWERS_WHEEL`` names an already built wheel to install instead of building one.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import LABELS, ROOT_DIR
from tests.support.data import sample_photos
from tests.support.packaging import clean_env, project_wheel, run, uv_bin, uv_failure

pytestmark = [
    pytest.mark.network,
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.tier("full"),
]

ROOT = ROOT_DIR
PER_LABEL = 8
"""Photos per label: 40 in all, enough for a test split on both ranks."""
JOB = [
    "data.loader=streaming",
    "data.image_size=32",
    "train.epochs=1",
    "train.per_device_batch_size=8",
    "distributed.num_processes=2",
    "distributed.local_mode=true",
    "distributed.timeout_seconds=300",
]
SHOWN = (
    "torch",
    "torchvision",
    "numpy",
    "pandas",
    "pyarrow",
    "pyspark",
    "delta-spark",
    "mlflow",
    "mosaicml-streaming",
    "scikit-learn",
    "matplotlib",
    "pydantic",
)
"""Packages whose resolved versions the failure messages name."""


@pytest.fixture
def venv(pypi: None, tmp_path: Path) -> Iterator[Path]:
    """A fresh virtual environment holding the wheel with [local,streaming] and exactly
    what the resolver chose for its requirements; removed after the test."""
    uv = uv_bin()
    wheel = project_wheel(uv, tmp_path)
    env = tmp_path / "venv"
    try:
        created = run(
            [uv, "venv", "--no-config", "--python", sys.executable, str(env)], 120, tmp_path
        )
        assert created.returncode == 0, created.stderr
        python = str(env / "bin" / "python")
        install = [
            uv,
            "pip",
            "install",
            "--no-config",
            "--link-mode",
            "symlink",
            "--python",
            python,
        ]
        proc = run([*install, f"{wheel}[local,streaming]"], 600, tmp_path, clean_env())
        assert proc.returncode == 0, f"uv pip install failed: {uv_failure(proc.stderr)}"
        check = run([uv, "pip", "check", "--python", python], 60, tmp_path, clean_env())
        assert check.returncode == 0, check.stdout + check.stderr
        yield env
    finally:
        shutil.rmtree(env, ignore_errors=True)


def _versions(env: Path) -> dict[str, str]:
    code = (
        "import json, sys\nfrom importlib import metadata\n"
        "print(json.dumps({n: metadata.version(n) for n in sys.argv[1:]}))"
    )
    proc = run([str(env / "bin" / "python"), "-c", code, *SHOWN], 60, env.parent)
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout))


def _figures(env: Path, summary: dict[str, object]) -> list[str]:
    """The run's ``figures/`` artifacts, read with the environment's own MLflow (the store's
    schema is that MLflow's, which may be newer than this one's). Some MLflow 3 releases
    (3.0.1) resolve a run's artifacts through the process-wide store, not the client's:
    both point at the run's store."""
    code = (
        "import json, sys, mlflow\n"
        "mlflow.set_tracking_uri(sys.argv[1])\n"
        "client = mlflow.MlflowClient(tracking_uri=sys.argv[1])\n"
        "print(json.dumps(sorted(a.path for a in client.list_artifacts(sys.argv[2], 'figures'))))"
    )
    args = [str(summary["mlflow_tracking_uri"]), str(summary["mlflow_run_id"])]
    proc = run([str(env / "bin" / "python"), "-c", code, *args], 120, env.parent, clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return list(json.loads(proc.stdout))


def test_the_wheel_with_only_its_declared_requirements_runs_a_job(
    venv: Path, tmp_path: Path
) -> None:
    versions = _versions(venv)
    where = run(
        [str(venv / "bin" / "python"), "-c", "import flowers_job; print(flowers_job.__file__)"],
        60,
        tmp_path,
    )
    assert str(venv) in where.stdout, f"flowers_job is not the installed wheel: {where.stdout}"
    photos = sample_photos(tmp_path / "photos", per_label=PER_LABEL)
    out = tmp_path / "out"
    sets = [arg for setting in JOB for arg in ("--set", setting)]
    cli = [str(venv / "bin" / "flowers-job"), "run", "--images", str(photos), "--output-dir"]
    proc = run([*cli, str(out), *sets], 600, tmp_path, clean_env())
    assert proc.returncode == 0, (
        f"flowers-job run failed with {versions}:\n{proc.stderr[-6000:]}\n{proc.stdout[-2000:]}"
    )

    summary = json.loads((out / "summary.json").read_text())
    images = PER_LABEL * len(LABELS)
    assert summary["loader"] == "streaming" and summary["world_size"] == 2
    assert summary["train_rows"] + summary["val_rows"] + summary["test_rows"] == images
    assert summary["test"]["rows"] == summary["test_rows"] > 0
    assert 0.0 <= summary["test_accuracy"] <= 1.0
    assert summary["registered_model_name"] == "flowers_classifier"
    assert summary["registered_model_version"] == 1
    assert _figures(venv, summary) == [
        "figures/confusion_matrix.png",
        "figures/curves.png",
        "figures/worst_mistakes.png",
    ], versions
