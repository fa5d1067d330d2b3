"""The driver's identity and liveness, and the watch that ties the ranks' lives to it.

Torch-free (psutil only): the driver side imports it while preparing data, and every
rank starts :func:`watch_driver` first thing. A driver killed with SIGKILL (or by the OOM
killer) runs no cleanup; in local mode TorchDistributor's ``torchrun`` and its ranks
outlive it, would keep training, hold the Petastorm cache and race a resumed run for the
checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

__all__ = [
    "at_driver_death",
    "driver_identity",
    "process_alive",
    "watch_driver",
    "watched_processes",
]

log = logging.getLogger(__name__)

_AT_DRIVER_DEATH: list[Callable[[], None]] = []


def at_driver_death(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` (quick, no collectives) if the driver's watch ends this process.

    The watch ends the process with ``os._exit``, which runs no ``atexit`` handler and no
    ``finally``; what must not outlive the rank (shared memory, lock files) registers here.
    """
    _AT_DRIVER_DEATH.append(cleanup)


def driver_identity() -> dict[str, Any]:
    """Who the driver is, for :func:`watch_driver`: ``{"host", "pid", "create_time"}``.

    ``create_time`` (seconds since the epoch, from psutil) tells a reused pid from the driver.
    """
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "create_time": psutil.Process().create_time(),
    }


def process_alive(identity: dict[str, Any]) -> bool:
    """Whether the process of :func:`driver_identity` ``identity`` still runs on this host."""
    try:
        proc = psutil.Process(int(identity["pid"]))
        same = abs(proc.create_time() - float(identity["create_time"])) < 1.0
        return same and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _is_jvm(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return proc.name() == "java" or os.path.basename(proc.exe()) == "java"
    return False


def _identity(proc: psutil.Process) -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": proc.pid, "create_time": proc.create_time()}


def watched_processes(driver: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The processes this rank must not outlive, as :func:`driver_identity` dicts.

    The chain of this process's ancestors, nearest first, up to the first that is either
    the driver (local mode: the ranks descend from it) or a JVM (barrier mode: the Spark
    executor whose task started ``torchrun``, or the driver's JVM on a local master); plus
    the driver itself when it runs on this host. Without either, the parent (``torchrun``).
    """
    here = bool(driver) and driver.get("host") == socket.gethostname()  # type: ignore[union-attr]
    chain: list[psutil.Process] = []
    for proc in psutil.Process().parents():
        chain.append(proc)
        if (here and proc.pid == int(driver["pid"])) or _is_jvm(proc):  # type: ignore[index]
            break
    else:
        chain = chain[:1]
    watched = [_identity(p) for p in chain if p.pid != 1]
    if here and all(w["pid"] != int(driver["pid"]) for w in watched):  # type: ignore[index]
        watched.append(dict(driver))  # type: ignore[arg-type]
    return watched


def watch_driver(driver: dict[str, Any] | None, interval_seconds: float = 2.0) -> bool:
    """Exit this process (and its children) soon after the driver or the executor dies.

    A daemon thread checks every ``interval_seconds`` that every process of
    :func:`watched_processes` still exists and, once one does not, runs the
    :func:`at_driver_death` cleanups, kills this process's children and ends it with
    ``os._exit(70)``. In local mode that is the driver; on a cluster, where the driver is
    on another host, the Spark executor (its JVM) that runs this rank's task, and the
    processes between: a SIGKILLed driver, executor or Spark worker never leaves a rank
    training on (measured times: docs/failures.md, "Faults across hosts").

    Args:
        driver: :func:`driver_identity` of the driver, or None.
        interval_seconds: polling period (seconds).

    Returns:
        True if a watch was started (False: nothing to watch).
    """
    watched = watched_processes(driver)
    if not watched:
        return False

    def watch() -> None:
        while all(process_alive(w) for w in watched):
            time.sleep(interval_seconds)
        gone = next(w for w in watched if not process_alive(w))
        log.error(
            "process %s (%s) is gone: process %d exits",
            gone["pid"],
            "the driver" if driver and gone["pid"] == driver.get("pid") else "an ancestor",
            os.getpid(),
        )
        for cleanup in _AT_DRIVER_DEATH:
            try:
                cleanup()
            except Exception:
                log.exception("cleanup before exit failed")
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        os._exit(70)

    threading.Thread(target=watch, name="driver-watchdog", daemon=True).start()
    return True
