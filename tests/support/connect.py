"""A real Spark Connect server for the tests, and Connect sessions that leave no trace.

The server is the pyspark wheel's own (``SparkConnectServer``, started with spark-submit: the
wheel ships no ``sbin/start-connect-server.sh``), with what the job needs on the server side:
Delta Lake's jar and SQL extension (the job's tables; MERGE and the rest through SQL), and
Spark's Python workers running this interpreter (the project, torch, Streaming: the barrier
tasks run the ranks there), as docs/cluster.md's "Spark Connect" server does.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pyspark
import pytest

from tests.support import REPO
from tests.support.data import DELTA_STATE_CONF
from tests.support.packaging import clean_env, project_wheel, run, uv_bin, uv_failure
from tests.support.processes import stop_group

SPARK_HOME = Path(pyspark.__file__).parent
"""The pyspark wheel is a Spark distribution: bin/spark-submit and the jars, Connect's too."""
SERVER_START_SECONDS = 180.0
"""Bound on the Connect server's start (about 12 s on the 2-core machine with the jars in
Ivy's cache; resolving Delta's jar from Maven Central the first time takes longer)."""
SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
DELTA_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def delta_package() -> str:
    """Delta's Maven coordinate for the installed delta-spark (as
    ``configure_spark_with_delta_pip`` computes it)."""
    from packaging.version import Version

    delta = metadata.version("delta-spark")
    if Version(delta) < Version("4.1"):
        return f"io.delta:delta-spark_2.13:{delta}"
    spark = ".".join(metadata.version("pyspark").split(".")[:2])
    return f"io.delta:delta-spark_{spark}_2.13:{delta}"  # from 4.1 the artifact names Spark


def spark_env(**extra: str) -> dict[str, str]:
    """The environment of a spark-submit from the pyspark wheel, with Python workers running
    this interpreter."""
    return {
        **os.environ,
        "SPARK_HOME": str(SPARK_HOME),
        "PYSPARK_PYTHON": sys.executable,
        **extra,
    }


def server_command(
    port: int,
    master: str = "local[2]",
    host: str = "127.0.0.1",
    driver_memory: str = "1g",
    conf: Mapping[str, str] | None = None,
    delta: bool = True,
) -> list[str]:
    """The spark-submit command line of a Spark Connect server on ``host:port``.

    Args:
        master: the cluster the server's jobs run on (``local[2]``, ``spark://host:7077``).
        delta: with Delta Lake's jar (``--packages``) and SQL extension.
        conf: more ``--conf`` settings.
    """
    settings = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.connect.grpc.binding.address": host,
        "spark.connect.grpc.binding.port": str(port),
        "spark.sql.shuffle.partitions": "8",
        **DELTA_STATE_CONF,  # as the job's local session: a Connect client cannot set it
        # as docs/cluster.md's server runs: Python workers forked warm, so that a stage after
        # Spark's one-minute idle-worker cleanup does not import pandas, pyarrow and the
        # loaders' libraries again in each worker
        "spark.python.daemon.module": "flowers_job.cluster.python_daemon",
        **(DELTA_CONF if delta else {}),
        **(conf or {}),
    }
    command = [
        str(SPARK_HOME / "bin" / "spark-submit"),
        *("--class", SERVER_CLASS),
        *("--master", master),
        *("--driver-memory", driver_memory),
        *(("--packages", delta_package()) if delta else ()),
    ]
    for key, value in settings.items():
        command += ["--conf", f"{key}={value}"]
    return [*command, "spark-internal"]


@dataclass
class ConnectServer:
    """A running server: its URL and log."""

    url: str
    log: Path
    process: subprocess.Popen[bytes]


def wait_for_port(host: str, port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    """Until ``host:port`` accepts a connection (bounded by :data:`SERVER_START_SECONDS`).

    Raises:
        RuntimeError: the server exited or did not listen in time (its log's end quoted).
    """
    deadline = time.monotonic() + SERVER_START_SECONDS
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"no Spark Connect server on {host}:{port}:\n{log.read_text()[-3000:]}"
                ) from None
            time.sleep(0.5)


