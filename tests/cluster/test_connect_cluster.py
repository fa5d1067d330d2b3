"""The job over Spark Connect on the multi-host netns cluster (tools/cluster.py).

The cluster of tests/cluster/test_cluster.py (master, 2 workers of 1 core, the basic-auth
MLflow server on fl-driver) plus a Spark Connect server on fl-driver
(:meth:`Cluster.connect_server`, ``sc://10.88.0.2:15002``, running its jobs on the
cluster's master) and a client host, fl-client, in its own namespace, where
``flowers-job run --remote`` runs (:meth:`Cluster.client`): the job's driver side (checks,
MLflow, TorchDistributor's client) there, every Spark job on the server and its executors.

One Streaming run end to end (ingest, then train), with rank 1 SIGKILLed in epoch 2 (held
there by the test-only ``hang`` fault, attempt 0 only, which like every executor setting
is the server's: ``spark.executorEnv.*`` at its start, a Connect client cannot set it),
then restarted from the last checkpoint by the job itself, as :class:`TestFaults` of
test_cluster.py checks on classic Spark.

TorchDistributor on Connect starts its log-streaming server on the client, bound to the
server's ``spark.driver.host`` (pyspark 4.0.5 ``distributor.py``,
``_run_distributed_training``): on fl-client that bind fails (``OSError: [Errno 99] Cannot
assign requested address``), pyspark logs a warning (itself a broken logging call, printed
as ``--- Logging error ---``) and the ranks' output is not streamed to the client; it
stays in the executors' stderr. So the ranks are found from rank 0's ``ranks.json`` in the
run's failure-report dir, not from the client's log. Appends its times to
``$FLOWERS_CLUSTER_REPORT`` as test_cluster.py does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import filelock
import pytest

from tests.cluster.test_cluster import (
    BASE,
    JOB_CONF,
    LOCK_TIMEOUT,
    MLFLOW_AUTH,
    assert_no_secret,
    check_registered,
    check_summary,
    fresh,
    job_args,
    rank_processes,
    report,
    wait_for,
)
from tests.support import ROOT_DIR
from tests.support.data import sample_photos
from tests.support.faults import fault_env

sys.path.insert(0, str(ROOT_DIR / "tools"))
from cluster import Cluster, make_env

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.tier("full")]

JOB_TIMEOUT = 600.0
"""Bound on the client's ``flowers-job run`` (seconds), the restart included."""


def _ranks(out: Path, log: str) -> dict[int, tuple[str, int]]:
    """``{rank: (host, pid)}`` of the running attempt: rank 0's ``ranks.json`` in the
    failure-report dir ``out/flowers-failures-*``, else its ``ranks:`` log line (streamed
    only where the client can bind the log server)."""
    for path in sorted(out.glob("flowers-failures-*/ranks.json")):
        try:
            ranks = json.loads(path.read_text())["ranks"]
        except (OSError, ValueError, KeyError):
            continue  # being written
        return {int(r["rank"]): (str(r["host"]), int(r["pid"])) for r in ranks}
    return {
        int(m[0]): (m[1], int(m[2]))
        for m in re.findall(r"(\d+)@(fl-w\d)\([^,]*, [^,]*, pid (\d+)", log)
    }


@pytest.fixture(scope="module")
def connect_job() -> Iterator[dict[str, Any]]:
    """The cluster with its Connect server and client host, held by this run alone (the
    lock of test_cluster.py: the hosts' names and addresses are fixed), and the Streaming
    job run from fl-client through a killed rank: its exit status, log, output dir, the
    killed rank's host and the cluster (up until the module's tests are done)."""
    from flowers_job.runtime.allocator import spark_conf as allocator_conf

    lock = filelock.FileLock(BASE.with_name(BASE.name + ".lock"))
    try:
        acquired = lock.acquire(timeout=LOCK_TIMEOUT)
    except filelock.Timeout:
        pytest.fail(f"another cluster test held {lock.lock_file} for {LOCK_TIMEOUT:.0f} s")
    with acquired:
        make_env()
        photos = BASE / "shared" / "photos"
        if not photos.is_dir():
            sample_photos(photos, per_label=16)
        cluster = Cluster(base=BASE, mlflow_auth=MLFLOW_AUTH, client_host=True)
        cluster.up()
        try:
            # the executors' settings, fixed at the server's start: the allocator tuning
            # (as docs/cluster.md tells a cluster's admin) and the test's fault; Delta's
            # state and the loader cache's jobs in 2 partitions, as the classic job's
            # (JOB_CONF): a Connect client cannot set them
            executor_env = {f"spark.executorEnv.{k}": v for k, v in fault_env("hang:1:2:0").items()}
            t0 = time.monotonic()
            cluster.connect_server(conf={**JOB_CONF, **allocator_conf(), **executor_env})
            server_seconds = time.monotonic() - t0
            yield {**_killed_run(cluster, photos), "cluster": cluster}
            report(test="connect server start", seconds=round(server_seconds, 1))
        finally:
            cluster.down()


