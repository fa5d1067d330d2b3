"""The SparkSession: Delta Lake enabled, sensible local defaults.

On a cluster (spark-submit, Databricks) the session already exists or the
launcher sets the master; locally we build ``local[*]`` with the Delta jars
resolved from Maven Central by ``configure_spark_with_delta_pip``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from pyspark.sql import SparkSession

__all__ = ["get_spark", "task_slots"]

_LOCAL_DEFAULTS = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    # Few, small tables: the default 200 shuffle partitions only add scheduling overhead.
    "spark.sql.shuffle.partitions": "8",
    "spark.driver.memory": "4g",
    # Image bytes travel through Arrow in the decode UDF; keep batches modest (~ 64 MB).
    "spark.sql.execution.arrow.maxRecordsPerBatch": "512",
    "spark.databricks.delta.snapshotPartitions": "2",
}


def get_spark(
    app_name: str = "flowers_job", master: str | None = None, conf: Mapping[str, str] | None = None
) -> SparkSession:
    """Return the active SparkSession, or build a local one with Delta Lake.

    Args:
        app_name: Spark application name.
        master: Spark master URL for a new session (default ``$FLOWERS_SPARK_MASTER`` or
            ``local[*]``). Ignored when a session already exists (spark-submit, Databricks).
        conf: Spark settings for a new local session, over the local defaults (e.g.
            ``{"spark.driver.memory": "1g"}``). Ignored when a session already exists.

    Returns:
        A session whose ``spark_catalog`` is Delta's.

    Raises:
        RuntimeError: if the JVM cannot start (no Java) or the Delta jars cannot be resolved.
    """
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    if "PYSPARK_GATEWAY_PORT" in os.environ:
        # Under spark-submit the JVM is already configured (master, --packages, resources).
        return (
            SparkSession.builder.appName(app_name)
            .config("spark.sql.extensions", _LOCAL_DEFAULTS["spark.sql.extensions"])
            .config(
                "spark.sql.catalog.spark_catalog",
                _LOCAL_DEFAULTS["spark.sql.catalog.spark_catalog"],
            )
            .getOrCreate()
        )
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # STACK.md trap 11
    # Python workers must run this interpreter (with torch, Pillow...), not the system one.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from delta import configure_spark_with_delta_pip

    builder = SparkSession.builder.appName(app_name).master(
        master or os.environ.get("FLOWERS_SPARK_MASTER", "local[*]")
    )
    for key, value in {**_LOCAL_DEFAULTS, **(conf or {})}.items():
        builder = builder.config(key, value)
    spark = configure_spark_with_delta_pip(builder).getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("FLOWERS_SPARK_LOG_LEVEL", "WARN"))
    return spark


def task_slots(spark: SparkSession) -> int:
    """Concurrent task slots of the cluster: ``defaultParallelism / spark.task.cpus``.

    Barrier mode (``local_mode=False``) needs one slot per training process.
    """
    cpus_per_task = int(spark.conf.get("spark.task.cpus", "1") or 1)
    return max(1, spark.sparkContext.defaultParallelism // cpus_per_task)
