"""A pytest plugin (registered by tests/conftest.py): a session fails when a process it started
is still alive at its end, and that process is killed, so that no server, JVM or worker of the
suite outlives it.

What counts as the session's (Linux; ``/proc`` and psutil):

- every descendant of the pytest process that started after the session began;
- every process, whatever its parent, whose environment carries this session's mark: at the
  start the plugin adds a fresh word to :data:`SESSION_ENV` in ``os.environ``, which every
  process started afterwards inherits, so that a server whose parent is gone (re-parented
  to init, the case a descendant scan misses) is still found.

At the end (``pytest_sessionfinish``, after the session fixtures' teardown) the helpers whose
life is tied to this process's are stopped first (PySpark's JVM, which exits when its stdin
closes; multiprocessing's resource tracker and fork server), then the session's processes are
given up to ``--leftover-grace`` seconds (:data:`GRACE_SECONDS`) to exit. Any still alive
(zombies do not count) are named in a "processes left behind" section (pid, age, the test
that ran when it started, command line), killed (their process group where every member is
the session's, then each process), and the session's exit status becomes a failure
(``pytest.ExitCode.TESTS_FAILED``) unless it is one already. docs/testing.md, "Processes left
behind".
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tests.support.processes import describe, group_members, marked_processes

SESSION_ENV = "FLOWERS_JOB_TEST_SESSION"
"""The environment variable that marks every process a pytest session starts: one word (a
fresh uuid) per session, nested sessions (a test that runs pytest) adding theirs."""
GRACE_SECONDS = 30.0
"""Default of ``--leftover-grace``: how long the session's processes get to exit after its
last teardown, seconds (a JVM's shutdown, Spark's Python workers noticing it)."""
POLL_SECONDS = 0.5
"""How often the session's processes are looked for during the grace, seconds."""
KILL_SECONDS = 10.0
"""Wait for a killed leftover, or a stopped helper, to exit, seconds."""
HELPER_STOP_SECONDS = 30.0
"""Wait for PySpark's JVM to exit once its stdin is closed, seconds."""
SECTION = "processes left behind"
"""The title of the report's section."""
COUNTED_AS = "left behind"
"""What pytest's last line counts them as (``1 passed, 1 left behind in 3.1s``)."""


@dataclass
class Leftover:
    """A process of the session still alive at its end."""

    pid: int
    age: float
    """Seconds since it started."""
    command: str
    during: str
    """Which test ran when it started (``while <node id> ran``, ``after <node id>``)."""
    group: int | None
    survived: bool = False
    """Still alive after the kill."""


@dataclass
class _State:
    mark: str
    previous: str | None
    """:data:`SESSION_ENV` before this session (a session around this one), None when unset."""
    before: set[tuple[int, float | None]]
    """The (pid, start) of this process's descendants alive at the start: not this session's."""
    tests: list[tuple[float, float, str]] = field(default_factory=list)
    """(start, end, node id) of each test run, seconds since boot."""
    left: list[Leftover] = field(default_factory=list)


_STATE = pytest.StashKey[_State]()


def started(pid: int) -> float | None:
    """When ``pid`` started, seconds since boot (``/proc/<pid>/stat``'s start time: the clock
    of :func:`now`); None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")


def now() -> float:
    """Seconds since boot (``CLOCK_BOOTTIME``, the clock of ``/proc``'s start times)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _key(pid: int) -> tuple[int, float | None]:
    return pid, started(pid)


def descendants() -> list[psutil.Process]:
    """This process's descendants, alive or zombie."""
    with contextlib.suppress(psutil.Error):
        return psutil.Process().children(recursive=True)
    return []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--leftover-grace",
        type=float,
        default=GRACE_SECONDS,
        metavar="SECONDS",
        help="how long the processes this session started get to exit after its end before "
        f"they fail it and are killed (default {GRACE_SECONDS:.0f}; tests/support/leftovers.py)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Marks what this session starts from now on (:data:`SESSION_ENV`), and notes this
    process's descendants that are not the session's."""
    mark = uuid.uuid4().hex
    previous = os.environ.get(SESSION_ENV)
    os.environ[SESSION_ENV] = f"{previous} {mark}" if previous else mark
    config.stash[_STATE] = _State(mark, previous, {_key(p.pid) for p in descendants()})


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    """Notes when each test ran (setup to teardown), to name the test a leftover started in."""
    start = now()
    try:
        return (yield)
    finally:
        if (state := item.config.stash.get(_STATE, None)) is not None:
            state.tests.append((start, now(), item.nodeid))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """After every session fixture's teardown (the runner's own ``pytest_sessionfinish``):
    stop the helpers that die with this process, wait out the grace, then name and kill what
    is left, failing the session."""
    state = session.config.stash.get(_STATE, None)
    if state is None:
        return
    stop_helpers(state.before)
    grace = float(session.config.getoption("leftover_grace", GRACE_SECONDS))
    procs = wait_for_leftovers(state, grace)
    if not procs:
        return
    state.left = [_leftover(proc, state.tests) for proc in procs]
    survivors = {proc.pid for proc in kill(procs)}
    for left in state.left:
        left.survived = left.pid in survivors
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:  # counted on pytest's last line
        reporter.stats.setdefault(COUNTED_AS, []).extend(state.left)
    else:
        sys.stderr.write("\n".join(report_lines(state.left, grace)) + "\n")


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    state = terminalreporter.config.stash.get(_STATE, None)
    if state is None or not state.left:
        return
    grace = float(terminalreporter.config.getoption("leftover_grace", GRACE_SECONDS))
    terminalreporter.write_sep("=", SECTION, red=True, bold=True)
    for line in report_lines(state.left, grace):
        terminalreporter.write_line(line)


def pytest_unconfigure(config: pytest.Config) -> None:
    """:data:`SESSION_ENV` as it was before this session."""
    state = config.stash.get(_STATE, None)
    if state is None:
        return
    if state.previous is None:
        os.environ.pop(SESSION_ENV, None)
    else:
        os.environ[SESSION_ENV] = state.previous


def session_processes(state: _State) -> list[psutil.Process]:
    """The live (not zombie) processes of this session: descendants of this process started
    after the session began, and processes anywhere carrying its mark; this process left out.
    """
    found: dict[int, psutil.Process] = {}
    for proc in [*descendants(), *marked_processes(state.mark, SESSION_ENV)]:
        if proc.pid == os.getpid() or proc.pid in found or _key(proc.pid) in state.before:
            continue
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE:
                found[proc.pid] = proc
    return sorted(found.values(), key=lambda p: p.pid)


def wait_for_leftovers(state: _State, grace: float) -> list[psutil.Process]:
    """This session's processes still alive after up to ``grace`` seconds (returns as soon as
    there are none)."""
    deadline = time.monotonic() + grace
    while (left := session_processes(state)) and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
    return left


def stop_helpers(before: set[tuple[int, float | None]]) -> None:
    """Stop the helper processes of this process that would exit only with it, and were
    started in this session (not in ``before``): PySpark's JVM (the ``spark`` fixture's, any
    local session's; its stdin closed, then SIGKILL after :data:`HELPER_STOP_SECONDS`),
    multiprocessing's resource tracker and fork server. Their own children are then the
    check's like any other process."""
    if "pyspark" in sys.modules:
        _stop_spark_jvm(before)
    for module, attribute, pid_attribute in (
        ("multiprocessing.resource_tracker", "_resource_tracker", "_pid"),
        ("multiprocessing.forkserver", "_forkserver", "_forkserver_pid"),
    ):
        helper = getattr(sys.modules.get(module), attribute, None)
        pid = getattr(helper, pid_attribute, None)
        if helper is not None and pid is not None and _key(pid) not in before:
            with contextlib.suppress(Exception):  # best effort: the check names what is left
                helper._stop()


