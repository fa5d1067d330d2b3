"""A killed rank is named, with its signal: each rank's watchdog
(:mod:`flowers_job.runtime.watchdog`) with real processes, no Spark, no torch.

A stand-in rank (``python -c``) starts its watchdog through :func:`start_watchdog`, as
:func:`flowers_job.train.rank.train_worker` does, and then sleeps, says done, reports an
exception, SIGKILLs itself or runs out of memory in a real memory cgroup. The driver's side
(:func:`flowers_job.driver.failures.failure`) reads what the watchdog wrote.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from flowers_job.driver.failures import (
    DONE_SUFFIX,
    FATAL_SUFFIX,
    RANKS_FILE,
    TrainingError,
    check_finished,
    failure,
    wait_for_reports,
)
from flowers_job.runtime.watchdog import KILLED_SUFFIX, start_watchdog, watchdog_done
from tests.support import faults
from tests.support.faults import ATTEMPT_ENV, FAULT_ENV, delay, fault_env, inject
from tests.support.processes import process_gone

pytestmark = [pytest.mark.timeout(120), pytest.mark.tier("gate")]

SETTINGS = {
    "train.per_device_batch_size": "32",
    "data.loader_workers": "2",
    "loaders.streaming.prefetch_batches": "4",
    "loaders.petastorm.shuffle_buffer_rows": "256",
}
_RANK = """
import json, sys, time
from pathlib import Path
from flowers_job.runtime.hooks import hook, injector
from flowers_job.runtime.watchdog import watchdog_done, start_watchdog

directory, mode = Path(sys.argv[1]), sys.argv[2]
hook("rank_start", rank=1, attempt=0)
print(start_watchdog(directory, 1, json.loads(sys.argv[3])), flush=True)
if mode == "sleep":
    time.sleep(60)
elif mode == "done":
    watchdog_done()
elif mode == "report":
    (directory / "rank-1.json").write_text(json.dumps({"rank": 1, "type": "RuntimeError"}))
    sys.exit(1)
else:
    injector().inject(mode, 1, 0)  # kill, oom: FLOWERS_JOB_HOOKS names the tests' injector
    time.sleep(60)
