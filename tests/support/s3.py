"""Object storage for the tests: a real S3 API server (moto), the settings that take Spark,
pyarrow and boto3 to it, and uploads of photo samples.

Two servers, one API (:class:`S3Store`, a bucket on a server):

- local mode: the ``s3`` fixture (function scope) starts moto's server (a process) on
  127.0.0.1 and a free port once per session (``s3_server``), creates a fresh bucket for
  the test and sets ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
  ``AWS_DEFAULT_REGION`` and ``AWS_ENDPOINT_URL`` in this process's environment
  (monkeypatch: restored after the test), which boto3, pyarrow's ``S3FileSystem`` and s3a
  read. A CLI run (``flowers-job run``, :func:`tests.conftest.run_cli`) reaches it with
  ``env=store.cli_env()``: its own Spark session then has ``hadoop-aws`` and the
  ``fs.s3a.*`` settings through ``PYSPARK_SUBMIT_ARGS``.
- the test cluster (tools/cluster.py, ``Cluster(s3=True)``): moto runs on fl-driver;
  ``S3Store(cluster.s3_endpoint, bucket)`` from this process, and ``cluster.submit`` gives
  the driver and the executors what they need.

The jars (``hadoop-aws`` and the 550 MB AWS SDK bundle) are resolved once into the Ivy cache
of ``cluster.ivy_dir()`` (outside the repo; ``make s3-jars`` fills it), by the ``s3_jars``
fixture and by ``Cluster.up``, and reused by every run.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT_DIR

sys.path.insert(0, str(ROOT_DIR / "tools"))
from cluster import (
    S3_CREDENTIALS,
    ivy_dir,
    local_s3_server,
    resolve_packages,
    s3_env,
    s3a_conf,
)


def s3_packages() -> tuple[str, str]:
    """The ``--packages`` of a local session on ``s3a://`` storage in this interpreter's
    environment (the default one, or the legacy Petastorm one with an older pyspark): Delta's
    jar for the installed delta-spark and pyspark, and ``hadoop-aws`` at pyspark's own Hadoop
    version, as the job computes it (``flowers_job.cluster.session.object_store_conf``). The
    netns cluster's, from requirements/lock.txt, are ``cluster.S3_PACKAGES``."""
    from flowers_job.cluster.session import object_store_conf
    from tests.support.connect import delta_package

    (hadoop_aws,), _ = object_store_conf(["s3a://bucket"])
    return delta_package(), hadoop_aws


RESOLVE_TIMEOUT = 600.0
"""Bound on the jars' resolution into an empty Ivy cache (seconds; 55 to 96 s measured)."""
SERVER_TIMEOUT = 30.0
"""Bound on the local S3 server's start (seconds; about 2 s)."""