def _stop_spark_jvm(before: set[tuple[int, float | None]]) -> None:
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    proc: subprocess.Popen[bytes] | None = getattr(gateway, "proc", None)
    if gateway is None or proc is None or _key(proc.pid) in before:
        return  # none, or not this session's (spark-submit's, an outer session's)
    # No call into the JVM (a hung one would hang here): py4j's sockets closed, then its
    # stdin, on whose end it exits (its shutdown hook stops a SparkContext left active).
    with contextlib.suppress(Exception):
        gateway.shutdown()
    SparkContext._gateway = None
    SparkContext._jvm = None
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    try:
        proc.wait(HELPER_STOP_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(KILL_SECONDS)


def _during(start: float | None, tests: list[tuple[float, float, str]]) -> str:
    """Which test ran at ``start`` (seconds since boot): ``while <node id> ran``, else ``after
    <node id>`` (the last one that had ended), else ``before the first test``."""
    if start is None:
        return "at an unknown time"
    tick = 1 / os.sysconf("SC_CLK_TCK")  # start times are whole clock ticks, rounded down
    earlier = None
    for begin, end, nodeid in tests:
        if begin - tick <= start <= end:
            return f"while {nodeid} ran"
        if end < start:
            earlier = nodeid
    return f"after {earlier}" if earlier else "before the first test"


def _leftover(proc: psutil.Process, tests: list[tuple[float, float, str]]) -> Leftover:
    start = started(proc.pid)
    try:
        group: int | None = os.getpgid(proc.pid)
    except OSError:
        group = None
    age = now() - start if start is not None else float("nan")
    return Leftover(proc.pid, age, describe(proc), _during(start, tests), group)


def kill(procs: list[psutil.Process]) -> list[psutil.Process]:
    """SIGKILL each of ``procs``: its process group first where every live member of that
    group is among ``procs`` (never this process's group nor an ancestor's), then the
    process; waits up to :data:`KILL_SECONDS` (reaping this process's children). Returns
    those still alive."""
    mine = {p.pid for p in procs}
    protected = set()
    with contextlib.suppress(psutil.Error, OSError):
        protected = {os.getpgid(0), *(os.getpgid(p.pid) for p in psutil.Process().parents())}
    for proc in procs:
        with contextlib.suppress(OSError):
            group = os.getpgid(proc.pid)
            if group not in protected and {p.pid for p in group_members(group)} <= mine:
                os.killpg(group, signal.SIGKILL)
        with contextlib.suppress(psutil.Error):
            proc.kill()
    _, alive = psutil.wait_procs(procs, timeout=KILL_SECONDS)
    return [p for p in alive if _alive(p)]


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def report_lines(left: list[Leftover], grace: float) -> list[str]:
    """The report's lines: what was found, then one line per process."""
    lines = [
        f"{len(left)} process(es) this session started were still alive {grace:.0f} s after "
        "its end (tests/support/leftovers.py): the session fails; each was killed (its "
        "process group, then itself). Stop what a test starts with "
        "tests.support.processes.stop_group.",
    ]
    for item in left:
        state = "STILL ALIVE after SIGKILL" if item.survived else "killed"
        lines.append(
            f"pid {item.pid} (group {item.group}), {item.age:.0f} s old, started "
            f"{item.during}, {state}: {item.command}"
        )
    return lines
