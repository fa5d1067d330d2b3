"""Several GPUs per Spark task in barrier mode (flowers_job.cluster.placement.barrier_stage):
pyspark 4.2's TorchDistributor runs ``num_processes / spark.task.resource.gpu.amount`` barrier
tasks, each a torchrun of one process per GPU of the task, and refuses a ``num_processes``
that is not a multiple (SPARK-41916, https://github.com/apache/spark/pull/53501); before 4.2
it starts ``ceil(num_processes / amount)`` tasks of one process each, whose torchrun waits for
``num_processes``.

Faked: the Spark session (its settings, slots, master and the placement probe's hosts), for
:func:`check_cluster`'s decisions. Real: the installed pyspark's own TorchDistributor rule
(``_get_num_tasks``, ``_get_torchrun_args``), checked against :func:`barrier_stage`; and, in
the full tier on pyspark 4.2+, TorchDistributor on a ``local-cluster`` of 2 executors with
fake GPUs, numbering the ranks of each task.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from flowers_job.cluster import placement
from flowers_job.cluster.placement import (
    GPUS_PER_TASK_SINCE,
    BarrierStage,
    barrier_stage,
    check_cluster,
    pyspark_version,
)
from flowers_job.config import JobConfig, load_config
from flowers_job.errors import ClusterError
from flowers_job.runtime.layout import HostLayout, rank_hosts

pytestmark = pytest.mark.tier("gate")

NEW = GPUS_PER_TASK_SINCE
OLD = (4, 0)
DATABRICKS_18 = (4, 1)


class EqualRanksPerHost:
    """A loader that needs as many ranks on every host (as Mosaic Streaming does; its real
    check: tests/unit/cluster/test_placement.py), without importing the loaders."""

    places_ranks = True

    @staticmethod
    def check_layout(layout: HostLayout) -> None:
        if not layout.equal:
            raise RuntimeError(f"data.loader=streaming: placed unequally ({layout.describe()})")


class AnyLayout:
    """A loader that reads any placement (as Petastorm does): no placement probe."""

    places_ranks = False


def _loader(name: str) -> Any:
    return {"streaming": EqualRanksPerHost, "petastorm": AnyLayout}[name]


class FakeSession:
    """What check_cluster reads of a session on a cluster of ``slots`` task slots whose
    barrier probe lands on ``task_hosts`` (index = partition id)."""

    def __init__(self, conf: dict[str, str], slots: int, task_hosts: list[str]) -> None:
        self.conf = SimpleNamespace(get=lambda key, default=None: conf.get(key, default))
        self.slots = slots
        self.task_hosts = task_hosts
        self.waited_for: list[int] = []
        self.probed_tasks: list[int] = []

    def range(self, n: int, numPartitions: int) -> Any:  # noqa: N803 (pyspark's name)
        assert n == numPartitions
        self.probed_tasks.append(n)
        return SimpleNamespace(mapInPandas=lambda f, schema, barrier: ("probe", n, barrier))


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A function that makes a :class:`FakeSession` of a standalone cluster and points
    placement's view of Spark at it, on pyspark ``version``."""

    def make(
        gpus_per_task: str | None,
        slots: int,
        task_hosts: list[str] | None = None,
        version: tuple[int, int] = NEW,
    ) -> FakeSession:
        conf = {} if gpus_per_task is None else {"spark.task.resource.gpu.amount": gpus_per_task}
        session = FakeSession(conf, slots, task_hosts or [])

        def wait_for_slots(spark: Any, needed: int, timeout_seconds: float) -> int:
            spark.waited_for.append(needed)
            return int(spark.slots)

        def run_probe(spark: Any, frame: Any, what: str, timeout_seconds: float) -> list[Any]:
            _, n, barrier = frame
            assert barrier and what == "placement probe"
            return [{"partition": i, "host": spark.task_hosts[i]} for i in range(n)]

        monkeypatch.setattr(placement, "pyspark_version", lambda: version)
        monkeypatch.setattr(placement, "is_local_master", lambda spark: False)
        monkeypatch.setattr(placement, "spark_master", lambda spark: "spark://m:7077")
        monkeypatch.setattr(placement, "wait_for_slots", wait_for_slots)
        monkeypatch.setattr(placement, "run_probe", run_probe)
        return session

    return make


def _config(tmp_path: Path, num_processes: int) -> JobConfig:
    return load_config(
        None,
        [
            "distributed.local_mode=false",
            f"distributed.num_processes={num_processes}",
            "tracking.tracking_uri=http://mlflow.example:5000",
        ],
        **{"paths.output_dir": tmp_path},
    )


