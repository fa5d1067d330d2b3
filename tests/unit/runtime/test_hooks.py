"""The one extension point for tests (:mod:`flowers_job.runtime.hooks`): without
``FLOWERS_JOB_HOOKS`` every hook point is a no-op; with it, the injector it names (a file or
a module) is called with the hook point's context; a bad value is an error naming the
variable; and the production package neither imports an injector nor knows any fault."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from flowers_job.runtime import hooks
from flowers_job.runtime.hooks import HOOKS_ENV, HooksError, hook, injector, wrap_batches
from tests.support.faults import ATTEMPT_ENV, INJECTOR, fault_env

pytestmark = [pytest.mark.timeout(120), pytest.mark.tier("gate")]

PACKAGE = Path(hooks.__file__).resolve().parents[1]
RECORDER = """
CALLS = []


def checkpoint_write(**context):
    CALLS.append(("checkpoint_write", context))


def rank_start(**context):
    CALLS.append(("rank_start", context))


def mid_epoch(batches, **context):
    CALLS.append(("mid_epoch", context))
    return [b * 10 for b in batches]
"""
"""An injector that records its calls (and defines no ``ingest_table_written``)."""


def _recorder(directory: Path, name: str = "recorder") -> Path:
    path = directory / f"{name}.py"
    path.write_text(RECORDER)
    return path


def test_without_the_variable_every_hook_point_is_a_noop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batches = iter([1, 2, 3])
    for unset in (None, ""):
        if unset is None:
            monkeypatch.delenv(HOOKS_ENV, raising=False)
        else:
            monkeypatch.setenv(HOOKS_ENV, unset)
        assert injector() is None
        hook("rank_start", rank=0, attempt=0)
        hook("checkpoint_write", epoch=1)
        hook("no such point")  # unchecked without an injector: no cost beyond the lookup
        assert wrap_batches(batches, rank=0, epoch=1, step=1) is batches


def test_a_file_injector_is_called_with_the_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(HOOKS_ENV, str(_recorder(tmp_path)))
    module = injector()
    assert module is not None and injector() is module  # loaded once per value
    hook("checkpoint_write", epoch=3)
    hook("rank_start", rank=1, attempt=2)
    hook("ingest_table_written", table="images")  # not defined by the injector: nothing
    assert wrap_batches([1, 2], rank=1, epoch=3, step=0) == [10, 20]
    assert module.CALLS == [
        ("checkpoint_write", {"epoch": 3}),
        ("rank_start", {"rank": 1, "attempt": 2}),
        ("mid_epoch", {"rank": 1, "epoch": 3, "step": 0}),
    ]
    with pytest.raises(ValueError, match="no hook point 'checkpoint_written'"):
        hook("checkpoint_written", epoch=3)
    # another value: that injector, loaded afresh
    monkeypatch.setenv(HOOKS_ENV, str(_recorder(tmp_path, "other")))
    other = injector()
    assert other is not None and other is not module
    hook("checkpoint_write", epoch=4)
    assert other.CALLS == [("checkpoint_write", {"epoch": 4})] and len(module.CALLS) == 3


def test_a_module_name_names_an_injector_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"recorder_{uuid.uuid4().hex}"
    _recorder(tmp_path, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(HOOKS_ENV, name)
    hook("checkpoint_write", epoch=5)
    module = injector()
    assert module is not None and module.__name__ == name
    assert module.CALLS == [("checkpoint_write", {"epoch": 5})]
    monkeypatch.delitem(sys.modules, name)


@pytest.mark.parametrize(
    "value",
    [
        "relative/injector.py",
        "/no/such/injector.py",
        "no_such_injector_module_3f1",
        "not a module",
        "broken",  # a file that raises when loaded
    ],
)
def test_a_bad_value_is_an_error_naming_the_variable(
    value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if value == "broken":
        broken = tmp_path / "broken.py"
        broken.write_text("raise ImportError('half an injector')\n")
        value = str(broken)
    monkeypatch.setenv(HOOKS_ENV, value)
    with pytest.raises(HooksError, match=re.escape(f"{HOOKS_ENV}={value!r}")) as err:
        hook("checkpoint_write", epoch=1)
    print(err.value)
    with pytest.raises(HooksError, match=re.escape(f"{HOOKS_ENV}={value!r}")):
        wrap_batches([], rank=0, epoch=1, step=0)


def test_the_tests_injector_gets_the_attempt_from_the_rank_start_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The injector, loaded by its path as a rank loads it: the attempt reaches it as the
    ``rank_start`` context, and an attempt-bound fault fires on that attempt only."""
    for name, value in fault_env("raise:1:2:1").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(ATTEMPT_ENV, "")  # restored after the test
    hook("rank_start", rank=1, attempt=0)
    assert list(wrap_batches(range(4), rank=1, epoch=2, step=2)) == [0, 1, 2, 3]
    hook("rank_start", rank=1, attempt=1)
    assert os.environ[ATTEMPT_ENV] == "1"
    with pytest.raises(RuntimeError, match=r"injected fault \(FLOWERS_JOB_FAULT=raise:1:2:1\)"):
        list(wrap_batches(range(4), rank=1, epoch=2, step=2))


def test_the_rank_imports_no_injector_and_the_package_knows_no_fault() -> None:
    """Even with ``FLOWERS_JOB_HOOKS`` set, importing the rank's modules loads no injector
    (only a hook point's call does); the hooks module imports neither pyspark nor torch; no
    module of the package names a fault setting."""
    code = (
        "import sys\n"
        "import flowers_job.runtime.hooks\n"
        "heavy = sorted(m for m in ('torch', 'pyspark') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
        "import flowers_job.train.rank, flowers_job.train.loop, flowers_job.train.checkpoint\n"
        "bad = [m for m in sys.modules if 'faults' in m or 'injector' in m or m[:5] == 'tests']\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, HOOKS_ENV: INJECTOR}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (PACKAGE / "faults.py").exists()
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        for word in ("FLOWERS_JOB_FAULT", "FLOWERS_JOB_INGEST_FAULT", "FLOWERS_JOB_ATTEMPT"):
            assert word not in text, f"{path.relative_to(PACKAGE.parent)} names {word}"
