"""The job on a real multi-host Spark standalone cluster (tools/cluster.py).

One network namespace per host: a master, 2 workers (their own JVMs, IPs, host names,
temp dir and /dev/shm) and the driver, which runs spark-submit in client mode and a real
MLflow tracking server with basic auth: its credentials reach the ranks only through the
executors' environment (``spark.executorEnv.*`` in the submit conf), as the README tells
users. The project runs there as the built wheel (``.venv-cluster``).
Skipped, with the reason, where namespaces cannot be made (not root, no ``ip``).

Clusters one after the other (the hosts' names and addresses are fixed): host names
that resolve to the hosts' own addresses, for every test but :class:`TestLoopbackNames`,
which gets names that resolve to loopback. The job runs end to end (``run``: ingest, then
train) once on each: with Petastorm on the first through a killed rank and the automatic
restart that follows, with Streaming on the second. The other fault runs train (``train``) on a copy of the
tables the first job ingested, so that none of them ingests again before its first epoch.
A third, :class:`TestObjectStore`'s, shares no directory between its hosts and stores
everything in a bucket of an S3 API server (moto) on the driver host (tests/support/s3.py).

Measured times to surface (fault -> driver exit, and -> no rank process on any host) are
appended as JSON lines to ``$FLOWERS_CLUSTER_REPORT`` when it is set.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import filelock
import mlflow
import psutil
import pytest

from flowers_job.loaders import loader_problem
from tests.support import ROOT_DIR
from tests.support.data import DELTA_STATE_CONF, SMALL_TABLES_CONF, sample_photos
from tests.support.faults import fault_env
from tests.support.s3 import S3Store

sys.path.insert(0, str(ROOT_DIR / "tools"))
from cluster import Cluster, answers, make_env, unavailable_reason

from tests.support import ROOT_DIR

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.tier("full")]

_REASON = unavailable_reason()
if _REASON is None and not (ROOT_DIR / ".venv").is_dir():
    _REASON = "no .venv beside tests/ to build .venv-cluster from (run `make setup`)"
if _REASON is not None:
    pytest.skip(f"no cluster here: {_REASON}", allow_module_level=True)

JOB_TIMEOUT = 600.0
"""Bound on one spark-submit (seconds). The S3 cluster's job on the sample with Streaming on
Spark 4.2 and Spark's default partitions: 3 min 45 s from the submit to training's first
stage on a quiet machine. Before the executors' Python workers were forked warm
(flowers_job.cluster.python_daemon) it took about 6.5 min under load, 3 min 44 s of it the
loader cache's Spark jobs, and once ran past this bound (docs/testing.md)."""
LOCK_TIMEOUT = 600.0
"""Longest wait for another run of this file, on this machine, to give the cluster up."""
BASE = Path("/var/tmp/flowers-cluster-test")
PRIVATE = BASE / "shared" / "private"
"""An empty private mount on worker 2 (storage the driver's writes never reach there)."""
CLUSTERS: dict[str, dict[str, Any]] = {
    # Host names resolve to the host's own address; 1 core per worker.
    "own-address names": {"private_dirs": {2: [PRIVATE]}},
    # Host names resolve to loopback (Debian's 127.0.1.1), SPARK_LOCAL_IP set; 2 cores and
    # one (fake) GPU per worker.
    "loopback names": {"loopback_names": True, "worker_cores": 2, "worker_gpus": 1},
    # No directory shared by the hosts; an S3 API server (moto) on the driver host; host
    # names that resolve to loopback, 2 cores per worker (4 ranks on 2 hosts).
    # MLflow's artifacts in the bucket too.
    "object store": {
        "shared_dir": False,
        "s3": True,
        "loopback_names": True,
        "worker_cores": 2,
        "mlflow_artifacts": "s3://flowers/mlflow-artifacts",
    },
}
MLFLOW_AUTH = ("flowers-admin", "pw-cluster-3b8e1f6a0d")
"""The MLflow server's user and password (basic auth) on every cluster: Cluster.submit
gives them to the driver's environment and the executors' (``spark.executorEnv.*``). The
password is found in no log, summary or MLflow param."""
TRAIN_CONF = DELTA_STATE_CONF
"""spark-submit settings of the fault runs: Delta's state in 2 partitions, not 50, which on
two 1-core executors is some 800 tasks of nothing per run (about 30 s at a load of 5 on the
2-core CI machine). The job's first end-to-end run (``run``, killed in epoch 2 and
restarted) takes :data:`JOB_CONF`. The S3 cluster's failing Streaming job keeps Spark's
defaults, as docs/cluster.md runs it; its resume takes :data:`JOB_CONF`."""
JOB_CONF = SMALL_TABLES_CONF
"""The first end-to-end run's: :data:`TRAIN_CONF`, and the loader cache's and the split's
Spark jobs in 2 shuffle partitions, not 200 (Streaming's MDS conversion runs several per
split: with Spark's defaults they took 3 min 44 s of a 6.5 min run under load)."""
TRAIN_ENTRY = """\
# spark-submit entry of `flowers-job train` (tests/cluster/test_cluster.py), as jobs/train_flowers.py
# is that of `flowers-job run`: training on the tables already in --output-dir.
import sys

from flowers_job.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
"""


@pytest.fixture(scope="module")
def cluster_python() -> Path:
    return make_env()


@pytest.fixture(scope="module")
def photos(cluster_python: Path) -> Iterator[Path]:
    """16 real photos per label (80) on the storage every host shares."""
    shared = BASE / "shared" / "photos"
    if not shared.is_dir():
        sample_photos(shared, per_label=16)
    yield shared


def fresh(path: Path) -> Path:
    """``path`` with nothing left in it from an earlier run."""
    shutil.rmtree(path, ignore_errors=True)
    return path


