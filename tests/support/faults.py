"""The tests' fault injector: the hook functions of :mod:`flowers_job.runtime.hooks`, acting
out the faults that the test-only fault settings ask for.

The job loads it only when ``FLOWERS_JOB_HOOKS`` names it (:data:`INJECTOR`, its absolute
path; :func:`fault_env` gives both variables); the fault settings alone do nothing. It is
loaded by file path in the ranks, on other hosts too (the test cluster shares this file
system, not ``tests/``), so it imports only the standard library and ``flowers_job``.

``FLOWERS_JOB_FAULT`` holds comma-separated ``<kind>:<rank>:<epoch>[:<attempt>]`` entries;
without ``<attempt>`` an entry fires on every attempt of the run, with it only when
``FLOWERS_JOB_ATTEMPT`` (:data:`ATTEMPT_ENV`, set by :func:`rank_start` from the job's
attempt; "0" when unset) equals it:

===================== ====================================================================
kind                  what that rank does at that epoch
===================== ====================================================================
``raise``             raises ``RuntimeError`` half-way through the epoch's training steps (a
                      bug, a corrupt batch)
``hang``              sleeps half-way through the epoch, for at most :data:`HANG_SECONDS` (a
                      stuck reader or a deadlock): the other ranks' next collective times out
``abort``             the rank calls ``os.abort()`` half-way through the epoch: it dies of
                      SIGABRT without a Python exception, as a crash in native code does
``kill``              the rank SIGKILLs itself half-way through the epoch: no exception, no
                      fatal-signal report; its watchdog (:mod:`flowers_job.runtime.watchdog`)
                      names it
``oom``               the rank allocates and touches memory half-way through the epoch until
                      the kernel's OOM killer ends it (at most :data:`OOM_MAX_BYTES` or
                      :data:`OOM_MAX_SECONDS`, then it raises). Only in a memory cgroup with a
                      limit below the machine's memory (else it raises): with
                      ``FLOWERS_JOB_FAULT_CGROUP=<cgroup dir>`` the rank joins that cgroup
                      first (:func:`join_fault_cgroup`)
``pause_checkpoint``  stops while writing the epoch's checkpoint (rank 0 writes it): the
                      temporary file is written, not yet synced nor renamed over
                      ``last.pt``; for at most :data:`HANG_SECONDS`, so a test can kill
                      the driver there
``fail_registration`` ``fail_registration:0:0``: rank 0 raises ``RuntimeError`` while it logs
                      and registers the model, after the last collective: the other ranks
                      have returned their result already
``slow_registration`` ``slow_registration:<rank>:<seconds>``: that rank (rank 0 registers the
                      model) sleeps ``<seconds>`` before logging and registering the model, as
                      a slow model registry does
===================== ====================================================================

Ingest has its own pause, ``FLOWERS_JOB_INGEST_FAULT=pause_after:<table>``
(:func:`ingest_pause`).

The hook points it defines (:mod:`flowers_job.runtime.hooks` documents where each is
called): :func:`rank_start`, :func:`mid_epoch`, :func:`checkpoint_write`,
:func:`before_registration`, :func:`before_log_model`, :func:`ingest_table_written`.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

from flowers_job.runtime.hooks import HOOKS_ENV
from flowers_job.runtime.watchdog import memory_cgroup, memory_limit

__all__ = [
    "ATTEMPT_ENV",
    "FAULT_CGROUP_ENV",
    "FAULT_ENV",
    "HANG_SECONDS",
    "INGEST_FAULT_ENV",
    "INJECTOR",
    "before_log_model",
    "before_registration",
    "checkpoint_write",
    "delay",
    "fault_env",
    "ingest_pause",
    "ingest_table_written",
    "inject",
    "join_fault_cgroup",
    "mid_epoch",
    "rank_start",
]

T = TypeVar("T")

INJECTOR = str(Path(__file__).resolve())
"""This file's absolute path: the value of ``FLOWERS_JOB_HOOKS`` that loads it."""
FAULT_ENV = "FLOWERS_JOB_FAULT"
ATTEMPT_ENV = "FLOWERS_JOB_ATTEMPT"
"""The run's attempt (0, 1, ...), which an entry's optional fourth field selects."""
FAULT_CGROUP_ENV = "FLOWERS_JOB_FAULT_CGROUP"
"""The directory of a memory cgroup that a rank with an ``oom`` fault joins."""
OOM_CHUNK_BYTES = 64 * 2**20
"""What the ``oom`` fault allocates and touches at a time (bytes)."""
OOM_MAX_BYTES = 64 * 2**30
OOM_MAX_SECONDS = 120.0
"""Bounds of the ``oom`` fault (bytes, seconds): past either it raises ``RuntimeError``."""
INGEST_FAULT_ENV = "FLOWERS_JOB_INGEST_FAULT"
"""``pause_after:<table>`` pauses ingest after writing ``<table>``."""
INGEST_PAUSE_SECONDS = 3600.0
"""Upper bound of an injected ingest pause (seconds)."""
HANG_SECONDS = 900.0
"""Upper bound of an injected hang (seconds): even a forgotten fault never blocks forever."""