def _killed_run(cluster: Cluster, photos: Path) -> dict[str, Any]:
    """``flowers-job run --remote`` on fl-client with Streaming, 2 ranks in barrier mode;
    rank 1 SIGKILLed once epoch 1 is checkpointed (it is held in epoch 2)."""
    out = fresh(cluster.shared / "connect")
    log_path = BASE / "connect-job.log"
    log_path.unlink(missing_ok=True)
    argv = [
        str(cluster.python.parent / "flowers-job"), "run", "--remote", cluster.connect_url,
        *job_args(cluster, photos, out, "data.loader=streaming", "distributed.num_processes=2",
                  "distributed.timeout_seconds=20"),
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = cluster.client(argv, log=log_path)

    def text() -> str:
        return log_path.read_text(errors="replace") if log_path.exists() else ""

    try:
        wait_for(
            lambda: (
                proc.poll() is not None
                or ((out / "checkpoints" / "last.pt").exists() and len(_ranks(out, text())) == 2)
            ),
            JOB_TIMEOUT,
            "epoch 1 checkpointed",
        )
        assert proc.poll() is None, (
            f"the run ended (exit {proc.returncode}) before epoch 1 was checkpointed:\n"
            + text()[-4000:]
        )
        time.sleep(1.0)  # into epoch 2, where rank 1 is held
        ranks = _ranks(out, text())
        os.kill(ranks[1][1], signal.SIGKILL)
        rc = proc.wait(timeout=JOB_TIMEOUT)
        wait_for(lambda: not rank_processes(cluster), 120, "no rank process left")
    finally:
        if proc.poll() is None:
            proc.kill()
    log = text()
    report(
        test="connect job streaming killed rank",
        seconds=round(time.monotonic() - t0, 1),
        ranks_streamed_to_client="ranks: " in log,
    )
    return {"rc": rc, "log": log, "out": out, "killed_host": ranks[1][0]}


class TestConnectCluster:
    def test_streaming_job_from_a_client_host_runs_a_rank_on_each_worker(
        self, connect_job: dict[str, Any]
    ) -> None:
        rc, log, out, cluster = (connect_job[k] for k in ("rc", "log", "out", "cluster"))
        assert rc == 0, log[-4000:]
        assert "Spark Connect session (sc://10.88.0.2:15002" in log
        assert f"master {cluster.master_url}" in log
        summary = check_summary(out, cluster)  # 2 ranks, one on fl-w1, one on fl-w2
        assert summary["loader"] == "streaming"
        assert 0.0 <= summary["test_accuracy"] <= 1.0
        check_registered(cluster, summary)  # through the MLflow server on fl-driver
        assert_no_secret(log)

    def test_a_killed_rank_restarts_from_the_last_checkpoint(
        self, connect_job: dict[str, Any]
    ) -> None:
        """Rank 1 SIGKILLed in epoch 2 is named with its signal and host, and the barrier
        stage runs again from the last checkpoint to the end, as on classic Spark."""
        rc, log, out = connect_job["rc"], connect_job["log"], connect_job["out"]
        assert rc == 0, log[-4000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["restarts"] == 1
        (restart,) = summary["restart_history"]
        host = connect_job["killed_host"]
        assert restart["cause"].startswith(f"rank 1 was killed by SIGKILL on host {host}"), restart
        assert restart["world_size_after"] == 2
        assert [h["epoch"] for h in summary["history"]] == [1, 2, 3]
        # the ranks' "resumed from" line is not streamed to fl-client (the module docstring):
        # the driver's record of the checkpoint the restart continued is checked instead
        assert restart["resumed_from"]["epoch"] >= 1, restart
        report(test="connect restart after a killed rank", **restart)
