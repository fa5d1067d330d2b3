"""``flowers-job predict``: real local Spark, real photos, a registered model (no training).

A small sample of the real photos plus bad files (empty, text named .jpg, a truncated JPEG,
and a photo directly in the root, which has no label) is scored from the folder and from a
Delta table: every input row comes out, bad ones with ingest's reason code and no
prediction; a re-run writes no Delta version, a new model version does; the default model
comes from summary.json, ``models:/name@alias`` resolves; the CLI end to end once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from delta.tables import DeltaTable
from mlflow import MlflowClient
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from flowers_job.cli import main
from flowers_job.serving.batch_predict import (
    OUTPUT_COLUMNS,
    ROWS_PER_PARTITION,
    PredictError,
    UsageError,
    default_model,
    predict,
    resolve_model,
    score_images,
    scoring_partitions,
)
from flowers_job.serving.model_ref import ship_model
from tests.support import LABELS, PHOTOS
from tests.support.data import sample_photos
from tests.support.model_registry import register_model
from tests.support.processes import run_cli

pytestmark = [pytest.mark.timeout(600), pytest.mark.tier("full")]

BAD = {
    "daisy/empty.jpg": "empty_file",
    "roses/text.jpg": "not_an_image",
    "tulips/cut.jpg": "corrupt",
}


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 real photos per label, the three bad files of ``BAD`` and ``loose.jpg`` in the root."""
    root = sample_photos(tmp_path_factory.mktemp("predict_photos"), per_label=2)
    good = sorted((PHOTOS / "tulips").glob("*.jpg"))[-1].read_bytes()
    (root / "daisy" / "empty.jpg").write_bytes(b"")
    (root / "roses" / "text.jpg").write_text("not a photo\n")
    (root / "tulips" / "cut.jpg").write_bytes(good[: len(good) // 3])
    (root / "loose.jpg").write_bytes(good)
    return root


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An output dir with version 1 registered and its summary.json, as ``run`` leaves it."""
    out = tmp_path_factory.mktemp("predict_out")
    example = sorted((PHOTOS / "daisy").glob("*.jpg"))[0].read_bytes()
    info = register_model(out, [example], seed=0)
    (out / "summary.json").write_text(json.dumps(info))
    return {**info, "output_dir": out, "example": example}


def _rows(spark: SparkSession, path: Path) -> dict[Any, Any]:
    df = spark.read.format("delta").load(str(path))
    key = "relative_path" if "relative_path" in df.columns else "row_id"
    return {r[key]: r for r in df.collect()}


def _version(spark: SparkSession, path: Path) -> int:
    last = DeltaTable.forPath(spark, str(path)).history(1).first()
    assert last is not None
    return int(last["version"])


def _check_scored(row: Any) -> None:
    assert row["reason_code"] is None and row["reason"] is None
    probs = row["probabilities"]
    assert sorted(probs) == sorted(LABELS)
    assert abs(sum(probs.values()) - 1.0) < 1e-6
    assert row["predicted_label"] == max(probs, key=probs.get)
    assert row["probability"] == probs[row["predicted_label"]]


def test_images_every_entry_gets_a_row_and_a_rerun_writes_nothing(
    spark: SparkSession, photos: Path, registry: dict[str, Any], tmp_path: Path
) -> None:
    ref = resolve_model("models:/flowers_classifier/1", registry["mlflow_tracking_uri"])
    out = tmp_path / "predictions"
    report = predict(spark, ref, out, images=photos)

    files = [p for p in photos.rglob("*") if p.is_file()]
    assert report.written and report.input_rows == report.output_rows == len(files) == 14
    assert report.reason_counts == {"empty_file": 1, "not_an_image": 1, "corrupt": 1}
    assert sum(report.label_counts.values()) == 11
    rows = _rows(spark, out)
    assert set(rows) == {p.relative_to(photos).as_posix() for p in files}
    for rel, code in BAD.items():
        assert rows[rel]["reason_code"] == code and rows[rel]["reason"]
        assert rows[rel]["predicted_label"] is None and rows[rel]["probabilities"] is None
    for rel, row in rows.items():
        assert row["model_uri"] == "models:/flowers_classifier/1" and row["model_version"] == 1
        assert row["scored_at"] is not None
        assert row["label"] == (rel.split("/")[0] if "/" in rel else None)  # the true label
        if rel not in BAD:
            _check_scored(row)
    # the same photo bytes, in the root and in tulips/: the same pixels, the same scores
    same = sorted((PHOTOS / "tulips").glob("*.jpg"))[-1].name
    assert same not in {Path(r).name for r in rows if r.startswith("tulips/")}  # not sampled
    assert rows["loose.jpg"]["label"] is None and rows["loose.jpg"]["predicted_label"]

    version = _version(spark, out)
    again = predict(spark, ref, out, images=photos)
    assert not again.written and _version(spark, out) == version == again.delta_version
    assert again.label_counts == report.label_counts


def test_table_input_new_version_and_alias(
    spark: SparkSession, registry: dict[str, Any], tmp_path: Path
) -> None:
    """A Delta table with row_id, path, label, image (one corrupt, one null): rows in == out;
    version 2 writes a new Delta version; ``@champion`` resolves to it."""
    photos = [sorted((PHOTOS / label).glob("*.jpg"))[3] for label in LABELS]
    data: list[tuple[Any, ...]] = [
        (i, str(p), p.parent.name, p.read_bytes(), "test" if i < 3 else "train")
        for i, p in enumerate(photos)
    ]
    data += [
        (10, "cut.jpg", "roses", photos[2].read_bytes()[:500], "train"),
        (11, None, None, None, "val"),
    ]
    table = tmp_path / "images"
    spark.createDataFrame(
        data, "row_id long, path string, label string, image binary, split string"
    ).write.format("delta").partitionBy("split").save(str(table))

    uri = registry["mlflow_tracking_uri"]
    out = tmp_path / "predictions"
    first = predict(spark, resolve_model("models:/flowers_classifier/1", uri), out, table=table)
    rows = _rows(spark, out)
    assert first.input_rows == first.output_rows == len(rows) == 7
    assert spark.read.format("delta").load(str(out)).columns == [
        "row_id",
        "path",
        "label",
        *OUTPUT_COLUMNS,
    ]
    assert rows[10]["reason_code"] == "corrupt" and rows[10]["probabilities"] is None
    assert rows[11]["reason_code"] == "empty_file" and rows[11]["predicted_label"] is None
    for i in range(5):
        _check_scored(rows[i])
        assert rows[i]["label"] == LABELS[i]

    info = register_model(registry["output_dir"], [registry["example"]], seed=1)
    assert info["registered_model_version"] == 2
    second = predict(spark, resolve_model("models:/flowers_classifier/2", uri), out, table=table)
    assert second.written and second.delta_version == first.delta_version + 1
    assert {r["model_version"] for r in _rows(spark, out).values()} == {2}

    MlflowClient(uri).set_registered_model_alias("flowers_classifier", "champion", "2")
    champion = resolve_model("models:/flowers_classifier@champion", uri)
    assert champion.version == 2
    third = predict(spark, champion, out, table=table)
    rows = _rows(spark, out)
    assert rows[0]["model_uri"] == "models:/flowers_classifier@champion"
    assert rows[0]["model_version"] == 2
    assert third.label_counts == second.label_counts  # the same version, the same predictions
    assert not predict(spark, champion, out, table=table).written
    # --split: one partition of the table, as the bundle scores the held-out test split
    held_out = predict(spark, champion, tmp_path / "test_predictions", table=table, split="test")
    assert held_out.input_rows == held_out.output_rows == 3

    # score_images is lazy and reusable: the scored frame of any DataFrame with `image`
    df = spark.read.format("delta").load(str(table)).where(F.col("row_id") < 5)
    scored = score_images(spark, champion, df, num_partitions=2)
    assert scored.where(F.col("predicted_label").isNull()).count() == 0


def test_model_loaded_once_per_python_worker(spark: SparkSession, registry: dict[str, Any]) -> None:
    """Two jobs of 8 scoring tasks each on 2 slots: every Python worker loads the model once
    (the workers and the model are reused across tasks and jobs), with torch's threads at the
    task's cores (``spark.task.cpus`` = 1 here, so 2 workers use the 2 cores, no more)."""
    photos = [sorted((PHOTOS / label).glob("*.jpg"))[3].read_bytes() for label in LABELS]
    df = spark.createDataFrame(
        [(i, photos[i % len(photos)]) for i in range(16)], "row_id long, image binary"
    )
    ref = resolve_model("models:/flowers_classifier/1", registry["mlflow_tracking_uri"])
    scored = score_images(spark, ref, df, num_partitions=8)
    for _ in range(2):
        rows = scored.select("row_id", "predicted_label").collect()
        assert len(rows) == 16 and all(r["predicted_label"] for r in rows)
    name = ship_model(spark, ref).name

    def worker_state(batches: Iterable[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        import os

        import torch

        from flowers_job.serving import score_udf as scoring

        for _ in batches:
            yield pd.DataFrame(
                {
                    "pid": [os.getpid()],
                    "loads": [scoring.WORKER_LOADS.get(name, 0)],
                    "threads": [torch.get_num_threads()],
                }
            )

    seen = (
        spark.range(8)
        .repartition(8)
        .mapInPandas(worker_state, "pid long, loads long, threads long")
        .collect()
    )
    loads = {r["pid"]: r["loads"] for r in seen}
    assert 1 in loads.values() and set(loads.values()) <= {0, 1}, loads
    assert {r["threads"] for r in seen} == {1}


@pytest.mark.parametrize(
    ("rows", "slots", "tasks"),
    [(3670, 2, 6), (0, 2, 2), (10, 8, 8), (1_000_000, 64, 1920), (ROWS_PER_PARTITION * 4, 2, 4)],
)
def test_scoring_tasks_fill_every_slot_of_the_last_wave(rows: int, slots: int, tasks: int) -> None:
    """A multiple of the slots, each task of ROWS_PER_PARTITION rows or more (unless the
    input is smaller than one per slot): tasks of 127 rows cost 20-25 % more per row."""
    got = scoring_partitions(rows, slots)
    assert got == tasks and got % slots == 0
    assert got == slots or rows / got >= ROWS_PER_PARTITION


def test_default_model_and_errors(registry: dict[str, Any], tmp_path: Path) -> None:
    """summary.json names the default model; unknown models and aliases are named errors."""
    model_uri, tracking_uri = default_model(registry["output_dir"])
    assert model_uri == "models:/flowers_classifier/1"
    assert tracking_uri is not None and tracking_uri == registry["mlflow_tracking_uri"]
    with pytest.raises(PredictError, match="no --model given and no"):
        default_model(tmp_path)
    with pytest.raises(PredictError, match=r"has versions \[1"):
        resolve_model("models:/flowers_classifier/99", tracking_uri)
    with pytest.raises(PredictError, match="aliases"):
        resolve_model("models:/flowers_classifier@nope", tracking_uri)
    with pytest.raises(PredictError, match="no registered model named 'other'"):
        resolve_model("models:/other/1", tracking_uri)
    with pytest.raises(UsageError, match="expected models:/<name>/<version>"):
        resolve_model("runs:/abc/model", tracking_uri)


def test_cli(
    photos: Path, registry: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`flowers-job predict`: its refusals (in this process: they return before Spark starts),
    then one real run as a user runs it, with the default model from summary.json."""
    out_dir = str(registry["output_dir"])
    table = str(tmp_path / "predictions")
    common = ["predict", "--output-dir", out_dir, "--output-table", table]
    bad_alias = [*common, "--model", "models:/flowers_classifier@nope", "--images", str(photos)]
    assert main(bad_alias) == 1
    assert (
        "flowers-job predict: --model models:/flowers_classifier@nope:" in capsys.readouterr().err
    )
    assert main([*common, "--images", str(tmp_path / "nowhere")]) == 1
    assert "nowhere: not a directory" in capsys.readouterr().err
    bad_uri = ["predict", "--model", "models:/flowers_classifier", "--images", "a"]
    assert main([*bad_uri, "--output-table", table]) == 2
    assert "expected models:/<name>/<version>" in capsys.readouterr().err
    with pytest.raises(SystemExit) as both:
        main(["predict", "--images", "a", "--table", "b", "--output-table", table])
    assert both.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    assert not Path(table).exists()

    done = run_cli(*common, "--images", str(photos), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["model_uri"] == "models:/flowers_classifier/1" and report["written"]
    assert report["input_rows"] == report["output_rows"] == 14
    assert report["reason_counts"] == {"empty_file": 1, "not_an_image": 1, "corrupt": 1}
    assert "task" in done.stderr  # the progress bar
