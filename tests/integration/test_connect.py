"""The job over Spark Connect: ``flowers-job run --remote`` trains on a real Connect server,
``predict --remote`` scores there, and a library call with a Connect session ingests.

Real components: a local Spark Connect server (the pyspark wheel's ``SparkConnectServer``,
started with spark-submit, ``local[2]``, Delta's jar and SQL extension: the ``connect_url``
fixture of tests/conftest.py), its Python client (``pyspark[connect]``: grpcio,
grpcio-status), TorchDistributor's barrier stage run by the server's Python workers, the
Streaming loader, a sqlite MLflow store. Runs in the local suite only (the DBR 17.3
environment has no grpcio, as ``requirements/dbr-17.3-ml.txt`` is built).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any, cast

import mlflow
import pytest
from pyspark.sql import SparkSession

from flowers_job.config import load_config
from flowers_job.driver.pipeline import run_ingest
from tests.integration.test_job_e2e import FAST as E2E_FAST
from tests.support import PHOTOS, ROOT_DIR
from tests.support.connect import (
    SPARK_HOME,
    client_env,
    connect_session,
    free_port,
    run,
    spark_env,
    without_jvm_frames,
)
from tests.support.data import copy_tables, needs_loader
from tests.support.processes import run_cli

pytestmark = [pytest.mark.timeout(900), pytest.mark.tier("full")]
"""The full tier: a job over Connect costs the gate's local suite about 500 s beside the DBR
side (docs/testing.md); the gate keeps the unreachable server's refusal here, and a real
Connect server's tables, probes, placement and listing (``unit/tables/test_tables_connect.py``,
``unit/cluster/test_cluster_connect.py``)."""

FAST = [*E2E_FAST, "train.epochs=1"]
"""The small job (tests/integration/test_job_e2e.py's settings, one epoch)."""
JOB_SECONDS = 600
"""Bound on one CLI job over Connect (about 2 minutes on the 2-core machine)."""


def _sets(*settings: str) -> list[str]:
    return [a for s in settings for a in ("--set", s)]


def _log_lines(stderr: str) -> list[str]:
    """The job's own log records (``<time> LEVEL logger: message``), in order."""
    return [
        line
        for line in stderr.splitlines()
        if re.match(r"^\d{4}-\d\d-\d\d .* (INFO|WARNING|ERROR) ", line)
    ]


@pytest.fixture(scope="module")
def connect_run(
    request: pytest.FixtureRequest,
    connect_url: str,
    photos: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    """``flowers-job run --remote <server>`` with the Streaming loader in barrier mode (the
    ranks are the server's Spark tasks) on the 60-photo sample; its process and summary.

    The client is ``.venv-connect``'s ``flowers-job`` (``pyspark-client``, no JVM: the
    ``connect_client`` fixture), run from a temp dir so that the project comes from its
    wheel; this environment's CLI where that one cannot be built (no package index)."""
    out = tmp_path_factory.mktemp("connect-run")
    args = [
        *("run", "--remote", connect_url, "--images", str(photos), "--output-dir", str(out)),
        *_sets(*FAST, "data.loader=streaming", "distributed.local_mode=false"),
    ]
    try:
        client = request.getfixturevalue("connect_client")
    except pytest.skip.Exception:
        client = None
    if client is None:
        proc = run_cli(*args, timeout=JOB_SECONDS)
    else:
        proc = run([str(client / "flowers-job"), *args], JOB_SECONDS, out.parent, client_env())
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return {"proc": proc, "out": out, "summary": summary, "client": client}


def test_cli_run_over_spark_connect_with_streaming(
    connect_run: dict[str, Any], connect_url: str
) -> None:
    """From the client with no JVM (``pyspark-client``): exit 0, a test accuracy, the model
    registered in the run's MLflow store; the log's first line says the session is Spark
    Connect and names the server, a later one that it answered (its Spark and master)."""
    proc, summary = connect_run["proc"], connect_run["summary"]
    assert proc.returncode == 0, without_jvm_frames(proc.stderr)[-5000:]
    shown = json.loads(proc.stdout[: proc.stdout.rindex("}") + 1])
    assert 0.0 <= shown["test_accuracy"] <= 1.0
    assert shown["loader"] == "streaming" and shown["world_size"] == 2
    lines = _log_lines(proc.stderr)
    assert lines[0].endswith(f"session: Spark Connect (--remote {connect_url})"), lines[:3]
    assert any(
        f"Spark Connect session (sc://{connect_url.removeprefix('sc://')}, server Spark" in line
        and "master local[2]" in line
        for line in lines
    ), lines[:5]
    assert summary["local_mode"] is False and summary["loader"] == "streaming"
    assert summary["train_rows"] + summary["val_rows"] + summary["test_rows"] == 60
    assert summary["test"]["rows"] == summary["test_rows"] > 0
    name, version = summary["registered_model_name"], summary["registered_model_version"]
    model = mlflow.MlflowClient(summary["mlflow_tracking_uri"]).get_model_version(
        name, str(version)
    )
    assert model.run_id == summary["mlflow_run_id"]
    assert summary["test_accuracy"] == shown["test_accuracy"]
    assert len(summary["ranks"]) == 2  # both ranks reported, from the server's tasks


def test_the_job_ran_from_the_client_with_no_jvm(connect_run: dict[str, Any]) -> None:
    """The job above ran from ``.venv-connect`` (``pyspark-client``); skipped, naming why,
    where that environment could not be built and this environment's CLI ran it instead."""
    if connect_run["client"] is None:
        pytest.skip(".venv-connect could not be built here: the job ran from .venv's CLI")
    assert connect_run["proc"].returncode == 0


def test_predict_table_over_spark_connect(connect_run: dict[str, Any], connect_url: str) -> None:
    """``predict --remote`` scores the run's test split with the model the run registered
    (``--output-dir``: its summary), on the same server: one output row per input row."""
    out, summary = connect_run["out"], connect_run["summary"]
    assert connect_run["proc"].returncode == 0, connect_run["proc"].stderr[-3000:]
    # the run's store, whatever an earlier test of this process left in MLFLOW_TRACKING_URI
    env = {**os.environ, "MLFLOW_TRACKING_URI": summary["mlflow_tracking_uri"]}
    proc = run_cli(
        *("predict", "--remote", connect_url, "--output-dir", str(out)),
        *("--table", summary["tables"]["images"], "--split", "test"),
        *("--output-table", str(out / "predictions")),
        timeout=JOB_SECONDS,
        env=env,
    )
    assert proc.returncode == 0, without_jvm_frames(proc.stderr)[-5000:]
    report = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert report["input_rows"] == report["output_rows"] == summary["test_rows"], report
    assert sum(report["label_counts"].values()) == summary["test_rows"], report
    assert report["model_version"] == summary["registered_model_version"]
    assert "Spark Connect session" in proc.stderr


def test_library_ingest_with_a_connect_session(
    connect_url: str, photos: Path, tmp_path: Path
) -> None:
    """``run_ingest`` handed a Connect session (as Databricks serverless hands ``spark``):
    the photos listed and decoded by the server's tasks, the tables written through SQL;
    then a change, ingested incrementally over Connect too (the quarantine's no-op check,
    the parameterized DELETE and the loader cache's append), and training's checks accept the
    tables."""
    import shutil

    from flowers_job.tables.delta_tables import checked_tables

    images = tmp_path / "photos"
    shutil.copytree(photos, images)
    quoted = images / "daisy" / "o'neil.jpg"  # a quote in the path: the DELETE's parameters
    sorted((images / "daisy").glob("*.jpg"))[0].rename(quoted)
    cfg = load_config(
        None,
        ["data.image_size=32"],
        **{"data.images": images, "paths.output_dir": tmp_path / "out"},
    )
    with connect_session(connect_url) as session:
        spark = cast(SparkSession, session)
        report = run_ingest(spark, cfg)
        assert report.images_rows == 60 and report.quarantined_rows == 0
        assert report.train_rows + report.val_rows + report.test_rows == 60
        again = run_ingest(spark, cfg)  # nothing changed: nothing written
        assert again.files_decoded == 0 and again.rows_inserted == 0
        quoted.unlink()
        new = sorted((PHOTOS / "daisy").glob("*.jpg"))[30].read_bytes()
        (images / "daisy" / "new.jpg").write_bytes(new)
        third = run_ingest(spark, cfg)
        assert (third.mode, third.rows_inserted, third.rows_deleted) == ("incremental", 1, 1)
        assert third.images_rows == 60 and third.quarantined_rows == 0
        assert checked_tables(spark, cfg).meta["fingerprint"] == third.fingerprint
    assert "SPARK_CONNECT_MODE_ENABLED" not in os.environ  # later tests' Spark stays classic


@pytest.mark.tier("gate")
def test_an_unreachable_server_exits_2_naming_it_without_its_token(
    photos: Path, tmp_path: Path
) -> None:
    """A Connect URL nothing answers at: status 2 within seconds, the URL named, its
    parameters (a token) not; nothing written."""
    url = f"sc://127.0.0.1:{free_port()}/;token=not-for-logs"
    out = tmp_path / "out"
    proc = run_cli(
        *("run", "--remote", url, "--images", str(photos), "--output-dir", str(out)),
        *_sets(*FAST, "data.loader=streaming"),
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "no Spark Connect server answers at sc://127.0.0.1:" in proc.stderr
    assert "not-for-logs" not in proc.stdout + proc.stderr


def test_spark_submit_remote_runs_the_job_on_the_server(
    connect_url: str, photos: Path, tmp_path: Path
) -> None:
    """``spark-submit --remote <server> jobs/train_flowers.py``: pyspark hands the Python
    driver a Connect session (``PYSPARK_REMOTE_INIT_CONF_*``), and the job runs on the
    server to the end."""
    out = tmp_path / "out"
    submitted = subprocess.run(
        [
            str(SPARK_HOME / "bin" / "spark-submit"),
            *("--remote", connect_url),
            str(ROOT_DIR / "jobs" / "train_flowers.py"),
            *("--images", str(photos), "--output-dir", str(out)),
            *_sets(*FAST, "data.loader=streaming", "distributed.local_mode=false"),
        ],
        capture_output=True,
        text=True,
        timeout=JOB_SECONDS,
        check=False,
        env=spark_env(),
    )
    output = submitted.stdout + submitted.stderr
    assert submitted.returncode == 0, output[-5000:]
    assert f"session: Spark Connect (spark.remote={connect_url} from spark-submit" in output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["registered_model_version"] >= 1 and summary["loader"] == "streaming"


@pytest.mark.parametrize("loader", ["petastorm"], indirect=True)  # skipped where it cannot run
def test_petastorm_runs_on_spark_connect_too(
    connect_url: str, photos: Path, tmp_path: Path, loader: str
) -> None:
    """Petastorm's converter (``make_spark_converter``) reads ``df._jdf``, which a Connect
    DataFrame lacks. This project's Petastorm loader never calls it: Spark writes the cache
    (DataFrame writes) and the ranks read it with Petastorm's reader, so the job runs."""
    out = tmp_path / "out"
    proc = run_cli(
        *("run", "--remote", connect_url, "--images", str(photos), "--output-dir", str(out)),
        *_sets(*FAST, f"data.loader={loader}", "distributed.local_mode=false"),
        timeout=JOB_SECONDS,
    )
    assert proc.returncode == 0, without_jvm_frames(proc.stderr)[-5000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["loader"] == "petastorm" and summary["registered_model_version"] >= 1


@needs_loader("delta")
def test_delta_reads_the_table_on_spark_connect(
    connect_url: str, photos: Path, tables: Path, tmp_path: Path
) -> None:
    """The Delta loader's driver side is Spark queries (a count, ``DESCRIBE DETAIL``) and a
    read of the log, which a Connect client can do; its ranks, the server's barrier tasks,
    read the table with delta-rs and need no session. ``train --remote`` on tables that
    classic Spark wrote runs with no cache written. Tables written over Connect carry string
    columns typed ``string collate UTF8_BINARY`` in their Delta schema, which delta-rs 1.6
    cannot parse: ``run --remote`` (ingest over Connect) is refused before any rank starts,
    naming the type and the loader that reads the table through Spark. For the same reason
    ``embeddings.enabled: auto`` stays off over Connect (the embeddings table it would
    write), and ``true`` is refused before Spark starts."""
    out = copy_tables(tables, tmp_path / "classic")
    proc = run_cli(
        *("train", "--remote", connect_url, "--output-dir", str(out)),
        *_sets(*FAST, "data.loader=delta", "distributed.local_mode=false"),
        timeout=JOB_SECONDS,
    )
    assert proc.returncode == 0, without_jvm_frames(proc.stderr)[-5000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["loader"] == "delta" and summary["registered_model_version"] >= 1
    assert {u["bytes_written"] for u in summary["loader_cache"].values()} == {0}
    assert not summary["embeddings"] and "embeddings.enabled=auto: false" in proc.stderr
    refused = run_cli(
        *("train", "--remote", connect_url, "--output-dir", str(out)),
        *_sets(*FAST, "data.loader=delta", "embeddings.enabled=true"),
        timeout=JOB_SECONDS,
    )
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "embeddings.enabled" in refused.stderr and "Spark Connect" in refused.stderr

    out = tmp_path / "connect"
    proc = run_cli(
        *("run", "--remote", connect_url, "--images", str(photos), "--output-dir", str(out)),
        *_sets(*FAST, "data.loader=delta", "distributed.local_mode=false"),
        timeout=JOB_SECONDS,
    )
    assert proc.returncode != 0
    assert "string collate UTF8_BINARY" in proc.stderr, proc.stderr[-3000:]
    assert "data.loader=streaming reads the table through Spark instead" in proc.stderr
    assert "rank 0" not in proc.stderr and not (out / "checkpoints").exists()
