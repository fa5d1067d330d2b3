"""After a suite its bound stopped: kill what it left running.

The Makefile starts each suite with :data:`~tests.support.leftovers.SESSION_ENV` set to a
word of its own; every process the suite starts inherits it (the pytest session adds its
own word after it). A suite that ends normally checks its own leftovers
(:mod:`tests.support.leftovers`); one that its bound killed (``timeout``'s SIGKILL never
reaches that check) leaves its servers, which run in process groups of their own. Then

    python -m tests.support.sweep WORD

names every process whose environment carries ``WORD`` on stderr, kills it (SIGKILL), and
exits 1 when it found any, 0 when none.
"""

from __future__ import annotations

import signal
import sys

import psutil

from tests.support.leftovers import SESSION_ENV
from tests.support.processes import KILL_SECONDS, describe, marked_processes


def sweep(word: str) -> list[str]:
    """Kill every process whose :data:`SESSION_ENV` carries ``word`` but this one.

    Returns:
        One line per process killed: its pid and command line.
    """
    found = [p for p in marked_processes(word, SESSION_ENV) if p.pid != psutil.Process().pid]
    lines = [f"pid {p.pid}: {describe(p)}" for p in found]
    for proc in found:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.Error:  # gone meanwhile
            continue
    psutil.wait_procs(found, timeout=KILL_SECONDS)
    return lines


def main(argv: list[str]) -> int:
    """``sweep(argv[0])``, each process named on stderr; 1 when any was found."""
    (word,) = argv
    lines = sweep(word)
    for line in lines:
        print(f"left running by the stopped suite, killed: {line}", file=sys.stderr)
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
