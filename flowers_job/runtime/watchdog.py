"""A watchdog beside each rank: it names the signal of a rank that dies without a word.

A rank SIGKILLed (by hand, by torchrun after a SIGTERM it did not answer, or by the kernel's
OOM killer) runs no Python code: it writes no ``rank-<r>.json`` and :mod:`faulthandler` no
``rank-<r>.fatal``, and the driver would lead with another rank's consequence (a collective
that lost its peer). Each rank therefore starts a small process, first thing
(:func:`start_watchdog`), that outlives it long enough to say how it ended.

The watchdog

- runs ``python -I <this file>`` in a session of its own: torchrun stops its workers with
  ``os.killpg``, which must not reach it; it imports neither this package nor torch;
- waits on a pidfd of the rank (``os.pidfd_open``, Linux >= 5.3) and on its stdin, a pipe
  from the rank: the rank writes ``done`` there (:func:`watchdog_done`) when
  :func:`~flowers_job.train.rank.train_worker` returns or after it has written its own
  failure report, and the watchdog then exits;
- when the rank exits without saying ``done``, reads its wait status: from the last field
  of ``/proc/<pid>/stat`` (``exit_code``) while the rank is a zombie, or, once its parent
  (torchrun) has reaped it, from the pidfd (``PIDFD_INFO_EXIT``, Linux >= 6.15); on older
  kernels a reap first makes the report say "signal unknown";
- unless the rank left a ``rank-<r>.json``, a non-empty ``rank-<r>.fatal``, or exited with
  status 0, writes ``rank-<r>.killed`` (JSON, temporary file + rename) into the report dir:
  rank, ``type: "Killed"``, how it ended (signal name and number, or exit status), a
  message, host, pid, the time it saw the death, and the evidence of the OOM killer: the
  ``oom_kill`` count of the rank's memory cgroup (cgroup v1 ``memory.oom_control``, v2
  ``memory.events``) at start and at death, and the kernel log's ``Killed process <pid>``
  record (``/dev/kmsg``, read from its end at start; root or CAP_SYSLOG, else skipped).
  When the OOM killer ended the rank, the message names the settings that decide a rank's
  memory (:func:`memory_settings`).

It exits at most about 0.5 s after the rank and leaves nothing behind; the driver reads its
report (:func:`flowers_job.driver.failures.failure`)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "KILLED_SUFFIX",
    "memory_cgroup",
    "memory_limit",
    "memory_settings",
    "oom_kills",
    "start_watchdog",
    "watchdog_done",
]

KILLED_SUFFIX = ".killed"
"""``rank-<rank>.killed`` in the report dir: the watchdog's report of a rank that died
without a Python exception or a fatal-signal report."""
UPLOAD_SECONDS = 120.0
"""Bound on copying a dead rank's reports to an object store (seconds)."""
_FATAL_SUFFIX = (
    ".fatal"  # = flowers_job.runtime.reports.FATAL_SUFFIX (this file imports no package)
)
_DONE = b"done"
_READY = b"ready\n"
READY_SECONDS = 5.0
"""How long the rank waits for its watchdog to take its baselines (seconds)."""
OOM_RECORD_SECONDS = 0.5
"""How long the watchdog waits for the kernel's OOM record once the cgroup counted an OOM
kill (seconds): the kernel logs it right after sending SIGKILL."""
_PIDFD_INFO_EXIT = 1 << 3
_PIDFD_INFO_SIZE = 64  # PIDFD_INFO_SIZE_VER0: struct pidfd_info up to exit_code (offset 60)
_PIDFD_GET_INFO = (3 << 30) | (_PIDFD_INFO_SIZE << 16) | (0xFF << 8) | 11  # _IOWR(0xFF, 11, ...)
_CGROUP_ROOTS = (Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup"))

log = logging.getLogger(__name__)

_started: list[subprocess.Popen[bytes]] = []  # this process's watchdog (at most one)


def start_watchdog(
    failure_dir: Path,
    rank: int | None,
    settings: Mapping[str, str] | None = None,
    upload: str | None = None,
) -> int | None:
    """Start this rank's watchdog, and wait (at most :data:`READY_SECONDS`) until it watches.

    Args:
        failure_dir: the job's report dir, where the watchdog writes ``rank-<rank>.killed``.
        rank: this process's rank (None, outside torchrun: no watchdog).
        settings: the job's settings that decide a rank's memory, by dotted name, with
            their values (the driver's, :attr:`flowers_job.train.job_spec.TrainingJob.
            memory_settings`), which an OOM report names (:func:`memory_settings`).
        upload: the report dir in an object store, where the watchdog copies what is in
            ``failure_dir`` (this host's) once the rank has died (``python -m
            flowers_job.location``, at most :data:`UPLOAD_SECONDS`).

    Returns:
        The watchdog's pid, or None where it cannot run (no rank, no ``os.pidfd_open``, or
        the start failed: logged).
    """
    watchdog_done()  # a watchdog of an earlier call in this process
    if rank is None:
        return None
    try:
        pidfd = os.pidfd_open(os.getpid())
        fields = _stat_fields("self") or []
        watch = {
            "pidfd": pidfd,
            "pid": os.getpid(),
            "start_time": fields[19] if len(fields) > 19 else None,  # a reused pid differs
            "rank": rank,
            "dir": str(failure_dir),
            "settings": memory_settings(settings),
            "upload": upload,
        }
    except (AttributeError, OSError) as exc:
        log.warning("rank %s: no watchdog (%s): a SIGKILL would go unnamed", rank, exc)
        return None
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), json.dumps(watch)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=(pidfd,),
            start_new_session=True,
        )
    except OSError:
        log.exception("rank %s: the watchdog did not start", rank)
        return None
    finally:
        os.close(pidfd)
    _started.append(proc)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], READY_SECONDS)
    if not ready or proc.stdout.readline() != _READY:
        log.warning("rank %s: its watchdog (pid %d) is not ready", rank, proc.pid)
    proc.stdout.close()
    return proc.pid