"""
GONE_SECONDS = 5.0
"""How soon after its rank the watchdog must be gone (seconds)."""


def _start_rank(
    directory: Path, mode: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], int]:
    """A stand-in rank in a process group of its own (torchrun's workers are), and its
    watchdog's pid."""
    directory.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", _RANK, str(directory), mode, json.dumps(SETTINGS)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line.isdigit(), f"no watchdog started: {line!r}"
    return proc, int(line)


def _wait_gone(pid: int) -> float:
    """Seconds until process ``pid`` is gone; fails after :data:`GONE_SECONDS`."""
    t0 = time.monotonic()
    while not process_gone(pid):
        assert time.monotonic() - t0 < GONE_SECONDS, f"the watchdog (pid {pid}) is still running"
        time.sleep(0.02)
    return time.monotonic() - t0


def _killed(directory: Path) -> dict[str, object]:
    return dict(json.loads((directory / f"rank-1{KILLED_SUFFIX}").read_text()))


def test_a_sigkilled_rank_is_named_with_its_signal(tmp_path: Path) -> None:
    """torchrun's way: SIGKILL to the rank's process group. The watchdog, in a session of its
    own, survives it, writes ``rank-1.killed`` naming SIGKILL and no OOM kill, and exits."""
    rank, watchdog = _start_rank(tmp_path, "sleep")
    os.killpg(rank.pid, signal.SIGKILL)
    killed_at = time.time()
    assert rank.wait(10) == -signal.SIGKILL
    print(f"watchdog gone {_wait_gone(watchdog):.3f} s after the reap")
    report = _killed(tmp_path)
    assert report["type"] == "Killed"
    assert (report["signal"], report["signal_number"]) == ("SIGKILL", 9)
    assert report["how"] == "was killed by SIGKILL"
    assert (report["rank"], report["pid"]) == (1, rank.pid)
    assert abs(float(report["time"]) - killed_at) < 2.0  # type: ignore[arg-type]
    oom = report["oom"]
    assert isinstance(oom, dict) and oom["killer"] is False
    assert "not the OOM killer" in str(report["message"])
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temporary file


def test_the_kill_fault_sigkills_the_rank(tmp_path: Path) -> None:
    rank, watchdog = _start_rank(tmp_path, "kill", fault_env("kill:1:0"))
    assert rank.wait(10) == -signal.SIGKILL
    _wait_gone(watchdog)
    assert _killed(tmp_path)["signal"] == "SIGKILL"


def test_a_rank_that_says_done_leaves_no_report(tmp_path: Path) -> None:
    rank, watchdog = _start_rank(tmp_path, "done")
    assert rank.wait(10) == 0
    _wait_gone(watchdog)
    assert not list(tmp_path.iterdir())


def test_a_rank_that_reported_its_exception_gets_no_killed_report(tmp_path: Path) -> None:
    """It wrote ``rank-1.json`` and exited 1 without saying done: its own report stands."""
    rank, watchdog = _start_rank(tmp_path, "report")
    assert rank.wait(10) == 1
    _wait_gone(watchdog)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-1.json"]


def test_the_watchdog_leaves_no_process_or_thread_behind(tmp_path: Path) -> None:
    """Started and told done in this very process: no child, no new thread afterwards."""
    threads = threading.active_count()
    children = {c.pid for c in psutil.Process().children()}  # the suite's Spark JVM, say
    pid = start_watchdog(tmp_path, 0, None)
    assert pid is not None and not process_gone(pid)
    assert psutil.Process(pid).ppid() == os.getpid()
    assert os.getsid(pid) == pid  # a session of its own: torchrun's killpg misses it
    watchdog_done()
    assert process_gone(pid)
    assert {c.pid for c in psutil.Process().children()} <= children
    assert threading.active_count() == threads
    assert not list(tmp_path.iterdir())


@pytest.fixture
def limited_cgroup() -> Iterator[Path]:
    """A fresh memory cgroup allowing 256 MiB (no swap), removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("creating a memory cgroup needs root")
    v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
    name = f"flowers-test-{uuid.uuid4().hex[:12]}"
    limit = str(256 * 2**20)
    if (v1 / "cgroup.procs").is_file():
        cgroup = v1 / name
        cgroup.mkdir()
        (cgroup / "memory.limit_in_bytes").write_text(limit)
        if (cgroup / "memory.memsw.limit_in_bytes").is_file():
            (cgroup / "memory.memsw.limit_in_bytes").write_text(limit)
    elif "memory" in (v2 / "cgroup.subtree_control").read_text().split():
        cgroup = v2 / name
        cgroup.mkdir()
        (cgroup / "memory.max").write_text(limit)
        (cgroup / "memory.swap.max").write_text("0")
    else:
        pytest.skip("no cgroup v1 or v2 memory controller")
    try:
        yield cgroup
    finally:
        deadline = time.monotonic() + 10.0
        while True:
            try:
                cgroup.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def test_an_oom_killed_rank_is_named_with_the_oom_killer_and_the_settings(
    tmp_path: Path, limited_cgroup: Path
) -> None:
    """The ``oom`` fault in a 256 MiB cgroup: the kernel's OOM killer SIGKILLs the rank;
    the report says so and names the settings that decide a rank's memory."""
    env = fault_env("oom:1:0", cgroup=limited_cgroup)
    rank, watchdog = _start_rank(tmp_path / "failures", "oom", env)
    assert rank.wait(60) == -signal.SIGKILL
    _wait_gone(watchdog)
    report = _killed(tmp_path / "failures")
    print(report["message"])
    assert report["signal"] == "SIGKILL"
    oom = report["oom"]
    assert isinstance(oom, dict) and oom["killer"] is True
    assert oom["cgroup"] == str(limited_cgroup) and oom["cgroup_oom_kills"] == 1
    assert oom["memory_limit_bytes"] == 256 * 2**20
    message = str(report["message"])
    assert "the kernel's OOM killer ended it" in message and "256 MiB" in message
    for setting in (
        "train.per_device_batch_size=32",
        "data.loader_workers=2",
        "loaders.streaming.prefetch_batches=4",
        "loaders.petastorm.shuffle_buffer_rows=256",
        "spark.executor.memory",
    ):
        assert setting in message
    error = failure(tmp_path / "failures", RuntimeError("torchrun failed"), world_size=2)
    assert str(error).startswith("rank 1 was killed by SIGKILL on host ")
    assert (error.kind, error.oom, error.rank) == ("killed", True, 1)


def _ranks_file(directory: Path) -> None:
    ranks = [{"rank": r, "host": "vm", "address": "127.0.0.1"} for r in (0, 1)]
    (directory / RANKS_FILE).write_text(json.dumps({"ranks": ranks}))


def _report(directory: Path, rank: int, kind: str, message: str, at: float) -> None:
    report = {"rank": rank, "type": kind, "message": message, "traceback": "...", "time": at}
    (directory / f"rank-{rank}.json").write_text(json.dumps(report))


GLOO_RESET = (
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:41524: "
    "Connection reset by peer"
)


def test_the_driver_names_the_killed_rank_before_an_earlier_lost_peer(tmp_path: Path) -> None:
    """Rank 0's gloo error is written 5 ms before rank 1's watchdog report: the error leads
    with rank 1 and its signal all the same, rank 0's error after it as a consequence."""
    rank, watchdog = _start_rank(tmp_path, "sleep")
    os.killpg(rank.pid, signal.SIGKILL)
    rank.wait(10)
    _wait_gone(watchdog)
    _ranks_file(tmp_path)
    _report(tmp_path, 0, "RuntimeError", GLOO_RESET, float(_killed(tmp_path)["time"]) - 0.005)  # type: ignore[arg-type]
    error = failure(tmp_path, RuntimeError("torchrun failed"), world_size=2)
    text = str(error)
    assert text.startswith(
        "rank 1 was killed by SIGKILL on host vm (127.0.0.1): no Python exception"
    ), text
    assert f"then rank 0: RuntimeError: {GLOO_RESET}" in text
    assert (error.rank, error.kind, error.oom) == (1, "killed", False)
    assert error.cause == "Killed: rank 1 was killed by SIGKILL"
    with pytest.raises(TrainingError, match="rank 1 was killed by SIGKILL"):
        check_finished(tmp_path, world_size=2)  # a "successful" run with a killed rank


@pytest.mark.parametrize(
    ("reports", "kind", "rank"),
    [
        ([(0, "RuntimeError", GLOO_RESET, 1.0), (1, "DataError", "no rows", 2.0)], "permanent", 1),
        ([(0, "Terminated", "SIGTERM", 1.0), (1, "RuntimeError", "a bug", 2.0)], "exception", 1),
        ([(0, "CollectiveTimeoutError", "waited", 1.0), (1, "Terminated", "x", 0.5)], "timeout", 0),
        ([(0, "RuntimeError", "Connection closed by peer [10.0.0.2]", 1.0)], "connection", 0),
        ([], "killed", None),
    ],
)
def test_the_kind_of_a_failure(
    tmp_path: Path, reports: list[tuple[int, str, str, float]], kind: str, rank: int | None
) -> None:
    for r, type_name, message, at in reports:
        _report(tmp_path, r, type_name, message, at)
    error = failure(tmp_path, RuntimeError("torchrun failed"), world_size=2)
    assert (error.kind, error.rank, error.oom) == (kind, rank, False)


def test_a_fatal_signal_still_leads_as_before(tmp_path: Path) -> None:
    _ranks_file(tmp_path)
    _report(tmp_path, 0, "RuntimeError", GLOO_RESET, 0.0)
    (tmp_path / f"rank-1{FATAL_SUFFIX}").write_text("Fatal Python error: Aborted\n\nstack\n")
    error = failure(tmp_path, RuntimeError("torchrun failed"), world_size=2)
    assert str(error).startswith("rank 1 died of a fatal signal on host vm (127.0.0.1)")
    assert (error.rank, error.cause, error.kind) == (1, "FatalSignal: Aborted", "fatal_signal")


def test_the_driver_waits_for_a_late_report_and_stops_at_its_bound(tmp_path: Path) -> None:
    """Rank 0 ended well (``.done``), rank 1's faulthandler file is empty (alive), rank 2
    raised, and rank 1 reports 1 s later: the wait returns with every rank accounted for, so
    the error names rank 1 too. Without rank 1's report it gives up at its bound and says
    which rank stayed silent (a report once written after the driver's read, in CI)."""
    (tmp_path / f"rank-0{DONE_SUFFIX}").write_bytes(b"")
    (tmp_path / f"rank-1{FATAL_SUFFIX}").write_bytes(b"")
    _report(tmp_path, 2, "RuntimeError", "injected", 1.0)
    late = threading.Timer(1.0, _report, (tmp_path, 1, "RuntimeError", GLOO_RESET, 2.0))
    late.start()
    started = time.monotonic()
    assert wait_for_reports(tmp_path, world_size=3, timeout_seconds=30, poll_seconds=0.1) == []
    assert 0.9 < time.monotonic() - started < 10
    late.join()
    assert f"then rank 1: RuntimeError: {GLOO_RESET}" in str(
        failure(tmp_path, RuntimeError("x"), 3)
    )

    (tmp_path / "rank-1.json").unlink()
    started = time.monotonic()
    assert wait_for_reports(tmp_path, world_size=3, timeout_seconds=1, poll_seconds=0.1) == [1]
    assert time.monotonic() - started >= 1


def test_a_fault_entry_with_an_attempt_fires_on_that_attempt_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(FAULT_ENV, "raise:1:2:1,slow_registration:0:0.01:1")
    monkeypatch.delenv(ATTEMPT_ENV, raising=False)
    inject("raise", 1, 2)  # attempt 0 by default: nothing
    monkeypatch.setenv(ATTEMPT_ENV, "1")
    with pytest.raises(RuntimeError, match="injected fault"):
        inject("raise", 1, 2)
    inject("raise", 0, 2)  # another rank
    t0 = time.monotonic()
    delay("slow_registration", 0)
    assert time.monotonic() - t0 >= 0.01
    monkeypatch.setenv(FAULT_ENV, "raise:1:2")  # no attempt: every attempt
    with pytest.raises(RuntimeError, match="injected fault"):
        inject("raise", 1, 2)


def test_the_oom_fault_refuses_to_run_without_a_memory_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(FAULT_ENV, "oom:1:0")
    monkeypatch.setattr(faults, "memory_limit", lambda cgroup: None)
    with pytest.raises(RuntimeError, match="refused"):
        inject("oom", 1, 0)
