"""PySpark's worker daemon with the job's task libraries imported once, before it forks.

Spark starts one daemon per executor (``pyspark.daemon``) and forks every Python worker
from it. A worker left idle for a minute is killed (``PythonWorkerFactory``'s fixed
``IDLE_WORKER_TIMEOUT_NS``), and the next Python stage forks new ones, which import their
libraries again. Between the loader cache's Python stages (one MDS conversion per split)
the Delta jobs of the JVM alone often take longer than that minute, so every conversion
started in cold workers: ``import streaming.base.converters`` pulls in torch, transformers
and scikit-learn, 8.7 s and 1 GB on an idle 2-core machine and 34-59 s per worker on a
loaded one (docs/performance.md).

Set as ``spark.python.daemon.module`` (a static setting: ``spark-submit --conf``; the local
session sets it itself), this module imports those libraries in the daemon, and every
worker it forks starts with them. A library that is not installed is skipped; the daemon
then works as PySpark's own. The executors' Python must have ``flowers_job`` installed (as
the cluster's environment does); where it does not (a Databricks cluster's
libraries install after the daemon starts), leave the setting unset.

Forking after these imports: they leave two helper threads in the daemon (NumPy's BLAS
pool and an allocator's background thread), of libraries that register fork handlers; a
forked worker has only the forking thread, as with PySpark's own daemon, and imports
nothing again. Every Python stage of the test suites, local and on the netns cluster, runs
in workers forked this way.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys

__all__ = ["PRELOAD", "main", "preload"]

PRELOAD = (
    "pandas",
    "pyarrow",
    "PIL.Image",
    "streaming.base.converters",
)
"""Modules the job's Python tasks import: the Arrow batches of every ``mapInPandas``, the
ingest's photo checks, and Mosaic Streaming's ``dataframe_to_mds`` (with torch)."""


def preload(modules: tuple[str, ...] = PRELOAD) -> list[str]:
    """Import ``modules``, skipping quietly any whose package is not installed (Streaming in
    the Petastorm environment) and, with a line on stderr, any that fails to import
    (PySpark's worker then imports it as usual, and fails there if it must).

    Returns:
        The modules imported.
    """
    done = []
    for name in modules:
        if importlib.util.find_spec(name.partition(".")[0]) is None:
            continue
        try:
            # the daemon tells Spark its port on stdout: nothing else may go there
            with contextlib.redirect_stdout(sys.stderr):
                importlib.import_module(name)
        except Exception as exc:  # an optional library, or one broken here: not the daemon's job
            print(f"flowers_job python daemon: {name} not preloaded: {exc!r}", file=sys.stderr)
        else:
            done.append(name)
    return done


def main() -> None:
    """Preload, then run PySpark's daemon (``pyspark.daemon.manager``) in this process."""
    preload()
    from pyspark.daemon import manager

    manager()


if __name__ == "__main__":
    main()
