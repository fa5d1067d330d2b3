"""``data.loader``: the loader that cannot run on this stack is refused before Spark starts.

The default environment and the Databricks ones (pyarrow >= 19, NumPy 2) run only Streaming,
so there the refusal is real; the legacy Petastorm environment runs both. There one test
fakes the installed versions (the only stand-in here): a real pyarrow 19 cannot be installed
next to the pyarrow 14 that Petastorm needs.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from packaging.version import Version

from flowers_job.config import ConfigError, JobConfig, load_config
from flowers_job.loaders import LOADERS, loader_problem, resolve_loader
from flowers_job.loaders.petastorm import loader as petastorm_loader
from tests.support.processes import run_cli

pytestmark = pytest.mark.tier("gate")


def _cfg(tmp_path: Path, loader: str) -> JobConfig:
    return load_config(None, [f"data.loader={loader}"], **{"paths.output_dir": tmp_path})


def test_an_unknown_loader_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"  data\.loader: Input should be 'auto'"):
        _cfg(tmp_path, "tfrecord")


@pytest.mark.parametrize("name", LOADERS)
def test_each_loader_resolves_here_or_is_refused_naming_the_field(
    tmp_path: Path, name: str
) -> None:
    problem = loader_problem(name)
    if problem is None:
        assert resolve_loader(_cfg(tmp_path, name))[0].data.loader == name
    else:
        with pytest.raises(ConfigError) as err:
            resolve_loader(_cfg(tmp_path, name))
        message = str(err.value)
        assert "data.loader" in message and problem in message


def test_auto_is_delta_where_it_runs_else_streaming_else_petastorm(tmp_path: Path) -> None:
    """Path tables on classic Spark: the first of delta, streaming, petastorm that imports
    here (the default environment: delta; the Databricks ones: streaming; the legacy one:
    petastorm)."""
    resolved = resolve_loader(_cfg(tmp_path, "auto"))[0].data.loader
    assert resolved == next(name for name in LOADERS if loader_problem(name) is None)
    assert list(LOADERS) == ["delta", "streaming", "petastorm"]


def test_petastorm_on_a_new_pyarrow_names_the_version_and_the_loader_that_can(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DBR 17.3 versions, with petastorm 0.13.1 installed by a user, faked in the version
    lookup only (see the module docstring)."""
    if loader_problem("streaming") is not None:
        pytest.skip(f"needs the streaming loader: {loader_problem('streaming')}")
    real = petastorm_loader._version
    fake = {"pyarrow": Version("19.0.1"), "numpy": Version("2.1.3"), "petastorm": Version("0.13.1")}
    monkeypatch.setattr(petastorm_loader, "_version", lambda dist: fake.get(dist) or real(dist))
    with pytest.raises(ConfigError) as err:
        resolve_loader(_cfg(tmp_path, "petastorm"))
    message = str(err.value)
    assert "data.loader: 'petastorm' cannot run on this stack" in message
    assert "pyarrow 19.0.1" in message and "pyarrow < 15" in message
    working = next(name for name in LOADERS if loader_problem(name) is None)
    assert working in ("delta", "streaming")  # delta where deltalake is installed
    assert f"use data.loader={working} instead" in message
    assert resolve_loader(_cfg(tmp_path, "auto"))[0].data.loader == working


def test_cli_refuses_a_loader_this_stack_cannot_run_before_spark_starts(tmp_path: Path) -> None:
    broken = [name for name in LOADERS if loader_problem(name) is not None]
    if not broken:
        pytest.skip("every loader runs on this stack (the legacy Petastorm environment)")
    t0 = time.perf_counter()
    proc = run_cli(
        "run",
        "--images",
        str(tmp_path),
        "--output-dir",
        str(tmp_path / "out"),
        "--set",
        f"data.loader={broken[0]}",
        timeout=120,
    )
    print(f"data.loader={broken[0]} refused by the CLI in {time.perf_counter() - t0:.1f} s")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"data.loader: '{broken[0]}' cannot run on this stack" in proc.stderr
    assert "Ivy" not in proc.stderr and "SparkContext" not in proc.stderr  # no JVM started
    assert not (tmp_path / "out").exists()


def test_checking_the_loaders_prints_no_warning_from_their_libraries() -> None:
    """What every run does before Spark starts, in a new process that shows every warning
    once: each loader that runs here imports its library (Petastorm's import alone uses
    pyarrow's deprecated ``LocalFileSystem`` and distutils' ``LooseVersion``), and nothing of
    it reaches stderr."""
    code = textwrap.dedent(
        """
        from flowers_job.loaders import LOADERS, loader_problem
        print({name: loader_problem(name) for name in LOADERS})
        """
    )
    proc = subprocess.run(
        [sys.executable, "-W", "default", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]


def test_streaming_imports_without_its_example_datasets_which_still_load_when_used() -> None:
    """``import_streaming`` in a new process: what the loader uses imports, the example
    datasets' transformers tokenizers do not; an example dataset, asked for, is the real one."""
    if loader_problem("streaming") is not None:
        pytest.skip(f"needs the streaming loader: {loader_problem('streaming')}")
    code = textwrap.dedent(
        """
        import sys
        from flowers_job.loaders.streaming.streaming_loader import import_streaming
        streaming = import_streaming()
        from streaming import StreamingDataLoader, StreamingDataset
        from streaming.base.converters import dataframe_to_mds
        skipped = [m for m in ("streaming.text.c4", "transformers.models.auto") if m in sys.modules]
        assert not skipped, skipped
        from streaming.text import StreamingC4
        import streaming.vision.cifar10
        assert StreamingC4.__module__ == "streaming.text.c4"
        assert streaming.vision.StreamingCOCO.__module__ == "streaming.vision.coco"
        assert streaming.multimodal.StreamingInsideWebVid.__name__ == "StreamingInsideWebVid"
        for name in ("text", "vision", "multimodal"):
            real = sys.modules["streaming." + name]
            assert real is getattr(streaming, name) and real.__file__.endswith("__init__.py")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
