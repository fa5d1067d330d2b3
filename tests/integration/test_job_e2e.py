"""The whole job on a class-balanced sample of the real photos, with real components:
local Spark + Delta, Petastorm or Streaming, TorchDistributor with 2 gloo processes, an
MLflow sqlite store in a temp dir, and the registered pyfunc model predicting. The CLI run
also carries secrets and checks that they end up nowhere.

The CLI run ingests the photos itself; the other tests start from a copy of the session's
tables (the same 60 photos at 32 px, ``tables`` in conftest.py).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
import pytest
from pyspark.sql import SparkSession

import flowers_job
from flowers_job.config import JobConfig, load_config
from flowers_job.driver.pipeline import run_job, run_training, training_job
from flowers_job.runtime.allocator import ALLOCATOR_ENV
from flowers_job.runtime.process_group import DistContext, init_distributed, shutdown_distributed
from tests.support import LABELS, PHOTOS
from tests.support.data import LOADERS, TABLE_LOADERS, copy_tables
from tests.support.processes import MARK_ENV, marked_processes, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.tier("full")]

FAST = [
    "data.image_size=32",  # the size of the session's tables
    "train.per_device_batch_size=8",
    "train.base_learning_rate=0.003",
    "distributed.timeout_seconds=300",
]
SENTINEL = "SENTINEL"
"""Part of every secret below: no byte string the job writes or prints may contain it."""
SECRET_ENV = {"DATABRICKS_TOKEN": f"dapi-{SENTINEL}-env-0a1b2c"}
SECRET_CONFIG = f"""tracking:
  username: ann
  password: pw-{SENTINEL}-cfg-3d4e5f
  token: tk-{SENTINEL}-cfg-6a7b8c
