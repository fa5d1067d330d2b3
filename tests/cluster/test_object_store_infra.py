"""The object-storage test infrastructure of tests/support/s3.py, in local mode, without Spark
(seconds): the moto server, a bucket, the environment boto3 and pyarrow read, a photo
sample's upload, and the settings a CLI run gets. Spark on ``s3a://`` is checked on the
test cluster (tests/cluster/test_cluster.py, :class:`TestObjectStore`), where it costs one
spark-submit."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from tests.support import LABELS
from tests.support.connect import delta_package
from tests.support.data import sample_photos
from tests.support.s3 import S3Store, s3, s3_jars, s3_server  # noqa: F401 (fixtures)

pytestmark = pytest.mark.tier("gate")


def test_a_photo_sample_uploads_with_its_layout_and_reads_back_through_the_environment(
    s3: S3Store,  # noqa: F811
    tmp_path: Path,
) -> None:
    import boto3
    from pyarrow import fs

    local = sample_photos(tmp_path / "photos", per_label=2)
    assert s3.upload(local, "photos") == f"s3a://{s3.bucket}/photos"
    expected = sorted(f"photos/{p.relative_to(local)}" for p in local.rglob("*.jpg"))
    assert s3.keys("photos/") == expected and len(expected) == 2 * len(LABELS)
    first = sorted(local.rglob("*.jpg"))[0]
    key = f"photos/{first.relative_to(local)}"
    assert s3.read(key) == first.read_bytes()
    # The fixture's environment alone (AWS_*) takes pyarrow and boto3 to the server.
    assert os.environ["AWS_ENDPOINT_URL"] == s3.endpoint
    filesystem, path = fs.FileSystem.from_uri(s3.url(key, scheme="s3"))
    with filesystem.open_input_stream(path) as f:
        assert f.read() == first.read_bytes()
    listed = boto3.client("s3").list_objects_v2(Bucket=s3.bucket)
    assert sorted(o["Key"] for o in listed["Contents"]) == expected  # no directory markers


def test_a_cli_run_gets_hadoop_aws_from_the_cache_and_the_s3a_settings(
    s3: S3Store,  # noqa: F811
    s3_jars: Path,  # noqa: F811
) -> None:
    env = s3.cli_env({"PATH": "/usr/bin"})
    args = shlex.split(env["PYSPARK_SUBMIT_ARGS"])
    assert args[-1] == "pyspark-shell"
    packages = args[args.index("--packages") + 1].split(",")
    assert [p.split(":")[1] for p in packages] == [delta_package().split(":")[1], "hadoop-aws"]
    for package in packages:  # resolved into the cache the runs use
        group, artifact, version = package.split(":")
        assert (s3_jars / "jars" / f"{group}_{artifact}-{version}.jar").is_file()
    conf = dict(a.split("=", 1) for a in args[1:-1] if "=" in a)
    assert conf["spark.jars.ivy"] == str(s3_jars)
    assert conf["spark.hadoop.fs.s3a.endpoint"] == s3.endpoint
    assert conf["spark.hadoop.fs.s3a.path.style.access"] == "true"
    assert env["AWS_ACCESS_KEY_ID"] == s3.credentials[0] and env["PATH"] == "/usr/bin"
    assert s3.credentials[1] not in env["PYSPARK_SUBMIT_ARGS"]  # in the environment only
