"""The SparkSession: Delta Lake enabled, sensible local defaults.

On a cluster (spark-submit, Databricks) the session already exists or the launcher sets the
master; locally it is ``local[*]``, with the Delta jars resolved from Maven Central by
``configure_spark_with_delta_pip``, what S3 needs, and the driver's GPUs as a ``gpu``
resource.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from pyspark.sql import SparkSession

from flowers_job.cluster.connect import is_connect_session
from flowers_job.runtime.allocator import apply_to_environ
from flowers_job.runtime.allocator import spark_conf as allocator_spark_conf

__all__ = ["cuda_device_count", "get_spark", "local_gpu_conf", "object_store_conf"]

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
    # Python workers forked with pandas, pyarrow and Streaming's writer already imported:
    # those forked after Spark's one-minute idle cleanup start warm (python_daemon).
    "spark.python.daemon.module": "flowers_job.cluster.python_daemon",
}


def object_store_conf(urls: list[str]) -> tuple[list[str], dict[str, str]]:
    """The Maven packages and Spark settings a local session needs for ``urls``: for any
    ``s3a://`` (``s3://``, ``s3n://``) URI, ``org.apache.hadoop:hadoop-aws`` at pyspark's own
    Hadoop version (its ``hadoop-client-api`` jar's), and with ``AWS_ENDPOINT_URL`` set (an
    S3-compatible store: MinIO, moto), ``fs.s3a.endpoint`` with path-style access. The
    credentials stay where s3a's default provider chain finds them (the ``AWS_*``
    environment variables, ``~/.aws``, an instance profile); nothing here copies them.

    Returns:
        ``(packages, settings)``, both empty when no URI is in S3.
    """
    from flowers_job.location import S3_SCHEMES

    if not any(u.split("://", 1)[0] in S3_SCHEMES for u in urls if "://" in u):
        return [], {}
    import pyspark

    jars = sorted((Path(pyspark.__file__).parent / "jars").glob("hadoop-client-api-*.jar"))
    version = jars[-1].name.removeprefix("hadoop-client-api-").removesuffix(".jar")
    settings = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        settings = {
            "spark.hadoop.fs.s3a.endpoint": endpoint,
            "spark.hadoop.fs.s3a.path.style.access": "true",
            "spark.hadoop.fs.s3a.connection.ssl.enabled": str(endpoint.startswith("https")).lower(),
        }
    return [f"org.apache.hadoop:hadoop-aws:{version}"], settings


def get_spark(
    app_name: str = "flowers_job",
    master: str | None = None,
    conf: Mapping[str, str] | None = None,
    object_stores: list[str] | None = None,
) -> SparkSession:
    """Return the active SparkSession, or build a local one with Delta Lake.

    Args:
        app_name: Spark application name.
        master: Spark master URL for a new session (default ``$FLOWERS_SPARK_MASTER`` or
            ``local[*]``). Ignored when a session already exists (spark-submit, Databricks).
        conf: Spark settings for a new local session, over the local defaults (e.g.
            ``{"spark.driver.memory": "1g"}``). Ignored when a session already exists.
        object_stores: the job's locations (output dir, loader cache, images): a new local
            session gets what S3 needs (:func:`object_store_conf`). Ignored when a session
            already exists (spark-submit: ``--packages``, ``--conf``; docs/cluster.md).

    Returns:
        A session whose ``spark_catalog`` is Delta's.

    Raises:
        RuntimeError: if the JVM cannot start (no Java) or the Delta jars cannot be resolved.
    """
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    # The ranks of local mode (torchrun, started from this process) and, through
    # spark.executorEnv.*, Spark's Python workers get the allocator tuning.
    apply_to_environ()
    if "PYSPARK_GATEWAY_PORT" in os.environ:
        # Under spark-submit the JVM is already configured (master, --packages, resources);
        # the SparkContext is not yet, so the executors' environment can still be set. A
        # setting given to spark-submit (--conf spark.executorEnv.X=...) wins.
        from pyspark import SparkConf

        submitted = SparkConf()
        builder = (
            SparkSession.builder.appName(app_name)
            .config("spark.sql.extensions", _LOCAL_DEFAULTS["spark.sql.extensions"])
            .config(
                "spark.sql.catalog.spark_catalog",
                _LOCAL_DEFAULTS["spark.sql.catalog.spark_catalog"],
            )
        )
        for key, value in allocator_spark_conf().items():
            if not submitted.contains(key):
                builder = builder.config(key, value)
        return builder.getOrCreate()
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # docs/known-issues.md, "Spark"
    # Python workers must run this interpreter (with torch, Pillow...), not the system one.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from delta import configure_spark_with_delta_pip

    builder = SparkSession.builder.appName(app_name).master(
        master or os.environ.get("FLOWERS_SPARK_MASTER", "local[*]")
    )
    gpus = local_gpu_conf(cuda_device_count())
    packages, s3 = object_store_conf(object_stores or [])
    settings = {**_LOCAL_DEFAULTS, **s3, **allocator_spark_conf(), **gpus, **(conf or {})}
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = configure_spark_with_delta_pip(builder, extra_packages=packages).getOrCreate()
    if not is_connect_session(spark):  # SPARK_REMOTE made it Connect: no SparkContext
        spark.sparkContext.setLogLevel(os.environ.get("FLOWERS_SPARK_LOG_LEVEL", "WARN"))
    return spark


def cuda_device_count() -> int:
    """CUDA devices this process can use (``torch.cuda.device_count()``, which honours
    ``CUDA_VISIBLE_DEVICES``); 0 without an NVIDIA driver, and then torch is not imported."""
    if not (Path("/proc/driver/nvidia").exists() or shutil.which("nvidia-smi")):
        return 0
    import torch

    return int(torch.cuda.device_count())


GPU_DISCOVERY_SCRIPT = "flowers-gpu-discovery.sh"


def local_gpu_conf(count: int, directory: Path | None = None) -> dict[str, str]:
    """Spark settings that give a local session's driver ``count`` GPUs (none for 0).

    TorchDistributor's local mode with ``use_gpu`` refuses to start unless the driver has a
    ``gpu`` resource (``spark.driver.resource.gpu.amount`` and a discovery script, which
    Spark runs at start-up and which must print ``{"name": "gpu", "addresses": [...]}``);
    it then gives each rank one of those addresses in ``CUDA_VISIBLE_DEVICES``. The script
    written here (into ``directory``, default the temp dir) prints the indices
    ``0..count-1``: the devices torch sees in this process.
    """
    if count <= 0:
        return {}
    directory = Path(directory or tempfile.gettempdir())
    script = directory / f"{GPU_DISCOVERY_SCRIPT.removesuffix('.sh')}-{count}.sh"
    addresses = ", ".join(f'"{i}"' for i in range(count))
    script.write_text(f'#!/bin/sh\necho \'{{"name": "gpu", "addresses": [{addresses}]}}\'\n')
    script.chmod(0o755)
    return {
        "spark.driver.resource.gpu.amount": str(count),
        "spark.driver.resource.gpu.discoveryScript": str(script),
    }
