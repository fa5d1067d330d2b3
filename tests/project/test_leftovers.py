"""The suite's process hygiene: a pytest session that leaves a process running fails, naming it,
and the process is killed (:mod:`tests.support.leftovers`, run here in inner pytest sessions
of their own); a server's process group is stopped whole, a member that ignores SIGTERM
included (:func:`tests.support.processes.stop_group`, ``tools/cluster.py``'s
``stop_process``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import REPO, ROOT_DIR
from tests.support.leftovers import SESSION_ENV
from tests.support.processes import (
    IGNORES_SIGTERM,
    KILL_SECONDS,
    SLEEPER,
    process_gone,
    wait_for_file,
)

pytest_plugins = ["pytester"]
pytestmark = [pytest.mark.tier("gate"), pytest.mark.timeout(180)]

INNER_SECONDS = 120.0
"""Bound on an inner pytest session, seconds (about 3 s on the 2-core machine)."""


def _inner_session(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, body: str
) -> pytest.RunResult:
    """An inner pytest session (its own process) running ``body`` as its one test file, with
    the leftover check and a 1 s grace."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT_DIR), os.environ.get("PYTHONPATH")]))
    )
    pytester.makepyfile(test_inner=body)
    return pytester.runpytest_subprocess(
        *("-p", "tests.support.leftovers", "--leftover-grace=1", "-p", "no:cacheprovider"),
        timeout=INNER_SECONDS,
    )


def test_a_server_left_running_fails_the_session_is_named_and_killed(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid_file = pytester.path / "leftover.pid"
    result = _inner_session(
        pytester,
        monkeypatch,
        f"""
import subprocess, sys

def test_leaves_a_server_running():
    proc = subprocess.Popen([sys.executable, "-c", {SLEEPER!r}], start_new_session=True)
    open({str(pid_file)!r}, "w").write(str(proc.pid))
""",
    )
    pid = int(pid_file.read_text())
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.assert_outcomes(passed=1)  # the test itself passed: the check failed the session
    result.stdout.fnmatch_lines(
        [
            "*= processes left behind =*",
            "1 process(es) this session started were still alive 1 s after its end*",
            f"pid {pid} (group {pid}), * s old, started while "
            f"test_inner.py::test_leaves_a_server_running ran, killed: *{SLEEPER}",
        ]
    )
    assert "1 left behind" in result.stdout.lines[-1]
    assert process_gone(pid)


def test_an_orphaned_server_is_found_by_the_session_mark(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server whose parent has exited (re-parented to init: no descendant of pytest, as the
    tracking server's uvicorn was) is found by :data:`SESSION_ENV` in its environment."""
    pid_file = pytester.path / "orphan.pid"
    spawn = (
        "import subprocess, sys; "
        f"p = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}], start_new_session=True, "
        "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
        "print(p.pid)"
    )
    result = _inner_session(
        pytester,
        monkeypatch,
        f"""
import subprocess, sys
import psutil

def test_leaves_an_orphan():
    out = subprocess.run(
        [sys.executable, "-c", {spawn!r}], capture_output=True, text=True, check=True, timeout=60
    )
    pid = int(out.stdout)
    assert pid not in [p.pid for p in psutil.Process().children(recursive=True)]
    open({str(pid_file)!r}, "w").write(str(pid))
""",
    )
    pid = int(pid_file.read_text())
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.stdout.fnmatch_lines(
        [f"pid {pid} (group {pid}), * s old, started while *test_leaves_an_orphan ran, killed: *"]
    )
    assert process_gone(pid)


def test_a_session_that_stops_its_server_passes(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    words = len(os.environ[SESSION_ENV].split()) + 1  # the inner session's mark after ours
    result = _inner_session(
        pytester,
        monkeypatch,
        f"""
import os, signal, subprocess, sys
from tests.support.leftovers import SESSION_ENV
from tests.support.processes import stop_group

def test_stops_its_server():
    proc = subprocess.Popen([sys.executable, "-c", {SLEEPER!r}], start_new_session=True)
    assert stop_group(proc, timeout=10) == -signal.SIGTERM
    assert len(os.environ[SESSION_ENV].split()) == {words}
""",
    )
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert "left behind" not in result.stdout.str()


def test_this_session_marks_what_it_starts() -> None:
    mark = os.environ[SESSION_ENV]
    proc = subprocess.Popen(
        [sys.executable, "-c", "import os, sys; print(os.environ[sys.argv[1]])", SESSION_ENV],
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = proc.communicate(timeout=60)
    assert out.strip() == mark


def test_the_cluster_tools_stop_process_kills_the_group_the_leader_leaves(tmp_path: Path) -> None:
    """``tools/cluster.py``'s ``stop_process`` (the S3 server's): once the leader has exited
    on SIGTERM, the rest of its group is SIGKILLed at once."""
    if str(REPO / "tools") not in sys.path:
        sys.path.insert(0, str(REPO / "tools"))
    from cluster import stop_process

    ready = tmp_path / "ready"
    leader_code = (
        "import subprocess, sys; "
        f"c = subprocess.Popen([sys.executable, '-c', {IGNORES_SIGTERM!r}, sys.argv[1]]); "
        "open(sys.argv[2], 'w').write(str(c.pid)); c.wait()"
    )
    child_file = tmp_path / "child.pid"
    leader = subprocess.Popen(
        [sys.executable, "-c", leader_code, str(ready), str(child_file)], start_new_session=True
    )
    wait_for_file(ready)
    child = int(wait_for_file(child_file))
    stop_process(leader, timeout=20)
    assert leader.returncode == -signal.SIGTERM
    deadline = time.monotonic() + KILL_SECONDS
    while not process_gone(child):
        assert time.monotonic() < deadline, f"pid {child} still alive"
        time.sleep(0.05)


def _sweep(word: str) -> subprocess.CompletedProcess[str]:
    """``python -m tests.support.sweep word``, as the Makefile runs it."""
    return subprocess.run(
        [sys.executable, "-m", "tests.support.sweep", word],
        cwd=ROOT_DIR,
        capture_output=True,
        text=True,
        timeout=INNER_SECONDS,
        check=False,
    )


def test_the_sweep_after_a_stopped_suite_kills_what_carries_its_word() -> None:
    """What the Makefile runs when a suite's bound killed it: a server in a group of its own
    whose environment carries the suite's word is named and killed; one without it is not."""
    word = f"suite-test-{os.getpid()}"
    env = {**os.environ, SESSION_ENV: f"{word} inner-session"}
    marked = subprocess.Popen([sys.executable, "-c", SLEEPER], env=env, start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", SLEEPER], start_new_session=True)
    try:
        out = _sweep(word)
        assert out.returncode == 1, out.stderr
        assert f"killed: pid {marked.pid}: " in out.stderr and SLEEPER in out.stderr
        assert str(other.pid) not in out.stderr
        assert marked.wait(KILL_SECONDS) == -signal.SIGKILL
        assert other.poll() is None
        again = _sweep(word)
        assert again.returncode == 0 and not again.stderr, again.stderr
    finally:
        for proc in (marked, other):
            proc.kill()
            proc.wait(KILL_SECONDS)