"""
MLFLOW_CREDENTIALS = (
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
)
CONTRACT_KEYS = {
    "val_accuracy",
    "val_loss",
    "best_epoch",
    "epochs_completed",
    "stop_reason",
    "world_size",
    "global_batch_size",
    "train_rows",
    "val_rows",
    "test_rows",
    "test_accuracy",
    "test_loss",
    "test_macro_f1",
    "test",
    "lineage",
    "promotion",
    "quarantined_rows",
    "num_partitions",
    "label_names",
    "mlflow_tracking_uri",
    "mlflow_run_id",
    "registered_model_name",
    "registered_model_version",
    "tables",
    "loader_cache",
}


def _check_summary(summary: dict[str, Any], spark: SparkSession, images: int) -> None:
    assert summary.keys() >= CONTRACT_KEYS
    assert summary["world_size"] == 2
    assert summary["global_batch_size"] == 16
    assert summary["label_names"] == sorted(LABELS)
    assert summary["num_partitions"] % 2 == 0
    assert 0.0 <= summary["val_accuracy"] <= 1.0 and summary["val_loss"] > 0
    assert 1 <= summary["best_epoch"] <= summary["epochs_completed"]
    counts = {n: spark.read.format("delta").load(p).count() for n, p in summary["tables"].items()}
    assert counts["images"] == images and counts["quarantine"] == summary["quarantined_rows"] == 0
    per_split = spark.read.format("delta").load(summary["tables"]["images"]).groupBy("split")
    for split, n in ((r["split"], r["count"]) for r in per_split.count().collect()):
        assert n == summary[f"{split}_rows"] > 0, split
    assert summary["train_rows"] + summary["val_rows"] + summary["test_rows"] == images
    test = summary["test"]
    assert test["rows"] == summary["test_rows"] == sum(map(sum, test["confusion"]))
    assert [c["label"] for c in test["per_class"]] == summary["label_names"]
    assert sum(c["support"] for c in test["per_class"]) == summary["test_rows"]
    # macro-F1 over the classes present in the test split (an absent one has f1 None)
    f1 = [c["f1"] for c in test["per_class"] if c["support"] > 0]
    assert None not in f1 and all(c["f1"] is None for c in test["per_class"] if c["support"] == 0)
    assert summary["test_macro_f1"] == pytest.approx(sum(f1) / len(f1))
    # every rank started with the allocator tuning (read from its /proc/self/environ)
    for r in summary["ranks"]:
        assert {k: r["allocator"][k] for k in ALLOCATOR_ENV} == dict(ALLOCATOR_ENV), r


def _check_mlflow(summary: dict[str, Any], epochs: int) -> None:
    client = mlflow.MlflowClient(tracking_uri=summary["mlflow_tracking_uri"])
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["world_size"] == "2"
    assert run.data.params["train.per_device_batch_size"] == "8"
    for metric in ("train_loss", "val_loss", "val_accuracy", "images_per_second"):
        history = client.get_metric_history(run.info.run_id, metric)
        assert sorted(m.step for m in history) == list(range(1, epochs + 1)), metric
    last = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val_accuracy")}
    assert last[summary["best_epoch"]] == pytest.approx(summary["val_accuracy"])


def _check_review(summary: dict[str, Any]) -> None:
    """What a reviewer reads in the MLflow run: the best and test scores, the figures and
    tables, the lineage, and the champion decision."""
    # MLflow 3.0.1 resolves a run's artifact location through the process-wide store, not
    # the client's: point both at this run's store
    mlflow.set_tracking_uri(summary["mlflow_tracking_uri"])
    client = mlflow.MlflowClient(tracking_uri=summary["mlflow_tracking_uri"])
    run = client.get_run(summary["mlflow_run_id"])
    metrics = run.data.metrics
    # best_val_* were skipped before (that epoch's step was logged already)
    assert metrics["best_val_accuracy"] == pytest.approx(summary["val_accuracy"])
    assert metrics["best_val_loss"] == pytest.approx(summary["val_loss"])
    for key in ("test_accuracy", "test_loss", "test_macro_f1"):
        assert metrics[key] == pytest.approx(summary[key]), key
    assert metrics["test_images_per_second"] > 0
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "figures")}
    assert artifacts == {
        "figures/curves.png",
        "figures/confusion_matrix.png",
        "figures/worst_mistakes.png",
    }
    local = Path(client.download_artifacts(run.info.run_id, "figures/curves.png"))
    assert local.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    per_class = json.loads(
        Path(client.download_artifacts(run.info.run_id, "test/per_class.json")).read_text()
    )
    assert per_class["columns"] == ["label", "precision", "recall", "f1", "support"]
    assert len(per_class["data"]) == len(LABELS)
    confusion = json.loads(
        Path(client.download_artifacts(run.info.run_id, "test/confusion_matrix.json")).read_text()
    )
    assert [row[1:] for row in confusion["data"]] == summary["test"]["confusion"]
    # lineage: every split as a dataset input: the images table at the Delta version read
    assert run.inputs is not None
    inputs = {
        i.dataset.name: (json.loads(i.dataset.source), {t.key: t.value for t in i.tags})
        for i in run.inputs.dataset_inputs
    }
    splits = summary["lineage"]["splits"]
    assert set(inputs) == {f"flowers_{name}" for name in ("train", "val", "test")}
    images = summary["lineage"]["tables"]["images"]
    assert images["path"] == summary["tables"]["images"]
    for name, split in splits.items():
        source, tags = inputs[f"flowers_{name}"]
        assert source["path"] == split["path"] == images["path"]
        assert tags["delta_version"] == str(split["version"]) == str(images["version"])
        assert tags["mlflow.data.context"] == name and tags["split"] == name
    assert run.data.tags["flowers_job.images_version"] == str(images["version"])
    fingerprint = summary["lineage"]["ingest_fingerprint"]
    assert run.data.tags["flowers_job.ingest_fingerprint"] == fingerprint
    assert fingerprint == summary.get("ingest", {}).get("fingerprint", fingerprint)
    assert len(fingerprint) == 64
    assert (
        run.data.tags["flowers_job.test_split_digest"] == (summary["lineage"]["test_split_digest"])
    )
    assert run.data.tags["flowers_job.version"] == flowers_job.__version__
    # the champion decision: in the summary and the run; the alias follows it
    promotion = summary["promotion"]
    assert promotion["version"] == summary["registered_model_version"]
    assert run.data.tags["flowers_job.promoted"] == str(promotion["promoted"]).lower()
    logged = json.loads(
        Path(client.download_artifacts(run.info.run_id, "promotion.json")).read_text()
    )
    assert logged == promotion
    champion = client.get_model_version_by_alias(summary["registered_model_name"], "champion")
    if promotion["promoted"]:
        assert int(champion.version) == summary["registered_model_version"]
    else:
        assert int(champion.version) == promotion["champion_version"]
        assert promotion["champion_test_accuracy"] > summary["test_accuracy"]


def _check_model_predicts(summary: dict[str, Any]) -> None:
    mlflow.set_tracking_uri(summary["mlflow_tracking_uri"])
    name, version = summary["registered_model_name"], summary["registered_model_version"]
    model = mlflow.pyfunc.load_model(f"models:/{name}/{version}")
    files = [sorted((PHOTOS / label).glob("*.jpg"))[-1] for label in LABELS]  # unseen photos
    out = model.predict(pd.DataFrame({"image": [f.read_bytes() for f in files]}))
    assert list(out.columns) == sorted(LABELS)
    assert out.shape == (5, 5)
    assert (out.sum(axis=1) - 1.0).abs().max() < 1e-5
    assert ((out >= 0) & (out <= 1)).all().all()


def _assert_no_secret(where: str, data: bytes) -> None:
    assert SENTINEL.encode() not in data, f"a secret leaked into {where}"


def _assert_no_secret_shipped(spark: SparkSession, cfg: JobConfig, folder: Path) -> None:
    """The bytes TorchDistributor ships to the ranks: ``cloudpickle((train_worker, (job,),
    {}))`` written by its own ``FunctionPickler``, the job built as ``run_training`` does."""
    from pyspark.ml.dl_util import FunctionPickler

    from flowers_job.driver.prepare import prepare_data
    from flowers_job.loaders import resolve_loader
    from flowers_job.train.rank import train_worker

    with prepare_data(spark, *resolve_loader(cfg)) as data:
        job = training_job(spark, cfg, data, str(folder), use_gpu=False)
        pickled = FunctionPickler.pickle_fn_and_save(train_worker, "", str(folder), job)
    _assert_no_secret("the pickled (train_worker, job)", Path(pickled).read_bytes())


def _wait_until_gone(mark: str, timeout: float) -> None:
    """Poll every 0.5 s until no process carries ``mark``; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while left := marked_processes(mark):
        if time.monotonic() > deadline:
            for proc in left:
                proc.kill()
            pytest.fail(f"{len(left)} processes of the finished driver still run after {timeout} s")
        time.sleep(0.5)


