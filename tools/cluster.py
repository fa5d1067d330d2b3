"""A real Spark standalone cluster on one Linux machine: one network namespace per host.

    python tools/cluster.py up      # master + 2 workers + driver host + MLflow server
    python tools/cluster.py submit -- --images ... --output-dir ... --set ...
    python tools/cluster.py down    # removes everything it made
    python tools/cluster.py up --connect          # and a Spark Connect server, a client host
    python tools/cluster.py client -- flowers-job run --remote sc://10.88.0.2:15002 ...
    python tools/cluster.py jars    # the Ivy cache of hadoop-aws (s3a://), once (make s3-jars)

(``make cluster-up`` / ``make cluster-down`` run these.) Needs root (``ip netns``,
``unshare``, ``mount``) and Java; the tests skip with the reason when it cannot run.

Hosts (defaults; addresses on the bridge ``flbr0``, 10.88.0.0/24):

=========== ============ ===================================================
host        address      runs
=========== ============ ===================================================
(this ns)   10.88.0.1    nothing: the bridge's own address, to reach the UIs
fl-driver   10.88.0.2    spark-submit (client mode), the MLflow server :5000 (basic auth
                         with ``mlflow_auth``), with ``s3``: an S3 API server :9000 (moto);
                         :meth:`Cluster.connect_server`: a Spark Connect server :15002
fl-master   10.88.0.3    ``org.apache.spark.deploy.master.Master`` :7077, UI :8080
fl-w1..wN   10.88.0.11.. ``org.apache.spark.deploy.worker.Worker``, N cores each
fl-client   10.88.0.20   with ``client_host``: a Spark Connect client (:meth:`Cluster.client`),
                         no Spark process; it sees the shared dir as fl-driver does
=========== ============ ===================================================

Each host is a network namespace (its own interfaces, addresses and ``/etc/hosts``, via
``/etc/netns/<host>/hosts``), and every process tree started on it also gets its own UTS
namespace (host name) and mount namespace with a private ``/dev/shm``, and its own temp
dir (``TMPDIR``, ``SPARK_LOCAL_DIRS``: ``<base>/tmp/<host>``), as separate machines have.
What the hosts share is ``<base>/shared`` (default ``/var/tmp/flowers-cluster/shared``),
standing in for NFS/DBFS: put the photos and the
output dir there. ``loopback_names=True`` makes each host's name resolve to 127.0.1.1 in
its own ``/etc/hosts`` (Debian's default) and sets ``SPARK_LOCAL_IP`` instead.

Object storage instead of a shared disk (the options of :class:`Cluster`):

================= =========================================================================
option            what changes
================= =========================================================================
``s3=True``       ``moto.server`` (a real S3 API: any bucket, any credentials, in memory)
                  runs on fl-driver at :attr:`Cluster.s3_endpoint` (``http://10.88.0.2:9000``;
                  this namespace reaches it over the bridge). :meth:`Cluster.submit` puts
                  ``hadoop-aws`` (:data:`HADOOP_AWS_PACKAGE`) on the driver's and the
                  executors' class path from the Ivy cache :func:`ivy_dir`, as jars
                  installed on every host (:meth:`Cluster.up` fills it from Maven Central
                  once; through ``--packages`` each executor would copy the 550 MB SDK
                  bundle into its work dir on every submit), the ``spark.hadoop.fs.s3a.*``
                  settings of :func:`s3a_conf`, and the credentials and endpoint
                  (:meth:`Cluster.s3_env`, ``AWS_*``) to the driver's environment and the
                  executors' (``spark.executorEnv.*``; ``executor_s3_env`` leaves some out)
``shared_dir=     no directory is shared: every process tree started on a host (its
False``           mount namespace) gets an empty private tmpfs over ``<base>/shared``, and
                  sees only its own ``<base>/tmp/<host>`` under ``<base>/tmp`` (a tmpfs
                  over ``<base>/tmp`` with the host's own dir bind-mounted back). A file a
                  job writes to a local path is seen by no other host, nor by another
                  spark-submit on the same host
================= =========================================================================

The project runs on the hosts as an installed wheel: ``<repo>/.venv-cluster`` is a venv
with the built wheel installed and the locked dependencies taken from ``.venv`` (a
``.pth`` file), made by ``python tools/cluster.py env``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from xml.etree import ElementTree

REPO = Path(__file__).resolve().parents[1]
BRIDGE = "flbr0"
SUBNET = "10.88.0"


def _locked(name: str) -> str:
    """The version of ``name`` that requirements/lock.txt pins (the cluster's environment)."""
    for line in (REPO / "requirements" / "lock.txt").read_text().splitlines():
        if line.lower().startswith(f"{name}=="):
            return line.split("==", 1)[1].strip()
    raise RuntimeError(f"requirements/lock.txt pins no {name}")


SPARK_VERSION = _locked("pyspark")
DELTA_VERSION = _locked("delta-spark")
"""delta-spark of requirements/lock.txt, which spark-submit's ``--packages`` must match."""
DELTA_PACKAGE = (
    f"io.delta:delta-spark_{'.'.join(SPARK_VERSION.split('.')[:2])}_2.13:{DELTA_VERSION}"
)
"""Delta's jar for that Spark: from Delta 4.1 the artifact names Spark's minor version, as
``configure_spark_with_delta_pip`` asks for it."""
HADOOP_VERSION = "3.5.0"
"""The Hadoop of pyspark 4.2 (its ``hadoop-client-api`` jar; a test holds the two together)."""
HADOOP_AWS_PACKAGE = f"org.apache.hadoop:hadoop-aws:{HADOOP_VERSION}"
"""The ``s3a://`` file system of pyspark's Hadoop (the versions must match). It brings the
AWS SDK bundle, about 600 MB: resolved once into :func:`ivy_dir`, outside the repo."""
S3_PACKAGES = (DELTA_PACKAGE, HADOOP_AWS_PACKAGE)
"""``--packages`` of a local Spark application on ``s3a://`` storage (both in :func:`ivy_dir`)."""
S3_PORT = 9000
S3_CREDENTIALS = ("flowers-s3-key", "flowers-s3-secret-7c41d9e2")
"""Access key and secret of the test S3 server (moto accepts any)."""
S3_REGION = "us-east-1"
STATE_FILE = "cluster.json"
CLIENT_HOST = "fl-client"
"""The Spark Connect client's host (:attr:`Cluster.client_host`): no Spark process runs there."""
CONNECT_PORT = 15002
"""Spark Connect's default port, on fl-driver (:meth:`Cluster.connect_server`)."""
CONNECT_SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
CONNECT_START_SECONDS = 180.0
"""Bound on a Connect server's start (spark-submit's JVM, Delta from the Ivy cache, the
master's executors; about 15 s on the 2-core machine)."""
CONNECT_DELTA_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}
"""Delta's SQL extension and catalog, static settings a Connect server needs at its start
(the job's classic session sets them when it builds itself; a Connect client cannot)."""
JVM_OPTIONS = (
    "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC "
    "-XX:+UnlockDiagnosticVMOptions -XX:-BytecodeVerificationRemote"
)
"""Java options of every JVM of the cluster (master, workers, drivers, executors): the C1
compiler only, the serial collector, no bytecode verification of the jars' classes. Six
JVMs share a small machine for minutes; C2's compilations and G1's threads cost more CPU
than they return there (tests/conftest.py, SHORT_LIVED_JVM, has the same options, for the
drivers the tests start, and the measurement)."""


