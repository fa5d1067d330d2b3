"""Spark Connect: the job needs classic Spark, and says so before any work.

A Spark Connect session (Databricks serverless compute and standard access mode, any
``sc://`` URL) has no ``SparkContext``: no RDDs, no barrier mode, no ``addFile``, no status
tracker. Training runs TorchDistributor, which needs all of them; ingest lists files with
an RDD; ``predict`` ships the model with ``addFile`` and counts task slots through the JVM.
On Connect each of these fails with pyspark's ``[JVM_ATTRIBUTE_NOT_SUPPORTED]``, deep in
the run. :func:`refuse_spark_connect` fails first, with a
:class:`~flowers_job.errors.ClusterError` (a ``ConfigError``: exit 2) that says what the job
needs and which setting made the session a Connect one.

What makes a Python process use Spark Connect (pyspark 4.0's ``SparkSession.builder``,
``pyspark.sql.utils.is_remote``, ``pyspark.util.default_api_mode``):

- ``SPARK_REMOTE=sc://...`` (or ``local``: a Connect server started in-process);
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
from typing import Any

from flowers_job.errors import ClusterError

__all__ = ["NEEDS", "connect_reason", "is_connect_session", "refuse_spark_connect"]

NEEDS = (
    "This job needs classic Spark (a SparkContext: TorchDistributor's barrier mode, RDDs, "
    "addFile), which Spark Connect does not have. Run it on classic compute: on Databricks "
    "a classic (not serverless) job cluster in dedicated (single user) access mode with a "
    "Databricks Runtime ML (docs/cluster.md); elsewhere spark-submit without --remote, and "
    "with SPARK_REMOTE, SPARK_API_MODE and SPARK_CONNECT_MODE_ENABLED unset"
)
"""What the refusal tells the user to use instead (the second half of its message)."""


def is_connect_session(spark: Any) -> bool:
    """``spark`` is a Spark Connect session (``pyspark.sql.connect.session.SparkSession``).

    The class is looked up in ``sys.modules`` only: a Connect session cannot exist unless
    its module was imported, and importing it needs grpcio, which a classic-only
    environment may lack."""
    module = sys.modules.get("pyspark.sql.connect.session")
    return module is not None and isinstance(spark, module.SparkSession)


def _url(value: str) -> str:
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
        ("SPARK_REMOTE" in env, f"SPARK_REMOTE={_url(env.get('SPARK_REMOTE', ''))}"),
        (
            "spark.remote" in submitted,
            f"spark.remote={_url(submitted.get('spark.remote', ''))} from spark-submit "
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


def refuse_spark_connect(spark: Any = None) -> None:
    """Raise before any work when Spark is (or would be) Spark Connect.

    Args:
        spark: the session about to be used; None checks the environment only
            (:func:`connect_reason`).

    Raises:
        ClusterError: naming the setting or the session class that made it Connect, and what
            the job needs instead (:data:`NEEDS`).
    """
    reason = connect_reason(spark)
    if reason is not None:
        raise ClusterError(f"Spark Connect is not supported ({reason}). {NEEDS}.")
