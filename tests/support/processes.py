"""Processes a test starts and finds: the CLI as a user runs it, servers (each in a process
group of its own, stopped as a group: :func:`stop_group`), and every process a run leaves
behind (by a mark in their environment). The check that a whole pytest session leaves none:
:mod:`tests.support.leftovers`."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil


def run_cli(
    *args: str, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m flowers_job ARGS`` as a user runs it; output captured, never raises on exit."""
    return subprocess.run(
        [sys.executable, "-m", "flowers_job", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )


MARK_ENV = "FLOWERS_JOB_TEST_MARK"
"""Set to a fresh value in a CLI driver's environment, so that every process it starts (its
JVM, Spark's Python workers, the ranks), whatever their parent, can be found."""


def marked_processes(mark: str, name: str = MARK_ENV) -> list[psutil.Process]:
    """Every process (any parent) whose environment variable ``name`` carries ``mark``: equal
    to it, or one of its space-separated words (nested pytest sessions each add theirs,
    :mod:`tests.support.leftovers`). Processes whose environment cannot be read (another
    user's) are left out."""
    found = []
    for proc in psutil.process_iter():
        try:
            if mark in proc.environ().get(name, "").split():
                found.append(proc)
        except psutil.Error:
            continue
    return found


STOP_SECONDS = 30.0
"""Default wait of :func:`stop_group` for a group to exit after SIGTERM, seconds."""
KILL_SECONDS = 10.0
"""Wait of :func:`stop_group` for a group to exit after SIGKILL, seconds."""
POLL_SECONDS = 0.1
"""How often :func:`stop_group` looks at the group, seconds."""


def group_members(pgid: int) -> list[psutil.Process]:
    """The live processes (zombies left out) of process group ``pgid``, any parent."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (OSError, psutil.Error):  # gone meanwhile
            continue
    return found


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # no process left in the group
        os.killpg(pgid, sig)


def _wait_group(pgid: int, seconds: float) -> list[psutil.Process]:
    """Until group ``pgid`` has no live member or ``seconds`` have passed; what is left."""
    deadline = time.monotonic() + seconds
    while (left := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
    return left


def stop_group(proc: subprocess.Popen[Any], timeout: float = STOP_SECONDS) -> int:
    """Stop a server a test started in a process group of its own (``start_new_session=True``)
    and everything in that group, whatever its parent now: SIGTERM to the group, up to
    ``timeout`` seconds for every member to exit, then SIGKILL to the group and up to
    :data:`KILL_SECONDS` more, then the leader reaped. The leader stays unreaped (a zombie)
    until the group is empty, so that its pid, the group's id, cannot be reused meanwhile.
    Safe to call on a server that has exited, or been reaped, already.

    Args:
        proc: the group's leader, as ``subprocess.Popen`` started it.
        timeout: seconds the group is given to exit after SIGTERM.

    Returns:
        The leader's exit status (``-signal`` when a signal ended it).

    Raises:
        ValueError: ``proc`` does not lead a process group of its own (it was stopped
            alone, SIGTERM then SIGKILL, before this is raised).
        RuntimeError: members of the group still live :data:`KILL_SECONDS` after SIGKILL
            (a process in uninterruptible sleep), naming them.
    """
    if proc.returncode is None and os.getpgid(proc.pid) != proc.pid:  # a zombie keeps its group
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(KILL_SECONDS)
        raise ValueError(
            f"pid {proc.pid} ({proc.args!r}) leads no process group of its own: start it with "
            "start_new_session=True"
        )
    _signal_group(proc.pid, signal.SIGTERM)
    if _wait_group(proc.pid, timeout):
        _signal_group(proc.pid, signal.SIGKILL)
        if left := _wait_group(proc.pid, KILL_SECONDS):
            names = "; ".join(f"pid {p.pid}: {describe(p)}" for p in left)
            raise RuntimeError(
                f"process group {proc.pid} still has {names} {KILL_SECONDS} s after SIGKILL"
            )
    return proc.wait(KILL_SECONDS)


START_SECONDS = 30.0
"""Bound on a helper process's start (it writes its pid file), seconds."""
SLEEPER = "import time; time.sleep(600)"
"""A child process's ``-c`` code that runs until it is stopped (at most 10 min)."""
IGNORES_SIGTERM = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "open(sys.argv[1], 'w').write('ready'); time.sleep(600)"
)
"""A process that ignores SIGTERM (as the tracking server's uvicorn was seen to), and says
so in the file ``argv[1]`` once it does."""


def process_gone(pid: int) -> bool:
    """No live process ``pid`` (a zombie not yet reaped by init counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_for_file(path: Path) -> str:
    """``path``'s text once it has some (bounded by :data:`START_SECONDS`)."""
    deadline = time.monotonic() + START_SECONDS
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, f"nothing in {path} after {START_SECONDS} s"
        time.sleep(0.05)
    return path.read_text()


def describe(proc: psutil.Process) -> str:
    """``proc``'s command line, or its name where that cannot be read ("?" once it is gone)."""
    try:
        return " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        return "?"
