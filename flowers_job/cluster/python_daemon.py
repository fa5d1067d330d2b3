"""PySpark's worker daemon with the job's task libraries imported once, before it forks.

Spark starts one daemon per executor (``pyspark.daemon``) and forks every Python worker
from it. A worker left idle for a minute is killed (``PythonWorkerFactory``'s fixed
``IDLE_WORKER_TIMEOUT_NS``), and the next Python stage forks new ones, which import their
libraries again. Between the loader cache's Python stages (one MDS conversion per split)
the Delta jobs of the JVM alone often take longer than that minute, so every conversion
started in cold workers: ``import streaming.base.converters`` pulls in torch, transformers
and scikit-learn, 8.7 s and 1 GB on an idle 2-core machine and 34-59 s per worker on a
loaded one (docs/performance.md). The daemon imports each loader's task libraries the
loader's own way (:data:`flowers_job.loaders.TASK_LIBRARIES`): Streaming without its
example datasets, which bring in transformers' tokenizer registry and scikit-learn (3,923
modules imported the plain way, 2,538 this way).

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

__all__ = ["PRELOAD", "main", "preload", "preload_loaders"]

PRELOAD = (
    "pandas",
    "pyarrow",
    "PIL.Image",
)
"""Modules the job's Python tasks import whatever the loader: the Arrow batches of every
``mapInPandas`` and the ingest's photo checks. Then each loader's own
(:func:`preload_loaders`): Mosaic Streaming's ``dataframe_to_mds``, with torch."""


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


def preload_loaders() -> list[str]:
    """Call each loader's importer of :data:`flowers_job.loaders.TASK_LIBRARIES`, naming on
    stderr any that fails (its tasks then import as usual, and fail there if they must).

    Returns:
        The modules imported.
    """
    from flowers_job.loaders import task_library_importers

    done = []
    for name, importer in task_library_importers().items():
        try:
            with contextlib.redirect_stdout(sys.stderr):  # stdout is the daemon's port
                done += importer()
        except Exception as exc:  # a loader's library broken here: not the daemon's job
            print(
                f"flowers_job python daemon: {name}'s libraries not preloaded: {exc!r}",
                file=sys.stderr,
            )
    return done


def main() -> None:
    """Preload, then run PySpark's daemon (``pyspark.daemon.manager``) in this process."""
    preload()
    preload_loaders()
    from pyspark.daemon import manager

    manager()


if __name__ == "__main__":
    main()
