"""What the job asks the cluster, on a Spark Connect session as on classic Spark.

Real components: the conftest's Spark Connect server (spark-submit, ``SparkConnectServer``,
``local[2]``, Delta) reached through an in-process Connect session
(:func:`tests.support.connect.connect_session`), beside the conftest's classic local[2]
session. The Connect client has no SparkContext (``[JVM_ATTRIBUTE_NOT_SUPPORTED]``): every
function here goes through the DataFrame API, job tags and progress handlers instead.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from flowers_job.cluster.connect import (
    SparkJobTimeout,
    default_parallelism,
    is_connect_session,
    run_probe,
)
from flowers_job.cluster.executor_cores import executor_cores
from flowers_job.cluster.executor_probe import check_executors, probe_executors
from flowers_job.cluster.placement import check_cluster, placement_hosts
from flowers_job.cluster.progress import task_progress
from flowers_job.cluster.slots import driver_gpus, live_task_slots, task_slots, wait_for_slots
from flowers_job.cluster.storage import is_local_master
from flowers_job.config import load_config
from flowers_job.errors import ClusterError
from flowers_job.loaders import resolve_loader
from flowers_job.location import Location
from tests.support.data import sample_photos

pytestmark = [pytest.mark.timeout(300), pytest.mark.tier("gate")]

PROBE_SECONDS = 120.0
"""Bound on each probe stage here (a second or two on the local server)."""


@pytest.fixture(scope="module")
def remote(spark: SparkSession, connect_url: str) -> Iterator[Any]:
    """One Connect session for the module, opened after the classic session exists (a
    classic builder run while a Connect session is open would hand back a Connect one)."""
    from tests.support.connect import connect_session

    with connect_session(connect_url) as session:
        assert is_connect_session(session)
        yield session


@pytest.fixture(params=["classic", "connect"])
def either(request: pytest.FixtureRequest, spark: SparkSession) -> Iterator[Any]:
    """The classic session (with pyspark's functions in classic mode, though the module's
    Connect session is open), then the Connect one: what both must do alike."""
    from tests.support.connect import classic_mode

    if request.param == "connect":
        yield request.getfixturevalue("remote")
        return
    with classic_mode():
        yield spark


def test_slots_and_cores_of_a_local_server(remote: Any) -> None:
    """The server's local[2]: 2 slots counted through a Spark job (once, then fresh), waited
    for, all live; no executor cores (tasks run in the server's driver), no driver GPUs."""
    assert default_parallelism(remote) == 2
    assert default_parallelism(remote, fresh=True, timeout_seconds=PROBE_SECONDS) == 2
    assert task_slots(remote) == 2
    assert wait_for_slots(remote, 2, timeout_seconds=PROBE_SECONDS) == 2
    assert wait_for_slots(remote, 3, timeout_seconds=2, settle_seconds=1) == 2  # settles
    assert live_task_slots(remote) == (2, [])
    assert is_local_master(remote)
    assert executor_cores(remote) == {}
    assert driver_gpus(remote) == []


def test_placement_and_executor_probe_on_connect(remote: Any, tmp_path: Path) -> None:
    """The barrier stages: every rank's host, and each task reading back the token of a
    directory (the executor probe's storage part, which a local master skips in
    check_executors)."""
    assert placement_hosts(remote, 2, PROBE_SECONDS) == [socket.gethostname()] * 2
    (tmp_path / "out").mkdir()
    dirs = {"paths.output_dir": Location.of(tmp_path / "out")}
    reports = probe_executors(remote, dirs, None, PROBE_SECONDS)
    assert len(reports) == 2
    assert all(r["missing"] == [] and r["host"] == socket.gethostname() for r in reports)
    cfg = load_config(None, [], **{"paths.output_dir": tmp_path / "job"})
    assert check_executors(remote, cfg, PROBE_SECONDS) == []  # local master, no server


def test_check_cluster_on_connect(remote: Any, tmp_path: Path) -> None:
    """Barrier mode's slots are checked against the server's cluster (named by its master);
    GPUs in local mode are refused before any work, naming barrier mode."""
    out = {"paths.output_dir": tmp_path}
    barrier = load_config(None, ["distributed.local_mode=false"], **out)
    check_cluster(remote, *resolve_loader(barrier))
    three = load_config(
        None, ["distributed.local_mode=false", "distributed.num_processes=3"], **out
    )
    with pytest.raises(ClusterError, match=r"cluster \(local\[2\]\) has 2 task slots"):
        check_cluster(remote, *resolve_loader(three))
    gpu = load_config(None, ["distributed.use_gpu=true"], **out)
    with pytest.raises(ClusterError, match=r"Spark Connect session.*local_mode=false"):
        check_cluster(remote, *resolve_loader(gpu))
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_probe_past_its_bound_is_interrupted(either: Any) -> None:
    """A barrier stage that would sleep for 10 minutes is interrupted after its bound (a job
    tag and interruptTag), and its slots serve the next stage."""

    def _sleep(batches: Iterable[Any]) -> Iterator[Any]:  # in the test: pickled by value
        import time

        for batch in batches:
            time.sleep(600)
            yield batch

    frame = either.range(2, numPartitions=2).mapInPandas(_sleep, "id long", barrier=True)
    with pytest.raises(SparkJobTimeout, match=r"the sleep probe .* did not end within 3 s"):
        run_probe(either, frame, "sleep probe", timeout_seconds=3)
    # a stage still sleeping would hold both slots: this one could not start
    assert placement_hosts(either, 2, PROBE_SECONDS) == [socket.gethostname()] * 2


def test_listing_is_the_same_on_both(spark: SparkSession, remote: Any, tmp_path: Path) -> None:
    """10 real photos (2 per label) and a stray file: the same listing rows, in as many
    tasks, from the classic session and the Connect one."""
    from flowers_job.photos.files import list_files
    from flowers_job.photos.listing import label_folders

    root = sample_photos(tmp_path / "photos", per_label=2)
    (root / "notes.txt").write_text("not a photo")
    labels, others = label_folders(str(root))
    from tests.support.connect import classic_mode

    def listed(session: Any) -> tuple[list[tuple[Any, ...]], int]:
        listing = list_files(session, str(root), labels, labels + others)
        tasks = listing.selectExpr("spark_partition_id() AS p").distinct().count()
        return sorted(tuple(r) for r in listing.collect()), tasks

    with classic_mode():
        classic = listed(spark)
    connect = listed(remote)
    assert len(classic[0]) == 11 and classic == connect
    assert classic[1] > 1


def test_task_progress_counts_the_tasks_of_a_job(
    either: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bar of a job of 4 tasks ends at 4 of 4."""

    def _slow(batches: Iterable[Any]) -> Iterator[Any]:  # in the test: pickled by value
        import time

        for batch in batches:
            time.sleep(0.5)
            yield batch

    with task_progress(either, "four tasks"):
        either.range(4, numPartitions=4).mapInPandas(_slow, "id long").collect()
    err = capsys.readouterr().err
    assert "four tasks" in err and "4/4" in err
