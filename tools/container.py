"""The job's container image (docker/Dockerfile), built and run with podman, with no registry.

    python tools/container.py base              # a bookworm base made of Debian's packages
    python tools/container.py build             # the image on it (FROM that base)
    python tools/container.py run -- run --images /data ...   # flowers-job in the image
    python tools/container.py cluster-up        # Spark master + 2 workers, S3, MLflow
    python tools/container.py cluster-down

Needs root, podman, buildah's engine (podman build), mmdebstrap and runc (``make
container-deps`` installs them from Debian's packages); :func:`unavailable_reason` says what
is missing, and the tests skip with it.

The base (:func:`make_base`) is ``mmdebstrap --variant=minbase`` of bookworm with Python 3.11,
its venv module, the CA certificates and libgomp1 (what the wheels of the lock file need
beyond what they bundle), and this machine's own CA certificates (those in
``/usr/local/share/ca-certificates``: a TLS-intercepting proxy's, where there is one), as a
company's base image carries its CA. It is imported as ``localhost/flowers-base:<recipe
hash>`` and made again only when the recipe changes.

:func:`build_image` is ``podman build --build-arg BASE=<base>`` of docker/Dockerfile, with
this machine's uv cache (``~/.cache/uv``) mounted where the Dockerfile's build cache is: the
locked wheels come from it, as ``make setup``'s do.

Two facts of this kind of machine (a VM with cgroups v1 and v2 mounted side by side, no
``CAP_SYS_RESOURCE``) that every ``podman run`` here works around (:func:`podman`):

- crun, podman's default runtime, refuses hybrid cgroups ("cgroups in hybrid mode not
  supported"); runc runs them (``--runtime runc``, :data:`RUNTIME`).
- podman raises a container's ``RLIMIT_NOFILE``/``RLIMIT_NPROC`` to 1,048,576 by default,
  which a process without ``CAP_SYS_RESOURCE`` may not: the containers get this process's own
  open-files limit and :data:`NPROC` processes (:func:`ulimits`).

The cluster (:class:`ContainerCluster`) is one podman network (:data:`NETWORK`, with DNS:
containers reach each other by name) and containers of the one image:

=========== ===============================================================================
container   runs
=========== ===============================================================================
fl-s3       an S3 API server (``python -m moto.server``) :9000, bucket ``flowers``
fl-mlflow   an MLflow tracking server :5000, artifacts proxied to ``s3://flowers/mlflow``
fl-master   ``org.apache.spark.deploy.master.Master`` :7077, UI :8080
fl-w1, fl-w2 ``org.apache.spark.deploy.worker.Worker``, :attr:`worker_cores` cores each
fl-driver   :meth:`ContainerCluster.submit`: spark-submit in client mode, then gone
=========== ===============================================================================

No directory is shared: the photos and the output are in the bucket (``s3a://``), and the
image's ``spark-defaults.conf`` puts Delta and ``hadoop-aws`` on every JVM's class path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import JVM_OPTIONS, S3_CREDENTIALS, S3_PORT, s3_env, s3a_conf

REPO = Path(__file__).resolve().parents[1]
IMAGE = "localhost/flowers-job:test"
"""The tag :func:`build_image` gives by default."""
SUITE = "bookworm"
MIRRORS = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "libgomp1")
"""The base's packages beyond minbase: Python 3.11 and its venv module (the Dockerfile's
venv), the CA bundle, and libgomp1 (OpenMP, which pyarrow's and scikit-learn's wheels load
from the system). Java comes from the Dockerfile, as on the public base."""
EXTRA_CA_DIR = Path("/usr/local/share/ca-certificates")
RUNTIME = os.environ.get("FLOWERS_OCI_RUNTIME", "runc")
NPROC = 32768
"""Processes per container (its ``RLIMIT_NPROC``): far above a Spark worker's with 2 ranks."""
BASE_TIMEOUT = 900.0
"""Bound on mmdebstrap (seconds; about 25 s with a reachable mirror)."""
BUILD_TIMEOUT = 3000.0
"""Bound on one image build (seconds; about 5 min from a warm uv cache, 2-core machine)."""
NETWORK = "flowers-cl"
SUBNET = "10.89.39.0/24"
"""The cluster's podman network: apart from podman's default (10.88.0.0/16) and the netns
cluster's bridge (tools/cluster.py, 10.88.0.0/24)."""
BUCKET = "flowers"
CLUSTER_START_TIMEOUT = 240.0
"""Bound on the cluster's start: both workers ALIVE, the S3 and MLflow servers answering."""


