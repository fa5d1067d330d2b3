"""The ``champion`` alias (driver side, after training): promote a version that scores at least
as well on the test split as the current champion does on the same split.

A new version becomes ``models:/<name>@champion`` when its ``test_accuracy`` is at least
the champion's on the same test split:

- there is no champion yet: promoted;
- the champion's run was scored on a test split with the same digest
  (:data:`~flowers_job.tracking.tags.TAG_TEST_SPLIT`, :func:`flowers_job.driver.prepare.split_digest`):
  its logged ``test_accuracy`` is compared;
- otherwise (new photos, another seed or fraction, a run before test splits existed):
  the champion is scored on this run's test table, on the executors
  (:func:`flowers_job.serving.batch_predict.score_images`), and that accuracy is compared. Logged numbers
  of different splits are never compared.

The decision, both numbers and how the champion's was obtained are logged to the new
version's run (``promotion.json``, metric ``champion_test_accuracy``, tags
``flowers_job.promoted`` and ``flowers_job.driver.promotion``). This runs on the driver after
the ranks have exited; it is the only registry write outside rank 0, and it happens once.
Unity Catalog registries support aliases the same way (three-level model names); that
path cannot be tested here.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from typing import Any, Literal

import mlflow
from mlflow.exceptions import MlflowException
from pyspark.sql import SparkSession

from flowers_job.config import JobConfig
from flowers_job.tables.table_ref import TableRef
from flowers_job.tracking.credentials import store_client
from flowers_job.tracking.tags import TAG_TEST_SPLIT

__all__ = ["CHAMPION", "Promotion", "champion_accuracy_on", "promote"]

log = logging.getLogger(__name__)

CHAMPION = "champion"
"""The registry alias of the best version so far: ``models:/<name>@champion``."""


@dataclass
class Promotion:
    """The champion decision for one registered version.

    Attributes:
        promoted: the version now carries the ``champion`` alias.
        reason: why, in words.
        model_name / version: the new version.
        test_accuracy: its test accuracy.
        champion_version: the champion before this decision (None: there was none).
        champion_test_accuracy: the champion's accuracy on this run's test split.
        champion_scored: ``logged`` (same split digest, its logged number), ``rescored``
            (scored here on this run's test table) or ``none``.
        test_split_digest: the split both numbers are on.
    """

    promoted: bool
    reason: str
    model_name: str
    version: int
    test_accuracy: float
    champion_version: int | None
    champion_test_accuracy: float | None
    champion_scored: Literal["logged", "rescored", "none"]
    test_split_digest: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def champion_accuracy_on(
    spark: SparkSession,
    model_uri: str,
    test_table: TableRef,
    version: int,
    tracking_uri: str,
    split: str | None = None,
) -> float:
    """Accuracy of the model at ``model_uri`` (in the MLflow store ``tracking_uri``) on the
    Delta table ``test_table`` at Delta ``version`` (its rows of ``split`` when given, the
    ``images`` table's test split): scored on the executors
    (:func:`flowers_job.serving.batch_predict.score_images`), compared with the table's ``label`` column;
    an image the model cannot decode counts as wrong. ``spark`` may be a classic or a Spark
    Connect session (the model ships as a session artifact, the count is SQL).

    Raises:
        MlflowException: the model cannot be loaded.
    """
    from flowers_job.serving.batch_predict import score_images

    df = test_table.read(spark, version)
    if split is not None:
        df = df.where(df["split"] == split)
    scored = score_images(
        spark, model_uri, df.select("row_id", "label", "image"), tracking_uri=tracking_uri
    )
    # SQL, not pyspark.sql.functions: classic and Connect alike (score_udf._UDF_OUT says why);
    # a row without a prediction compares as null, which SUM skips: wrong
    row = scored.selectExpr(
        "count(1) AS n", "sum(CAST(predicted_label = label AS INT)) AS correct"
    ).first()
    assert row is not None
    return float(row["correct"] or 0) / max(1, int(row["n"]))


def _current_champion(client: mlflow.MlflowClient, name: str) -> Any | None:
    try:
        return client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST" or "not found" in str(exc).lower():
            return None
        raise


def promote(spark: SparkSession, cfg: JobConfig, summary: dict[str, Any]) -> Promotion | None:
    """Decide whether the version this run registered becomes the ``champion``; set the alias
    and log the decision to the run.

    Args:
        summary: the run's summary: ``registered_model_name``, ``registered_model_version``,
            ``mlflow_run_id``, ``test_accuracy`` and ``lineage`` (splits and
            ``test_split_digest``).

    Returns:
        The decision, or None when the model was not registered
        (``tracking.registered_model_name`` is None).

    Raises:
        MlflowException: the registry cannot be read or written, or the champion cannot be
            loaded for rescoring.
    """
    name, version = summary.get("registered_model_name"), summary.get("registered_model_version")
    if not name or version is None:
        return None
    version = int(version)
    ours = float(summary["test_accuracy"])
    digest = str(summary["lineage"]["test_split_digest"])
    with store_client(cfg.tracking_uri) as client:
        champion = _current_champion(client, name)
        theirs: float | None = None
        how: Literal["logged", "rescored", "none"] = "none"
        if champion is None:
            promoted, reason = True, "no champion yet"
        else:
            run = client.get_run(champion.run_id) if champion.run_id else None
            logged = run.data.metrics.get("test_accuracy") if run is not None else None
            if (
                run is not None
                and run.data.tags.get(TAG_TEST_SPLIT) == digest
                and logged is not None
            ):
                theirs, how = float(logged), "logged"
            else:
                test = summary["lineage"]["splits"]["test"]
                theirs = champion_accuracy_on(
                    spark,
                    f"models:/{name}/{champion.version}",
                    TableRef.from_lineage(test),
                    int(test["version"]),
                    cfg.tracking_uri,
                    test.get("split"),
                )
                how = "rescored"
            promoted = ours >= theirs
            reason = (
                f"test accuracy {ours:.4f} {'>=' if promoted else '<'} the champion's (version "
                f"{champion.version}) {theirs:.4f} on the same test split ({how})"
            )
        decision = Promotion(
            promoted=promoted,
            reason=reason,
            model_name=name,
            version=version,
            test_accuracy=ours,
            champion_version=int(champion.version) if champion is not None else None,
            champion_test_accuracy=theirs,
            champion_scored=how,
            test_split_digest=digest,
        )
        if promoted:
            client.set_registered_model_alias(name, CHAMPION, str(version))
        run_id = summary["mlflow_run_id"]
        client.log_dict(run_id, decision.to_dict(), "promotion.json")
        client.set_tag(run_id, "flowers_job.promoted", str(promoted).lower())
        client.set_tag(run_id, "flowers_job.driver.promotion", reason[:5000])
        if theirs is not None:
            client.log_metric(run_id, "champion_test_accuracy", theirs)
    log.info("%s version %d: %s", name, version, json.dumps(decision.to_dict()))
    return decision
