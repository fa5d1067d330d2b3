"""A server's process group is stopped whole, a member that ignores SIGTERM included
(:func:`tests.support.processes.stop_group`, what every server of the tests is stopped with)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.processes import (
    IGNORES_SIGTERM,
    KILL_SECONDS,
    SLEEPER,
    process_gone,
    stop_group,
    wait_for_file,
)

pytestmark = [pytest.mark.tier("gate"), pytest.mark.timeout(180)]


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
        wait_for_file(ready)
        child = int(wait_for_file(child_file))
        start = time.monotonic()
        assert stop_group(leader, timeout=2) == -signal.SIGTERM
        took = time.monotonic() - start
    finally:
        if leader.returncode is None:
            os.killpg(leader.pid, signal.SIGKILL)
            leader.wait(KILL_SECONDS)
    assert process_gone(child)
    assert 2 <= took < 2 + KILL_SECONDS, took


def test_stop_group_kills_a_leader_that_ignores_sigterm(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    leader = subprocess.Popen(
        [sys.executable, "-c", IGNORES_SIGTERM, str(ready)], start_new_session=True
    )
    wait_for_file(ready)
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
