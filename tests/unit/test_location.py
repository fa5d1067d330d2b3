"""Where shared files live (flowers_job/location.py): one behaviour on a local disk and in a
bucket of a real S3 API server (moto, tests/support/s3.py), and the helpers around it: the
Streaming host cache (loaders/streaming/remote.py), the local session's S3 settings
(spark.object_store_conf), the config's refusals. No Spark: seconds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flowers_job.cluster.session import object_store_conf
from flowers_job.config import ConfigError, load_config
from flowers_job.loaders.streaming.remote import dataset_source, enter_host_cache, leave_host_cache
from flowers_job.location import Location, copy_files_up, is_remote
from tests.support import ROOT_DIR
from tests.support.s3 import S3Store, s3, s3_jars, s3_server  # noqa: F401 (fixtures)

sys.path.insert(0, str(ROOT_DIR / "tools"))
import cluster

pytestmark = [pytest.mark.timeout(300), pytest.mark.tier("gate")]


@pytest.fixture(params=["local", "s3"])
def base(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    """An empty directory on the local disk, or an empty prefix of a fresh bucket."""
    if request.param == "local":
        return Location.of(tmp_path / "out")
    store: S3Store = request.getfixturevalue("s3")
    return Location.of(store.url("out"))


def test_the_same_operations_on_a_disk_and_in_a_bucket(base: Location) -> None:
    ckpt = base / "checkpoints"
    assert not ckpt.exists() and ckpt.iterdir() == [] and ckpt.walk() == []
    (ckpt / "last.pt").write_bytes(b"x" * 10)
    (ckpt / "mlflow_run.json").write_text('{"id": 1}')
    (ckpt / "deep" / "a.bin").write_bytes(b"yy")
    assert ckpt.exists() and ckpt.is_dir() and (ckpt / "last.pt").is_file()
    assert [c.name for c in ckpt.iterdir()] == ["deep", "last.pt", "mlflow_run.json"]
    assert [c.name for c in ckpt.glob("*.json")] == ["mlflow_run.json"]
    assert [c.url.removeprefix(ckpt.url) for c in ckpt.walk()] == [
        "/deep/a.bin",
        "/last.pt",
        "/mlflow_run.json",
    ]
    assert ckpt.size_bytes() == 10 + 9 + 2 and (ckpt / "last.pt").size_bytes() == 10
    assert (ckpt / "mlflow_run.json").read_text() == '{"id": 1}'
    assert (ckpt / "last.pt").mtime() > 0
    (ckpt / "last.pt").write_bytes(b"z")  # replaced whole
    assert (ckpt / "last.pt").read_bytes() == b"z"
    with pytest.raises(FileNotFoundError):
        (ckpt / "missing").read_bytes()
    (ckpt / "last.pt").unlink()
    (ckpt / "last.pt").unlink(missing_ok=True)
    with pytest.raises(FileNotFoundError):
        (ckpt / "last.pt").unlink()
    ckpt.rmtree()
    ckpt.rmtree()  # nothing left: nothing to do
    assert not ckpt.exists() and base.walk() == []


def test_a_local_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = Location.of(tmp_path) / "summary.json"
    target.write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    assert open(target).read() == "{}"  # a local Location is a path  # noqa: SIM115


def test_uris_paths_and_names() -> None:
    assert is_remote("s3a://b/x") and is_remote("gs://b") and not is_remote("/x")
    assert not is_remote("file:///x") and not is_remote("my:photos") and not is_remote("C:x")
    s3a = Location.of("s3a://bucket/out/")
    assert s3a.url == "s3a://bucket/out" and s3a.sdk_url == "s3://bucket/out"
    assert (s3a / "tables").parent == s3a and (s3a / "tables").name == "tables"
    assert s3a.as_uri() == "s3a://bucket/out" and not s3a.is_local
    with pytest.raises(TypeError, match="object store"):
        os.fspath(s3a)
    with pytest.raises(ValueError, match="needs a local path"):
        _ = s3a.local_path
    assert Location.of("file:///tmp/x").url == "/tmp/x"


def test_credentials_in_a_uri_are_refused_without_showing_them() -> None:
    for key, value in (
        ("paths.output_dir", "s3a://AKIA:s3cr3t-value@bucket/out"),
        ("paths.cache_url", "s3a://AKIA:s3cr3t-value@bucket/cache"),
    ):
        overrides = {
            "paths.output_dir": "/tmp/out",
            key: value,
            "tracking.tracking_uri": "http://x",
        }
        with pytest.raises(ConfigError, match=re.escape(f"{key}: credentials in the URI")) as info:
            load_config(None, [], **overrides)
        assert "s3cr3t-value" not in str(info.value)


def test_an_object_store_output_dir_needs_a_tracking_server() -> None:
    with pytest.raises(
        ConfigError, match=r"tracking\.tracking_uri: required with paths\.output_dir"
    ):
        load_config(None, [], **{"paths.output_dir": "s3a://bucket/out"})
    cfg = load_config(
        None, [], **{"paths.output_dir": "s3a://bucket/out", "tracking.tracking_uri": "http://x"}
    )
    assert cfg.paths.cache_root.as_uri() == "s3a://bucket/out/loader_cache"
    assert cfg.model_dump(mode="json")["paths"]["output_dir"] == "s3a://bucket/out"


def test_a_dead_ranks_reports_are_copied_up_then_removed(s3: S3Store, tmp_path: Path) -> None:  # noqa: F811
    """What the watchdog runs after a death (``python -m flowers_job.location``): the
    non-empty files go to the report dir in the bucket, the host's folder goes."""
    here = tmp_path / "flowers-failures-x-rank1"
    here.mkdir()
    (here / "rank-1.killed").write_text('{"rank": 1}')
    (here / "rank-1.fatal").write_text("")  # faulthandler's file of a rank that did not crash
    reports = s3.url("out/flowers-failures-x")
    subprocess.run(
        [sys.executable, "-m", "flowers_job.location", str(here), reports],
        check=True,
        timeout=120,
    )
    assert not here.exists()
    assert s3.keys("out/") == ["out/flowers-failures-x/rank-1.killed"]
    assert copy_files_up(here, reports) == []  # gone: nothing to copy


