"""The memory allocator of every process that runs torch or decodes images.

glibc's malloc hands every block above its mmap threshold (at most 32 MiB, adjusted at run
time) to ``mmap`` and gives it back to the kernel on ``free``; it also trims the top of the
heap back to the kernel once more than its trim threshold (128 KiB by default) is free. A
CPU forward pass allocates and frees activation tensors of several MiB each, so with the
defaults every step page-faults its activations afresh: on this project's 2-core machine,
half of a training rank's CPU time went to the kernel ([known issues](docs/known-issues.md#torch),
and the measurements in benchmarks/README.md).

The cure chosen here is glibc's own tuning, set in the environment before a process starts
(glibc reads it once, at its first ``malloc``):

- ``MALLOC_MMAP_MAX_=0``: no block is mapped on its own; large tensors come from the heap
  and are reused from step to step (raising ``MALLOC_MMAP_THRESHOLD_`` is not enough: glibc
  caps it at 32 MiB, below the first activations of a 224 px batch of 32). A thread arena
  that cannot hold a block still falls back to ``mmap``, and so does the main heap when
  ``brk`` fails, so no allocation fails for it;
- ``MALLOC_TRIM_THRESHOLD_`` at 1 GiB: freed memory stays in the process for the next step
  instead of going back to the kernel and being faulted in again;
- ``MALLOC_TOP_PAD_`` at 64 MiB: the heap grows in large steps.

Measured with benchmarks/allocators.py (frozen Lite0 + head, 2 ranks of 1 thread, 224 px,
batch 32; benchmarks/README.md has the table): glibc's defaults 55 img/s with 27 of 50 CPU
seconds in the kernel, ``MALLOC_MMAP_THRESHOLD_`` raised alone 52, this tuning 155 (2.5 s in
the kernel), jemalloc with its default decay 40, and with decay off
(``MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1``) 169. jemalloc is not the default
because it must be installed on every host and preloaded (``LD_PRELOAD``, an init script on
Databricks), for about 9% over the tuned glibc, which needs nothing. The cost of the tuning:
a process keeps up to ``MALLOC_TRIM_THRESHOLD_`` of freed memory, at most about one training
step's peak.

The variables reach:

- the ranks in local mode (TorchDistributor's ``torchrun`` inherits the driver's
  environment: :func:`apply_to_environ`);
- every rank also applies them to itself with ``mallopt`` when it starts
  (:func:`tune_this_process`): a rank on a cluster whose executors lack the variables is
  still tuned, though only from then on;
- Spark's Python workers, which decode on ingest and run the ranks in barrier mode, on this
  machine and on a cluster: ``spark.executorEnv.<NAME>`` (:func:`spark_conf`; PySpark passes
  every ``spark.executorEnv.*`` setting to the Python workers it starts, and a cluster's
  executors get them in their own environment). On Databricks, set them in the cluster's
  Spark config (``spark.executorEnv.MALLOC_MMAP_MAX_ 0`` ...) or its
  environment variables; the bundle in databricks.yml does.
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