log = logging.getLogger(__name__)


def fault_env(
    fault: str | None = None,
    *,
    cgroup: str | Path | None = None,
    ingest: str | None = None,
) -> dict[str, str]:
    """The environment variables that switch this injector on (``FLOWERS_JOB_HOOKS``) and
    ask for faults: ``fault`` as ``FLOWERS_JOB_FAULT``, ``cgroup`` as
    ``FLOWERS_JOB_FAULT_CGROUP``, ``ingest`` as ``FLOWERS_JOB_INGEST_FAULT`` (each only when
    given)."""
    env = {HOOKS_ENV: INJECTOR}
    for name, value in ((FAULT_ENV, fault), (FAULT_CGROUP_ENV, cgroup), (INGEST_FAULT_ENV, ingest)):
        if value is not None:
            env[name] = str(value)
    return env


# The hook points (flowers_job.runtime.hooks calls them by name).


def rank_start(*, rank: int | None, attempt: int) -> None:
    """Hook point ``rank_start``: record the attempt for attempt-bound entries
    (``FLOWERS_JOB_ATTEMPT``) and join the ``oom`` fault's memory cgroup
    (:func:`join_fault_cgroup`)."""
    os.environ[ATTEMPT_ENV] = str(attempt)
    join_fault_cgroup(rank)


def mid_epoch(batches: Iterable[T], *, rank: int, epoch: int, step: int) -> Iterable[T]:
    """Hook point ``mid_epoch``: ``batches``, acting out ``raise``, ``abort``, ``kill``,
    ``oom`` and ``hang`` faults before batch ``step`` when ``FLOWERS_JOB_FAULT`` is set;
    ``batches`` itself otherwise."""
    if not os.environ.get(FAULT_ENV):
        return batches
    return _mid_epoch(batches, rank, epoch, step)


def checkpoint_write(*, epoch: int) -> None:
    """Hook point ``checkpoint_write``: the ``pause_checkpoint`` fault (rank 0 writes)."""
    inject("pause_checkpoint", 0, epoch)


def before_registration(*, rank: int | None) -> None:
    """Hook point ``before_registration``: the ``slow_registration`` fault."""
    delay("slow_registration", rank)


def before_log_model(*, rank: int | None) -> None:
    """Hook point ``before_log_model``: the ``fail_registration`` fault."""
    inject("fail_registration", rank, 0)


def ingest_table_written(*, table: str) -> None:
    """Hook point ``ingest_table_written``: the ingest pause (:func:`ingest_pause`)."""
    ingest_pause(table)


# The faults.


def inject(kind: str, rank: int | None, epoch: int) -> None:
    """Act out fault ``kind`` if ``FLOWERS_JOB_FAULT`` asks for it at this rank and epoch
    (and attempt, where the entry names one).

    Raises:
        RuntimeError: for ``raise`` and ``fail_registration`` (the message names the
            setting); for ``oom`` outside a memory cgroup with a limit below the machine's
            memory, or past its bounds.
    """
    spec = os.environ.get(FAULT_ENV, "")
    if not any(e[2] == str(epoch) for e in _entries(kind, rank)):
        return
    if kind in ("raise", "fail_registration"):
        raise RuntimeError(f"injected fault ({FAULT_ENV}={spec})")
    if kind == "abort":
        log.warning("injected fault %s:%s:%s: os.abort()", kind, rank, epoch)
        os.abort()
    if kind == "kill":
        log.warning("injected fault %s:%s:%s: SIGKILL", kind, rank, epoch)
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "oom":
        _exhaust_memory(f"{kind}:{rank}:{epoch}")
    log.warning("injected fault %s:%s:%s: sleeping up to %.0f s", kind, rank, epoch, HANG_SECONDS)
    time.sleep(HANG_SECONDS)


def _mid_epoch(batches: Iterable[T], rank: int, epoch: int, step: int) -> Iterator[T]:
    for i, batch in enumerate(batches):
        if i == step:
            inject("raise", rank, epoch)
            inject("abort", rank, epoch)
            inject("kill", rank, epoch)
            inject("oom", rank, epoch)
            inject("hang", rank, epoch)
        yield batch


def delay(kind: str, rank: int | None) -> None:
    """Sleep the seconds that a ``<kind>:<rank>:<seconds>[:<attempt>]`` entry of
    ``FLOWERS_JOB_FAULT`` asks for (at most :data:`HANG_SECONDS`); nothing without one."""
    for parts in _entries(kind, rank):
        seconds = min(float(parts[2]), HANG_SECONDS)
        log.warning("injected fault %s: sleeping %.0f s", ":".join(parts), seconds)
        time.sleep(seconds)