def unavailable_reason() -> str | None:
    """Why no image can be built or run here (None: it can): not root, or a tool missing."""
    if os.geteuid() != 0:
        return "podman here runs as root (rootful storage and networks): not root"
    for tool in ("podman", "mmdebstrap", RUNTIME):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make container-deps)"
    return None


def ulimits() -> list[str]:
    """``--ulimit`` options within this process's hard limits (podman's own defaults exceed
    them here, and only ``CAP_SYS_RESOURCE`` may raise a limit)."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nofile = 1048576 if nofile == resource.RLIM_INFINITY else min(nofile, 1048576)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={NPROC}:{NPROC}"]


def podman(*args: str) -> list[str]:
    """A podman command line with the OCI runtime this machine needs (:data:`RUNTIME`)."""
    return ["podman", "--runtime", RUNTIME, *args]


def check(argv: Sequence[str], timeout: float, log: Path | None = None) -> str:
    """Run ``argv`` to its end within ``timeout`` seconds; its output (also written to ``log``).

    Raises:
        RuntimeError: it failed or ran out of time (the command and its output's tail).
    """
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{argv[:3]} ran past {timeout:.0f} s") from exc
    out = proc.stdout + proc.stderr
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(out)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... exited {proc.returncode}:\n{out[-3000:]}")
    return out


def image_exists(tag: str) -> bool:
    return subprocess.run(["podman", "image", "exists", tag], check=False).returncode == 0


def base_recipe() -> str:
    """What the base is made of (its tag's hash): suite, mirrors, packages, extra CAs."""
    cas = sorted(EXTRA_CA_DIR.glob("*.crt")) if EXTRA_CA_DIR.is_dir() else []
    parts = [SUITE, *MIRRORS, *BASE_PACKAGES, *(p.read_text() for p in cas)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def make_base(work: Path, *, force: bool = False) -> tuple[str, float]:
    """The Debian-made base image: ``(tag, seconds)``; 0 seconds when one of this recipe
    exists already (``force``: made again). The tar mmdebstrap writes is deleted after
    ``podman import``.

    Raises:
        RuntimeError: mmdebstrap or the import failed (their output's tail).
    """
    tag = f"localhost/flowers-base:{SUITE}-{base_recipe()}"
    if image_exists(tag) and not force:
        return tag, 0.0
    start = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    tar = work / "base.tar"
    cas = sorted(EXTRA_CA_DIR.glob("*.crt")) if EXTRA_CA_DIR.is_dir() else []
    hooks = []
    if cas:
        names = " ".join(str(p) for p in cas)
        hooks += [
            f"--customize-hook=copy-in {names} /usr/local/share/ca-certificates/",
            '--customize-hook=chroot "$1" update-ca-certificates',
        ]
    hooks.append('--customize-hook=rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*')
    argv = [
        "mmdebstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", *hooks,
        "--format=tar", SUITE, str(tar), *MIRRORS,
    ]  # fmt: skip
    try:
        check(argv, BASE_TIMEOUT, work / "mmdebstrap.log")
        check(["podman", "import", "--change", "CMD=/bin/bash", str(tar), tag], 300)
    finally:
        tar.unlink(missing_ok=True)
    return tag, time.monotonic() - start


def build_image(
    base: str | None,
    tag: str = IMAGE,
    *,
    log: Path | None = None,
    no_cache: bool = False,
    uv_cache: Path | None = None,
    context: Path = REPO,
) -> float:
    """``podman build`` of docker/Dockerfile in ``context`` (the repo root): ``BASE=base``
    (None: the Dockerfile's default), tagged ``tag``; ``no_cache`` builds every layer again.
    ``uv_cache`` (default: uv's own, ``$UV_CACHE_DIR`` or ``~/.cache/uv``) is mounted where
    the Dockerfile's uv cache is, when it exists. Images left untagged are removed. Returns
    the build's wall seconds.

    Raises:
        RuntimeError: the build failed (its output's tail; the whole in ``log``).
    """
    argv = podman("build", "-f", str(context / "docker" / "Dockerfile"), "-t", tag)
    if uv_cache is None:
        uv_cache = Path(os.environ.get("UV_CACHE_DIR") or Path.home() / ".cache" / "uv")
    if base is not None:
        argv += ["--build-arg", f"BASE={base}"]
    if uv_cache is not None and uv_cache.is_dir():
        argv += ["-v", f"{uv_cache}:/root/.cache/uv"]
    if no_cache:
        argv.append("--no-cache")
    start = time.monotonic()
    check([*argv, str(context)], BUILD_TIMEOUT, log)
    seconds = time.monotonic() - start
    subprocess.run(["podman", "image", "prune", "-f"], capture_output=True, check=False)
    return seconds


def image_size(tag: str) -> int:
    """The image's size, bytes (uncompressed, all layers, as ``podman images`` shows it)."""
    out = check(["podman", "image", "inspect", "--format", "{{.Size}}", tag], 60)
    return int(out.split()[0])


# Arguments: podman run's options, keyword-only.
def run_args(  # noqa: PLR0913
    tag: str,
    args: Sequence[str],
    *,
    mounts: Mapping[Path, str] = {},
    network: str = "none",
    env: Mapping[str, str] = {},
    name: str | None = None,
    entrypoint: str | None = None,
    detach: bool = False,
) -> list[str]:
    """The ``podman run`` command line of ``args`` in image ``tag``: ``mounts`` maps a host
    path to ``"<container path>[:ro]"``; ``network`` is ``none`` (no interface but
    loopback), or a network's name."""
    argv = podman("run", *ulimits(), "--network", network)
    argv += ["-d"] if detach else ["--rm"]
    if name is not None:
        argv += ["--name", name, "--hostname", name]
    if entrypoint is not None:
        argv += ["--entrypoint", entrypoint]
    for host, inside in mounts.items():
        argv += ["-v", f"{host}:{inside}"]
    for key in env:
        argv += ["-e", key]  # the value from this process's environment: not in the argv
    return [*argv, tag, *args]


def run(
    tag: str,
    args: Sequence[str],
    *,
    timeout: float,
    log: Path,
    env: Mapping[str, str] = {},
    **kwargs: object,
) -> tuple[int, str, float]:
    """``podman run`` (:func:`run_args`) to its end: ``(exit status, output, wall seconds)``.
    On timeout the container is killed and the status is 124."""
    argv = run_args(tag, args, env=env, **kwargs)  # type: ignore[arg-type]
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = 124
    return rc, log.read_text(errors="replace"), time.monotonic() - start


@dataclass
class ContainerCluster:
    """A Spark standalone cluster of containers of one image (the module's docstring).

    Args:
        image: the image every container runs.
        logs: where the containers' logs are copied at :meth:`down`.
        workers: Spark workers (``fl-w1`` ...).
        worker_cores: task slots per worker (one rank each).
    """

    image: str
    logs: Path
    workers: int = 2
    worker_cores: int = 2

    def names(self) -> list[str]:
        return ["fl-s3", "fl-mlflow", "fl-master", *self.worker_names(), "fl-driver"]

    def worker_names(self) -> list[str]:
        return [f"fl-w{i}" for i in range(1, self.workers + 1)]

    @property
    def master_url(self) -> str:
        return "spark://fl-master:7077"

    @property
    def s3_endpoint(self) -> str:
        """The S3 server as the containers reach it (by name)."""
        return f"http://fl-s3:{S3_PORT}"

    @property
    def mlflow_url(self) -> str:
        return "http://fl-mlflow:5000"

    def address(self, name: str) -> str:
        """The container's address on :data:`NETWORK` (this machine reaches it there)."""
        out = check(
            ["podman", "inspect", "--format", "{{json .NetworkSettings.Networks}}", name], 60
        )
        return str(json.loads(out)[NETWORK]["IPAddress"])

    def _start(
        self, name: str, args: Sequence[str], entrypoint: str, env: Mapping[str, str] = {}
    ) -> None:
        argv = run_args(
            self.image, args, network=NETWORK, name=name, entrypoint=entrypoint, env=env,
            detach=True,
        )  # fmt: skip
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=120, env={**os.environ, **env},
            check=False,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"{name} did not start: {(proc.stdout + proc.stderr)[-2000:]}")

    def up(self, timeout: float = CLUSTER_START_TIMEOUT) -> ContainerCluster:
        """Create the network and start every container but the driver; wait until the
        master lists every worker ALIVE and both servers answer.

        Raises:
            RuntimeError: something did not start within ``timeout`` seconds (everything
                started is removed again).
        """
        self.down(quiet=True)
        try:
            check(["podman", "network", "create", "--subnet", SUBNET, NETWORK], 60)
            s3 = s3_env(self.s3_endpoint)
            self._start(
                "fl-s3", ["-m", "moto.server", "-H", "0.0.0.0", "-p", str(S3_PORT)], "python"
            )
            self._start(
                "fl-mlflow",
                ["server", "--host", "0.0.0.0", "--port", "5000", "--workers", "1",
                 "--backend-store-uri", "sqlite:////tmp/mlflow.db",
                 "--artifacts-destination", f"s3://{BUCKET}/mlflow",
                 "--allowed-hosts", f"fl-mlflow,fl-mlflow:5000,{SUBNET.rsplit('.', 1)[0]}.*"],
                "mlflow",
                env={**s3, "MLFLOW_S3_ENDPOINT_URL": self.s3_endpoint,
                     "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            )  # fmt: skip
            jvm = {"SPARK_DAEMON_JAVA_OPTS": JVM_OPTIONS}
            self._start(
                "fl-master",
                ["org.apache.spark.deploy.master.Master", "--host", "fl-master", "--port",
                 "7077", "--webui-port", "8080"],
                "spark-class", env=jvm,
            )  # fmt: skip
            for name in self.worker_names():
                self._start(
                    name,
                    ["org.apache.spark.deploy.worker.Worker", "--cores", str(self.worker_cores),
                     "--memory", "4g", self.master_url],
                    "spark-class", env=jvm,
                )  # fmt: skip
            self._wait(timeout)
        except BaseException:
            self.down()
            raise
        return self

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = "nothing answered"
        while time.monotonic() < deadline:
            try:
                master = json.loads(
                    urllib.request.urlopen(
                        f"http://{self.address('fl-master')}:8080/json/", timeout=5
                    ).read()
                )
                alive = sum(w.get("state") == "ALIVE" for w in master.get("workers", []))
                urllib.request.urlopen(f"http://{self.address('fl-mlflow')}:5000/health", timeout=5)
                urllib.request.urlopen(f"http://{self.address('fl-s3')}:{S3_PORT}/", timeout=5)
                state = f"{alive} of {self.workers} workers ALIVE"
                if alive == self.workers:
                    return
            except (OSError, ValueError, RuntimeError) as exc:
                state = f"not yet: {exc}"
            time.sleep(2)
        raise RuntimeError(f"the cluster did not start within {timeout:.0f} s: {state}")

    def host_s3_endpoint(self) -> str:
        """The S3 server as this machine reaches it (its address on the network)."""
        return f"http://{self.address('fl-s3')}:{S3_PORT}"

    def submit(
        self,
        script: str,
        args: Sequence[str],
        *,
        log: Path,
        timeout: float,
        conf: Mapping[str, str] = {},
    ) -> tuple[int, str, float]:
        """spark-submit of ``script`` (a path in the image) in client mode, from a new
        container ``fl-driver`` on the network: the S3 credentials in the driver's
        environment and the executors' (``spark.executorEnv.*``), s3a at the S3 server.
        Returns ``(exit status, output, wall seconds)``."""
        s3 = s3_env(self.s3_endpoint)
        settings = {
            **s3a_conf(self.s3_endpoint),
            **{f"spark.executorEnv.{k}": v for k, v in s3.items()},
            "spark.executor.extraJavaOptions": JVM_OPTIONS,
            "spark.ui.showConsoleProgress": "false",
            **conf,
        }
        argv = ["--master", self.master_url]
        for key, value in settings.items():
            argv += ["--conf", f"{key}={value}"]
        return run(
            self.image, [*argv, script, *args], timeout=timeout, log=log, env=s3,
            network=NETWORK, name="fl-driver", entrypoint="spark-submit",
        )  # fmt: skip

    def down(self, quiet: bool = False) -> None:
        """Copy each container's log into :attr:`logs`, remove the containers and the network."""
        self.logs.mkdir(parents=True, exist_ok=True)
        for name in self.names():
            out = subprocess.run(
                ["podman", "logs", name], capture_output=True, text=True, check=False
            )
            if out.returncode == 0:
                (self.logs / f"{name}.log").write_text(out.stdout + out.stderr)
            subprocess.run(
                ["podman", "rm", "-f", "-t", "5", name], capture_output=True, check=False
            )
        subprocess.run(["podman", "network", "rm", "-f", NETWORK], capture_output=True, check=False)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    base = sub.add_parser("base", help="make the Debian-made base image")
    base.add_argument("--work", type=Path, default=Path("/var/tmp/flowers-container"))
    base.add_argument("--force", action="store_true")
    build = sub.add_parser("build", help="build docker/Dockerfile on the Debian-made base")
    build.add_argument("--tag", default=IMAGE)
    build.add_argument("--public-base", action="store_true", help="the Dockerfile's default base")
    build.add_argument("--no-cache", action="store_true")
    runp = sub.add_parser("run", help="flowers-job ARGS in the image, --network none")
    runp.add_argument("--tag", default=IMAGE)
    runp.add_argument("args", nargs=argparse.REMAINDER)
    up = sub.add_parser("cluster-up")
    up.add_argument("--tag", default=IMAGE)
    sub.add_parser("cluster-down")
    ns = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        print(f"cannot: {reason}", file=sys.stderr)
        return 2
    work = Path("/var/tmp/flowers-container")
    if ns.command == "base":
        tag, seconds = make_base(ns.work, force=ns.force)
        print(f"{tag} ({seconds:.0f} s)")
    elif ns.command == "build":
        base_tag = None if ns.public_base else make_base(work)[0]
        seconds = build_image(base_tag, ns.tag, log=work / "build.log", no_cache=ns.no_cache)
        print(f"{ns.tag}: {image_size(ns.tag) / 1e9:.2f} GB, built in {seconds:.0f} s")
    elif ns.command == "run":
        args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
        return subprocess.run(run_args(ns.tag, args), check=False).returncode
    elif ns.command == "cluster-up":
        cluster = ContainerCluster(ns.tag, work / "logs").up()
        print(f"up: master UI http://{cluster.address('fl-master')}:8080, "
              f"S3 {cluster.host_s3_endpoint()} (key {S3_CREDENTIALS[0]})")  # fmt: skip
    elif ns.command == "cluster-down":
        ContainerCluster(IMAGE, work / "logs").down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
