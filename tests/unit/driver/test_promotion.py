"""The ``champion`` alias: real registered models in a real sqlite MLflow store, and (for a
champion scored on another test split) real scoring on the executors of a local Spark; then
the same through a real MLflow tracking server with proxied artifacts
(``--artifacts-destination``) while the process-wide tracking URI names another store.

Gate tier, in every environment's suite (the local stack, Databricks Runtime 17.3 and 18):
MLflow 3.0.1 (17.3's) resolved the server's ``mlflow-artifacts:`` URIs through the
process-wide URI, and only that environment showed it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
import pytest
from pyspark.sql import SparkSession

from flowers_job.config import JobConfig, load_config
from flowers_job.driver.promotion import CHAMPION, promote
from flowers_job.tracking.credentials import store_client
from flowers_job.tracking.tags import TAG_TEST_SPLIT
from tests.support import LABELS, PHOTOS
from tests.support.model_registry import register_model, tracking_server

pytestmark = [pytest.mark.timeout(600), pytest.mark.tier("gate")]


def _photos(per_label: int) -> list[tuple[str, bytes]]:
    return [
        (label, path.read_bytes())
        for label in LABELS
        for path in sorted((PHOTOS / label).glob("*.jpg"))[:per_label]
    ]


def _register(
    out: Path, seed: int, test_accuracy: float, digest: str, overrides: list[str] | None = None
) -> dict[str, Any]:
    """A registered version whose run carries what rank 0 logs: its test score and split."""
    summary = register_model(out, [_photos(1)[0][1]], seed=seed, overrides=overrides)
    client = mlflow.MlflowClient(summary["mlflow_tracking_uri"])
    version = client.get_model_version(
        summary["registered_model_name"], str(summary["registered_model_version"])
    )
    assert version.run_id is not None
    client.log_metric(version.run_id, "test_accuracy", test_accuracy)
    client.set_tag(version.run_id, TAG_TEST_SPLIT, digest)
    return {**summary, "mlflow_run_id": version.run_id, "test_accuracy": test_accuracy}


def _summary(registered: dict[str, Any], digest: str, test_table: str = "") -> dict[str, Any]:
    return {
        **registered,
        "lineage": {
            "test_split_digest": digest,
            "splits": {"test": {"path": test_table, "version": 0, "split": None}},
        },
    }


def _test_table(spark: SparkSession, path: Path, photos: list[tuple[str, bytes]]) -> str:
    """A Delta test table of ``photos`` at ``path`` (``row_id``, ``label``, ``image``)."""
    spark.createDataFrame(
        [(i, label, image) for i, (label, image) in enumerate(photos)],
        "row_id long, label string, image binary",
    ).write.format("delta").save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real MLflow tracking server with proxied artifacts; its URL."""
    with tracking_server(tmp_path_factory.mktemp("server-store")) as url:
        yield url


def _champion(cfg: JobConfig) -> int:
    client = mlflow.MlflowClient(cfg.tracking_uri)
    return int(client.get_model_version_by_alias("flowers_classifier", CHAMPION).version)


def test_the_champion_moves_only_to_an_equal_or_better_score_on_the_same_split(
    spark: SparkSession, tmp_path: Path
) -> None:
    cfg = load_config(None, [], **{"paths.output_dir": tmp_path})
    first = promote(spark, cfg, _summary(_register(tmp_path, 0, 0.80, "d1"), "d1"))
    assert first is not None and first.promoted and first.champion_scored == "none"
    assert _champion(cfg) == 1

    worse = _register(tmp_path, 1, 0.70, "d1")
    decision = promote(spark, cfg, _summary(worse, "d1"))
    assert decision is not None and not decision.promoted
    assert (decision.champion_version, decision.champion_test_accuracy) == (1, 0.80)
    assert decision.champion_scored == "logged"
    assert _champion(cfg) == 1
    # the decision and both numbers are in the losing version's run
    client = mlflow.MlflowClient(cfg.tracking_uri)
    run = client.get_run(worse["mlflow_run_id"])
    assert run.data.tags["flowers_job.promoted"] == "false"
    assert (
        "0.7000 < the champion's (version 1) 0.8000"
        in run.data.tags["flowers_job.driver.promotion"]
    )
    assert run.data.metrics["champion_test_accuracy"] == 0.80
    with store_client(cfg.tracking_uri) as scoped:  # MLflow 3.0.1: see store_client
        logged = json.loads(
            Path(scoped.download_artifacts(run.info.run_id, "promotion.json")).read_text()
        )
    assert logged == decision.to_dict()

    equal = promote(spark, cfg, _summary(_register(tmp_path, 2, 0.80, "d1"), "d1"))
    assert equal is not None and equal.promoted
    assert _champion(cfg) == 3
    # predict's alias resolution sees the new champion
    mlflow.set_tracking_uri(cfg.tracking_uri)
    model = mlflow.pyfunc.load_model(f"models:/flowers_classifier@{CHAMPION}")
    assert model.metadata.run_id == client.get_model_version("flowers_classifier", "3").run_id
    mlflow.set_tracking_uri(None)  # type: ignore[arg-type]  # MLflow's own reset


