"""Test-only fault injection, switched on by one environment variable. Never set it in production.

``FLOWERS_JOB_FAULT`` holds comma-separated ``<kind>:<rank>:<epoch>`` entries:

=================== ======================================================================
kind                what that rank does at that epoch
=================== ======================================================================
``raise``           raises ``RuntimeError`` half-way through the epoch's training steps (a
                    bug, a corrupt batch)
``hang``            sleeps half-way through the epoch, for at most :data:`HANG_SECONDS` (a
                    stuck reader or a deadlock): the other ranks' next collective times out
``abort``           the rank calls ``os.abort()`` half-way through the epoch: it dies of
                    SIGABRT without a Python exception, as a crash in native code does
``pause_checkpoint`` stops while writing the epoch's checkpoint (rank 0 writes it): the
                    temporary file is written, not yet synced nor renamed over
                    ``last.pt``; for at most :data:`HANG_SECONDS`, so a test can kill
                    the driver there
``fail_registration`` ``fail_registration:0:0``: rank 0 raises ``RuntimeError`` while it logs
                    and registers the model, after the last collective: the other ranks
                    have returned their result already
``slow_registration`` ``slow_registration:<rank>:<seconds>``: that rank (rank 0 registers the
                    model) sleeps ``<seconds>`` before logging and registering the model, as
                    a slow model registry does
=================== ======================================================================

The tests in ``tests/test_faults.py`` use it with real TorchDistributor processes;
workers inherit the variable from the driver's environment. Ingest has its own test-only
pause, ``FLOWERS_JOB_INGEST_FAULT=pause_after:<table>`` (:func:`ingest_pause`).

Production code calls a fault point in one line (:func:`mid_epoch`, :func:`inject`,
:func:`delay`, :func:`ingest_pause`); what a fault does lives here. Without the variables
every fault point does nothing.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

__all__ = [
    "FAULT_ENV",
    "HANG_SECONDS",
    "INGEST_FAULT_ENV",
    "delay",
    "ingest_pause",
    "inject",
    "mid_epoch",
]

T = TypeVar("T")

FAULT_ENV = "FLOWERS_JOB_FAULT"
INGEST_FAULT_ENV = "FLOWERS_JOB_INGEST_FAULT"
"""Test only: ``pause_after:<table>`` pauses ingest after writing ``<table>``."""
INGEST_PAUSE_SECONDS = 3600.0
"""Upper bound of an injected ingest pause (seconds)."""
HANG_SECONDS = 900.0
"""Upper bound of an injected hang (seconds): even a forgotten fault never blocks forever."""

log = logging.getLogger(__name__)


def inject(kind: str, rank: int | None, epoch: int) -> None:
    """Act out fault ``kind`` if ``FLOWERS_JOB_FAULT`` asks for it at this rank and epoch.

    Raises:
        RuntimeError: for ``raise`` (the message names the setting).
    """
    spec = os.environ.get(FAULT_ENV, "")
    if f"{kind}:{rank}:{epoch}" not in spec.split(","):
        return
    if kind in ("raise", "fail_registration"):
        raise RuntimeError(f"injected fault ({FAULT_ENV}={spec})")
    if kind == "abort":
        log.warning("injected fault %s:%s:%s: os.abort()", kind, rank, epoch)
        os.abort()
    log.warning("injected fault %s:%s:%s: sleeping up to %.0f s", kind, rank, epoch, HANG_SECONDS)
    time.sleep(HANG_SECONDS)


def mid_epoch(batches: Iterable[T], rank: int, epoch: int, step: int) -> Iterable[T]:
    """``batches``, acting out ``raise``, ``abort`` and ``hang`` faults before batch ``step``
    when ``FLOWERS_JOB_FAULT`` is set; ``batches`` itself otherwise."""
    if not os.environ.get(FAULT_ENV):
        return batches
    return _mid_epoch(batches, rank, epoch, step)


def _mid_epoch(batches: Iterable[T], rank: int, epoch: int, step: int) -> Iterator[T]:
    for i, batch in enumerate(batches):
        if i == step:
            inject("raise", rank, epoch)
            inject("abort", rank, epoch)
            inject("hang", rank, epoch)
        yield batch


def delay(kind: str, rank: int | None) -> None:
    """Sleep the seconds that a ``<kind>:<rank>:<seconds>`` entry of ``FLOWERS_JOB_FAULT``
    asks for (at most :data:`HANG_SECONDS`); nothing without one."""
    for entry in os.environ.get(FAULT_ENV, "").split(","):
        parts = entry.split(":")
        if len(parts) == 3 and parts[0] == kind and parts[1] == str(rank):
            seconds = min(float(parts[2]), HANG_SECONDS)
            log.warning("injected fault %s: sleeping %.0f s", entry, seconds)
            time.sleep(seconds)


def ingest_pause(table: str) -> None:
    """Pause ingest (at most :data:`INGEST_PAUSE_SECONDS`) right after it wrote ``table``,
    if ``FLOWERS_JOB_INGEST_FAULT=pause_after:<table>``, so that a test can kill it there."""
    if os.environ.get(INGEST_FAULT_ENV) == f"pause_after:{table}":
        log.warning("%s: ingest paused after writing the %s table", INGEST_FAULT_ENV, table)
        time.sleep(INGEST_PAUSE_SECONDS)