@contextmanager
def connect_server(
    workdir: Path,
    master: str = "local[2]",
    conf: Mapping[str, str] | None = None,
    delta: bool = True,
    env: Mapping[str, str] | None = None,
    driver_memory: str = "1g",
) -> Iterator[ConnectServer]:
    """A local Spark Connect server (:func:`server_command`) for the block, in a process group
    of its own; the group stopped after (SIGTERM, SIGKILL after 30 s:
    :func:`tests.support.processes.stop_group`)."""
    port = free_port()
    log = workdir / f"connect-server-{port}.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            server_command(port, master, driver_memory=driver_memory, conf=conf, delta=delta),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=spark_env(**(env or {})),
            cwd=workdir,
            start_new_session=True,  # the JVM and its Python workers: one group
        )
    try:
        wait_for_port("127.0.0.1", port, process, log)
        yield ConnectServer(f"sc://127.0.0.1:{port}", log, process)
    finally:
        stop_group(process)


@contextmanager
def connect_session(url: str) -> Iterator[Any]:
    """A Spark Connect session to ``url`` in this process, as pyspark's
    ``SparkSession.builder.remote(url)`` makes it (and Databricks hands it): with
    ``SPARK_CONNECT_MODE_ENABLED`` set, so that ``pyspark.sql.functions`` build Connect
    columns. Stopped after the block, and that variable put back (it would make every later
    ``SparkSession.builder`` in this process a Connect one)."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    before = os.environ.get("SPARK_CONNECT_MODE_ENABLED")
    os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"
    spark = ConnectSession.builder.remote(url).getOrCreate()
    try:
        yield spark
    finally:
        spark.stop()
        if before is None:
            os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)
        else:
            os.environ["SPARK_CONNECT_MODE_ENABLED"] = before


@contextmanager
def classic_mode() -> Iterator[None]:
    """``SPARK_CONNECT_MODE_ENABLED`` unset for the block: ``pyspark.sql.functions`` build
    classic columns again, for a test that uses the classic session while a Connect one
    (:func:`connect_session`) is open in the same process."""
    before = os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)
    try:
        yield
    finally:
        if before is not None:
            os.environ["SPARK_CONNECT_MODE_ENABLED"] = before


CLIENT_LOCK = REPO / "requirements" / "connect-client.txt"
CLIENT_VENV = REPO / ".venv-connect"
CLIENT_SETUP_SECONDS = 900
"""Bound on ``make setup-connect`` (a cold uv cache downloads torch: minutes)."""


def without_jvm_frames(text: str) -> str:
    """``text`` less the server's Java stack frames (``\tat ...``), which the Connect client
    copies into its errors: the job's log and the error's message stay."""
    return "\n".join(line for line in text.splitlines() if not line.startswith("\tat "))


def _make_env() -> dict[str, str]:
    """:func:`clean_env` less the calling make's own variables: under ``make test`` (``-j2``)
    they name its jobserver, which this make is no child of."""
    env = clean_env()
    for name in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES"):
        env.pop(name, None)
    return env


def client_env() -> dict[str, str]:
    """This process's environment less what would point the client elsewhere: another
    environment, or a Spark Connect session asked for outside its ``--remote``."""
    env = clean_env()
    for name in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "SPARK_HOME", "PYSPARK_PYTHON"):
        env.pop(name, None)
    return env


def client_bin(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``connect_client`` fixture (tests/conftest.py): ``.venv-connect``'s ``bin``, set up by ``make setup-connect`` with the wheel under
    test; skipped, naming why, where it is not built yet and the package index cannot be
    reached (its lock file's hash names the marker the Makefile leaves)."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed: .venv-connect is built by `make setup-connect`")
    marker = hashlib.sha256(CLIENT_LOCK.read_bytes()).hexdigest()[:12]  # Makefile's CONNECT_ID
    if not (CLIENT_VENV / f".installed-{marker}").exists():
        request.getfixturevalue("pypi")  # skips where the index cannot be reached
    uv = uv_bin()
    wheel = project_wheel(uv, tmp_path_factory.mktemp("connect-wheel"))
    made = run(
        [
            "make",
            "--no-print-directory",
            "setup-connect",
            f"UV={uv}",
            "CONNECT_NEEDS=",  # this .venv is set up already: it runs this test
            f"CONNECT_VENV={CLIENT_VENV}",
            f"CONNECT_WHEEL={wheel}",
        ],
        CLIENT_SETUP_SECONDS,
        REPO,
        _make_env(),
    )
    assert made.returncode == 0, uv_failure(made.stdout + made.stderr)
    return CLIENT_VENV / "bin"
