"""The files a rank writes into the job's report dir for the driver to read back
(:mod:`flowers_job.driver.failures`, :mod:`flowers_job.driver.restarts`): their names, in one
place, and the atomic JSON write. Stdlib and :class:`~flowers_job.location.Location` only.

========================== ================================================================
file                       written by
========================== ================================================================
``rank-<r>.json``          a rank whose Python code raised: type, message, traceback, host
``rank-<r>.fatal``         :mod:`faulthandler` in a rank that died of a fatal signal
``rank-<r>.killed``        the watchdog beside a rank that died without a word
                           (:mod:`flowers_job.runtime.watchdog`)
``rank-<r>.done``          a rank whose training function returned
``ranks.json``             rank 0, once the group is up: every rank's host, address and pid
``model.json``             rank 0, after registering the model
``first_step.json``        rank 0, after its first training step
========================== ================================================================
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flowers_job.location import Location
from flowers_job.runtime.watchdog import KILLED_SUFFIX

__all__ = [
    "DONE_SUFFIX",
    "FAILURE_SUFFIX",
    "FATAL_SUFFIX",
    "FIRST_STEP_FILE",
    "KILLED_SUFFIX",
    "MODEL_FILE",
    "NO_MESSAGE",
    "RANKS_FILE",
    "SUMMARY_CHARS",
    "SUMMARY_LINES",
    "summarize_message",
    "write_json",
]

FAILURE_SUFFIX = ".json"
"""``rank-<rank>.json`` in the report dir: the report of a rank whose Python code raised."""
FATAL_SUFFIX = ".fatal"
"""``rank-<rank>.fatal`` in the report dir: what :mod:`faulthandler` writes when that rank
dies of a fatal signal (SIGSEGV, SIGABRT, SIGBUS, SIGILL, SIGFPE), a crash in native code
that leaves no Python exception and so no ``rank-<rank>.json``: the signal and every
thread's Python stack. Empty while the rank lives; the driver reports a non-empty one."""
DONE_SUFFIX = ".done"
"""``rank-<rank>.done`` in the report dir: empty, written by a rank whose training function
returned. With the failure reports it tells the driver that every rank has ended
(:func:`wait_for_reports`)."""
RANKS_FILE = "ranks.json"
"""Written by rank 0 into the report dir once the group is up: every rank's host, address
and pid (:func:`~flowers_job.runtime.process_group.gather_ranks`), for the driver's failure report."""
MODEL_FILE = "model.json"
"""Written by rank 0 into the job's report dir after registering the model: the model URI,
version and run id, which the driver adds to the summary (local mode returns whichever
rank's result was written last: docs/known-issues.md, "Spark")."""
FIRST_STEP_FILE = "first_step.json"
"""Written by rank 0 into the job's report dir after its first training step: the attempt,
the time (``first_step_at``, seconds since the epoch) and the checkpoint it continued
(``resumed_from``: epoch, step, ``saved_at``)."""


def write_json(path: Location | Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path``, whole or not at all (:meth:`Location.write_bytes`)."""
    Location.of(path).write_text(json.dumps(data, default=str))


SUMMARY_LINES = 4
"""Non-empty lines of an exception's message that :func:`summarize_message` keeps."""
SUMMARY_CHARS = 500
"""Most characters of :func:`summarize_message`'s result (the traceback keeps the rest)."""
NO_MESSAGE = "(no message: see the traceback)"
"""What :func:`summarize_message` says of an empty message."""


def summarize_message(message: str) -> str:
    """An exception's message on one line, for a report's lead, a tag or a restart's cause:
    its first :data:`SUMMARY_LINES` non-empty lines, stripped and joined by ``" | "``, cut to
    :data:`SUMMARY_CHARS` characters (ending in ``...`` when cut); never empty.

    A message may start with a line break: matplotlib's mathtext error for a label
    ``$\\notacommand$`` is an empty line, the expression, a caret line and the parser's
    error; a report that kept only the first line said ``ValueError:`` and nothing more.
    """
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    text = " | ".join(lines[:SUMMARY_LINES]) + (" | ..." if len(lines) > SUMMARY_LINES else "")
    if len(text) > SUMMARY_CHARS:
        text = text[: SUMMARY_CHARS - 3].rstrip() + "..."
    return text or NO_MESSAGE
