"""The job's errors: one hierarchy under :class:`FlowersJobError`, whose ``exit_code`` is the
status ``flowers-job`` exits with (:func:`flowers_job.cli.main` maps them in one place).

- :class:`ConfigError` (also a ``ValueError``): exit 2

  - :class:`ClusterError`: exit 2

    - :class:`ObjectStoreError` (also a ``RuntimeError``): exit 2

  - :class:`OutputInUseError`: exit 2

- :class:`DataError` (also a ``RuntimeError``): exit 1

  - :class:`IngestError`, :class:`ShardError`: exit 1

- :class:`TrainingError` (also a ``RuntimeError``): exit 1

  - :class:`CollectiveTimeoutError`: exit 1

- :class:`TrackingError` (also a ``RuntimeError``): exit 1
- :class:`PredictError` (also a ``RuntimeError``): exit 1

  - :class:`UsageError`: exit 2

Each keeps the builtin it subclassed before (``ValueError``, ``RuntimeError``) as a second
base, for callers that catch the builtin. Each is still importable from the module that
raised it before (``flowers_job.config``, ``flowers_job.ingest.job``,
``flowers_job.tracking.mlflow_run``, ...). Exit status 0 is success; an exception outside
this hierarchy is a bug and ends the process with Python's traceback (status 1).
A photo that cannot become an image is not an error of the job:
:class:`flowers_job.vision.limits.ImageRejected` is a row's verdict, never raised out of it.

This module imports nothing from the package, so that every layer can import it (the
configuration included).
"""

from __future__ import annotations

__all__ = [
    "ClusterError",
    "CollectiveTimeoutError",
    "ConfigError",
    "DataError",
    "FlowersJobError",
    "IngestError",
    "ObjectStoreError",
    "OutputInUseError",
    "PredictError",
    "ShardError",
    "TrackingError",
    "TrainingError",
    "UsageError",
]


class FlowersJobError(Exception):
    """The base of the job's errors: what the CLI reports as one line,
    ``flowers-job <command>: <Error>: <message>``, and exits with :attr:`exit_code`."""

    exit_code: int = 1
    """The status ``flowers-job`` exits with: 2 the configuration (or the cluster it asks
    for) is wrong, before any work; 1 the work failed."""


class ConfigError(FlowersJobError, ValueError):
    """Invalid configuration. The message names every offending field (``train.epochs: ...``).
    Raised while the configuration is built (:func:`flowers_job.config.load_config`) and by
    the checks before any work (a loader this stack cannot run, a missing package).
    Exit status 2."""

    exit_code = 2


class ClusterError(ConfigError):
    """The configuration does not fit the Spark cluster: task slots or GPUs, a placement of
    ranks the loader cannot read with, storage or tracking credentials the executors lack,
    too few live executors to restart, a loader or local-mode GPUs a Spark Connect session
    cannot run, a Connect server that does not answer. Raised on the driver right
    after Spark starts (:mod:`flowers_job.cluster`) or before a restart, before any work.
    A :class:`ConfigError`, as before it had a class of its own. Exit status 2."""


class ObjectStoreError(ClusterError, RuntimeError):
    """The object store of ``data.images`` failed for another reason than a missing key
    (credentials, permissions, network). Raised in the ingest's Spark tasks: the task fails
    and is retried, and a photo is never quarantined for it. The message names
    ``data.images`` and the URI, never credentials. Exit status 2 (should it reach the CLI
    unwrapped)."""


class OutputInUseError(ConfigError):
    """Another flowers_job command holds the lease on ``paths.output_dir``
    (:mod:`flowers_job.driver.lease`): the message names it (host, pid, start time). Raised
    on the driver by ``run``, ``train`` and ``ingest`` before they write anything there.
    Exit status 2."""


class DataError(FlowersJobError, RuntimeError):
    """The tables cannot be trained on as they are (missing, inconsistent, too small), or
    their loader cache cannot be written. Raised on the driver, before any rank starts.
    Exit status 1."""


class IngestError(DataError):
    """The input as a whole cannot be ingested (``data.images`` missing, unreadable, without
    a label folder); nothing was written. Raised on the driver by ``ingest`` and ``run``.
    Exit status 1."""


class ShardError(DataError):
    """A rank read other rows than the driver's plan: more or fewer batches or rows, or rows
    dropped or read twice across the ranks. Raised on a rank: the driver then raises a
    :class:`TrainingError` naming it (and never restarts for it). Exit status 1."""


class TrainingError(FlowersJobError, RuntimeError):
    """Distributed training failed. Raised on the driver after TorchDistributor returns or
    raises (:func:`flowers_job.driver.failures.failure`). ``rank`` and ``cause`` name the
    failing rank; ``reported_at`` is when that rank reported it (seconds since the epoch);
    ``kind`` is one of :data:`flowers_job.driver.failures.KINDS`, and ``oom`` whether the
    kernel's OOM killer ended that rank. Exit status 1."""

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        cause: str | None = None,
        reported_at: float | None = None,
        kind: str = "exception",
        oom: bool = False,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.cause = cause
        self.reported_at = reported_at
        self.kind = kind
        self.oom = oom


class CollectiveTimeoutError(TrainingError):
    """A collective waited longer than ``distributed.timeout_seconds`` for another rank.
    Raised on a rank (:mod:`flowers_job.train.rank`); the driver reports it as the
    consequence of another rank's failure, in a :class:`TrainingError`. Exit status 1."""


class TrackingError(FlowersJobError, RuntimeError):
    """The MLflow store cannot be used (unreachable, refused, no such experiment to list).
    Raised on the driver by the preflight before Spark starts, and by ``runs``.
    Exit status 1."""


class PredictError(FlowersJobError, RuntimeError):
    """Scoring cannot start: unknown model, version or alias, missing input. Raised on the
    driver by ``predict``, before Spark starts. Exit status 1."""


class UsageError(PredictError):
    """The ``predict`` command line is wrong: a malformed model URI, no model to use.
    Exit status 2."""

    exit_code = 2