# full: a second scoring job on the executors (about 80 s); the gate keeps the other promotions
@pytest.mark.tier("full")
def test_a_champion_scored_on_another_split_is_rescored_on_this_one(
    spark: SparkSession, tmp_path: Path
) -> None:
    """The champion's logged 0.99 was on another split: it is not compared. The champion is
    scored on this run's test table instead, on the executors, and that number decides."""
    cfg = load_config(None, [], **{"paths.output_dir": tmp_path})
    old = _register(tmp_path, 0, 0.99, "old-split")
    promote(spark, cfg, _summary(old, "old-split"))
    photos = _photos(2)
    table = _test_table(spark, tmp_path / "test_table", photos)
    # the champion's accuracy on these photos, in this process
    mlflow.set_tracking_uri(cfg.tracking_uri)
    champion = mlflow.pyfunc.load_model(old["model_uri"])
    probs = champion.predict(pd.DataFrame({"image": [image for _, image in photos]}))
    expected = float((probs.idxmax(axis=1) == [label for label, _ in photos]).mean())
    mlflow.set_tracking_uri(None)  # type: ignore[arg-type]  # MLflow's own reset

    new = _register(tmp_path, 1, expected, "new-split")
    decision = promote(spark, cfg, _summary(new, "new-split", table))
    assert decision is not None
    assert decision.champion_scored == "rescored"
    assert decision.champion_test_accuracy == pytest.approx(expected)
    assert decision.promoted  # equal on the same split: promoted
    assert _champion(cfg) == 2


def test_promotion_reaches_the_tracking_server_whatever_the_process_wide_uri(
    spark: SparkSession, tmp_path: Path, server: str
) -> None:
    """The store is a tracking server with proxied artifacts,
    and the process-wide tracking URI names a ``file:`` store (as a runtime's default does).
    The first version is promoted (its decision logged as an artifact through the server),
    a second one on another split rescores the champion (its artifacts downloaded through
    the server), and the process-wide URI is what it was afterwards."""
    sets = [f"tracking.tracking_uri={server}", "tracking.experiment_name=promotion"]
    cfg = load_config(None, sets, **{"paths.output_dir": tmp_path})
    elsewhere = (tmp_path / "elsewhere").as_uri()
    first = _register(tmp_path, 0, 0.80, "d1", sets)
    assert first["model_uri"].startswith("models:/")
    table = _test_table(spark, tmp_path / "test_table", _photos(1))
    second = _register(tmp_path, 1, 0.10, "d2", sets)
    try:
        mlflow.set_tracking_uri(elsewhere)
        decision = promote(spark, cfg, _summary(first, "d1"))
        assert decision is not None and decision.promoted
        rescored = promote(spark, cfg, _summary(second, "d2", table))
        assert rescored is not None and rescored.champion_scored == "rescored"
        assert rescored.champion_test_accuracy is not None
        assert 0.0 <= rescored.champion_test_accuracy <= 1.0
        assert mlflow.get_tracking_uri() == elsewhere
        assert os.environ["MLFLOW_TRACKING_URI"] == elsewhere
    finally:
        mlflow.set_tracking_uri(None)  # type: ignore[arg-type]  # MLflow's own reset
    assert _champion(cfg) == (2 if rescored.promoted else 1)
    with store_client(server) as client:
        path = client.download_artifacts(first["mlflow_run_id"], "promotion.json", str(tmp_path))
    assert json.loads(Path(path).read_text()) == decision.to_dict()
    assert not (tmp_path / "elsewhere").exists()  # nothing went to the other store