# One real TorchDistributor job per cache loader in the gate; the Delta loader's is the full
# tier's (the gate trains it on the session's tables: tests/integration/test_delta_loader.py).
@pytest.mark.parametrize(
    "loader",
    [
        *(pytest.param(n, marks=pytest.mark.tier("gate")) for n in LOADERS),
        *(pytest.param(n, marks=pytest.mark.tier("full")) for n in TABLE_LOADERS),
    ],
    indirect=True,
)
def test_cli_run_local_mode_then_resume(
    spark: SparkSession,
    photos: Path,
    tmp_path: Path,
    loader: str,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """`flowers-job run` as a user runs it, then `train --resume` continues the same run.

    Both carry secrets: DATABRICKS_TOKEN in the environment, tracking.password/token in the
    config file. None appears in any output, file under the output dir (tables, MLflow's
    sqlite file and artifacts, checkpoints, summary) or the job shipped to the ranks.
    The finished driver leaves no process behind (its JVM exits too).
    """
    out, mark = tmp_path / "out", uuid.uuid4().hex
    secrets = tmp_path / "secrets.yaml"
    secrets.write_text(SECRET_CONFIG)
    sets = [a for s in [*FAST, "train.epochs=1", f"data.loader={loader}"] for a in ("--set", s)]
    proc = run_cli(
        "run",
        "--images",
        str(photos),
        "--output-dir",
        str(out),
        "--config",
        str(secrets),
        *sets,
        timeout=800,
        env={**os.environ, **SECRET_ENV, MARK_ENV: mark},
    )
    assert proc.returncode == 0, proc.stderr[-5000:] + proc.stdout[-3000:]
    _wait_until_gone(mark, 60)
    _assert_no_secret("the output of `flowers-job run`", (proc.stdout + proc.stderr).encode())
    first = json.loads((out / "summary.json").read_text())
    _check_summary(first, spark, images=60)
    assert first["loader"] == loader
    assert first["epochs_completed"] == 1 and first["stop_reason"] == "max_epochs"
    assert first["local_mode"] is True
    _check_model_predicts(first)

    for name, value in SECRET_ENV.items():
        monkeypatch.setenv(name, value)
    for name in MLFLOW_CREDENTIALS:  # the preflight exports them; restored after the test
        monkeypatch.delenv(name, raising=False)
    cfg = load_config(
        secrets,
        [*FAST, "train.epochs=2", f"data.loader={loader}"],
        **{"paths.output_dir": out, "train.resume": True},
    )
    assert cfg.tracking.password is not None and cfg.tracking.token is not None
    capfd.readouterr()
    second = run_training(spark, cfg)
    _assert_no_secret("the output of the resumed run", "".join(capfd.readouterr()).encode())
    # the resumed run reads the loader cache the first one wrote: no byte written again (a
    # loader that reads the table writes none at all)
    writes = loader not in TABLE_LOADERS
    assert all(
        not u["reused"] and (u["bytes_written"] > 0) == writes
        for u in first["loader_cache"].values()
    )
    assert all(
        u["reused"] == writes and u["bytes_written"] == 0 for u in second["loader_cache"].values()
    )
    assert second["mlflow_run_id"] == first["mlflow_run_id"]  # the same MLflow run continues
    assert second["epochs_completed"] == 2 and second["epochs_this_run"] == 1
    assert [h["epoch"] for h in second["history"]] == [1, 2]
    assert second["history"][0] == first["history"][0]  # epoch 1 restored, not re-run
    _check_mlflow(second, epochs=2)
    _check_review(second)
    # the first run's version was the first champion; the second compared with its logged
    # test score on the same split
    assert first["promotion"]["promoted"] and first["promotion"]["champion_scored"] == "none"
    assert second["promotion"]["champion_version"] == first["registered_model_version"]
    assert second["promotion"]["champion_scored"] == "logged"
    assert second["registered_model_version"] == first["registered_model_version"] + 1

    files = [path for path in out.rglob("*") if path.is_file()]
    assert out / "mlflow.db" in files and out / "checkpoints" / "last.pt" in files
    for path in files:
        _assert_no_secret(str(path), path.read_bytes())
    run = mlflow.MlflowClient(cfg.tracking_uri).get_run(second["mlflow_run_id"])
    assert not {"tracking.password", "tracking.token"} & run.data.params.keys()
    assert run.data.params["tracking.username"] == "ann"
    # rank 0 got the credentials from the environment it inherited: MLflow tags the run
    # with MLFLOW_TRACKING_USERNAME (the job itself carries no credentials)
    assert run.data.tags["mlflow.user"] == "ann"
    _assert_no_secret_shipped(spark, cfg, tmp_path)


@pytest.mark.parametrize("loader", ["streaming"], indirect=True)
def test_resume_refuses_reingested_data_unless_told(
    spark: SparkSession, photos: Path, tmp_path: Path, loader: str
) -> None:
    """A run, then a re-ingest of changed photos (one train photo touched: a new listing,
    hence a new ingest fingerprint and ``images`` version, the same splits): ``--resume``
    refuses before any rank starts (exit 2, naming the table's version and the fingerprint,
    old -> new) and leaves the checkpoint alone; with ``train.resume_on_new_data`` it
    continues the same MLflow run on the same test split."""
    from flowers_job.driver.pipeline import run_ingest
    from flowers_job.errors import ConfigError

    images = tmp_path / "photos"
    shutil.copytree(photos, images)
    out = tmp_path / "out"
    sets = [*FAST, f"data.loader={loader}"]
    paths = {"data.images": images, "paths.output_dir": out}
    first = run_job(spark, load_config(None, [*sets, "train.epochs=1"], **paths))
    table = str(out / "tables" / "images")
    row = spark.read.format("delta").load(table).where("split = 'train'").first()
    assert row is not None
    photo = images / row["relative_path"]
    os.utime(photo, ns=(photo.stat().st_atime_ns, photo.stat().st_mtime_ns + 10**9))
    resumed = {**paths, "train.resume": True}
    run_ingest(spark, load_config(None, [*sets, "train.epochs=2"], **resumed))
    last = (out / "checkpoints" / "last.pt").read_bytes()
    with pytest.raises(ConfigError) as refused:
        run_training(spark, load_config(None, [*sets, "train.epochs=2"], **resumed))
    message = str(refused.value)
    old = first["lineage"]["tables"]["images"]["version"]
    assert refused.value.exit_code == 2
    assert f"images table {table} version {old} -> " in message, message
    assert "ingest fingerprint" in message and "train.resume_on_new_data" in message
    assert (out / "checkpoints" / "last.pt").read_bytes() == last  # touched nothing

    allowed = load_config(
        None, [*sets, "train.epochs=2", "train.resume_on_new_data=true"], **resumed
    )
    second = run_training(spark, allowed)
    assert second["mlflow_run_id"] == first["mlflow_run_id"]
    assert second["epochs_completed"] == 2 and second["epochs_this_run"] == 1
    assert second["lineage"]["tables"]["images"]["version"] > old
    assert second["lineage"]["test_split_digest"] == first["lineage"]["test_split_digest"]
    assert second["test_rows"] == first["test_rows"]


@pytest.mark.parametrize("loader", ["streaming"], indirect=True)
def test_run_barrier_mode(
    spark: SparkSession, photos: Path, tables: Path, tmp_path: Path, loader: str
) -> None:
    """local_mode=False: TorchDistributor runs the ranks as a Spark barrier stage.

    ``run_job`` on ``photos`` with their tables already in the output dir: its ingest finds
    them up to date and writes nothing (the CLI run above ingests for real). Streaming only,
    the loader of Databricks' barrier-mode jobs (the DBR suite runs it); Petastorm in
    barrier mode runs end to end on a real cluster of several hosts (tests/cluster/test_cluster.py,
    the Petastorm job)."""
    cfg = load_config(
        None,
        [*FAST, "train.epochs=2", "distributed.local_mode=false", f"data.loader={loader}"],
        **{"data.images": photos, "paths.output_dir": copy_tables(tables, tmp_path)},
    )
    summary = run_job(spark, cfg)
    assert summary["ingest"]["written"] is False
    _check_summary(summary, spark, images=60)
    assert summary["local_mode"] is False and summary["loader"] == loader
    assert summary["epochs_completed"] == 2
    _check_mlflow(summary, epochs=2)
    _check_review(summary)
    _check_model_predicts(summary)
    assert not list((tmp_path / "loader_cache").glob("run-*"))  # cache removed


@contextmanager
def _one_rank_group() -> Iterator[DistContext]:
    """This process as rank 0 of a 1-rank gloo group, as torchrun would start it; the
    environment (RANK, LOCAL_WORLD_SIZE, GLOO_SOCKET_IFNAME, ... set on the way) restored
    when it is left."""
    saved = dict(os.environ)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    try:
        yield init_distributed(use_gpu=False, backend="gloo", timeout_seconds=300)
    finally:
        shutdown_distributed()
        os.environ.clear()
        os.environ.update(saved)


def test_frozen_backbone_validation_features_once_give_the_same_metrics(
    spark: SparkSession, tables: Path, tmp_path: Path, loader: str
) -> None:
    """train.cache_val_features: the validation features of the frozen backbone, computed
    once per run, give every epoch's metrics to the last digit of a run that computes them
    every epoch (same tables, seeds and shards), and the same test report.

    The rank side of both runs (:func:`~flowers_job.train.loop.fit`: build, the epochs,
    the best weights, the test scoring), in this process as a 1-rank gloo group, over the
    loader's real readers of one prepared cache: what differs between the two runs is
    there only. The driver and the TorchDistributor processes around it are the other
    tests'."""
    import matplotlib.pyplot as plt

    from flowers_job.driver.prepare import prepare_data
    from flowers_job.loaders import resolve_loader
    from flowers_job.train.loop import fit
    from flowers_job.train.state import Plans

    out = copy_tables(tables, tmp_path)
    settings = [
        *FAST,
        "train.epochs=3",
        "train.early_stopping.enabled=false",
        "distributed.num_processes=1",
        f"data.loader={loader}",
    ]
    cfg = load_config(None, settings, **{"paths.output_dir": out})
    assert cfg.model.freeze_backbone
    summaries = {}
    with prepare_data(spark, *resolve_loader(cfg)) as data, _one_rank_group() as ctx:
        plans = Plans(data.train, data.val, data.test, data.loader)
        for cache in (True, False):
            run_cfg = load_config(
                None,
                [*settings, f"train.cache_val_features={str(cache).lower()}"],
                **{"paths.output_dir": out / f"cache-{cache}"},
            )
            # The CLI makes the output dir before MLflow opens its sqlite store there.
            run_cfg.paths.output_dir.mkdir()
            try:
                summary, _ = fit(
                    run_cfg, ctx, plans, data.label_names, data.example_images, data.lineage
                )
            finally:
                mlflow.end_run()  # register() would end it; this test registers nothing
                plt.close("all")  # the report's figures, drawn for register()
            assert summary is not None
            summaries[cache] = summary
    cached, every_epoch = summaries[True], summaries[False]
    keys = ("train_loss", "train_accuracy", "val_loss", "val_accuracy")
    assert [{k: h[k] for k in keys} for h in cached["history"]] == [
        {k: h[k] for k in keys} for h in every_epoch["history"]
    ]
    assert len(cached["history"]) == 3
    # the same best weights, the same test score
    timing = {"images_per_second"}
    assert {k: v for k, v in cached["test"].items() if k not in timing} == {
        k: v for k, v in every_epoch["test"].items() if k not in timing
    }
