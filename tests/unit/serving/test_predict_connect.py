"""``predict`` and the champion's rescoring over a real Spark Connect server.

The session-scoped ``connect_url`` server (``SparkConnectServer``, ``local[2]``, Delta) scores
a registered model (no training) from a photo folder with a bad file and from a Delta table:
one output row per input, the bad one with its reason; the predictions are the classic
``spark`` fixture's for the same model and input; a re-run writes no Delta version; the model
reaches the server's Python workers as a session artifact (``addArtifacts``), not through a
SparkContext.

Every classic result is computed first (:func:`classic`), then one Connect session serves the
module's tests (:func:`remote`): a Connect session's Python workers are its own, so one
session loads the model once per worker, and no classic Spark call runs while pyspark is in
Connect mode. The table test runs without ``SPARK_CONNECT_MODE_ENABLED``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from flowers_job.driver.promotion import champion_accuracy_on
from flowers_job.location import Location
from flowers_job.serving.batch_predict import predict, resolve_model
from flowers_job.serving.model_ref import artifact_scope
from flowers_job.tables.table_ref import TableRef
from tests.support import LABELS, PHOTOS
from tests.support.connect import connect_session
from tests.support.data import sample_photos
from tests.support.model_registry import register_model

pytestmark = [pytest.mark.timeout(400), pytest.mark.tier("full")]

MODEL = "models:/flowers_classifier/1"
BAD = "roses/text.jpg"
"""The one bad entry of the photo sample: text named .jpg (ingest's ``not_an_image``)."""
CUT = 9
"""``row_id`` of the input table's bad row: a photo cut to 400 bytes (``corrupt``)."""


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """10 entries: 2 real photos per label, one of the roses replaced by a text file."""
    root = sample_photos(tmp_path_factory.mktemp("connect_photos"), per_label=2)
    next(iter(sorted((root / "roses").glob("*.jpg")))).unlink()
    (root / BAD).write_text("not a photo\n")
    return root


def _rows(spark: Any, path: Path, key: str) -> dict[Any, dict[str, Any]]:
    """The output table's rows by ``key``, as plain dicts (comparable across sessions)."""
    return {r[key]: r.asDict() for r in spark.read.format("delta").load(str(path)).collect()}


@pytest.fixture(scope="module")
def classic(
    spark: SparkSession, photos: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Version 1 registered; an input Delta table (``row_id, path, label, image``: one photo
    per label and the cut one at version 0; version 1 relabels rows 0-2 with the model's own
    predictions, so the model is right on exactly 3 of its 6 rows); everything scored on the
    classic ``spark`` fixture."""
    tmp = tmp_path_factory.mktemp("connect_predict")
    example = sorted((PHOTOS / "daisy").glob("*.jpg"))[0].read_bytes()
    info = register_model(tmp / "registry", [example], seed=0)
    uri = info["mlflow_tracking_uri"]
    ref = resolve_model(MODEL, uri)
    predict(spark, ref, tmp / "classic_images", images=photos)

    paths = [sorted((PHOTOS / label).glob("*.jpg"))[5] for label in LABELS]
    data: list[tuple[Any, ...]] = [
        (i, str(p), p.parent.name, p.read_bytes()) for i, p in enumerate(paths)
    ]
    data.append((CUT, "cut.jpg", "roses", paths[2].read_bytes()[:400]))
    schema = "row_id long, path string, label string, image binary"
    table = tmp / "images"
    spark.createDataFrame(data, schema).write.format("delta").save(str(table))
    predict(spark, ref, tmp / "classic_table", table=table)
    by_table = _rows(spark, tmp / "classic_table", "row_id")
    relabelled = [
        (i, p, by_table[i]["predicted_label"] if i < 3 else label, image)
        for i, p, label, image in data
    ]
    relabelled[3:5] = [  # rows 3 and 4 surely wrong: a label the model did not predict
        (i, p, next(x for x in LABELS if x != by_table[i]["predicted_label"]), image)
        for i, p, _, image in relabelled[3:5]
    ]
    spark.createDataFrame(relabelled, schema).write.format("delta").mode("overwrite").save(
        str(table)
    )
    return {
        "uri": uri,
        "ref": ref,
        "table": table,
        "rows": len(data),
        "images": _rows(spark, tmp / "classic_images", "relative_path"),
        "by_table": by_table,
        "accuracy": champion_accuracy_on(spark, MODEL, TableRef(path=Location.of(table)), 1, uri),
    }


@pytest.fixture(scope="module")
def remote(classic: dict[str, Any], connect_url: str) -> Iterator[Any]:
    """One Connect session for the module's tests, opened after :func:`classic`. Made by
    Connect's own builder, it leaves ``SPARK_CONNECT_MODE_ENABLED`` unset (pyspark's
    ``is_remote()`` false), unlike ``SparkSession.builder.remote(url)`` (the CLI's
    ``--remote``, spark-submit, a Databricks notebook): the table path and the champion's
    rescoring work even so."""
    with connect_session(connect_url) as spark:
        yield spark


def _same_predictions(connect: dict[Any, Any], classic: dict[Any, Any]) -> None:
    assert set(connect) == set(classic)
    for key, row in connect.items():
        other = classic[key]
        for column in ("predicted_label", "reason_code", "model_uri", "model_version"):
            assert row[column] == other[column], (key, column)
        if other["probabilities"] is None:
            assert row["probabilities"] is None, key
        else:
            assert sorted(row["probabilities"]) == sorted(LABELS)
            for label, p in other["probabilities"].items():
                assert row["probabilities"][label] == pytest.approx(p, abs=1e-5), (key, label)


def test_predict_images_over_connect_matches_classic_and_rerun_writes_nothing(
    remote: Any,
    classic: dict[str, Any],
    photos: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The photo folder's listing keys are ``pyspark.sql.functions`` columns
    (:func:`flowers_job.photos.files.listing_key`): ``SPARK_CONNECT_MODE_ENABLED=1``, as
    ``SparkSession.builder.remote(url)`` sets it, makes them Connect ones."""
    monkeypatch.setenv("SPARK_CONNECT_MODE_ENABLED", "1")
    assert artifact_scope(remote) == f"connect:{remote.session_id}"
    out = tmp_path / "connect"
    report = predict(remote, classic["ref"], out, images=photos)
    assert report.written and report.input_rows == report.output_rows == 10
    assert report.reason_counts == {"not_an_image": 1}
    assert sum(report.label_counts.values()) == 9
    again = predict(remote, classic["ref"], out, images=photos)
    assert not again.written and again.delta_version == report.delta_version
    assert again.label_counts == report.label_counts

    rows = _rows(remote, out, "relative_path")
    assert set(rows) == {p.relative_to(photos).as_posix() for p in photos.rglob("*") if p.is_file()}
    assert rows[BAD]["reason_code"] == "not_an_image" and rows[BAD]["reason"]
    assert rows[BAD]["predicted_label"] is None and rows[BAD]["probabilities"] is None
    for rel, row in rows.items():
        assert row["label"] == rel.split("/")[0]
        if rel != BAD:
            assert row["predicted_label"] in LABELS and row["reason_code"] is None
    _same_predictions(rows, classic["images"])


def test_predict_table_and_champion_rescoring_over_connect_match_classic(
    remote: Any, classic: dict[str, Any], tmp_path: Path
) -> None:
    """The Delta table at version 0 into a table; the champion's accuracy at version 1
    (:func:`champion_accuracy_on`, promotion's rescoring): 3 of 6 right, as on classic."""
    out = tmp_path / "connect"
    table = TableRef(path=Location.of(classic["table"]))
    report = predict(remote, classic["ref"], out, table=table)
    assert report.written and report.input_rows == report.output_rows == classic["rows"]
    assert not predict(remote, classic["ref"], out, table=table).written
    rows = _rows(remote, out, "row_id")
    assert rows[CUT]["reason_code"] == "corrupt" and rows[CUT]["predicted_label"] is None
    _same_predictions(rows, classic["by_table"])  # the table's latest version: same images

    accuracy = champion_accuracy_on(remote, MODEL, table, 1, classic["uri"])
    assert accuracy == classic["accuracy"] == pytest.approx(3 / classic["rows"])