def test_streaming_reads_a_bucket_through_one_local_copy_per_host(tmp_path: Path) -> None:
    from flowers_job.config.data import StreamingConfig

    settings = StreamingConfig(local_cache_dir=str(tmp_path), local_cache_limit_bytes=2**28)
    source = dataset_source("s3a://bucket/cache/run-1/mds-train", settings)
    assert source["remote"] == "s3://bucket/cache/run-1/mds-train"
    assert Path(source["local"]).parent == tmp_path and source["cache_limit"] == 2**28
    assert dataset_source("s3a://bucket/cache/run-1/mds-train", settings) == source  # per host
    assert dataset_source(str(tmp_path / "mds"), settings) == {"local": str(tmp_path / "mds")}
    enter_host_cache(source)
    other = Path(source["local"]) / ".readers" / "999999999"  # a reader that was killed
    other.touch()
    (Path(source["local"]) / "shard.00000.mds").write_bytes(b"x")
    assert leave_host_cache(source)  # the last live reader removes the copy
    assert not tmp_path.exists()  # and the root it made empty


def _pyspark_hadoop() -> str:
    """The Hadoop version of the installed pyspark's own jars."""
    import pyspark

    (api,) = (Path(pyspark.__file__).parent / "jars").glob("hadoop-client-api-*.jar")
    return api.name.removeprefix("hadoop-client-api-").removesuffix(".jar")


def test_the_test_clusters_jars_match_this_environment() -> None:
    """tools/cluster.py's ``--packages`` (from requirements/lock.txt) are the jars this
    environment's pyspark and delta-spark ask for, and those local ``s3a://`` sessions of
    the tests take (the legacy Petastorm environment's differ: its pyspark is older)."""
    from tests.support.connect import delta_package
    from tests.support.s3 import s3_packages

    hadoop_aws = f"org.apache.hadoop:hadoop-aws:{_pyspark_hadoop()}"
    assert (delta_package(), hadoop_aws) == cluster.S3_PACKAGES == s3_packages()


def test_the_test_clusters_hadoop_aws_class_path_names_one_version_of_each_jar() -> None:
    """The netns cluster's ``extraClassPath``: hadoop-aws and the jars its Ivy descriptor
    names, at its versions only, though the cache holds an older Hadoop's beside them."""
    ivy = cluster.ivy_dir()
    version = cluster.HADOOP_AWS_PACKAGE.rsplit(":", 1)[1]
    if not (ivy / "jars" / f"org.apache.hadoop_hadoop-aws-{version}.jar").is_file():
        pytest.skip(f"{cluster.HADOOP_AWS_PACKAGE} is not in {ivy} (make s3-jars)")
    jars = [Path(j).name for j in cluster.hadoop_aws_classpath(ivy).split(":")]
    assert jars[0] == f"org.apache.hadoop_hadoop-aws-{version}.jar"
    assert any(j.startswith("software.amazon.awssdk_bundle-") for j in jars)
    modules = [re.sub(r"-\d[\w.]*\.jar$", "", j) for j in jars]
    assert len(set(modules)) == len(modules), jars


def test_a_local_session_gets_what_s3a_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio:9000")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    packages, conf = object_store_conf(["/data/out", "s3a://bucket/photos"])
    assert packages == [f"org.apache.hadoop:hadoop-aws:{_pyspark_hadoop()}"]
    assert conf == {
        "spark.hadoop.fs.s3a.endpoint": "http://minio:9000",
        "spark.hadoop.fs.s3a.path.style.access": "true",
        "spark.hadoop.fs.s3a.connection.ssl.enabled": "false",
    }
    assert object_store_conf(["/data/out", "file:///cache", "None"]) == ([], {})
