"""Spark Connect and classic Spark: which one the job has, and what each can tell it.

Spark 4 makes Connect its main client API, and Databricks hands Connect sessions to
serverless compute and standard access mode. The job runs on both through the DataFrame API
(``mapInPandas``/``mapInArrow``, barrier ``mapInArrow``, SQL, job tags, session artifacts),
which both have; the few facts classic Spark reads from its ``SparkContext`` come from a
short Spark job or the session's settings on Connect (:func:`spark_master`,
:func:`default_parallelism`). What Connect cannot do is named by the code that needs it,
from a real attempt: there the driver cannot remove an executor that stopped answering
before a restart (``killExecutors``, the status store: :mod:`flowers_job.cluster.slots`),
nor tell a task's GPU slots unless the server's settings give them. A loader that needs
classic Spark says so (:attr:`flowers_job.loaders.base.Loader.classic_only`) and is refused
on Connect before any work; neither registered loader does (Petastorm's here never calls
``make_spark_converter``, whose ``DataFrame._jdf`` Connect lacks).

What makes a Python process use Spark Connect (pyspark 4.0's ``SparkSession.builder``,
``pyspark.sql.utils.is_remote``, ``pyspark.util.default_api_mode``):

- ``SPARK_REMOTE=sc://...`` (or ``local``: a Connect server started in-process), or
  ``flowers-job --remote sc://...``;
- spark-submit's ``--remote URL``, ``--conf spark.remote=URL`` or
  ``--conf spark.api.mode=connect``, which spark-submit hands to Python in
  ``PYSPARK_REMOTE_INIT_CONF_<i>`` (JSON), not as ``SPARK_REMOTE``;
- ``SPARK_API_MODE=connect``, or ``SPARK_CONNECT_MODE=1`` / the ``pyspark-connect`` package
  (Connect the default API mode);
- ``SPARK_CONNECT_MODE_ENABLED``, which pyspark sets once a Connect session exists in the
  process (and which a Databricks serverless or standard-access notebook has);
- ``pyspark-client``, a PySpark with no JVM side at all;
- or simply being handed a ``pyspark.sql.connect.session.SparkSession`` (Databricks gives
  one as ``spark`` on serverless compute and in standard access mode).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = [
    "SparkJobTimeout",
    "connect_reason",
    "connect_url",
    "default_parallelism",
    "is_connect_session",
    "remote_session",
    "run_tagged",
    "session_kind",
    "spark_master",
    "wanted_connect",
]


def is_connect_session(spark: Any) -> bool:
    """``spark`` is a Spark Connect session (``pyspark.sql.connect.session.SparkSession``).

    The class is looked up in ``sys.modules`` only: a Connect session cannot exist unless
    its module was imported, and importing it needs grpcio, which a classic-only
    environment may lack."""
    module = sys.modules.get("pyspark.sql.connect.session")
    return module is not None and isinstance(spark, module.SparkSession)


def connect_url(value: str) -> str:
    """A Connect URL without its parameters (``sc://host:port/;token=...``: a secret)."""
    base, _, params = value.partition(";")
    return f"{base.rstrip('/')}/;<parameters hidden>" if params else value


def _submitted_conf() -> dict[str, str]:
    """The settings spark-submit handed to Python for a Connect application
    (``PYSPARK_REMOTE_INIT_CONF_LEN`` JSON objects, as pyspark's Connect builder reads them)."""
    conf: dict[str, str] = {}
    with contextlib.suppress(ValueError, TypeError):  # not pyspark's JSON: what was read
        for i in range(int(os.environ.get("PYSPARK_REMOTE_INIT_CONF_LEN", "0"))):
            conf.update(json.loads(os.environ.get(f"PYSPARK_REMOTE_INIT_CONF_{i}", "{}")))
    return {str(k): str(v) for k, v in conf.items()}


def connect_reason(spark: Any = None) -> str | None:
    """What makes this process's Spark a Spark Connect one, as a setting and its value
    (a URL without its parameters); None for classic Spark.

    Args:
        spark: the session to check as well (any object); None: the environment only, which
            needs no JVM and no session (the CLI asks before it starts Spark).
    """
    from pyspark.util import default_api_mode, is_remote_only

    env = os.environ
    submitted = _submitted_conf()
    modes = {submitted.get("spark.api.mode", "").lower(), env.get("SPARK_API_MODE", "").lower()}
    cls = type(spark)
    reasons = [
        (
            spark is not None and is_connect_session(spark),
            f"the Spark session is a {cls.__module__}.{cls.__qualname__}",
        ),
        ("SPARK_REMOTE" in env, f"SPARK_REMOTE={connect_url(env.get('SPARK_REMOTE', ''))}"),
        (
            "spark.remote" in submitted,
            f"spark.remote={connect_url(submitted.get('spark.remote', ''))} from spark-submit "
            "--remote or --conf",
        ),
        (
            submitted.get("spark.api.mode", "").lower() == "connect",
            "spark.api.mode=connect from spark-submit --conf",
        ),
        (env.get("SPARK_API_MODE", "").lower() == "connect", "SPARK_API_MODE=connect"),
        (
            "SPARK_CONNECT_MODE_ENABLED" in env,
            f"SPARK_CONNECT_MODE_ENABLED={env.get('SPARK_CONNECT_MODE_ENABLED')}",
        ),
        (is_remote_only(), "the installed PySpark is pyspark-client (Connect only, no JVM)"),
        (
            default_api_mode() == "connect" and "classic" not in modes,
            "SPARK_CONNECT_MODE=1 or the pyspark-connect package (Connect by default)",
        ),
    ]
    return next((reason for hit, reason in reasons if hit), None)


def spark_master(spark: Any) -> str:
    """The master URL of the cluster that runs ``spark``'s jobs (``local[2]``,
    ``spark://host:7077``, ``yarn``...): ``SparkContext.master`` on classic Spark, the
    server's ``spark.master`` setting on Connect ('' where the server hides it)."""
    if is_connect_session(spark):
        return str(spark.conf.get("spark.master", "") or "")
    return str(spark.sparkContext.master)


_PARALLELISM_ROWS = 1 << 16
"""Rows of the ``spark.range`` whose partitions :func:`default_parallelism` counts on Connect:
more than any cluster's task slots, so that no partition is empty."""
_parallelism: dict[int, int] = {}
_parallelism_lock = threading.Lock()


class SparkJobTimeout(RuntimeError):
    """A Spark job run by :func:`run_tagged` did not end within its bound; it was interrupted
    (``SparkSession.interruptTag``)."""


def run_tagged(spark: Any, action: Callable[[], T], what: str, timeout_seconds: float) -> T:
    """``action()`` (Spark jobs: a ``collect``), bounded: run in a thread whose jobs are
    marked as its own, and cancelled after ``timeout_seconds``.

    On Spark Connect the mark is a job tag (``SparkSession.addTag``, kept per thread by the
    client) and the cancel ``SparkSession.interruptTag``. On classic Spark it is a job group
    (``SparkContext.setJobGroup`` with ``interruptOnCancel``, ``cancelJobGroup``): tried with
    pyspark 4.0.5 classic, ``interruptTag`` of a tag added in the thread that ran a barrier
    ``mapInPandas`` collect returned ``[]`` and left its tasks running (the job carried no
    tag), so classic Spark keeps the job group it always used.

    Returns:
        ``action()``'s value.

    Raises:
        SparkJobTimeout: not done within ``timeout_seconds`` (naming ``what``); its jobs were
            cancelled (the thread is given :data:`INTERRUPT_JOIN_SECONDS` to end).
        BaseException: the action's own error (``pyspark.errors`` classes on both kinds).
    """
    tag = f"flowers-{'-'.join(what.split())}-{uuid.uuid4().hex}".replace(",", "-")
    connect = is_connect_session(spark)
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        if connect:
            spark.addTag(tag)
        else:
            spark.sparkContext.setJobGroup(tag, f"flowers_job: {what}", True)
        try:
            result.append(action())
        except BaseException as exc:
            failure.append(exc)
        finally:
            if connect:
                spark.removeTag(tag)

    thread = threading.Thread(target=run, name=tag[:60], daemon=True)
    thread.start()
    thread.join(timeout_seconds)
    if thread.is_alive():
        with contextlib.suppress(Exception):  # a session stopping meanwhile: nothing to stop
            if connect:
                spark.interruptTag(tag)
            else:
                spark.sparkContext.cancelJobGroup(tag)
        thread.join(INTERRUPT_JOIN_SECONDS)
        raise SparkJobTimeout(f"the {what} (a Spark job) did not end within {timeout_seconds:g} s")
    if failure:
        raise failure[0]
    return result[0]


INTERRUPT_JOIN_SECONDS = 5.0
"""How long :func:`run_tagged` waits for an interrupted job's thread to end, seconds (about
a second on a local server)."""


def run_probe(spark: Any, frame: Any, what: str, timeout_seconds: float) -> list[Any]:
    """``frame.collect()`` of a short check run on the executors before any work (a barrier
    ``mapInPandas`` over ``spark.range(n, numPartitions=n)``), bounded: interrupted after
    ``timeout_seconds`` (:func:`~flowers_job.cluster.connect.run_tagged`: a job tag and
    ``interruptTag`` on Connect, a job group on classic Spark). The same stage on both.

    Returns:
        The collected rows.

    Raises:
        SparkJobTimeout: (a ``RuntimeError``) not done within ``timeout_seconds`` (naming
            ``what``).
        pyspark.errors.PySparkException: the stage's own error (a task's Python error is
            in its message).
    """
    return run_tagged(spark, frame.collect, what, timeout_seconds)


def default_parallelism(
    spark: Any, fresh: bool = False, timeout_seconds: float | None = None
) -> int:
    """Spark's default parallelism: the task slots of the registered executors (total cores
    on a cluster, n for ``local[n]``): ``SparkContext.defaultParallelism`` on classic Spark.

    Connect has no SparkContext (``spark.sparkContext`` raises
    ``[JVM_ATTRIBUTE_NOT_SUPPORTED]``); there it is the partition count of a ``spark.range``
    made without one (Spark's ``leafNodeDefaultParallelism``, which is ``defaultParallelism``
    unless ``spark.sql.leafNodeDefaultParallelism`` is set), counted by one small Spark job
    (about 0.3 s) the first time a session asks, and remembered for that session.

    Args:
        fresh: count again on Connect (executors that registered since), and remember the
            new count.
        timeout_seconds: bound on Connect's count (:func:`run_tagged`); None: unbounded. A
            cluster with no executor yet accepts the job and leaves it waiting for resources.

    Raises:
        SparkJobTimeout: Connect's count did not end within ``timeout_seconds``.
    """
    if not is_connect_session(spark):
        return int(spark.sparkContext.defaultParallelism)
    key = id(spark)
    with _parallelism_lock:
        if key in _parallelism and not fresh:
            return _parallelism[key]
    # an SQL expression, not pyspark.sql.functions: those build a classic Column unless
    # pyspark.sql.utils.is_remote() (SPARK_CONNECT_MODE_ENABLED), which a session made by
    # Connect's own builder does not set
    # (the partition id projected first: an aggregate may not take a nondeterministic
    # argument, [AGGREGATE_FUNCTION_WITH_NONDETERMINISTIC_EXPRESSION])
    partitions = spark.range(_PARALLELISM_ROWS).selectExpr("spark_partition_id() AS p")
    frame = partitions.selectExpr("max(p)")
    if timeout_seconds is None:
        row = frame.first()
    else:
        row = run_tagged(spark, frame.first, "parallelism count", timeout_seconds)
    count = max(1, int(row[0] if row and row[0] is not None else 0) + 1)
    with _parallelism_lock:
        _parallelism[key] = count
    return count


def session_kind(spark: Any) -> str:
    """One line that says which kind of session the job has: ``Spark Connect session
    (sc://host:port/, server Spark 4.0.5, master local[2])`` or ``classic Spark session
    (master local[2], Spark 4.0.5)``; a Connect URL's parameters (a token) are hidden."""
    master = spark_master(spark) or "unknown"
    if is_connect_session(spark):
        builder = getattr(getattr(spark, "client", None), "_builder", None)
        endpoint = getattr(builder, "endpoint", None)  # host:port, never the parameters
        where = f"sc://{endpoint}, " if endpoint else ""
        return f"Spark Connect session ({where}server Spark {spark.version}, master {master})"
    return f"classic Spark session (master {master}, Spark {spark.version})"


CONNECT_TIMEOUT_SECONDS = 10.0
"""How long :func:`remote_session` waits for a Connect server's port to accept a TCP
connection, seconds (pyspark's own gRPC retries would wait minutes)."""


def wanted_connect(remote: str | None) -> str | None:
    """What will make the session a Spark Connect one, before any session exists: ``remote``
    (``--remote``) or the environment (:func:`connect_reason`); None for classic Spark."""
    if remote:
        return f"--remote {connect_url(remote)}"
    return connect_reason()


def remote_session(remote: str | None = None) -> Any:
    """A Spark Connect session: to ``remote`` (``sc://HOST:PORT``), or to what the
    environment names: ``SPARK_REMOTE``, spark-submit's ``--remote`` (handed to Python as
    ``PYSPARK_REMOTE_INIT_CONF_*``, which pyspark's classic builder does not read), or
    spark-submit's ``spark.api.mode=connect`` (a Connect server in this process, on
    spark-submit's master).

    Raises:
        ClusterError: ``remote`` is not an ``sc://`` URL, or nothing answers at its host and
            port within :data:`CONNECT_TIMEOUT_SECONDS` (naming the URL, never its
            parameters: a token).
    """
    import socket
    from urllib.parse import urlparse

    from pyspark.sql import SparkSession

    from flowers_job.errors import ClusterError

    submitted = _submitted_conf()
    url = remote or os.environ.get("SPARK_REMOTE") or submitted.get("spark.remote") or ""
    if url.startswith("sc://"):
        parsed = urlparse(url.partition(";")[0].replace("sc://", "http://", 1))
        host, port = parsed.hostname or "localhost", parsed.port or 15002
        try:
            socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_SECONDS).close()
        except OSError as exc:
            raise ClusterError(
                f"no Spark Connect server answers at {connect_url(url)} ({host}:{port}): {exc}"
            ) from None
    elif remote:
        raise ClusterError(
            f"--remote {connect_url(remote)}: not a Spark Connect URL (sc://HOST:PORT)"
        )
    builder = SparkSession.builder
    if url:
        builder = builder.remote(url)
    elif submitted.get("spark.api.mode", "").lower() == "connect":
        # spark-submit --conf spark.api.mode=connect: pyspark starts a Connect server on
        # spark-submit's master in this process and connects to it
        builder = builder.config("spark.api.mode", "connect")
    return builder.getOrCreate()
