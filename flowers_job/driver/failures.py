"""The driver's side of the ranks' reports: which rank failed, how, and on which host.

The ranks write into the job's report dir (:mod:`flowers_job.train.rank`): ``rank-<r>.json``
(a Python exception), ``rank-<r>.fatal`` (a fatal signal), ``ranks.json`` (every rank's host)
and ``model.json`` (rank 0, once the model is registered); each rank's watchdog
(:mod:`flowers_job.runtime.watchdog`) writes ``rank-<r>.killed`` when its rank died without either
report (SIGKILL, the OOM killer). After TorchDistributor returns or raises, the driver turns
them into one :class:`TrainingError` that names the failing rank, its host and its cause,
ahead of the others' consequences.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from flowers_job.errors import TrainingError
from flowers_job.location import Location
from flowers_job.runtime.reports import (
    DONE_SUFFIX,
    FAILURE_SUFFIX,
    FATAL_SUFFIX,
    KILLED_SUFFIX,
    MODEL_FILE,
    RANKS_FILE,
    summarize_message,
)

__all__ = [
    "CONSEQUENCE_MESSAGES",
    "DONE_SUFFIX",
    "FATAL_SUFFIX",
    "KINDS",
    "MODEL_FILE",
    "PERMANENT_TYPES",
    "RANKS_FILE",
    "REPORT_WAIT_SECONDS",
    "TrainingError",
    "check_finished",
    "failure",
    "registered_model",
    "wait_for_reports",
]

log = logging.getLogger(__name__)

REPORT_WAIT_SECONDS = 30.0
"""Bound on the driver's wait for the ranks' reports after a failed run (seconds)."""
_ENDED = (FAILURE_SUFFIX, DONE_SUFFIX, KILLED_SUFFIX, FATAL_SUFFIX)
KINDS = ("killed", "fatal_signal", "timeout", "connection", "exception", "permanent")
""":attr:`TrainingError.kind`: how the failing rank failed. ``killed``: it died without a
word (SIGKILL, the OOM killer; also when no rank reported anything); ``fatal_signal``: a
crash in native code; ``timeout``: a collective waited past ``distributed.timeout_seconds``;
``connection``: it lost a peer (and no rank said why); ``exception``: its Python code
raised; ``permanent``: the configuration or the data is wrong, and a rerun fails the same."""
PERMANENT_TYPES = frozenset(
    {"ConfigError", "DataError", "ShardError", "IngestError", "TrackingError", "ValidationError"}
)
"""Exception type names (``report["type"]``) of failures that a rerun repeats."""
CONSEQUENCE_MESSAGES = ("connection reset by peer", "connection closed by peer", "broken pipe")
"""How gloo and NCCL word a lost peer (lower case): a rank that reports one failed because
another rank went first."""
_CONSEQUENCE_TYPES = ("CollectiveTimeoutError", "Terminated")


def failure(failure_dir: Location | Path, exc: BaseException, world_size: int) -> TrainingError:
    """The driver's error for a failed TorchDistributor run, from the ranks' reports.

    Three kinds of report, in ``failure_dir``: ``rank-<r>.json``, the exception and
    traceback of a rank whose Python code raised; ``rank-<r>.fatal``, what
    :mod:`faulthandler` wrote when a rank died of a fatal signal (a crash in native code:
    SIGSEGV, SIGABRT, ...) and every thread's Python stack; and ``rank-<r>.killed``, what a
    rank's watchdog saw of a death without either (SIGKILL, the OOM killer). The cause is
    chosen by class, then time: a rank that died (killed or fatal signal), then a Python
    exception, then a consequence (a lost peer: :data:`CONSEQUENCE_MESSAGES`, a
    ``CollectiveTimeoutError``), last torchrun's SIGTERM (``Terminated``). The watchdog and the
    others' lost connections race by milliseconds, so time alone cannot tell which came
    first. The others are listed after it. Each message is shown on one line, its first
    non-empty lines (:func:`~flowers_job.runtime.reports.summarize_message`: a message that
    starts with a line break still says something there); the whole message ends the
    traceback that closes the error. Ranks that wrote nothing were stopped from
    outside: hung (the others' collectives then time out), killed by torchrun after another
    rank failed, or killed without a watchdog.
    """
    failure_dir = Location.of(failure_dir)
    reports = []
    for path in failure_dir.glob(f"rank-*{FAILURE_SUFFIX}"):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    for path in failure_dir.glob(f"rank-*{FATAL_SUFFIX}"):
        try:
            text = path.read_bytes().decode(errors="replace").strip()
            if text:
                reports.append(_fatal_report(path, text))
        except OSError:
            continue
    reports += _killed_reports(failure_dir)
    if not reports:
        return TrainingError(
            f"distributed training failed and no rank reported an exception (killed by the OS, "
            f"out of memory?): {exc}",
            kind="killed",
        )
    reports.sort(key=lambda r: (_precedence(r), r.get("time", 0.0)))
    first = reports[0]
    where = _rank_hosts(failure_dir)
    if first["type"] == "Killed" and int(first["rank"]) not in where and first.get("host"):
        where[int(first["rank"])] = f" on host {first['host']}"
    silent = sorted(set(range(world_size)) - {int(r["rank"]) for r in reports})
    then = "".join(
        f"\nthen rank {r['rank']}: {r['type']}: {summarize_message(str(r['message']))}"
        for r in reports[1:]
        if r["rank"] != first["rank"]
    )
    note = (
        f"\nranks {', '.join(f'{r}{where.get(r, str())}' for r in silent)} reported no "
        "exception: killed (with their host, executor or driver), stopped after the failure, "
        "or hung (a collective that times out names distributed.timeout_seconds)"
        if silent
        else ""
    )
    what = "died of a fatal signal" if first["type"] == "FatalSignal" else "failed"
    lead = f"{first['type']}: {summarize_message(str(first['message']))}"
    if first["type"] == "Killed":
        what, lead = first["how"], first["message"]
    oom = bool((first.get("oom") or {}).get("killer"))
    return TrainingError(
        f"rank {first['rank']} {what}{where.get(int(first['rank']), '')}: {lead}{then}{note}\n"
        f"--- traceback of rank {first['rank']} ---\n{first['traceback']}",
        rank=first["rank"],
        cause=(
            f"Killed: rank {first['rank']} {first['how']}" + (" (the OOM killer)" if oom else "")
            if first["type"] == "Killed"
            else lead
        ),
        reported_at=first.get("time"),
        kind=_kind(first),
        oom=oom,
    )


def _is_consequence(report: dict[str, Any]) -> bool:
    """Whether a rank's report is another's consequence: a lost peer, a collective timeout,
    torchrun's SIGTERM."""
    message = str(report.get("message", "")).lower()
    return report["type"] in _CONSEQUENCE_TYPES or any(m in message for m in CONSEQUENCE_MESSAGES)


def _precedence(report: dict[str, Any]) -> int:
    """0: the rank died (killed, fatal signal); 1: an exception of its own; 2: a consequence;
    3: torchrun's SIGTERM (``Terminated``), which says nothing of the cause."""
    if report["type"] in ("Killed", "FatalSignal"):
        return 0
    if report["type"] == "Terminated":
        return 3
    return 2 if _is_consequence(report) else 1


def _kind(report: dict[str, Any]) -> str:
    """:data:`KINDS` of the report that leads."""
    if report["type"] in ("Killed", "FatalSignal"):
        return "killed" if report["type"] == "Killed" else "fatal_signal"
    if report["type"] == "CollectiveTimeoutError":
        return "timeout"
    if _is_consequence(report):
        return "connection"
    return "permanent" if report["type"] in PERMANENT_TYPES else "exception"


def _killed_reports(failure_dir: Location) -> list[dict[str, Any]]:
    """The watchdogs' ``rank-<r>.killed`` reports, each with a ``traceback`` that says what
    the watchdog saw (there is none: the process was killed)."""
    reports = []
    for path in failure_dir.glob(f"rank-*{KILLED_SUFFIX}"):
        try:
            report = json.loads(path.read_text())
            oom = report.get("oom") or {}
            kernel = oom.get("kernel_log") or (
                "nothing about it" if oom.get("kernel_log_read") else "not readable"
            )
            report["traceback"] = (
                f"(none: pid {report.get('pid')} {report['how']}; its memory cgroup "
                f"{oom.get('cgroup')}: {oom.get('cgroup_oom_kills')} new OOM kills; the kernel "
                f"log: {kernel})"
            )
            reports.append(report)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return reports


def _fatal_report(path: Location, text: str) -> dict[str, Any]:
    """A ``rank-<r>.fatal`` file as a report: type ``FatalSignal``, the message from
    faulthandler's first line ("Fatal Python error: Aborted" -> "Aborted"), the stacks as
    the traceback, and the file's modification time as the time."""
    rank = int(path.name.split("-", 1)[1].split(".", 1)[0])
    first_line = text.splitlines()[0]
    return {
        "rank": rank,
        "type": "FatalSignal",
        "message": first_line.removeprefix("Fatal Python error:").strip(),
        "traceback": text,
        "time": path.mtime(),
    }


def wait_for_reports(
    failure_dir: Location | Path,
    world_size: int,
    timeout_seconds: float = REPORT_WAIT_SECONDS,
    poll_seconds: float = 0.5,
) -> list[int]:
    """After a failed run, wait until every rank has said how it ended, at most
    ``timeout_seconds``: a ``rank-<r>.json``, a non-empty ``rank-<r>.fatal``, a
    ``rank-<r>.killed`` or a ``rank-<r>.done`` (:data:`DONE_SUFFIX`).

    TorchDistributor raises as soon as Spark fails the barrier stage, while the ranks of
    other hosts may still be unwinding: one that wrote its report after the driver had read
    the dir and removed it was missing from the error and left ``rank-3.json`` in the bucket
    (seen in CI across hosts: docs/performance.md). A rank that never writes (its host lost with
    its watchdog) costs the whole bound.

    Returns:
        The ranks that did not report in time, sorted (empty when all did).
    """
    failure_dir = Location.of(failure_dir)
    deadline = time.monotonic() + timeout_seconds
    missing = set(range(world_size))
    while True:
        for path in failure_dir.glob("rank-*"):
            rank, dot, suffix = path.name.removeprefix("rank-").partition(".")
            kind = dot + suffix
            if rank.isdigit() and kind in _ENDED and (kind != FATAL_SUFFIX or path.size_bytes()):
                missing.discard(int(rank))
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(poll_seconds)
    if missing:
        log.warning(
            "ranks %s wrote no report within %.0f s of the failure",
            sorted(missing),
            timeout_seconds,
        )
    return sorted(missing)


def check_finished(failure_dir: Location | Path, world_size: int) -> None:
    """After TorchDistributor returned: raise if a rank failed anyway, or rank 0 did not
    record the registered model.

    TorchDistributor's local mode reads the result file that *any* rank wrote, and pyspark
    4.0's ``torch_run_process_wrapper`` exits 0 whatever torchrun's status; so a run can
    "succeed" while a rank crashed, or while torchrun stopped rank 0 in the middle of the
    model registration that follows the last collective.

    Raises:
        TrainingError: a rank wrote a report, or ``model.json`` is missing.
    """
    failure_dir = Location.of(failure_dir)
    fatal = [p for p in failure_dir.glob(f"rank-*{FATAL_SUFFIX}") if p.size_bytes() > 0]
    killed = list(failure_dir.glob(f"rank-*{KILLED_SUFFIX}"))
    if fatal or killed or list(failure_dir.glob(f"rank-*{FAILURE_SUFFIX}")):
        raise failure(failure_dir, RuntimeError("a rank failed after training"), world_size)
    if not (failure_dir / MODEL_FILE).exists():
        raise TrainingError(
            f"rank 0 did not finish: TorchDistributor returned, but rank 0 wrote no {MODEL_FILE} "
            "(it logs and registers the model after the last collective); it was stopped or "
            "killed from outside (torchrun, the OS) without reporting an exception",
            rank=0,
            cause="no registered model",
            kind="killed",
        )


def _rank_hosts(report_dir: Location) -> dict[int, str]:
    """`` on host (address)`` of each rank, from rank 0's ``ranks.json`` ({} without one)."""
    try:
        ranks = json.loads((report_dir / RANKS_FILE).read_text())["ranks"]
        return {int(r["rank"]): f" on host {r['host']} ({r['address']})" for r in ranks}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def registered_model(report_dir: Location | Path) -> dict[str, Any]:
    """What rank 0 wrote after registering the model (``model.json``), or {}."""
    try:
        return dict(json.loads((Location.of(report_dir) / MODEL_FILE).read_text()))
    except (OSError, ValueError):
        return {}
