"""The memory allocator of every process that runs torch or decodes images: glibc's malloc
tuned so that a CPU step's activations of several MiB are reused from the heap instead of
mapped and unmapped on every step (``MALLOC_MMAP_MAX_=0``, ``MALLOC_TRIM_THRESHOLD_`` 1 GiB,
``MALLOC_TOP_PAD_`` 64 MiB), set in the environment before a process starts: glibc reads it
at its first ``malloc``. The variables reach the ranks in local mode (:func:`apply_to_environ`),
Spark's Python workers (:func:`spark_conf`: ``spark.executorEnv.*``) and every rank as it
starts (:func:`tune_this_process`, with ``mallopt``). Why, the alternatives measured
(jemalloc among them), and what it costs: docs/performance.md, "An allocator that does not
thrash"; the trap: docs/known-issues.md, "torch".
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "ALLOCATOR_ENV",
    "allocator_report",
    "apply_to_environ",
    "find_jemalloc",
    "spark_conf",
    "tune_this_process",
]

ALLOCATOR_ENV: Mapping[str, str] = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(2**30),
    "MALLOC_TOP_PAD_": str(64 * 2**20),
}
"""glibc's malloc tuning for torch on CPU (bytes; see the module docstring)."""

_JEMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/local/lib/libjemalloc.so.2",
)


def find_jemalloc() -> str | None:
    """Path of an installed ``libjemalloc.so.2``, or None (for benchmarks and users who
    prefer it: ``LD_PRELOAD=<path>``)."""
    return next((p for p in _JEMALLOC_PATHS if Path(p).exists()), None)


_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_TOP_PAD_": -2, "MALLOC_MMAP_MAX_": -4}
"""glibc's ``mallopt`` parameter numbers (``<malloc.h>``: M_TRIM_THRESHOLD, M_TOP_PAD,
M_MMAP_MAX) for the variables of :data:`ALLOCATOR_ENV`."""


def tune_this_process() -> bool:
    """Apply :data:`ALLOCATOR_ENV` to the running process with glibc's ``mallopt``, for a
    process that started without the variables (a benchmark or notebook that runs torch
    in-process; a rank on a cluster whose executors lack them). Values the environment
    set are kept. Returns False where glibc's ``mallopt`` is not available (musl, macOS,
    jemalloc preloaded: its own settings apply)."""
    import ctypes
    import ctypes.util

    if "jemalloc" in allocator_report()["allocator"]:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = True
    for key, param in _MALLOPT.items():
        value = int(os.environ.get(key, ALLOCATOR_ENV[key]))
        ok = bool(mallopt(ctypes.c_int(param), ctypes.c_int(min(value, 2**31 - 1)))) and ok
    return ok


def apply_to_environ(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set :data:`ALLOCATOR_ENV` in ``environ`` (default ``os.environ``) for the processes
    started from now on; values already set (by the user) are kept. The running process is
    not affected. Returns the values in effect."""
    env = os.environ if environ is None else environ
    for key, value in ALLOCATOR_ENV.items():
        env.setdefault(key, value)
    return {key: env[key] for key in ALLOCATOR_ENV}


def spark_conf(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``spark.executorEnv.<NAME>`` settings carrying the allocator variables to Spark's
    executors and Python workers (the user's own values in ``environ`` win)."""
    env = os.environ if environ is None else environ
    return {f"spark.executorEnv.{k}": env.get(k, v) for k, v in ALLOCATOR_ENV.items()}


def allocator_report() -> dict[str, str]:
    """What this process runs with: ``{"allocator": "jemalloc" | "tcmalloc" | "glibc",
    <each MALLOC_* variable>: its value or "unset"}``.

    The variables are read from ``/proc/self/environ``, the environment the process
    started with, which is what glibc read (a later ``os.environ`` change has no effect on
    the allocator); jemalloc and tcmalloc are found in ``/proc/self/maps``. Off Linux, from
    ``os.environ``, and "glibc".
    """
    try:
        maps = Path("/proc/self/maps").read_text()
        raw = Path("/proc/self/environ").read_bytes().split(b"\0")
        started = dict(e.decode(errors="replace").partition("=")[::2] for e in raw if e)
    except OSError:
        maps, started = "", dict(os.environ)
    kind = "jemalloc" if "libjemalloc" in maps else "tcmalloc" if "libtcmalloc" in maps else "glibc"
    return {"allocator": kind, **{k: started.get(k, "unset") for k in ALLOCATOR_ENV}}