def watchdog_done() -> None:
    """Tell this process's watchdog that the rank ends as it should (returned, or reported
    its failure), and reap it (at most 2 s). Nothing without a watchdog."""
    while _started:
        proc = _started.pop()
        try:
            assert proc.stdin is not None
            proc.stdin.write(_DONE + b"\n")
            proc.stdin.close()
        except OSError:
            pass  # it is gone already
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            log.warning("the watchdog (pid %d) did not exit after done", proc.pid)


def memory_settings(settings: Mapping[str, str] | None) -> dict[str, str | None]:
    """The settings that decide a rank's memory, with their values: ``settings`` (the batch,
    the decoding workers and the loader's own, from the driver), and
    ``spark.executor.memory`` (barrier mode) from ``SPARK_EXECUTOR_MEMORY`` if set."""
    return {
        **(settings or {}),
        "spark.executor.memory": os.environ.get("SPARK_EXECUTOR_MEMORY") or None,
    }


def memory_cgroup(pid: int | str = "self") -> Path | None:
    """The directory of process ``pid``'s memory cgroup: cgroup v1's ``memory`` hierarchy
    (``/sys/fs/cgroup/memory/<path>``), else v2's (``/sys/fs/cgroup/<path>``, where it has
    a memory controller); None without either, or where ``/proc`` cannot tell."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        if "memory" in controllers.split(","):
            directory = _CGROUP_ROOTS[0] / path.lstrip("/")
            return directory if directory.is_dir() else None
    for line in lines:
        if line.startswith("0::"):
            directory = _CGROUP_ROOTS[1] / line[3:].lstrip("/")
            return directory if (directory / "memory.events").is_file() else None
    return None


def oom_kills(cgroup: Path | None) -> int | None:
    """How many processes of ``cgroup`` the OOM killer has killed: ``oom_kill`` of v1's
    ``memory.oom_control`` or v2's ``memory.events``; None where neither can be read."""
    if cgroup is None:
        return None
    for name in ("memory.oom_control", "memory.events"):
        try:
            for line in (cgroup / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


def memory_limit(cgroup: Path | None) -> int | None:
    """The memory that ``cgroup`` and its ancestors allow (bytes; the smallest of v1's
    ``memory.limit_in_bytes`` and v2's ``memory.max``), or None without a limit."""
    limits = []
    directory = cgroup
    while directory is not None:
        for name in ("memory.limit_in_bytes", "memory.max"):
            try:
                text = (directory / name).read_text().strip()
            except OSError:
                continue
            if text.isdigit():
                limits.append(int(text))
        stop = directory in _CGROUP_ROOTS or directory.parent == directory
        directory = None if stop else directory.parent
    return min(limits) if limits else None


def _stat_fields(pid: int | str) -> list[str] | None:
    """``/proc/<pid>/stat`` from field 3 (state) on; the name, field 2, may hold spaces."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _pidfd_exit_status(pidfd: int) -> int | None:
    """The wait status kept on a reaped process's pidfd (``PIDFD_INFO_EXIT``, Linux >= 6.15)."""
    info = bytearray(_PIDFD_INFO_SIZE)
    struct.pack_into("Q", info, 0, _PIDFD_INFO_EXIT)
    with contextlib.suppress(OSError):
        fcntl.ioctl(pidfd, _PIDFD_GET_INFO, info)
        if struct.unpack_from("Q", info, 0)[0] & _PIDFD_INFO_EXIT:
            return int(struct.unpack_from("i", info, 60)[0])
    return None


def _exit_status(pidfd: int, pid: int, start_time: str | None) -> int | None:
    """The exited rank's wait status: from its pidfd once reaped, else from ``exit_code``
    (field 52 of ``/proc/<pid>/stat``) while a zombie, else from the pidfd again (reaped in
    between). None: reaped first on a kernel before 6.15, or a reused pid."""
    status = _pidfd_exit_status(pidfd)
    if status is not None:
        return status
    fields = _stat_fields(pid)
    if fields and len(fields) >= 50 and fields[19] == start_time and fields[0] in "ZX":
        return int(fields[49])
    return _pidfd_exit_status(pidfd)


def _open_kmsg() -> int | None:
    """``/dev/kmsg``, non-blocking, at its end (None without permission or without it)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    os.lseek(fd, 0, os.SEEK_END)
    return fd


def _read_kmsg(fd: int | None, records: list[str]) -> None:
    """Append the kernel log's OOM-kill records since the last read (until EAGAIN) to
    ``records``."""
    if fd is None:
        return
    for _ in range(100_000):
        try:
            data = os.read(fd, 8192)
        except BrokenPipeError:
            continue  # records overwritten since the last read: the next read goes on
        except OSError:
            return  # EAGAIN: nothing more
        if not data:
            return
        record = data.decode(errors="replace").split(";", 1)[-1].split("\n", 1)[0]
        if "Killed process" in record or "oom-kill:" in record:
            records.append(record)


def _oom_record(records: list[str], pid: int) -> str | None:
    """The kernel's record that the OOM killer killed ``pid``, if any."""
    killed = re.compile(rf"Killed process {pid}\b")
    summary = re.compile(rf"oom-kill:.*\bpid={pid}\b")
    found = [r for r in records if killed.search(r)] or [r for r in records if summary.search(r)]
    return found[0] if found else None


class _Watch:
    """What the watchdog knows of its rank: baselines at start, evidence at death."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.pid: int = args["pid"]
        self.rank: int = args["rank"]
        self.directory = Path(args["dir"])
        self.settings: dict[str, str | None] = args["settings"]
        self.cgroup = memory_cgroup(self.pid)
        self.baseline = oom_kills(self.cgroup)
        self.kmsg = _open_kmsg()
        self.records: list[str] = []

    def reported(self) -> bool:
        """Whether the rank left a report of its own (exception or fatal signal)."""
        stem = self.directory / f"rank-{self.rank}"
        fatal = stem.with_name(stem.name + _FATAL_SUFFIX)
        try:
            return stem.with_name(stem.name + ".json").exists() or fatal.stat().st_size > 0
        except OSError:
            return False

    def oom(self, sigkill: bool) -> dict[str, Any]:
        """The OOM killer's evidence: the cgroup's new OOM kills and the kernel's record."""
        kills = oom_kills(self.cgroup)
        new = kills - self.baseline if kills is not None and self.baseline is not None else None
        _read_kmsg(self.kmsg, self.records)
        deadline = time.monotonic() + OOM_RECORD_SECONDS
        while (
            sigkill
            and self.kmsg is not None
            and (new or 0) > 0
            and _oom_record(self.records, self.pid) is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
            _read_kmsg(self.kmsg, self.records)
        record = _oom_record(self.records, self.pid)
        return {
            "killer": record is not None or (sigkill and (new or 0) > 0),
            "kernel_log": record,
            "kernel_log_read": self.kmsg is not None,
            "cgroup": None if self.cgroup is None else str(self.cgroup),
            "cgroup_oom_kills": new,
            "memory_limit_bytes": memory_limit(self.cgroup),
        }


def _how(status: int | None) -> tuple[str, str | None, int | None, int | None]:
    """(how it ended, signal name, signal number, exit status) from a wait status."""
    if status is None:
        return "died, signal unknown (its parent reaped it first)", None, None, None
    number = status & 0x7F
    if number:
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        return f"was killed by {name}", name, number, None
    return f"exited with status {status >> 8 & 0xFF}", None, None, status >> 8 & 0xFF


def _settings_text(settings: dict[str, str | None]) -> str:
    def named(key: str) -> str:
        return key if settings.get(key) is None else f"{key}={settings[key]}"

    memory = settings.get("spark.executor.memory")
    common = ("train.per_device_batch_size", "data.loader_workers", "spark.executor.memory")
    loader = [named(key) for key in settings if key not in common]
    return (
        f"{named('train.per_device_batch_size')}, {named('data.loader_workers')} (each a "
        "process of its own), "
        + (f"the loader's read-ahead ({', '.join(loader)}), " if loader else "")
        + "and "
        + (f"spark.executor.memory={memory}" if memory else "the executor's memory")
        + " (spark.executor.memory, barrier mode)"
    )


def _message(
    how: str, signal_name: str | None, oom: dict[str, Any], settings: dict[str, Any]
) -> str:
    """The report's message: what is known of the death, and what to change for an OOM."""
    if oom["killer"]:
        limit = oom["memory_limit_bytes"]
        allows = f"; its memory cgroup allows {limit / 2**20:.0f} MiB" if limit else ""
        seen = oom["kernel_log"] or f"memory cgroup {oom['cgroup']}: an oom_kill counted"
        return (
            f"no Python exception: the kernel's OOM killer ended it ({seen}){allows}. What "
            f"decides a rank's memory: {_settings_text(settings)}; lower the first three or "
            "give the rank more memory"
        )
    if signal_name is None:
        return f"no Python exception and no fatal-signal report: it {how}"
    cgroup = (
        "its memory cgroup counted no OOM kill"
        if oom["cgroup_oom_kills"] is not None
        else "its memory cgroup could not be read"
    )
    kernel = "nor did the kernel log" if oom["kernel_log_read"] else "the kernel log unread"
    return (
        "no Python exception and no fatal-signal report: it was killed from outside (by hand, "
        f"by torchrun after a SIGTERM it did not answer, or by the OS); not the OOM killer as "
        f"far as can be seen: {cgroup}, {kernel}"
    )


def _report(watch: _Watch, status: int | None, seen: float) -> dict[str, Any]:
    how, signal_name, number, exit_status = _how(status)
    oom = watch.oom(sigkill=status is None or number == signal.SIGKILL)
    return {
        "rank": watch.rank,
        "type": "Killed",
        "how": how,
        "message": _message(how, signal_name, oom, watch.settings),
        "signal": signal_name,
        "signal_number": number,
        "exit_status": exit_status,
        "host": socket.gethostname(),
        "pid": watch.pid,
        "time": seen,
        "oom": oom,
        "settings": watch.settings,
    }


def _wait(pidfd: int) -> bool:
    """Block until the rank says done (True) or exits (False)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.register(0, select.POLLIN)
    heard = b""
    while True:
        events = sorted(poller.poll(), key=lambda e: e[0] != 0)  # stdin first
        for fd, _ in events:
            if fd != 0:
                return _DONE in heard + _drain_stdin()
            chunk = os.read(0, 4096)
            if not chunk:  # EOF without done: the pidfd says how it ends
                poller.unregister(0)
            heard = (heard + chunk)[-64:]
            if _DONE in heard:
                return True


def _drain_stdin() -> bytes:
    """What the rank wrote to stdin and the watchdog has not read yet."""
    data = b""
    while len(data) < 4096 and select.select([0], [], [], 0)[0] and (chunk := os.read(0, 4096)):
        data += chunk
    return data


def _write_report(directory: Path, rank: int, report: dict[str, Any]) -> Path | None:
    """``rank-<rank>.killed``, atomically; None where the report dir is gone (the run ended)."""
    if not directory.is_dir():
        return None
    path = directory / f"rank-{rank}{KILLED_SUFFIX}"
    tmp = directory / f".{path.name}.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, path)
    return path


def _protect() -> None:
    """Keep the OOM killer away from the watchdog (a few MiB; needs CAP_SYS_RESOURCE)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/oom_score_adj").write_text("-1000")


def main(argv: list[str]) -> int:
    """The watchdog process: ``python -I watchdog.py '<json>'``, the JSON of
    :func:`start_watchdog` (pidfd, pid, start_time, rank, dir, settings)."""
    args = json.loads(argv[0])
    _protect()
    watch = _Watch(args)
    with contextlib.suppress(OSError):  # ready: the rank may go on
        os.write(1, _READY)
    os.dup2(os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC), 1)  # the rank stops reading
    if _wait(args["pidfd"]):
        return 0
    seen = time.time()
    status = _exit_status(args["pidfd"], watch.pid, args["start_time"])  # before it is reaped
    if status != 0 and not watch.reported():
        report = _report(watch, status, seen)
        path = _write_report(watch.directory, watch.rank, report)
        where = f" ({path})" if path else ""
        sys.stderr.write(f"flowers_job watchdog: rank {watch.rank} {report['how']}{where}\n")
    if status != 0 and args.get("upload"):  # the report dir is in an object store
        cmd = [sys.executable, "-m", "flowers_job.location", str(watch.directory), args["upload"]]
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(cmd, timeout=UPLOAD_SECONDS, check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