def healthy(cluster: Cluster) -> bool:
    """Every worker ALIVE and the MLflow server answering (a test that failed half-way
    could have left a worker dead)."""
    import urllib.request

    if cluster.alive_workers() != cluster.workers:
        return False
    if cluster.s3 and not answers(f"{cluster.s3_endpoint}/moto-api/"):
        return False
    with contextlib.suppress(OSError):
        return bool(urllib.request.urlopen(f"{cluster.mlflow_url}/health", timeout=5).status == 200)
    return False


class Clusters:
    """The cluster of :data:`CLUSTERS` a test asks for, one at a time: built when another one
    (or none, or one a failed test left unhealthy) is up, which is taken down first."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.cluster: Cluster | None = None

    def get(self, name: str) -> Cluster:
        if self.cluster is not None and (self.name != name or not healthy(self.cluster)):
            self.close()
        if self.cluster is None:
            cluster = Cluster(base=BASE, mlflow_auth=MLFLOW_AUTH, **CLUSTERS[name])
            cluster.up()  # on failure, it takes down what it made
            self.name, self.cluster = name, cluster
        return self.cluster

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.down()
        self.name, self.cluster = None, None


@pytest.fixture(scope="module")
def clusters(photos: Path) -> Iterator[Clusters]:
    """The clusters, held by this run alone: another run of this file on this machine (the
    hosts' names and addresses are fixed) waits for it, at most :data:`LOCK_TIMEOUT`."""
    lock = filelock.FileLock(BASE.with_name(BASE.name + ".lock"))
    try:
        acquired = lock.acquire(timeout=LOCK_TIMEOUT)
    except filelock.Timeout:
        pytest.fail(
            f"another run of cluster/test_cluster.py held {lock.lock_file} for {LOCK_TIMEOUT:.0f} s"
        )
    with acquired:
        held = Clusters()
        try:
            yield held
        finally:
            held.close()


@pytest.fixture
def cluster(clusters: Clusters) -> Cluster:
    """Host names resolve to the host's own address; 1 core per worker; worker 2 has an empty
    private mount at :data:`PRIVATE`."""
    return clusters.get("own-address names")


@pytest.fixture
def loopback_cluster(clusters: Clusters) -> Cluster:
    """Host names resolve to 127.0.1.1, SPARK_LOCAL_IP set; 2 cores and 1 (fake) GPU per worker."""
    return clusters.get("loopback names")


@pytest.fixture(scope="module")
def train_entry(photos: Path) -> Path:
    path = BASE / "train_entry.py"
    path.write_text(TRAIN_ENTRY)
    return path


def job_args(
    cluster: Cluster, photos: Path | str, out: Path | str, *sets: str, server: bool = True
) -> list[str]:
    """The job arguments of docs/cluster.md: barrier mode, the MLflow server (``server``), a small
    model size, and batches small enough for 4 steps per epoch on the 80 photos' train split
    (58 rows, 29 per rank: val and test take about 20% and 10%). ``photos`` and ``out`` may
    be ``s3a://`` URLs (:class:`TestObjectStore`'s cluster)."""
    return ["--images", str(photos), *train_args(cluster, out, *sets, server=server)]


def train_args(cluster: Cluster, out: Path | str, *sets: str, server: bool = True) -> list[str]:
    """:func:`job_args` without the images: those of ``flowers-job train``."""
    args = ["--output-dir", str(out)]
    name = str(out).rstrip("/").rsplit("/", 1)[-1]
    for item in (
        "distributed.local_mode=false",
        "data.image_size=64",
        "train.per_device_batch_size=8",
        "train.epochs=3",
        *([f"tracking.tracking_uri={cluster.mlflow_url}"] if server else []),
        f"tracking.experiment_name=cluster-{name}",
        f"tracking.registered_model_name=cluster_{name}",
        *sets,
    ):
        args += ["--set", item]
    return args


def submit(cluster: Cluster, args: list[str], log: Path, **kwargs: Any) -> tuple[int, str]:
    """spark-submit on the driver host; its exit status and its log (this run's alone)."""
    log.unlink(missing_ok=True)
    proc = cluster.submit(args, log=log, **kwargs)
    try:
        rc = proc.wait(timeout=JOB_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    return rc, log.read_text(errors="replace")


def rank_processes(cluster: Cluster) -> dict[str, list[int]]:
    """torchrun and its children (the ranks) on each worker host."""
    found: dict[str, list[int]] = {}
    for host in cluster.worker_names():
        pids = []
        for pid in cluster.processes(host, "torch.distributed.run"):
            pids.append(pid)
            with contextlib.suppress(psutil.Error):
                pids += [c.pid for c in psutil.Process(pid).children(recursive=True)]
        if pids:
            found[host] = pids
    return found


def wait_for(condition: Any, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.25)
    return time.monotonic() - t0


def report(**values: Any) -> None:
    path = os.environ.get("FLOWERS_CLUSTER_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(values) + "\n")


def check_summary(
    out: Path | dict[str, Any], cluster: Cluster, world_size: int = 2, epochs: int = 3
) -> dict[str, Any]:
    """The run's summary (``out/summary.json``, or the summary ``out`` itself): ``world_size``
    ranks on both worker hosts (as evenly as Spark places them), each on the bridge's
    interface, and ``epochs`` epochs."""
    summary = out if isinstance(out, dict) else json.loads((out / "summary.json").read_text())
    ranks = summary["ranks"]
    assert len(ranks) == world_size
    per_host = [sum(r["host"] == h for r in ranks) for h in ("fl-w1", "fl-w2")]
    assert sorted(per_host) == [world_size // 2, world_size - world_size // 2], ranks
    assert {r["address"] for r in ranks} == {
        cluster.hosts["fl-w1"].address,
        cluster.hosts["fl-w2"].address,
    }
    assert all(r["interface"] == "eth0" for r in ranks)  # not lo, whatever the name says
    assert len({r["pid"] for r in ranks}) == world_size
    # the allocator tuning reached the executors (spark.executorEnv.*) and the ranks
    assert all(r["allocator"]["MALLOC_MMAP_MAX_"] == "0" for r in ranks), ranks
    # The row-count/checksum invariants are checked by the ranks every epoch (a violation
    # fails the job); the summary's counts match the tables.
    assert summary["train_rows"] + summary["val_rows"] + summary["test_rows"] == 80
    assert summary["epochs_completed"] == epochs
    assert summary["local_mode"] is False
    return summary


def check_cache_left(store: S3Store, out: str) -> dict[str, Any]:
    """What a finished (or failed) run leaves of the loader cache in the bucket: its
    published entries only (a marker and the one data folder it names each), no run folder,
    no unpublished writer's folder, no reader's lease. Returns entry name -> marker."""
    keys = [k for k in store.keys(f"{out}/loader_cache/") if not k.endswith("/")]
    assert not [k for k in keys if "/loader_cache/run-" in k], keys
    assert not [k for k in keys if "/users/" in k], keys
    markers = {
        k.split("/")[-2]: json.loads(store.read(k)) for k in keys if k.endswith("/entry.json")
    }
    for key in keys:
        entry, _, rest = key.split("/entries/", 1)[-1].partition("/")
        folder = rest.split("/", 1)[0]
        assert entry in markers, key
        assert folder in ("entry.json", "last_used", markers[entry]["data"]), key
    return markers


def assert_no_secret(log: str) -> None:
    """The MLflow server's password is in no spark-submit log (driver and ranks) and no
    executor or daemon log of any host."""
    secret = MLFLOW_AUTH[1]
    assert secret not in log
    for path in [*(BASE / "work").rglob("std*"), *(BASE / "logs").rglob("*")]:
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def check_registered(
    cluster: Cluster, summary: dict[str, Any], world_size: int = 2, epochs: int = 3
) -> None:
    """The run, the registered model and its promotion, read back through the tracking
    server with its credentials (the conftest restores the environment after the test)."""
    os.environ.update(cluster.mlflow_credentials())
    client = mlflow.MlflowClient(tracking_uri=cluster.mlflow_url)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["world_size"] == str(world_size)
    assert run.data.tags["mlflow.user"] == MLFLOW_AUTH[0]  # rank 0 logged as that user
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "val_loss")) == list(
        range(1, epochs + 1)
    )
    version = client.get_model_version(
        summary["registered_model_name"], str(summary["registered_model_version"])
    )
    assert version.run_id == run.info.run_id
    assert summary["model_uri"].startswith("models:/")
    # the driver's champion decision, made and recorded through the server
    assert "flowers_job.driver.promotion" in run.data.tags
    promotion = summary["promotion"]
    champion = client.get_model_version_by_alias(summary["registered_model_name"], "champion")
    expected = version.version if promotion["promoted"] else str(promotion["champion_version"])
    assert champion.version == expected, promotion
    secret = MLFLOW_AUTH[1]
    assert secret not in json.dumps(summary) and secret not in json.dumps(run.data.params)
    assert secret not in json.dumps(run.data.tags)


# --------------------------------------------------------------------------------------
# Host names resolve to the host's own address; 1 core per worker.
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster_job(clusters: Clusters, photos: Path) -> dict[str, Any]:
    """The job end to end with Streaming (the hosts run the default environment), once,
    through a killed rank: ``run`` (ingest, then
    train) with rank 1's process SIGKILLed in epoch 2; the driver restarts the ranks from
    the last checkpoint by itself (``train.max_restarts`` 1, the default) and the run ends
    (exit status, log, output dir). For :class:`TestCluster`, the killed-rank test and, its
    tables, :func:`fault_tables`."""
    cluster = clusters.get("own-address names")
    out = fresh(cluster.shared / "job")

    def kill_rank(ranks: dict[int, tuple[str, int]], proc: Any) -> None:
        os.kill(ranks[1][1], signal.SIGKILL)

    rc, log, _, _ = _fault_run(cluster, out, "kill-rank", kill_rank, images=photos)
    return {"rc": rc, "log": log, "out": out, "killed_host": _ranks_line_host(log)}


def _ranks_line_host(log: str) -> str | None:
    """The host of rank 1 in the first ``ranks:`` line of ``log``."""
    found = re.search(r"1@(fl-w\d)\(", log)
    return found[1] if found else None


class TestCluster:
    @pytest.mark.tier("gate")  # the gate's multi-host job (its restart: the test below)
    def test_job_runs_a_rank_on_each_host_and_logs_over_http(
        self, cluster: Cluster, cluster_job: dict[str, Any]
    ) -> None:
        rc, log, out = cluster_job["rc"], cluster_job["log"], cluster_job["out"]
        assert rc == 0, log[-4000:]
        # The run resumed after its killed rank (test_killed_rank_is_named_and_the_run_resumes)
        # and logged each epoch once: check_registered reads val_loss at steps 1, 2, 3.
        summary = check_summary(out, cluster)
        assert summary["loader"] == "streaming"
        check_registered(cluster, summary)
        assert_no_secret(log)
        report(test="job streaming own-address names", job_seconds=summary["job_seconds"])

    def test_a_local_tracking_store_is_refused_before_any_work(
        self, cluster: Cluster, photos: Path
    ) -> None:
        out = fresh(cluster.shared / "sqlite")
        rc, log = submit(cluster, job_args(cluster, photos, out, server=False), BASE / "sqlite.log")
        assert rc == 2, log[-3000:]
        assert "tracking.tracking_uri: sqlite:///" in log
        assert "tracking.store_is_shared=true" in log
        assert not (out / "tables").exists()  # nothing ingested

    def test_executors_without_tracking_credentials_are_refused_before_any_work(
        self, cluster: Cluster, photos: Path
    ) -> None:
        """The driver has the MLflow server's credentials, the executors have not (no
        ``spark.executorEnv.*``): the executor probe stops the job before any work."""
        out = fresh(cluster.shared / "no-credentials")
        rc, log = submit(
            cluster,
            job_args(cluster, photos, out),
            BASE / "no-credentials.log",
            executor_credentials=False,
        )
        assert rc == 2, log[-3000:]
        hosts = ", ".join(f"{h} ({cluster.hosts[h].address})" for h in cluster.worker_names())
        assert (
            f"tracking.tracking_uri: the MLflow store {cluster.mlflow_url} cannot be used from "
            "the executors"
        ) in log
        assert (
            "MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD set on the driver but missing "
            f"on executor host {hosts}"
        ) in log
        assert "--conf spark.executorEnv.MLFLOW_TRACKING_USERNAME=..." in log
        assert_no_secret(log)
        assert not (out / "tables").exists()  # nothing ingested


# --------------------------------------------------------------------------------------
# One worker has its own private mount where the output dir is.
# --------------------------------------------------------------------------------------
def test_an_output_dir_one_executor_cannot_see_is_refused(cluster: Cluster, photos: Path) -> None:
    out = fresh(PRIVATE / "out")
    rc, log = submit(cluster, job_args(cluster, photos, out), BASE / "private.log")
    assert rc == 2, log[-3000:]
    assert (
        f"paths.output_dir: {out} is not shared with the executors: executor host fl-w2 "
        f"({cluster.hosts['fl-w2'].address}) cannot read a file the driver wrote there"
    ) in log
    assert not (out / "tables").exists()


# --------------------------------------------------------------------------------------
# Faults across hosts: each kills or cuts something mid-training (rank 1 is held in its
# second epoch by the test-only `hang` fault, so the moment is deterministic), and checks:
# the driver names a rank or host and the cause, no rank process is left on any host, and
# the checkpoint of epoch 1 can be resumed. Each trains (`flowers-job train`) on the tables
# the Petastorm job ingested.
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fault_tables(cluster_job: dict[str, Any]) -> Path:
    """An output dir holding a copy of the Delta tables the Petastorm job ingested on the
    cluster (a Delta table's files are relative to its directory)."""
    if cluster_job["rc"] != 0:
        pytest.fail(
            f"no tables to train on: the Petastorm job failed\n{cluster_job['log'][-3000:]}"
        )
    out = fresh(BASE / "shared" / "faults")
    shutil.copytree(cluster_job["out"] / "tables", out / "tables")
    return out


def _ranks_line(log_path: Path) -> dict[int, tuple[str, int]]:
    """``{rank: (host, pid)}`` from rank 0's ``ranks:`` log line."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    return {
        int(m[0]): (m[1], int(m[2]))
        for m in re.findall(r"(\d+)@(fl-w\d)\([^,]*, [^,]*, pid (\d+)", text)
    }


def _executor_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` as the executors' environment (``spark.executorEnv.*``): the fault settings
    and ``FLOWERS_JOB_HOOKS``, which loads the tests' injector in the ranks."""
    return {f"spark.executorEnv.{name}": value for name, value in env.items()}


# Arguments: a fault scenario's knobs, each with a default.
def _fault_run(  # noqa: PLR0913
    cluster: Cluster,
    out: Path,
    name: str,
    act: Any,
    fault: str = "hang:1:2:0",  # attempt 0 only: a restart must not hang again
    sets: tuple[str, ...] = (),
    entry: Path | None = None,
    images: Path | None = None,
) -> tuple[int, str, dict[str, float], Path]:
    """``flowers-job train`` (``entry``) on the tables in ``out``, or the job end to end
    (``run``) on ``images``; ``act`` once epoch 1 is checkpointed."""
    ckpt = out / "checkpoints"
    shutil.rmtree(ckpt, ignore_errors=True)
    log = BASE / f"fault-{name}.log"
    log.unlink(missing_ok=True)
    conf = _executor_env(fault_env(fault)) if fault else {}
    sets = ("distributed.timeout_seconds=20", *sets)
    if images is None:
        args, conf = train_args(cluster, out, *sets), {**TRAIN_CONF, **conf}
    else:
        args = job_args(cluster, images, out, "data.loader=streaming", *sets)
        conf = {**JOB_CONF, **conf}
    proc = cluster.submit(args, log=log, conf=conf, script=entry)
    try:
        wait_for(
            lambda: (
                proc.poll() is not None
                or ((ckpt / "last.pt").exists() and len(_ranks_line(log)) == 2)
            ),
            JOB_TIMEOUT,
            "epoch 1 checkpointed",
        )
        # A run that ended before its fault fails the test now, not after JOB_TIMEOUT.
        assert proc.poll() is None, (
            f"the run ended (exit {proc.returncode}) before epoch 1 was checkpointed:\n"
            + log.read_text(errors="replace")[-3000:]
        )
        time.sleep(1.0)  # into epoch 2
        ranks = _ranks_line(log)
        t_fault = time.monotonic()
        act(ranks, proc)
        rc = proc.wait(timeout=JOB_TIMEOUT)
        surfaced = time.monotonic() - t_fault
        clean = wait_for(lambda: not rank_processes(cluster), 120, "no rank process left")
    finally:
        if proc.poll() is None:
            proc.kill()
    times = {"surfaced_seconds": round(surfaced, 1), "clean_seconds": round(surfaced + clean, 1)}
    report(test=f"fault {name}", **times)
    return rc, log.read_text(errors="replace"), times, out


def _resumable(out: Path) -> None:
    import torch

    state = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert int(state["epoch"]) >= 1


class TestFaults:
    @pytest.mark.tier("gate")  # the gate's restart path: the same run as the job above
    def test_killed_rank_is_named_and_the_run_restarts(
        self, cluster: Cluster, cluster_job: dict[str, Any]
    ) -> None:
        """The job (:func:`cluster_job`): rank 1 SIGKILLed in epoch 2 is named
        with its signal and host by its watchdog, and the barrier stage runs again from the
        last checkpoint, in the same MLflow run, to the end."""
        rc, log, out = cluster_job["rc"], cluster_job["log"], cluster_job["out"]
        assert rc == 0, log[-4000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["restarts"] == 1
        (restart,) = summary["restart_history"]
        host = cluster_job["killed_host"]
        assert restart["cause"].startswith(f"rank 1 was killed by SIGKILL on host {host}"), restart
        assert restart["world_size_after"] == 2
        assert [h["epoch"] for h in summary["history"]] == [1, 2, 3]
        assert "resumed from" in log
        report(test="restart after a killed rank", **restart)

    def test_killed_worker_jvm(
        self, cluster: Cluster, fault_tables: Path, train_entry: Path
    ) -> None:
        """A worker's JVM SIGKILLed in epoch 2 (its executor follows): the ranks fail, the
        restart finds one task slot left and, with ``distributed.min_processes=1``,
        continues on it from the last checkpoint: learning rate and global batch rescaled,
        every row read once per epoch at world size 1."""
        victim: list[str] = []

        def kill_worker(ranks: dict[int, tuple[str, int]], proc: Any) -> None:
            victim.append(ranks[1][0])
            for pid in cluster.processes(ranks[1][0], "deploy.worker.Worker"):
                os.kill(pid, signal.SIGKILL)

        try:
            rc, log, _, out = _fault_run(
                cluster,
                fault_tables,
                "kill-worker-jvm",
                kill_worker,
                entry=train_entry,
                sets=("distributed.min_processes=1",),
            )
        finally:
            if victim:
                cluster.start_worker(victim[0])
                cluster.wait_workers()
        assert rc == 0, log[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        (restart,) = summary["restart_history"]
        assert (restart["world_size_before"], restart["world_size_after"]) == (2, 1), restart
        assert restart["kind"] in ("connection", "killed", "timeout"), restart  # transient
        assert summary["world_size"] == 1 and summary["history"][-1]["world_size"] == 1
        assert [r["host"] for r in summary["ranks"]] != [victim[0]]
        assert "resumed at world_size 1 (the checkpoint's: 2)" in log
        report(test="restart on the slot left after a worker's JVM was killed", **restart)

    def test_killed_driver_leaves_no_rank_behind(
        self, cluster: Cluster, fault_tables: Path, train_entry: Path
    ) -> None:
        def kill_driver(ranks: dict[int, tuple[str, int]], proc: Any) -> None:
            driver = psutil.Process(proc.pid)
            for p in [driver, *driver.children(recursive=True)]:
                p.kill()

        rc, _, times, out = _fault_run(
            cluster, fault_tables, "kill-driver", kill_driver, entry=train_entry
        )
        assert rc == -signal.SIGKILL
        assert times["clean_seconds"] < 120
        _resumable(out)

    def test_a_worker_host_off_the_network(
        self, cluster: Cluster, fault_tables: Path, train_entry: Path
    ) -> None:
        cut: list[str] = []

        def pull_cable(ranks: dict[int, tuple[str, int]], proc: Any) -> None:
            cut.append(ranks[1][0])
            cluster.link(ranks[1][0], up=False)

        try:
            rc, log, _, out = _fault_run(
                cluster,
                fault_tables,
                "link-down",
                pull_cable,
                entry=train_entry,
                fault="",
                sets=("train.epochs=40", "train.early_stopping.enabled=false"),
            )
        finally:
            if cut:
                cluster.link(cut[0], up=True)
        # The collective timed out (a failure that may be transient); the restart finds the
        # cut host's executor silent, though Spark still counts it, and without
        # distributed.min_processes it is refused, naming the slots.
        assert rc == 1, log[-3000:]
        assert "distributed.timeout_seconds=20" in log
        assert re.search(r"rank \d failed on host fl-w\d \(10\.88\.0\.1\d\)", log)
        assert re.search(
            r"not restarted: distributed.num_processes: the restart needs 2 task slots and 1 "
            r"remain on this cluster's live executors \(executors \d+ do not answer\)",
            log,
        )
        _resumable(out)


# --------------------------------------------------------------------------------------
# Host names resolve to loopback (Debian's 127.0.1.1), SPARK_LOCAL_IP set; 2 cores and one
# (fake) GPU per worker.
# --------------------------------------------------------------------------------------
GPU_CONF = {"spark.executor.resource.gpu.amount": "1", "spark.task.resource.gpu.amount": "1"}


class TestLoopbackNames:
    def test_gpu_task_slots_are_counted(self, loopback_cluster: Cluster, photos: Path) -> None:
        out = fresh(loopback_cluster.shared / "slots")
        rc, log = submit(
            loopback_cluster,
            job_args(loopback_cluster, photos, out, "distributed.num_processes=3"),
            BASE / "slots.log",
            conf=GPU_CONF,
        )
        assert rc == 2, log[-3000:]
        # 4 CPU slots (2 workers x 2 cores), but 2 GPUs: the GPUs decide.
        assert "distributed.num_processes: 3 processes, but this Spark cluster" in log
        assert "has 2 GPU task slots (spark.task.resource.gpu.amount=1 per task)" in log

    def test_three_ranks_on_two_hosts(
        self, loopback_cluster: Cluster, fault_tables: Path, train_entry: Path
    ) -> None:
        """2 ranks on one host, 1 on the other: Streaming is refused before any work, naming
        the setting and the layout; Petastorm, where the hosts' environment has it, trains on
        them."""
        rc, log, out = loopback_train(loopback_cluster, fault_tables, train_entry, "streaming", 3)
        assert rc == 2, log[-4000:]
        assert "data.loader=streaming: Mosaic Streaming needs the same number of ranks" in log
        assert re.search(r"placed unequally \(fl-w\d: ranks 0, 2; fl-w\d: rank 1\)", log), log[
            -3000:
        ]
        assert sorted(p.name for p in out.iterdir()) == ["tables"]  # no cache, no checkpoint
        if loader_problem("petastorm") is not None:  # the hosts run the default environment
            return
        rc, log, out = loopback_train(
            loopback_cluster, fault_tables, train_entry, "petastorm", 3, "train.epochs=1"
        )
        assert rc == 0, log[-4000:]
        summary = check_summary(out, loopback_cluster, world_size=3, epochs=1)
        check_registered(loopback_cluster, summary, world_size=3, epochs=1)


def loopback_train(
    cluster: Cluster, tables: Path, entry: Path, loader: str, ranks: int, *sets: str
) -> tuple[int, str, Path]:
    """``flowers-job train`` with ``loader`` and ``ranks`` processes on one CPU task slot
    each, on a copy of the tables in ``tables``."""
    out = fresh(cluster.shared / f"{loader}-{ranks}")
    shutil.copytree(tables / "tables", out / "tables")
    rc, log = submit(
        cluster,
        train_args(
            cluster,
            out,
            f"data.loader={loader}",
            f"distributed.num_processes={ranks}",
            "distributed.use_gpu=false",
            *sets,
        ),
        BASE / f"{loader}-{ranks}.log",
        conf=TRAIN_CONF,
        script=entry,
    )
    return rc, log, out


# --------------------------------------------------------------------------------------
# No directory shared by the hosts; the shared storage is a bucket on an S3 API server.
# --------------------------------------------------------------------------------------
S3_BUCKET = "flowers"
S3_CHECK = """\
# spark-submit entry of tests/cluster/test_cluster.py's object-storage check (TestObjectStore).
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

from pyspark.sql import SparkSession

root, photo, shared = sys.argv[1:4]
spark = (
    SparkSession.builder.appName("s3-check")
    .config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
    .config("spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog")
    .getOrCreate()
)
# Files the driver writes to local paths: its temp dir and the (unshared) shared dir.
local = [Path(tempfile.mkdtemp()) / "token", Path(shared) / "driver-token"]
for path in local:
    path.write_text("driver")


def check(index, rows):
    from pyarrow import fs

    filesystem, path = fs.FileSystem.from_uri(photo)  # AWS_* of the executor's environment
    with filesystem.open_input_stream(path) as f:
        size = len(f.read())
    aws = ",".join(sorted(k for k in os.environ if k.startswith("AWS_")))
    sees = ",".join(str(p.exists()) for p in local)
    yield (index, socket.gethostname(), size, aws, sees)


rows = spark.sparkContext.parallelize(range(4), 4).mapPartitionsWithIndex(check)
df = spark.createDataFrame(rows, "task int, host string, bytes long, aws string, sees string")
df.write.format("delta").save(root + "/table")  # by the executors, to s3a://
back = spark.read.format("delta").load(root + "/table").orderBy("task").collect()
print("S3-CHECK " + json.dumps([r.asDict() for r in back]))
spark.stop()
"""


@pytest.fixture
def object_store_cluster(clusters: Clusters) -> Cluster:
    """No directory shared by the hosts; an S3 API server on fl-driver (Cluster.s3_endpoint);
    1 core per worker."""
    return clusters.get("object store")


@pytest.fixture
def object_store(object_store_cluster: Cluster, photos: Path) -> S3Store:
    """The cluster without a shared directory (``shared_dir=False``) and its S3 server: the
    bucket :data:`S3_BUCKET` with the 80 photos under ``photos/`` (``<label>/<file>``),
    uploaded from this namespace when the server (in memory) does not have them."""
    store = S3Store(object_store_cluster.s3_endpoint, S3_BUCKET).create()
    if len(store.keys("photos/")) != 80:
        store.upload(photos, "photos")
    return store


def _copy_streaming_tables(store: S3Store, prefix: str) -> None:
    """Copy, inside the bucket, the tables the Streaming job ingested to ``<prefix>/tables``.

    Raises:
        pytest.fail: there are none (that job failed).
    """
    tables = [k for k in store.keys("out-streaming/tables/") if not k.endswith("/")]
    if not tables:
        pytest.fail("no tables to train on: the Streaming job on the object store failed")
    client = store.client()
    for key in tables:
        target = f"{prefix}/" + key.removeprefix("out-streaming/")
        client.copy_object(
            Bucket=store.bucket, Key=target, CopySource={"Bucket": store.bucket, "Key": key}
        )


class TestObjectStore:
    def test_executors_write_delta_to_s3a_and_read_with_pyarrow_sharing_no_directory(
        self, object_store_cluster: Cluster, object_store: S3Store, photos: Path
    ) -> None:
        """One small spark-submit (not the job): each executor task reads a photo through
        pyarrow with the ``AWS_*`` of its environment, the tasks' rows are written as a
        Delta table to ``s3a://`` by the executors and read back by the driver; files the
        driver wrote to its temp dir and to ``<base>/shared`` are seen by no executor (and
        not from this namespace either)."""
        cluster = object_store_cluster
        first = sorted(photos.rglob("*.jpg"))[0]
        key = f"photos/{first.relative_to(photos).as_posix()}"
        script = BASE / "s3_check.py"
        script.write_text(S3_CHECK)
        root = object_store.url("check")
        args = [root, object_store.url(key, scheme="s3"), str(cluster.shared)]
        rc, log = submit(
            cluster,
            args,
            BASE / "s3-check.log",
            script=script,
            conf={
                **TRAIN_CONF,  # and the read-back's sort in 2 partitions, not 200
                "spark.sql.shuffle.partitions": "2",
                "spark.scheduler.minRegisteredResourcesRatio": "1.0",  # both executors
            },
        )
        assert rc == 0, log[-4000:]
        (line,) = [x for x in log.splitlines() if x.startswith("S3-CHECK ")]
        rows = json.loads(line.removeprefix("S3-CHECK "))
        assert [r["task"] for r in rows] == [0, 1, 2, 3]
        assert {r["host"] for r in rows} == set(cluster.worker_names()), rows
        assert all(r["bytes"] == first.stat().st_size for r in rows), rows
        aws = "AWS_ACCESS_KEY_ID,AWS_DEFAULT_REGION,AWS_ENDPOINT_URL,AWS_SECRET_ACCESS_KEY"
        assert all(r["aws"] == aws for r in rows), rows
        assert all(r["sees"] == "False,False" for r in rows), rows  # no shared directory
        assert not (cluster.shared / "driver-token").exists()  # the driver's private mount
        assert any(k.endswith(".json") for k in object_store.keys("check/table/_delta_log/"))
        secret = cluster.s3_env()["AWS_SECRET_ACCESS_KEY"]  # in no driver, executor, daemon log
        assert secret not in log
        for path in [*(BASE / "work").rglob("std*"), *(BASE / "logs").rglob("*")]:
            assert not path.is_file() or secret.encode() not in path.read_bytes(), path

    # three spark-submits, each bounded by JOB_TIMEOUT: the test's own bound above theirs (on
    # the slower machine, beside the local suite's jobs, it once ran 912 s, past the 900 s
    # of pytest-timeout's default, while its resumed run was training)
    @pytest.mark.timeout(3 * JOB_TIMEOUT + 120)
    def test_streaming_four_ranks_fail_leave_nothing_then_resume(
        self, object_store_cluster: Cluster, object_store: S3Store
    ) -> None:
        """The job end to end from ``s3a://`` (photos, output dir, loader cache) with Mosaic
        Streaming, 4 ranks on the 2 hosts, which share no directory: rank 2 raises in
        epoch 2 (no restart), and the bucket keeps epoch 1's checkpoint and the published
        loader cache entries, nothing else of the run's cache nor its reports; ``--resume``
        then finishes the run, reusing every entry without writing a byte of it. Spark alternates
        the ranks over the hosts; each host's ranks read consecutive shards."""
        cluster, store = object_store_cluster, object_store
        out = store.url("out-streaming")
        args = job_args(
            cluster,
            store.url("photos"),
            out,
            "data.loader=streaming",
            "distributed.num_processes=4",
            "train.epochs=2",
            "train.max_restarts=0",
        )
        fault = _executor_env(fault_env("raise:2:2"))
        rc, log = submit(cluster, args, BASE / "s3-streaming-fail.log", conf=fault)
        assert rc == 1, log[-4000:]
        assert "rank 2" in log and "RuntimeError" in log, log[-3000:]
        assert "out-streaming/checkpoints/last.pt" in store.keys("out-streaming/checkpoints/")
        left = store.keys("out-streaming/")
        written = check_cache_left(store, "out-streaming")  # published before training
        assert sorted(m["fields"]["split"] for m in written.values()) == ["test", "train", "val"]
        assert not [k for k in left if "/flowers-failures-" in k], left

        resume_log = BASE / "s3-streaming-resume.log"
        resume_log.unlink(missing_ok=True)
        # the resume in 2 partitions (JOB_CONF): the failed run above covered Spark's defaults
        resumed = cluster.submit([*args, "--resume"], log=resume_log, conf=JOB_CONF)
        try:  # one writer per output: a second run there, meanwhile, exits 2 naming the first
            deadline = time.monotonic() + JOB_TIMEOUT  # the lease comes before Spark starts
            while "out-streaming/.flowers_job.lease.json" not in store.keys("out-streaming/"):
                assert resumed.poll() is None, resume_log.read_text(errors="replace")[-3000:]
                assert time.monotonic() < deadline, "the resumed run took no lease"
                time.sleep(1)
            rc, log = submit(cluster, args, BASE / "s3-streaming-second.log")
            assert rc == 2, log[-3000:]
            assert "out-streaming is in use by flowers-job run, pid " in log, log[-3000:]
            rc = resumed.wait(timeout=JOB_TIMEOUT)
        finally:
            if resumed.poll() is None:
                resumed.kill()
        log = resume_log.read_text(errors="replace")
        assert rc == 0, log[-4000:]
        assert "resumed from s3a://flowers/out-streaming/checkpoints at the start of epoch 2" in log
        summary = check_summary(
            json.loads(store.read("out-streaming/summary.json")), cluster, world_size=4, epochs=2
        )
        assert summary["loader"] == "streaming"
        hosts = [r["host"] for r in summary["ranks"]]
        assert hosts[0] == hosts[2] != hosts[1] == hosts[3], hosts  # not consecutive
        assert f"shards by host: {hosts[0]}: ranks 0, 2; {hosts[1]}: ranks 1, 3" in log
        # Threads follow the executor's 2 cores, shared by its 2 ranks.
        assert [r["threads"] for r in summary["ranks"]] == [1, 1, 1, 1]
        check_registered(cluster, summary, world_size=4, epochs=2)
        # the registered model's files, through the tracking server, in the bucket
        assert any(k.endswith("/MLmodel") for k in store.keys("mlflow-artifacts/"))
        # the resume on unchanged tables wrote no byte of cache: the failed run's entries
        assert all(
            u["reused"] and u["bytes_written"] == 0 for u in summary["loader_cache"].values()
        )
        assert check_cache_left(store, "out-streaming") == written
        assert_no_secret(log)
        assert cluster.s3_env()["AWS_SECRET_ACCESS_KEY"] not in log + json.dumps(summary)
        report(test="run streaming 4 ranks object store", job_seconds=summary["job_seconds"])

    def test_petastorm_four_ranks(
        self, object_store_cluster: Cluster, object_store: S3Store, train_entry: Path
    ) -> None:
        """``flowers-job train`` with Petastorm, 4 ranks, on a copy (in the bucket) of the
        tables the Streaming job ingested: Petastorm reads its Parquet cache from the store
        through pyarrow."""
        problem = loader_problem("petastorm")
        if problem is not None:
            pytest.skip(f"the hosts run the default environment, where {problem}")
        cluster, store = object_store_cluster, object_store
        _copy_streaming_tables(store, "out-petastorm")
        args = train_args(
            cluster,
            store.url("out-petastorm"),
            "data.loader=petastorm",
            "distributed.num_processes=4",
            "distributed.use_gpu=false",
            "train.epochs=1",
        )
        rc, log = submit(
            cluster, args, BASE / "s3-petastorm.log", conf=TRAIN_CONF, script=train_entry
        )
        assert rc == 0, log[-4000:]
        summary = check_summary(
            json.loads(store.read("out-petastorm/summary.json")), cluster, world_size=4, epochs=1
        )
        assert summary["loader"] == "petastorm"
        check_registered(cluster, summary, world_size=4, epochs=1)
        markers = check_cache_left(store, "out-petastorm")
        assert sorted(m["fields"]["split"] for m in markers.values()) == ["test", "train", "val"]
        assert all(u["bytes_written"] > 0 for u in summary["loader_cache"].values())

    def test_delta_four_ranks_read_the_table_in_the_bucket(
        self, object_store_cluster: Cluster, object_store: S3Store, train_entry: Path
    ) -> None:
        """``flowers-job train`` with the Delta loader, 4 ranks on the 2 hosts, on a copy (in
        the bucket) of the tables the Streaming job ingested: the executors embed every
        photo (``embeddings.enabled: auto``, the frozen default) into an ``embeddings``
        table in the bucket, and each rank reads the table's log and its share of the files
        from ``s3a://`` with delta-rs, with the ``AWS_*`` of its executor; no cache is
        written."""
        problem = loader_problem("delta")
        if problem is not None:
            pytest.skip(f"the hosts run the default environment, where {problem}")
        cluster, store = object_store_cluster, object_store
        _copy_streaming_tables(store, "out-delta")
        args = train_args(
            cluster,
            store.url("out-delta"),
            "data.loader=delta",
            "distributed.num_processes=4",
            "distributed.use_gpu=false",
            "train.epochs=1",
        )
        rc, log = submit(cluster, args, BASE / "s3-delta.log", conf=TRAIN_CONF, script=train_entry)
        assert rc == 0, log[-4000:]
        summary = check_summary(
            json.loads(store.read("out-delta/summary.json")), cluster, world_size=4, epochs=1
        )
        assert summary["loader"] == "delta"
        check_registered(cluster, summary, world_size=4, epochs=1)
        photos = summary["train_rows"] + summary["val_rows"] + summary["test_rows"]
        embedded = summary["embeddings"]
        assert (embedded["embedded"], embedded["copied"], embedded["deleted"]) == (photos, 0, 0)
        assert "out-delta/tables/embeddings/_delta_log/00000000000000000000.json" in store.keys(
            "out-delta/tables/embeddings/_delta_log/"
        )
        assert {u["bytes_written"] for u in summary["loader_cache"].values()} == {0}
        # the job makes the cache's folder (an S3 directory marker), and writes nothing in it
        assert not [k for k in store.keys("out-delta/loader_cache/") if not k.endswith("/")]
        assert cluster.s3_env()["AWS_SECRET_ACCESS_KEY"] not in log + json.dumps(summary)

    def test_executors_without_object_store_credentials_are_refused(
        self, object_store_cluster: Cluster, object_store: S3Store
    ) -> None:
        """The driver has the bucket's credentials and endpoint, the executors none of the
        ``AWS_*`` variables (moto accepts unsigned requests, so the endpoint goes too: their
        clients look for the bucket on AWS, out of reach): the executor probe stops the job
        before any work, naming the setting and the variables."""
        cluster, store = object_store_cluster, object_store
        out = store.url("out-refused")
        rc, log = submit(
            cluster,
            job_args(cluster, store.url("photos"), out),
            BASE / "s3-refused.log",
            executor_s3_env=(),
        )
        assert rc == 2, log[-3000:]
        assert f"paths.output_dir: {out} is not shared with the executors" in log, log[-3000:]
        missing = "AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, AWS_SECRET_ACCESS_KEY"
        assert f"{missing} set on the driver, missing there" in log, log[-3000:]
        assert not store.keys("out-refused/tables/")  # nothing ingested
        assert cluster.s3_env()["AWS_SECRET_ACCESS_KEY"] not in log