# --- the rule ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_processes", "gpus", "stage"),
    [
        (4, "2", BarrierStage(4, 2, 2)),
        (8, "4", BarrierStage(8, 2, 4)),
        (2, "2", BarrierStage(2, 1, 2)),
        (3, "1", BarrierStage(3, 3, 1)),
        (3, None, BarrierStage(3, 3, 1)),  # no GPU: one process per task, whatever it holds
    ],
)
def test_a_multiple_of_the_gpus_per_task_runs_one_task_per_that_many(
    num_processes: int, gpus: str | None, stage: BarrierStage
) -> None:
    assert barrier_stage(num_processes, gpus, NEW) == stage


@pytest.mark.parametrize(
    ("num_processes", "gpus", "processes", "amounts"),
    [
        (3, "2", "distributed.num_processes=2 or 4", "spark.task.resource.gpu.amount=1 "),
        (6, "4", "distributed.num_processes=4 or 8", "spark.task.resource.gpu.amount=3, 2 or 1"),
        (1, "2", "distributed.num_processes=2,", "spark.task.resource.gpu.amount=1 "),
    ],
)
def test_a_non_multiple_is_refused_naming_both_settings_and_what_fits(
    num_processes: int, gpus: str, processes: str, amounts: str
) -> None:
    with pytest.raises(ClusterError) as refused:
        barrier_stage(num_processes, gpus, NEW)
    message = str(refused.value)
    assert message.startswith(
        f"distributed.num_processes: {num_processes} is not a multiple of "
        f"spark.task.resource.gpu.amount={gpus}: pyspark 4.2's TorchDistributor"
    )
    assert processes in message and amounts in message
    assert "SPARK-41916" in message


@pytest.mark.parametrize("version", [OLD, DATABRICKS_18])
def test_before_pyspark_4_2_several_gpus_per_task_run_one_process(
    version: tuple[int, int],
) -> None:
    """Before 4.2, a task of 2 GPUs runs one process and torchrun waits for num_processes
    of them: 4 processes would start 2 tasks and never meet; 1 process runs, on one GPU."""
    with pytest.raises(ClusterError) as refused:
        barrier_stage(4, "2", version)
    message = str(refused.value)
    assert message.startswith("spark.task.resource.gpu.amount=2 with distributed.num_processes=4")
    assert f"pyspark {version[0]}.{version[1]}'s TorchDistributor starts ceil(4/2)=2" in message
    assert "set spark.task.resource.gpu.amount=1" in message and "pyspark 4.2 or later" in message
    assert barrier_stage(1, "2", version) == BarrierStage(1, 1, 1)
    assert barrier_stage(4, "1", version) == BarrierStage(4, 4, 1)  # today's rule


@pytest.mark.parametrize("gpus", ["0", "0.5", "1.0", ""])
def test_gpus_per_task_that_torchdistributor_cannot_read_are_refused(gpus: str) -> None:
    with pytest.raises(ClusterError, match=r"^spark\.task\.resource\.gpu\.amount=\S+: barrier"):
        barrier_stage(2, gpus, NEW)


def test_pyspark_version_is_the_installed_one() -> None:
    import pyspark

    major, minor = pyspark.__version__.split(".")[:2]
    assert pyspark_version() == (int(major), int(minor))


