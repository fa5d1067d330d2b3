"""A server's process group is stopped whole, a member that ignores SIGTERM included
(:func:`tests.support.processes.stop_group`, what every server of the tests is stopped with)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.support.processes import KILL_SECONDS, stop_group

pytestmark = [pytest.mark.tier("gate"), pytest.mark.timeout(180)]

START_SECONDS = 30.0
"""Bound on a helper process's start (it writes its pid file), seconds."""
SLEEPER = "import time; time.sleep(600)"
IGNORES_SIGTERM = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "open(sys.argv[1], 'w').write('ready'); time.sleep(600)"
)
"""A process that ignores SIGTERM (as the tracking server's uvicorn was seen to), and says
so in the file ``argv[1]`` once it does."""


def _gone(pid: int) -> bool:
    """No live process ``pid`` (a zombie not yet reaped by init counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_for_file(path: Path) -> str:
    """``path``'s text once it has some (bounded by :data:`START_SECONDS`)."""
    deadline = time.monotonic() + START_SECONDS
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, f"nothing in {path} after {START_SECONDS} s"
        time.sleep(0.05)
    return path.read_text()


def test_stop_group_kills_a_member_that_ignores_sigterm(tmp_path: Path) -> None:
    """The leader exits on SIGTERM (as ``mlflow server`` does); its child, which ignores it
    (as the uvicorn worker did), is SIGKILLed with the group after the wait."""
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
    try:
        _wait_for_file(ready)
        child = int(_wait_for_file(child_file))
        start = time.monotonic()
        assert stop_group(leader, timeout=2) == -signal.SIGTERM
        took = time.monotonic() - start
    finally:
        if leader.returncode is None:
            os.killpg(leader.pid, signal.SIGKILL)
            leader.wait(KILL_SECONDS)
    assert _gone(child)
    assert 2 <= took < 2 + KILL_SECONDS, took


def test_stop_group_kills_a_leader_that_ignores_sigterm(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    leader = subprocess.Popen(
        [sys.executable, "-c", IGNORES_SIGTERM, str(ready)], start_new_session=True
    )
    _wait_for_file(ready)
    assert stop_group(leader, timeout=1) == -signal.SIGKILL


def test_stop_group_refuses_a_process_without_its_own_group_after_stopping_it() -> None:
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER])
    with pytest.raises(ValueError, match="start_new_session=True"):
        stop_group(proc, timeout=10)
    assert proc.returncode == -signal.SIGTERM


def test_stop_group_of_a_server_that_has_exited_already() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait(60)
    assert stop_group(proc, timeout=1) == 0
