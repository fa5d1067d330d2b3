"""The driver's identity and liveness, and the watchdog that ties the ranks' lives to it.

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

__all__ = ["at_driver_death", "driver_identity", "process_alive", "watch_driver"]

log = logging.getLogger(__name__)

_AT_DRIVER_DEATH: list[Callable[[], None]] = []


def at_driver_death(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` (quick, no collectives) if the watchdog ends this process.

    The watchdog ends the process with ``os._exit``, which runs no ``atexit`` handler and no
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


def watch_driver(driver: dict[str, Any] | None, interval_seconds: float = 2.0) -> bool:
    """Exit this process (and its children) soon after the driver dies.

    A daemon thread checks every ``interval_seconds`` that the driver process still exists
    and, once it does not, kills this process's children and ends it with ``os._exit(70)``.

    Args:
        driver: :func:`driver_identity` of the driver, or None to watch nothing.
        interval_seconds: polling period (seconds).

    Returns:
        True if a watchdog was started; False when the driver runs on another host (a
        cluster manager ends executors' processes when the driver goes).
    """
    if not driver or driver.get("host") != socket.gethostname():
        return False

    def watch() -> None:
        while process_alive(driver):
            time.sleep(interval_seconds)
        log.error("the driver (pid %s) is gone: process %d exits", driver["pid"], os.getpid())
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