def test_the_rule_is_the_installed_torchdistributors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed pyspark's own code: ``_get_num_tasks`` (the barrier tasks) and
    ``_get_torchrun_args`` in a task that holds ``g`` GPUs (torchrun's nodes and processes
    per node). Where barrier_stage accepts, they agree with it and torchrun waits for as many
    nodes as there are tasks; where it refuses, pyspark refuses too or its torchrun would wait
    for more nodes than tasks."""
    from pyspark.ml.torch.distributor import TorchDistributor

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("RANK", "0")
    for g in range(1, 5):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(g))))
        for n in range(1, 9):
            distributor: Any = TorchDistributor.__new__(TorchDistributor)
            conf = {"spark.task.resource.gpu.amount": str(g)}
            distributor.spark = SimpleNamespace(conf=SimpleNamespace(get=conf.get))
            distributor.num_processes, distributor.local_mode, distributor.use_gpu = n, False, True
            try:
                tasks = distributor._get_num_tasks()
            except RuntimeError:
                tasks = None
            try:
                stage = barrier_stage(n, str(g))
            except ClusterError:
                stage = None
            args, per_task = TorchDistributor._get_torchrun_args(False, n)
            nodes = int(next(a for a in args if a.startswith("--nnodes=")).split("=")[1])
            if stage is None:
                assert tasks is None or nodes != tasks, (n, g)
            else:
                assert (tasks, per_task, nodes) == (
                    stage.num_tasks,
                    stage.processes_per_task,
                    stage.num_tasks,
                ), (n, g)


# --- check_cluster --------------------------------------------------------------------


def test_check_cluster_accepts_a_multiple_and_counts_tasks_as_slots(
    cluster: Any, tmp_path: Path
) -> None:
    """4 processes, 2 GPUs per task: 2 barrier tasks, so 2 GPU slots are enough; the probe
    runs 2 tasks, and their ranks (0, 1 and 2, 3) are consecutive on each task's host."""
    spark = cluster("2", slots=2, task_hosts=["w1", "w2"])
    check_cluster(spark, _config(tmp_path, 4), _loader("streaming"))  # no refusal
    assert spark.waited_for == [2]
    assert spark.probed_tasks == [2]


def test_check_cluster_refuses_a_non_multiple_before_waiting(cluster: Any, tmp_path: Path) -> None:
    spark = cluster("2", slots=8)
    with pytest.raises(ClusterError) as refused:
        check_cluster(spark, _config(tmp_path, 3), _loader("petastorm"))
    message = str(refused.value)
    assert message.startswith("invalid configuration:\n  distributed.num_processes: 3 is not a ")
    assert "spark.task.resource.gpu.amount=2" in message
    assert "distributed.num_processes=2 or 4" in message
    assert spark.waited_for == [] and spark.probed_tasks == []


def test_one_task_of_two_gpus_is_one_slot_for_two_processes(cluster: Any, tmp_path: Path) -> None:
    """4 processes in 2 tasks of 2 GPUs: 1 GPU slot (one executor of 2 GPUs) is too few, and
    the message counts tasks; 2 processes in that one slot fit."""
    spark = cluster("2", slots=1, task_hosts=["w1"])
    with pytest.raises(ClusterError) as refused:
        check_cluster(spark, _config(tmp_path, 4), _loader("petastorm"))
    assert (
        "distributed.num_processes: 4 processes in 2 barrier tasks of 2 (one process per GPU "
        "of a task), but this Spark cluster (spark://m:7077) has 1 GPU task slots "
        "(spark.task.resource.gpu.amount=2 per task)"
    ) in str(refused.value)
    assert spark.waited_for == [2]
    check_cluster(spark, _config(tmp_path, 2), _loader("streaming"))
    assert spark.waited_for == [2, 1] and spark.probed_tasks == [1]


def test_check_cluster_depends_on_the_pyspark_version(cluster: Any, tmp_path: Path) -> None:
    """The same cluster (2 tasks of 2 GPUs fit) and 4 processes: pyspark 4.2 runs them,
    4.0 and 4.1 are refused before any wait; one GPU per task passes on every version,
    counting one slot per process (today's rule)."""
    check_cluster(
        cluster("2", slots=2, task_hosts=["w1", "w2"]), _config(tmp_path, 4), _loader("petastorm")
    )
    for version in (OLD, DATABRICKS_18):
        spark = cluster("2", slots=2, version=version)
        with pytest.raises(ClusterError, match=r"TorchDistributor starts ceil\(4/2\)=2"):
            check_cluster(spark, _config(tmp_path, 4), _loader("petastorm"))
        assert spark.waited_for == []
        spark = cluster("1", slots=4, version=version)
        check_cluster(spark, _config(tmp_path, 4), _loader("petastorm"))
        assert spark.waited_for == [4]
        spark = cluster("1", slots=3, version=version)
        with pytest.raises(ClusterError, match=r"4 processes, but .* has 3 GPU task slots"):
            check_cluster(spark, _config(tmp_path, 4), _loader("petastorm"))


def test_cpu_ranks_ignore_the_gpus_per_task(cluster: Any, tmp_path: Path) -> None:
    """distributed.use_gpu=false: TorchDistributor runs one process per task whatever the
    tasks hold, so 3 processes need 3 slots and no multiple."""
    spark = cluster("2", slots=3)
    cfg = _config(tmp_path, 3)
    cfg = cfg.model_copy(
        update={"distributed": cfg.distributed.model_copy(update={"use_gpu": False})}
    )
    check_cluster(spark, cfg, _loader("petastorm"))
    assert spark.waited_for == [3]