def join_fault_cgroup(rank: int | None) -> bool:
    """Move this process into the memory cgroup ``FLOWERS_JOB_FAULT_CGROUP`` names (its
    directory, e.g. ``/sys/fs/cgroup/memory/<name>``) if ``FLOWERS_JOB_FAULT`` holds an
    ``oom`` entry for ``rank`` (any epoch, this attempt); :func:`rank_start` calls it before
    the rank starts its watchdog, so that both count against the cgroup's limit. Needs write
    access to the cgroup's ``cgroup.procs`` (root); a failure is logged, and the ``oom``
    fault then refuses to run.

    Returns:
        True if this process joined the cgroup.
    """
    directory = os.environ.get(FAULT_CGROUP_ENV)
    if not directory or not _entries("oom", rank):
        return False
    try:
        (Path(directory) / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        log.exception("rank %s could not join the fault's memory cgroup %s", rank, directory)
        return False
    log.warning("rank %s joined the memory cgroup %s (the oom fault)", rank, directory)
    return True


def _entries(kind: str, rank: int | None) -> list[list[str]]:
    """The ``FLOWERS_JOB_FAULT`` entries of ``kind`` for ``rank`` on this attempt, split
    on ``:`` (``[kind, rank, epoch or seconds]``, plus the attempt where one is named)."""
    attempt = os.environ.get(ATTEMPT_ENV, "0")
    return [
        parts
        for parts in (e.strip().split(":") for e in os.environ.get(FAULT_ENV, "").split(","))
        if len(parts) in (3, 4)
        and parts[:2] == [kind, str(rank)]
        and (len(parts) == 3 or parts[3] == attempt)
    ]


def _exhaust_memory(entry: str) -> None:
    """Allocate and touch :data:`OOM_CHUNK_BYTES` at a time, keeping every chunk, until the
    kernel's OOM killer ends this process; only in a memory cgroup with a limit below the
    machine's memory, so that a developer's machine is never the one that runs out.

    Raises:
        RuntimeError: no such cgroup, or :data:`OOM_MAX_BYTES` or :data:`OOM_MAX_SECONDS`
            passed and the process still lives.
    """
    page = os.sysconf("SC_PAGE_SIZE")
    machine = page * os.sysconf("SC_PHYS_PAGES")
    limit = memory_limit(memory_cgroup())
    if limit is None or limit >= machine:
        raise RuntimeError(
            f"injected fault {entry}: refused: this process is in no memory cgroup with a limit "
            f"below the machine's memory ({machine} bytes); set {FAULT_CGROUP_ENV} to one"
        )
    log.warning("injected fault %s: allocating until the OOM killer (limit %d bytes)", entry, limit)
    chunks: list[bytearray] = []
    deadline = time.monotonic() + OOM_MAX_SECONDS
    while len(chunks) * OOM_CHUNK_BYTES < OOM_MAX_BYTES and time.monotonic() < deadline:
        chunk = bytearray(OOM_CHUNK_BYTES)
        chunk[::page] = b"\x01" * (OOM_CHUNK_BYTES // page)  # touch every page
        chunks.append(chunk)
    raise RuntimeError(
        f"injected fault {entry}: {len(chunks) * OOM_CHUNK_BYTES} bytes touched and still alive"
    )


def ingest_pause(table: str) -> None:
    """Pause ingest (at most :data:`INGEST_PAUSE_SECONDS`) right after it wrote ``table``,
    if ``FLOWERS_JOB_INGEST_FAULT=pause_after:<table>``, so that a test can kill it there."""
    if os.environ.get(INGEST_FAULT_ENV) == f"pause_after:{table}":
        log.warning("%s: ingest paused after writing the %s table", INGEST_FAULT_ENV, table)
        time.sleep(INGEST_PAUSE_SECONDS)


def kill_ingest_at_pause(
    images: Path, output_dir: os.PathLike[str], table: str, settings: Iterable[str]
) -> None:
    """Run ``flowers-job ingest`` (with ``--set`` each of ``settings``) in its own process
    group, paused after it writes ``table`` (:func:`ingest_pause`), and kill the group there
    (SIGKILL: the JVM and the Python workers too).

    Raises:
        AssertionError: the ingest ended without pausing, or was not killed.
    """
    import subprocess
    import sys

    from tests.support import ROOT_DIR

    env = {
        **os.environ,
        **fault_env(ingest=f"pause_after:{table}"),
        "PYTHONPATH": os.pathsep.join([str(ROOT_DIR), os.environ.get("PYTHONPATH", "")]),
    }
    args = ["--images", str(images), "--output-dir", str(output_dir)]
    for item in settings:
        args += ["--set", item]
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowers_job", "ingest", *args],
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    assert proc.stderr is not None
    try:
        for line in proc.stderr:
            if f"ingest paused after writing the {table} table" in line:
                break
        else:
            raise AssertionError(f"ingest ended (status {proc.wait()}) without pausing")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.returncode