@dataclass(frozen=True)
class S3Store:
    """A bucket on an S3 API server.

    Args:
        endpoint: the server's URL, ``http://HOST:PORT``.
        bucket: the bucket's name (3 to 63 lower-case letters, digits, dots, hyphens).
        credentials: access key and secret (moto accepts any).
    """

    endpoint: str
    bucket: str
    credentials: tuple[str, str] = S3_CREDENTIALS

    def url(self, prefix: str = "", scheme: str = "s3a") -> str:
        """``s3a://bucket/prefix`` (Spark's; ``scheme="s3"`` for pyarrow and boto3)."""
        return f"{scheme}://{self.bucket}/{prefix.strip('/')}".rstrip("/")

    def env(self) -> dict[str, str]:
        """``AWS_*``: the credentials, the region and ``AWS_ENDPOINT_URL``."""
        return s3_env(self.endpoint, self.credentials)

    def spark_conf(self) -> dict[str, str]:
        """Spark settings of an application on this server: ``spark.jars.packages`` (Delta
        and ``hadoop-aws``), ``spark.jars.ivy`` (the cache they were resolved into) and the
        ``spark.hadoop.fs.s3a.*`` of ``cluster.s3a_conf``. The credentials are not here:
        :meth:`env` (the executors' through ``spark.executorEnv.*``)."""
        return {
            "spark.jars.packages": ",".join(s3_packages()),
            "spark.jars.ivy": str(ivy_dir()),
            **s3a_conf(self.endpoint),
        }

    def submit_args(self) -> str:
        """``PYSPARK_SUBMIT_ARGS`` that give a local session built by pyspark (the CLI's
        ``flowers_job.cluster.session.get_spark``) :meth:`spark_conf`. ``--packages`` names Delta
        too: an explicit ``--packages`` wins over the ``spark.jars.packages`` that
        ``configure_spark_with_delta_pip`` sets, which would otherwise leave hadoop-aws out."""
        conf = self.spark_conf()
        args = ["--packages", conf.pop("spark.jars.packages")]
        for key, value in conf.items():
            args += ["--conf", f"{key}={value}"]
        return shlex.join([*args, "pyspark-shell"])

    def cli_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a CLI subprocess on this server: ``base`` (default this
        process's), :meth:`env` and ``PYSPARK_SUBMIT_ARGS`` (:meth:`submit_args`)."""
        env = dict(os.environ if base is None else base)
        return {**env, **self.env(), "PYSPARK_SUBMIT_ARGS": self.submit_args()}

    def filesystem(self) -> Any:
        """pyarrow's ``S3FileSystem`` on this server, not reading the environment; paths
        are ``bucket/key``."""
        from pyarrow import fs

        return fs.S3FileSystem(
            access_key=self.credentials[0],
            secret_key=self.credentials[1],
            region=s3_env(self.endpoint)["AWS_DEFAULT_REGION"],
            endpoint_override=self.endpoint,
            allow_bucket_creation=True,
        )

    def client(self) -> Any:
        """A boto3 S3 client of this server, not reading the environment."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.credentials[0],
            aws_secret_access_key=self.credentials[1],
            region_name=s3_env(self.endpoint)["AWS_DEFAULT_REGION"],
        )

    def create(self) -> S3Store:
        """Create the bucket (nothing when it exists already)."""
        client = self.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=self.bucket)
        return self

    def upload(self, local: Path, prefix: str) -> str:
        """Copy every file under the directory ``local`` to ``prefix`` in the bucket, keeping
        its layout (``<label>/<file>`` of a photo sample): one object per file and no
        directory markers, as ``aws s3 cp --recursive`` uploads. (pyarrow's ``copy_files``
        adds a ``dir/`` object per directory, and with its default ``use_threads=True``
        pyarrow 14 started 8 multipart uploads and waited forever: 80 photos, 2026-11-26.)

        Returns:
            The prefix's ``s3a://`` URL (what ``data.images`` takes).
        """
        from concurrent.futures import ThreadPoolExecutor

        client = self.client()  # boto3 clients are thread-safe
        files = sorted(p for p in local.rglob("*") if p.is_file())
        keys = [f"{prefix.strip('/')}/{p.relative_to(local).as_posix()}" for p in files]
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(lambda f, k: client.upload_file(str(f), self.bucket, k), files, keys))
        return self.url(prefix)

    def keys(self, prefix: str = "") -> list[str]:
        """Every object's key under ``prefix`` (``photos/`` lists ``photos/...`` only), sorted."""
        pages = (
            self.client()
            .get_paginator("list_objects_v2")
            .paginate(Bucket=self.bucket, Prefix=prefix)
        )
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def read(self, key: str) -> bytes:
        """The object ``key``'s bytes."""
        return bytes(self.client().get_object(Bucket=self.bucket, Key=key)["Body"].read())


def fresh_bucket(endpoint: str) -> S3Store:
    """A new, empty bucket on the server at ``endpoint``."""
    return S3Store(endpoint, f"flowers-{uuid.uuid4().hex[:12]}").create()


@pytest.fixture(scope="session")
def s3_jars() -> Path:
    """The Ivy cache with Delta's and ``hadoop-aws``'s jars (``cluster.ivy_dir()``), resolved
    from Maven Central when a jar is missing (at most :data:`RESOLVE_TIMEOUT` s)."""
    ivy = ivy_dir()
    packages = s3_packages()
    seconds = resolve_packages(Path(sys.executable), packages, ivy, RESOLVE_TIMEOUT)
    if seconds:
        print(f"resolved {', '.join(packages)} into {ivy} in {seconds:.0f} s")
    return ivy


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 and a free port for the session; its endpoint URL.

    A process of its own (``python -m moto.server``), as on the cluster, not moto's
    ``ThreadedMotoServer`` in this one: the tests' own pyarrow and Spark calls then never
    compete with the server for this process's GIL.

    Raises:
        pytest.fail: the server did not answer within :data:`SERVER_TIMEOUT` seconds.
    """
    log = tmp_path_factory.mktemp("s3-server") / "moto.log"
    try:
        server = local_s3_server(log, SERVER_TIMEOUT)
        endpoint = server.__enter__()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    try:
        yield endpoint
    finally:
        server.__exit__(None, None, None)


@pytest.fixture
def s3(s3_server: str, s3_jars: Path, monkeypatch: pytest.MonkeyPatch) -> S3Store:
    """A fresh bucket on the session's moto server, and its ``AWS_*`` in this process's
    environment for the test (:meth:`S3Store.env`)."""
    store = fresh_bucket(s3_server)
    for key, value in store.env().items():
        monkeypatch.setenv(key, value)
    return store