def mlflow_server(
    python: Path,
    host: str,
    port: int,
    store: Path,
    auth: tuple[str, str] | None = None,
    artifacts: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of an MLflow tracking server on ``host:port``: a
    sqlite store and proxied artifacts under ``store``; with ``auth`` (user, password),
    MLflow's basic-auth app (``--app-name basic-auth``, full mlflow with Flask-WTF), whose
    admin is that user (its config file written under ``store``). Every request then needs
    the user's credentials (MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD); ``/health``
    does not.
    """
    import secrets

    store.mkdir(parents=True, exist_ok=True)
    argv = [str(python), "-m", "mlflow", "server", "--host", host, "--port", str(port),
            "--workers", "1", "--backend-store-uri", f"sqlite:///{store}/mlflow.db",
            "--artifacts-destination", artifacts or str(store / "artifacts")]  # fmt: skip
    # Tracking and the model registry only: without this, MLflow 3 also starts its job
    # runners (huey consumers for GenAI scorers, trace roll-ups), a handful of Python
    # processes the job never uses.
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    if auth is not None:
        (store / "basic_auth.db").unlink(missing_ok=True)  # this user, whatever was there
        config = store / "basic_auth.ini"
        config.write_text(
            "[mlflow]\n"
            "default_permission = READ\n"
            f"database_uri = sqlite:///{store}/basic_auth.db\n"
            f"admin_username = {auth[0]}\n"
            f"admin_password = {auth[1]}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
            # a checked password is trusted for 10 minutes: one PBKDF2 check per user, not
            # one per request
            "auth_cache_ttl_seconds = 600\n"
        )
        config.chmod(0o600)
        argv[4:4] = ["--app-name", "basic-auth"]
        env["MLFLOW_AUTH_CONFIG_PATH"] = str(config)
        env["MLFLOW_FLASK_SERVER_SECRET_KEY"] = secrets.token_hex(16)  # CSRF, required
    return argv, env


class ClusterError(RuntimeError):
    """The cluster cannot be made or used here (the message says why)."""


def answers(url: str) -> bool:
    """Whether an HTTP GET of ``url`` returns 200 within 2 s."""
    with contextlib.suppress(OSError):
        return bool(urllib.request.urlopen(url, timeout=2).status == 200)
    return False


def _run(*cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=timeout)


def unavailable_reason() -> str | None:
    """Why this machine cannot run the cluster (None: it can): root, ``ip``, ``unshare``,
    Java, and a network namespace that can actually be created."""
    if os.geteuid() != 0:
        return "needs root for ip netns / unshare / mount"
    for tool in ("ip", "unshare", "java"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = f"flprobe{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe, timeout=20)
    except (subprocess.SubprocessError, OSError) as exc:
        return f"cannot create a network namespace: {getattr(exc, 'stderr', '') or exc}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def cluster_python(repo: Path = REPO) -> Path:
    return repo / ".venv-cluster" / "bin" / "python"


def make_env(repo: Path = REPO, timeout: float = 300) -> Path:
    """Install the project's wheel into a new ``.venv-cluster`` (dependencies from ``.venv``):
    ``FLOWERS_WHEEL`` (the one ``make test`` builds for every environment), else a wheel
    built here.

    Returns:
        The cluster's Python interpreter.

    Raises:
        subprocess.CalledProcessError: the wheel does not build or install.
    """
    venv, base = repo / ".venv-cluster", repo / ".venv"
    dist = repo / "build" / "cluster-wheel"
    shutil.rmtree(venv, ignore_errors=True)
    shutil.rmtree(dist, ignore_errors=True)
    given = os.environ.get("FLOWERS_WHEEL")
    if not given:
        subprocess.run(
            [str(base / "bin" / "pip"), "wheel", "-q", "--no-deps",
             "-w", str(dist), str(repo)],
            check=True, timeout=timeout,
        )  # fmt: skip
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    _resolve_delta(base / "bin" / "python", timeout)
    site = "lib/python3.11/site-packages"
    # The locked dependencies of .venv, without its editable flowers_job (a .pth file in
    # .venv's site-packages, which is not processed from here).
    (venv / site / "flowers_deps.pth").write_text(str((base / site).resolve()) + "\n")
    wheel = Path(given) if given else next(dist.glob("flowers_job-*.whl"))
    subprocess.run(
        [str(base / "bin" / "pip"), "--python", str(venv / "bin" / "python"), "install", "-q",
         "--no-deps", "--no-index", str(wheel)],
        check=True, timeout=timeout,
    )  # fmt: skip
    return venv / "bin" / "python"


def _resolve_delta(python: Path, timeout: float) -> None:
    """Put the Delta jars of :data:`DELTA_PACKAGE` in Ivy's default cache, from this
    namespace (see :func:`resolve_packages`)."""
    resolve_packages(python, (DELTA_PACKAGE,), Path.home() / ".ivy2.5.2", timeout)


def ivy_dir() -> Path:
    """Ivy's cache of :data:`S3_PACKAGES` (``spark.jars.ivy`` of every ``s3a://`` run, local or
    on the cluster): ``$FLOWERS_IVY_DIR``, else ``${XDG_CACHE_HOME:-~/.cache}/flowers-job/ivy``.
    About 1.1 GB once filled (the jars twice: Ivy's cache and its ``jars/`` copy)."""
    given = os.environ.get("FLOWERS_IVY_DIR")
    if given:
        return Path(given)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "flowers-job" / "ivy"


def resolve_packages(
    python: Path, packages: Sequence[str], ivy: Path, timeout: float = 600
) -> float:
    """Put the jars of Maven ``packages`` (``group:artifact:version``) and their dependencies
    in the Ivy cache ``ivy``, from this namespace: a local session of ``python`` with
    ``spark.jars.packages`` fetches them from Maven Central when one is missing from
    ``<ivy>/jars``. The cluster's hosts reach nothing outside the bridge, so spark-submit's
    ``--packages`` there resolves from this cache alone.

    Returns:
        Seconds spent resolving (0.0 when every jar was there already). Measured
        2026-11-26 (2-core machine): :data:`S3_PACKAGES` into an empty cache, 96 s (the
        550 MB AWS SDK bundle from Maven Central).

    Raises:
        subprocess.CalledProcessError: the resolution failed (offline, no Java...).
        subprocess.TimeoutExpired: not done within ``timeout`` seconds.
    """
    jars = [ivy / "jars" / "{}_{}-{}.jar".format(*p.split(":")) for p in packages]
    if all(j.exists() for j in jars):
        return 0.0
    start = time.monotonic()
    code = (
        "from pyspark.sql import SparkSession; "
        f"SparkSession.builder.master('local[1]').config('spark.jars.packages', "
        f"{','.join(packages)!r}).config('spark.jars.ivy', {str(ivy)!r}).getOrCreate().stop()"
    )
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"}
    subprocess.run([str(python), "-c", code], check=True, timeout=timeout, env=env)
    return time.monotonic() - start


def hadoop_aws_classpath(ivy: Path) -> str:
    """The jars of :data:`HADOOP_AWS_PACKAGE` in ``<ivy>/jars`` (:func:`resolve_packages`), as
    a class path (``spark.driver.extraClassPath``, ``spark.executor.extraClassPath``): its own
    jar and those of the dependencies its Ivy descriptor (``ivy-<version>.xml`` in Ivy's
    cache) puts on the compile or runtime class path, at the versions it names. The cache
    holds other versions' jars beside them (an older pyspark's hadoop-aws and its AWS SDK
    bundle, whose unshaded Netty 4.1 breaks Spark 4.2's RPC), which a name pattern would take.

    Raises:
        ClusterError: the descriptor or one of the jars is missing.
    """
    group, artifact, version = HADOOP_AWS_PACKAGE.split(":")
    descriptor = ivy / "cache" / group / artifact / f"ivy-{version}.xml"
    try:
        module = ElementTree.parse(descriptor).getroot()
    except (OSError, ElementTree.ParseError) as err:
        raise ClusterError(f"no Ivy descriptor of {HADOOP_AWS_PACKAGE}: {err}") from err
    coordinates = [(group, artifact, version)]
    for dep in module.iter("dependency"):
        conf = dep.get("conf", "")
        if conf.startswith(("compile", "runtime")):
            coordinates.append((dep.get("org", ""), dep.get("name", ""), dep.get("rev", "")))
    jars = [ivy / "jars" / f"{g}_{a}-{v}.jar" for g, a, v in coordinates]
    missing = [j.name for j in jars if not j.is_file()]
    if missing:
        raise ClusterError(f"jars of {HADOOP_AWS_PACKAGE} not in {ivy / 'jars'}: {missing}")
    return ":".join(str(j) for j in jars)


def s3a_conf(endpoint: str) -> dict[str, str]:
    """Spark settings of Hadoop's ``s3a://`` file system on an S3 API server at ``endpoint``
    (``http://HOST:PORT``): path-style requests (``http://HOST:PORT/bucket/key``, as
    moto and MinIO want), no TLS. The credentials are not here: s3a's default chain reads
    ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` from each JVM's environment (the
    executors' through ``spark.executorEnv.*``), as pyarrow and boto3 on the executors do."""
    return {
        "spark.hadoop.fs.s3a.endpoint": endpoint,
        "spark.hadoop.fs.s3a.endpoint.region": S3_REGION,
        "spark.hadoop.fs.s3a.path.style.access": "true",
        "spark.hadoop.fs.s3a.connection.ssl.enabled": "false",
    }


def s3_env(endpoint: str, credentials: tuple[str, str] = S3_CREDENTIALS) -> dict[str, str]:
    """The environment that boto3, pyarrow's ``S3FileSystem`` (14+) and s3a read: access key,
    secret, region and ``AWS_ENDPOINT_URL`` (the S3 API server at ``endpoint``)."""
    return {
        "AWS_ACCESS_KEY_ID": credentials[0],
        "AWS_SECRET_ACCESS_KEY": credentials[1],
        "AWS_DEFAULT_REGION": S3_REGION,
        "AWS_ENDPOINT_URL": endpoint,
    }


LOCAL_S3_TIMEOUT = 30.0
"""Bound on a local S3 server's start (seconds; about 2 s)."""


@contextlib.contextmanager
def local_s3_server(log_path: Path, timeout: float = LOCAL_S3_TIMEOUT) -> Iterator[str]:
    """A moto S3 server (``python -m moto.server``, a process of its own, so that the
    caller's own pyarrow and Spark calls never compete with it for a GIL) on 127.0.0.1 and
    a free port, its output in ``log_path``; yields its endpoint URL, and stops it on the
    way out whatever happens (SIGTERM, then SIGKILL after 30 s).

    Raises:
        RuntimeError: it did not answer within ``timeout`` seconds (with its log's tail).
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + timeout
        while not answers(f"{endpoint}/moto-api/"):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the S3 server {endpoint} did not start:\n{tail}")
            time.sleep(0.2)
        yield endpoint
    finally:
        stop_process(proc)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Stop a server process: SIGTERM, then SIGKILL after ``timeout`` seconds. When it leads
    a process group of its own (``start_new_session=True``) the signals go to the whole
    group, and what is left of the group once the leader has exited is SIGKILLed before the
    leader is reaped (its unreaped pid keeps the group's id from being reused).

    Raises:
        subprocess.TimeoutExpired: the leader still lives ``timeout`` s after SIGKILL.
    """
    if proc.returncode is not None:  # reaped already
        return
    group = os.getpgid(proc.pid) == proc.pid

    def send(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)

    send(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    # until the leader exits, at most `timeout` s (WNOWAIT: it stays unreaped)
    while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() > deadline:
            send(signal.SIGKILL)
            break
        time.sleep(0.1)
    if group:
        send(signal.SIGKILL)  # the members that outlived their leader
    proc.wait(timeout=timeout)


@dataclass
class Host:
    name: str
    address: str
    pids: list[int] = field(default_factory=list)

    @property
    def netns(self) -> str:
        return self.name


@dataclass
class Cluster:
    """A Spark standalone cluster of network-namespace hosts (see the module docstring).

    Args:
        base: working dir; ``<base>/shared`` is the storage all hosts see.
        workers: number of worker hosts.
        worker_cores: ``--cores`` of each worker (its executor's cores).
        worker_memory: ``--memory`` of each worker.
        loopback_names: host names resolve to 127.0.1.1 on their own host; ``SPARK_LOCAL_IP``
            is set on every host.
        private_dirs: ``{worker index (1-based): [dirs]}`` given an empty private mount on
            that worker (storage the driver's writes never reach).
        worker_gpus: fake GPUs per worker (a discovery script; none when 0).
        shared_dir: False: no directory shared by the hosts (the module docstring's table).
        s3: run an S3 API server on fl-driver; :meth:`submit` sets the job up for it.
        mlflow_artifacts: the MLflow server's ``--artifacts-destination`` (default a folder
            under ``base``); an ``s3://`` URI with :attr:`s3` stores the artifacts in the
            S3 server's bucket (which the caller creates), the server reaching it with
            :meth:`s3_env`.
        mlflow_auth: (user, password) of the MLflow server's basic auth (None: no auth).
            :meth:`submit` gives them to the driver's environment and, unless told not
            to, to the executors' (``spark.executorEnv.*``).
        python: the hosts' Python (default ``.venv-cluster``).
        client_host: add the host :data:`CLIENT_HOST` (10.88.0.20), where a Spark Connect
            client runs (:meth:`client`) against :meth:`connect_server`.
    """

    base: Path = Path("/var/tmp/flowers-cluster")
    workers: int = 2
    worker_cores: int = 1
    worker_memory: str = "6g"
    loopback_names: bool = False
    private_dirs: dict[int, list[Path]] = field(default_factory=dict)
    worker_gpus: int = 0
    mlflow_auth: tuple[str, str] | None = None
    shared_dir: bool = True
    s3: bool = False
    mlflow_artifacts: str | None = None
    python: Path = field(default_factory=cluster_python)
    client_host: bool = False
    hosts: dict[str, Host] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.hosts = {"fl-driver": Host("fl-driver", f"{SUBNET}.2")}
        self.hosts["fl-master"] = Host("fl-master", f"{SUBNET}.3")
        for i in range(1, self.workers + 1):
            self.hosts[f"fl-w{i}"] = Host(f"fl-w{i}", f"{SUBNET}.{10 + i}")
        if self.client_host:
            self.hosts[CLIENT_HOST] = Host(CLIENT_HOST, f"{SUBNET}.20")

    @property
    def shared(self) -> Path:
        return self.base / "shared"

    @property
    def master_url(self) -> str:
        return f"spark://{self.hosts['fl-master'].address}:7077"

    @property
    def connect_url(self) -> str:
        """The Spark Connect server's URL (:meth:`connect_server`), reachable from every host
        and this namespace."""
        return f"sc://{self.hosts['fl-driver'].address}:{CONNECT_PORT}"

    @property
    def mlflow_url(self) -> str:
        return f"http://{self.hosts['fl-driver'].address}:5000"

    @property
    def s3_endpoint(self) -> str:
        """The S3 API server's URL (with :attr:`s3`), reachable from every host and this
        namespace."""
        return f"http://{self.hosts['fl-driver'].address}:{S3_PORT}"

    def s3_env(self) -> dict[str, str]:
        """``AWS_*`` of the S3 server (credentials, region, endpoint); none without :attr:`s3`."""
        return s3_env(self.s3_endpoint) if self.s3 else {}

    @functools.cached_property
    def spark_home(self) -> Path:
        out = _run(
            str(self.python), "-c", "import pyspark, os; print(os.path.dirname(pyspark.__file__))"
        )
        return Path(out.stdout.strip())

    def worker_names(self) -> list[str]:
        return [h for h in self.hosts if h.startswith("fl-w")]

    # -- network -----------------------------------------------------------------------
    def _hosts_file(self, own: str) -> str:
        lines = ["127.0.0.1 localhost"]
        for host in self.hosts.values():
            if host.name == own and self.loopback_names:
                lines.append(f"127.0.1.1 {host.name}")
            else:
                lines.append(f"{host.address} {host.name}")
        return "\n".join(lines) + "\n"

    def _network_up(self) -> None:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        for host in self.hosts.values():
            ns, veth = host.netns, f"v-{host.name}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", veth, "master", BRIDGE, "up")
            _run("ip", "-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(self._hosts_file(host.name))

    def link(self, host: str, up: bool) -> None:
        """Take ``host``'s network link down (or back up): its cable pulled."""
        _run("ip", "link", "set", f"v-{host}", "up" if up else "down")

    # -- processes ---------------------------------------------------------------------
    def _env(self, host: Host) -> dict[str, str]:
        env = {
            "PATH": f"{self.python.parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "HOME": os.environ.get("HOME", "/root"),
            "SPARK_HOME": str(self.spark_home),
            "PYSPARK_PYTHON": str(self.python),
            "PYSPARK_DRIVER_PYTHON": str(self.python),
            "SPARK_LOG_DIR": str(self.base / "logs" / host.name),
            "SPARK_WORKER_DIR": str(self.base / "work" / host.name),
            # A private temp dir per host (Python's tempfile, Spark's local dirs); /tmp
            # itself stays shared, as the repo and its .venv-cluster may live there.
            "TMPDIR": str(self.base / "tmp" / host.name),
            "SPARK_LOCAL_DIRS": str(self.base / "tmp" / host.name),
            "JAVA_HOME": os.environ.get("JAVA_HOME", ""),
            "SPARK_DAEMON_JAVA_OPTS": JVM_OPTIONS,  # master and worker (spark-class)
            "SPARK_SUBMIT_OPTS": JVM_OPTIONS,  # a driver (spark-submit, client mode)
        }
        if self.loopback_names:
            env["SPARK_LOCAL_IP"] = host.address
        return {k: v for k, v in env.items() if v}

    def start(
        self,
        host: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        log: Path | None = None,
        private: Sequence[Path] = (),
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host``: its network, host name, /dev/shm and temp dir.

        Returns:
            The process (``ip netns exec`` -> ``unshare`` -> ``sh`` -> exec ``argv``).
        """
        h = self.hosts[host]
        if not self.shared_dir:
            private = [*private, self.shared]
        mounts = [
            f"mount -t tmpfs -o size=4g tmpfs {shlex.quote(str(d))}"
            for d in ("/dev/shm", *map(str, private))
        ]
        if not self.shared_dir:  # this host's own temp dir, and no other host's
            tmp, keep = self.base / "tmp", "/dev/shm/.own-tmp"
            own = shlex.quote(str(tmp / h.name))
            mounts += [
                f"mkdir {keep}", f"mount --bind {own} {keep}",
                f"mount -t tmpfs -o size=1g tmpfs {shlex.quote(str(tmp))}",
                f"mkdir {own}", f"mount --move {keep} {own}",
            ]  # fmt: skip
        script = f'hostname {h.name} && {" && ".join(mounts)} && exec "$@"'
        cmd = [
            "ip", "netns", "exec", h.netns,
            "unshare", "--uts", "--mount", "--propagation", "private",
            "sh", "-c", script, h.name, *argv,
        ]  # fmt: skip
        out = open(log, "ab") if log else None  # noqa: SIM115 (None: this process's stdout)
        proc = subprocess.Popen(
            cmd, env={**self._env(h), **(env or {})}, stdout=out, stderr=subprocess.STDOUT
        )
        h.pids.append(proc.pid)
        return proc

    def up(self, mlflow: bool = True, timeout: float = 90) -> Cluster:
        """Create the hosts, start the master, the workers, (``mlflow``) the MLflow server and
        (:attr:`s3`) the S3 server, and wait until all workers are registered and the
        servers answer (at most ``timeout`` seconds). With :attr:`s3`, first fills
        :func:`ivy_dir` with :data:`S3_PACKAGES` when a jar is missing (Maven Central,
        at most 600 s).

        Raises:
            ClusterError: a step failed or the workers did not register in time.
        """
        self.down()
        if mlflow:
            # an empty registry each time: the S3 server (moto) keeps its objects in memory,
            # so a registry kept from an earlier cluster would name artifacts that no longer
            # exist (a champion of another split, rescored, then fails to download)
            shutil.rmtree(self.base / "mlflow", ignore_errors=True)
        if self.s3:
            resolve_packages(self.python, S3_PACKAGES, ivy_dir())
        for sub in ("shared", "logs", "work"):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        for host in self.hosts.values():
            (self.base / "tmp" / host.name).mkdir(parents=True, exist_ok=True)
        for dirs in self.private_dirs.values():
            for p in dirs:
                p.mkdir(parents=True, exist_ok=True)
        try:
            self._network_up()
            logs = self.base / "logs"
            master = self.hosts["fl-master"]
            self.start(
                "fl-master",
                [str(self.spark_home / "bin" / "spark-class"), "org.apache.spark.deploy.master.Master", "--host",
                 master.address, "--port", "7077", "--webui-port", "8080"],
                log=logs / "master.out",
            )  # fmt: skip
            for name in self.worker_names():
                self.start_worker(name)
            if mlflow:
                argv, env = mlflow_server(
                    self.python, self.hosts["fl-driver"].address, 5000, self.base / "mlflow",
                    self.mlflow_auth, self.mlflow_artifacts,
                )  # fmt: skip
                if self.s3 and self.mlflow_artifacts:  # the server's own S3 client (boto3)
                    env.update(self.s3_env(), MLFLOW_S3_ENDPOINT_URL=self.s3_endpoint)
                self.start("fl-driver", argv, env=env, log=logs / "mlflow.out")
            if self.s3:
                self.start(
                    "fl-driver",
                    [str(self.python), "-m", "moto.server", "-H", self.hosts["fl-driver"].address,
                     "-p", str(S3_PORT)],
                    log=logs / "s3.out",
                )  # fmt: skip
            self._save()
            self._wait(mlflow, timeout)
        except BaseException:
            self.down()
            raise
        return self

    def start_worker(self, name: str) -> subprocess.Popen[bytes]:
        """Start (or restart) the Spark worker of host ``name`` (``fl-w<i>``)."""
        env = {}
        if self.worker_gpus:
            script = self.base / "fake_gpus.sh"
            addresses = ",".join(f'"{i}"' for i in range(self.worker_gpus))
            script.write_text(
                f'#!/bin/sh\necho \'{{"name": "gpu", "addresses": [{addresses}]}}\'\n'
            )
            script.chmod(0o755)
            env["SPARK_WORKER_OPTS"] = (
                f"-Dspark.worker.resource.gpu.amount={self.worker_gpus} "
                f"-Dspark.worker.resource.gpu.discoveryScript={script}"
            )
        index = int(name.removeprefix("fl-w"))
        return self.start(
            name,
            [str(self.spark_home / "bin" / "spark-class"), "org.apache.spark.deploy.worker.Worker",
             "--cores", str(self.worker_cores), "--memory", self.worker_memory, "--work-dir",
             str(self.base / "work" / name), self.master_url],
            env=env,
            log=self.base / "logs" / f"{name}.out",
            private=self.private_dirs.get(index, []),
        )  # fmt: skip

    def alive_workers(self) -> int:
        """Workers the master lists as ALIVE (0 when its UI does not answer)."""
        master_ui = f"http://{self.hosts['fl-master'].address}:8080/json/"
        with contextlib.suppress(OSError, ValueError):
            state = json.loads(urllib.request.urlopen(master_ui, timeout=2).read())
            return sum(w["state"] == "ALIVE" for w in state["workers"])
        return 0

    def wait_workers(self, timeout: float = 60) -> None:
        """Wait until every worker is ALIVE again (after :meth:`start_worker`).

        Raises:
            ClusterError: not within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while self.alive_workers() < self.workers:
            if time.monotonic() > deadline:
                raise ClusterError(f"workers not ALIVE after {timeout:.0f} s")
            time.sleep(0.5)

    def _wait(self, mlflow: bool, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        alive, ok, s3_ok = 0, not mlflow, not self.s3
        while time.monotonic() < deadline:
            alive = self.alive_workers()
            if mlflow and not ok:
                ok = answers(f"{self.mlflow_url}/health")
            if not s3_ok:
                s3_ok = answers(f"{self.s3_endpoint}/moto-api/")
            if alive == self.workers and ok and s3_ok:
                return
            time.sleep(0.5)
        raise ClusterError(
            f"after {timeout:.0f} s: {alive} of {self.workers} workers registered, MLflow "
            f"server {'up' if ok else 'not up'}, S3 server {'up' if s3_ok else 'not up'}; "
            f"logs in {self.base / 'logs'}"
        )

    def submit(
        self,
        job_args: list[str],
        *,
        conf: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        log: Path | None = None,
        script: Path | None = None,
        executor_credentials: bool = True,
        executor_s3_env: Sequence[str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """spark-submit (client mode) on the driver host, as docs/cluster.md tells users.

        With :attr:`mlflow_auth`, the driver gets the MLflow server's credentials in its
        environment, and the executors in theirs through ``spark.executorEnv.*`` (unless
        ``executor_credentials`` is False): the job never copies the driver's.
        With :attr:`s3`, the same for :meth:`s3_env` (the executors get only the names in
        ``executor_s3_env`` when given: ``()`` none), ``hadoop-aws`` on the class paths
        (:func:`hadoop_aws_classpath`) and :func:`s3a_conf` in the Spark conf.

        Returns:
            The spark-submit process; its output goes to ``log``.
        """
        argv, env = self._spark_submit(conf, env, executor_credentials, executor_s3_env)
        argv += [str(script or REPO / "jobs" / "train_flowers.py"), *job_args]
        return self.start("fl-driver", argv, env=env, log=log)

    def _spark_submit(
        self,
        conf: dict[str, str] | None,
        env: dict[str, str] | None,
        executor_credentials: bool,
        executor_s3_env: Sequence[str] | None,
    ) -> tuple[list[str], dict[str, str]]:
        """spark-submit's options and environment of a driver on fl-driver (:meth:`submit`,
        :meth:`connect_server`), without the application: the master, Delta, the JVM options,
        the executors' environment (MLflow credentials, S3) and, with :attr:`s3`, s3a."""
        credentials = self.mlflow_credentials()
        s3 = self.s3_env()
        executors = {
            **(credentials if executor_credentials else {}),
            **{k: v for k, v in s3.items() if executor_s3_env is None or k in executor_s3_env},
        }
        env = {**credentials, **s3, **(env or {})}
        conf = {
            # what docs/cluster.md runs: workers forked warm (flowers_job.cluster.python_daemon)
            "spark.python.daemon.module": "flowers_job.cluster.python_daemon",
            **{f"spark.executorEnv.{k}": v for k, v in executors.items()},
            **(conf or {}),
        }
        if self.s3:
            jars = hadoop_aws_classpath(ivy_dir())
            conf = {
                "spark.driver.extraClassPath": jars,
                "spark.executor.extraClassPath": jars,
                **s3a_conf(self.s3_endpoint),
                **conf,
            }
        argv = [
            str(self.spark_home / "bin" / "spark-submit"),
            "--master", self.master_url,
            "--packages", DELTA_PACKAGE,
            "--conf", "spark.ui.showConsoleProgress=false",
            "--conf", f"spark.executor.extraJavaOptions={JVM_OPTIONS}",
        ]  # fmt: skip
        for key, value in conf.items():
            argv += ["--conf", f"{key}={value}"]
        return argv, env

    def connect_server(
        self,
        *,
        conf: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        log: Path | None = None,
        executor_credentials: bool = True,
        executor_s3_env: Sequence[str] | None = None,
        timeout: float = CONNECT_START_SECONDS,
    ) -> subprocess.Popen[bytes]:
        """A Spark Connect server (:data:`CONNECT_SERVER_CLASS`, the pyspark wheel's
        ``spark-connect_2.13`` jar, on Spark's class path already) on fl-driver, listening on
        :attr:`connect_url` (the driver's address, :data:`CONNECT_PORT`), running its jobs
        on the cluster's master: spark-submit as :meth:`submit` makes it (Delta from the Ivy
        cache, the JVM options, the executors' environment with the MLflow credentials
        unless ``executor_credentials`` is False, :attr:`s3`'s settings; the executors'
        Python is the hosts' venv, :attr:`python`, as ``PYSPARK_PYTHON`` of the server's
        environment) plus Delta's SQL extension and catalog, which a Connect client cannot
        set (static SQL settings). ``conf`` is fixed for every client of the server: a
        client's session sets runtime SQL settings only (``spark.executorEnv.*``, the fault
        settings of a test, go here). :meth:`down` stops it with every other process.

        Returns:
            The server's process (spark-submit's JVM), once the port answers from this
            namespace; its output goes to ``log`` (default ``<base>/logs/connect-server.out``).

        Raises:
            ClusterError: the server exited or did not listen within ``timeout`` seconds
                (the end of its log quoted).
        """
        driver = self.hosts["fl-driver"].address
        conf = {
            **CONNECT_DELTA_CONF,
            "spark.connect.grpc.binding.address": driver,
            "spark.connect.grpc.binding.port": str(CONNECT_PORT),
            **(conf or {}),
        }
        argv, env = self._spark_submit(conf, env, executor_credentials, executor_s3_env)
        argv += ["--class", CONNECT_SERVER_CLASS, "spark-internal"]
        log = log or self.base / "logs" / "connect-server.out"
        log.unlink(missing_ok=True)
        proc = self.start("fl-driver", argv, env=env, log=log)
        start = time.monotonic()
        while True:
            try:
                socket.create_connection((driver, CONNECT_PORT), timeout=1).close()
                return proc
            except OSError:
                if proc.poll() is not None or time.monotonic() - start > timeout:
                    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                    if proc.poll() is None:
                        proc.kill()
                    raise ClusterError(
                        f"no Spark Connect server at {self.connect_url} after "
                        f"{time.monotonic() - start:.0f} s (exit {proc.poll()}); {log}:\n{tail}"
                    ) from None
                time.sleep(0.5)

    def client(
        self, argv: list[str], *, env: dict[str, str] | None = None, log: Path | None = None
    ) -> subprocess.Popen[bytes]:
        """Run ``argv`` on the client host fl-client (:attr:`client_host`), the machine of a
        Spark Connect client (``flowers-job run --remote`` :attr:`connect_url`): it sees the
        shared dir as the driver host does, reaches the servers of fl-driver over the
        bridge, and runs no Spark: its environment has the MLflow credentials and
        :meth:`s3_env`, as a user's shell would (the job's driver side runs here).

        Returns:
            The process; its output goes to ``log``.

        Raises:
            ClusterError: the cluster has no client host.
        """
        if CLIENT_HOST not in self.hosts:
            raise ClusterError(f"no {CLIENT_HOST} host: Cluster(client_host=True)")
        env = {**self.mlflow_credentials(), **self.s3_env(), **(env or {})}
        return self.start(CLIENT_HOST, argv, env=env, log=log)

    def mlflow_credentials(self) -> dict[str, str]:
        """The MLflow server's credentials as MLflow's client reads them (none without
        :attr:`mlflow_auth`)."""
        if self.mlflow_auth is None:
            return {}
        user, password = self.mlflow_auth
        return {"MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": password}

    def pids(self, host: str) -> list[int]:
        """Every process now running in ``host``'s network namespace."""
        out = _run("ip", "netns", "pids", self.hosts[host].netns, check=False)
        return [int(p) for p in out.stdout.split()]

    def processes(self, host: str, *needles: str) -> list[int]:
        """Processes on ``host`` whose command line contains one of ``needles``."""
        import psutil

        found = []
        for pid in self.pids(host):
            with contextlib.suppress(psutil.Error):
                cmd = " ".join(psutil.Process(pid).cmdline())
                if any(n in cmd for n in needles):
                    found.append(pid)
        return found

    def _save(self) -> None:
        state = {"base": str(self.base), "hosts": [h.name for h in self.hosts.values()]}
        (self.base / STATE_FILE).write_text(json.dumps(state))

    def down(self) -> None:
        """Kill every process on every host and remove the namespaces, links and hosts
        files; safe to call twice and after a partial ``up``."""
        names = set(self.hosts)
        with contextlib.suppress(OSError, ValueError):
            names |= set(json.loads((self.base / STATE_FILE).read_text())["hosts"])
        existing = set(_run("ip", "netns", "list", check=False).stdout.split())
        for name in sorted(names & existing):
            for pid in _run("ip", "netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        for name in sorted(names):
            _run("ip", "link", "del", f"v-{name}", check=False)
            if name in existing:
                _run("ip", "netns", "del", name, check=False)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
        _run("ip", "link", "del", BRIDGE, check=False)
        (self.base / STATE_FILE).unlink(missing_ok=True)
        for host in self.hosts.values():
            host.pids.clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/cluster.py", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["env", "jars", "up", "down", "submit", "client"])
    parser.add_argument("--base", type=Path, default=Cluster.base)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--worker-cores", type=int, default=1)
    parser.add_argument("--loopback-names", action="store_true")
    parser.add_argument("--s3", action="store_true", help="an S3 server on fl-driver (up, submit)")
    parser.add_argument(
        "--no-shared-dir", action="store_true", help="no directory shared by the hosts (up, submit)"
    )
    parser.add_argument(
        "--connect",
        action="store_true",
        help="the client host fl-client and a Spark Connect server on fl-driver (up, client)",
    )
    parser.add_argument(
        "job_args", nargs="*", help="after --: the job's arguments (submit), a command (client)"
    )
    args = parser.parse_args(argv)
    if args.command == "env":
        print(make_env())
        return 0
    if args.command == "jars":  # the Ivy cache of the s3a:// runs (make s3-jars)
        seconds = resolve_packages(Path(sys.executable), S3_PACKAGES, ivy_dir())
        print(f"{', '.join(S3_PACKAGES)} in {ivy_dir()} ({seconds:.0f} s resolving)")
        return 0
    cluster = Cluster(
        base=args.base,
        workers=args.workers,
        worker_cores=args.worker_cores,
        loopback_names=args.loopback_names,
        s3=args.s3,
        shared_dir=not args.no_shared_dir,
        client_host=args.connect or args.command == "client",
    )
    if args.command == "down":
        cluster.down()
        return 0
    if args.command == "up":
        reason = unavailable_reason()
        if reason:
            print(f"cannot start the cluster: {reason}", file=sys.stderr)
            return 1
        cluster.up()
        print(f"master {cluster.master_url}, MLflow {cluster.mlflow_url}, shared {cluster.shared}")
        if cluster.s3:
            print(f"S3 {cluster.s3_endpoint} ({', '.join(cluster.s3_env())} in submit's env)")
        if args.connect:
            cluster.connect_server()
            print(f"Spark Connect {cluster.connect_url}, client host {CLIENT_HOST}")
        return 0
    # client: on a cluster brought up with --connect
    run = cluster.client if args.command == "client" else cluster.submit
    return run(args.job_args).wait()


if __name__ == "__main__":
    sys.exit(main())
