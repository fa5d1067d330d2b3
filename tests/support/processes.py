"""Processes a test starts and finds: the CLI as a user runs it, servers, and every process a
run leaves behind (by a mark in their environment)."""

from __future__ import annotations

import subprocess
import sys

import psutil

from tests.support import ROOT_DIR


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


def marked_processes(mark: str) -> list[psutil.Process]:
    """Every process (any parent) whose environment carries ``MARK_ENV=mark``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARK_ENV) == mark:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """Stop a server a test started: SIGTERM, then SIGKILL after 30 s (bounded waits;
    ``tools/cluster.py``'s ``stop_process``)."""
    tools = str(ROOT_DIR / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    from cluster import stop_process

    stop_process(proc)