# --- the layout -------------------------------------------------------------------------


def test_the_ranks_of_a_task_are_consecutive_on_its_host() -> None:
    """torchrun numbers a task's ranks from partition id x processes per task."""
    assert rank_hosts(["w1", "w2"], 2) == ["w1", "w1", "w2", "w2"]
    assert rank_hosts(["a", "b", "a"], 1) == ["a", "b", "a"]
    with pytest.raises(ValueError, match="at least 1"):
        rank_hosts(["a"], 0)
    layout = HostLayout.of(rank_hosts(["w1", "w2", "w1", "w2"], 2), 4)
    assert layout.describe() == "w1: ranks 0, 1, 4, 5; w2: ranks 2, 3, 6, 7"
    assert (layout.shard, layout.local_rank, layout.local_world_size) == (2, 2, 4)


def test_streaming_refuses_tasks_of_two_ranks_placed_unequally(
    cluster: Any, tmp_path: Path
) -> None:
    """3 tasks of 2 GPUs on 2 hosts: 4 ranks on one host, 2 on the other."""
    spark = cluster("2", slots=3, task_hosts=["w1", "w2", "w1"])
    with pytest.raises(ClusterError, match=r"\(w1: ranks 0, 1, 4, 5; w2: ranks 2, 3\)"):
        check_cluster(spark, _config(tmp_path, 6), _loader("streaming"))
    assert spark.probed_tasks == [3]
    check_cluster(spark, _config(tmp_path, 6), _loader("petastorm"))  # no probe, no refusal


_TORCHDISTRIBUTOR_RANKS = """
import json, os, sys
from pyspark.sql import SparkSession
from pyspark.ml.torch.distributor import TorchDistributor

out, script = sys.argv[1], sys.argv[2]
spark = (
    SparkSession.builder.master("local-cluster[2,1,1024]")
    .config("spark.ui.enabled", "false")
    .config("spark.worker.resource.gpu.amount", "2")
    .config("spark.worker.resource.gpu.discoveryScript", script)
    .config("spark.executor.resource.gpu.amount", "2")
    .config("spark.executor.resource.gpu.discoveryScript", script)
    .config("spark.task.resource.gpu.amount", "2")
    .getOrCreate()
)
spark.sparkContext.setLogLevel("ERROR")

def ranks(out):
    import json, os
    keys = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES")
    seen = {k: os.environ.get(k) for k in keys}
    with open(os.path.join(out, "rank-" + seen["RANK"] + ".json"), "w") as f:
        json.dump(seen, f)

distributor = TorchDistributor(num_processes=4, local_mode=False, use_gpu=True)
print("TASKS", distributor.num_tasks)
distributor.run(ranks, out)
spark.stop()
"""


@pytest.mark.tier("full")
@pytest.mark.timeout(300)
@pytest.mark.skipif(
    pyspark_version() < GPUS_PER_TASK_SINCE, reason="pyspark before 4.2 runs one process per task"
)
def test_torchdistributor_numbers_the_ranks_of_a_task_consecutively(tmp_path: Path) -> None:
    """pyspark's own TorchDistributor on 2 executors of 2 fake GPUs (a discovery script; the
    ranks touch no GPU), 4 processes, 2 GPUs per task: 2 tasks, and task i (torchrun's
    GROUP_RANK, its partition id) runs ranks 2i and 2i+1 with LOCAL_RANK 0 and 1, both
    seeing the task's 2 GPUs: what rank_hosts assumes."""
    script = tmp_path / "gpus.sh"
    script.write_text('#!/bin/sh\necho \'{"name": "gpu", "addresses": ["0", "1"]}\'\n')
    script.chmod(0o755)
    out = tmp_path / "ranks"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", _TORCHDISTRIBUTOR_RANKS, str(out), str(script)],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
        env={
            **{k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"},
            "PYSPARK_PYTHON": sys.executable,
        },
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "TASKS 2" in proc.stdout
    seen = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(4)]
    assert [(s["GROUP_RANK"], s["LOCAL_RANK"]) for s in seen] == [
        ("0", "0"),
        ("0", "1"),
        ("1", "0"),
        ("1", "1"),
    ]
    assert {s["WORLD_SIZE"] for s in seen} == {"4"}
    assert {s["CUDA_VISIBLE_DEVICES"] for s in seen} == {"0,1"}
