"""Prepare (driver side) a head trained on embeddings (``embeddings.enabled``): bring the
``embeddings`` table in step with ``images`` at the checked version, then plan the train
split's views and the validation split's evaluation crop from it, for the Delta loader's
ranks to read as features. The test split stays the ``images`` table's photos, scored by
the whole model as the served model sees them (:mod:`flowers_job.driver.prepare`)."""

from __future__ import annotations

import uuid
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from pyspark.sql import functions as F

from flowers_job.errors import DataError
from flowers_job.ingest.embeddings import update_embeddings
from flowers_job.tables.table_ref import TableRef, table_ref
from flowers_job.vision.views import EmbeddingSpec, weights_file, weights_id

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from flowers_job.config import JobConfig
    from flowers_job.loaders.base import Loader, ShardPlan

__all__ = ["embedding_plans", "embedding_spec"]

EVAL_VIEW = "centre"
"""The view validation reads: the evaluation crop, what the served model sees."""


def embedding_spec(cfg: JobConfig) -> EmbeddingSpec:
    """The backbone, weights, transform and views ``cfg`` embeds with.

    Raises:
        ValueError: weights neither the package's nor a file (the config refuses those).
        OSError: the weights file cannot be read.
    """
    model = cfg.model
    weights = model.resolved_weights
    path = weights_file(
        model.architecture, weights, str(model.weights_path) if model.weights_path else None
    )
    return EmbeddingSpec(
        architecture=model.architecture,
        weights=weights,
        weights_path=str(model.weights_path) if model.weights_path else None,
        weights_id=weights_id(path),
        image_size=cfg.data.image_size,
        resize_size=cfg.data.stored_short_side,
        views=cfg.embeddings.view_names,
    )


def _counts(
    spark: SparkSession, table: TableRef, version: int, model_key: str
) -> dict[tuple[str, str], tuple[int, int]]:
    """(split, view) -> (rows, exact ``row_id`` sum) of ``model_key`` at ``version``: one
    aggregation over the partition columns and ``row_id``."""
    rows = (
        table.read(spark, version)
        .where(F.col("model_key") == model_key)
        .groupBy("split", "view")
        .agg(
            F.count(F.lit(1)).alias("rows"),
            F.sum(F.col("row_id").cast("decimal(38,0)")).alias("row_id_sum"),
        )
        .collect()
    )
    return {(r["split"], r["view"]): (int(r["rows"]), int(r["row_id_sum"] or 0)) for r in rows}


def embedding_plans(
    spark: SparkSession,
    cfg: JobConfig,
    writer: Loader,
    version: int,
    split_rows: dict[str, int],
) -> tuple[dict[str, ShardPlan], dict[str, Any]]:
    """Update the ``embeddings`` table for ``images`` at ``version`` and plan ``train`` (its
    photos' configured views) and ``val`` (:data:`EVAL_VIEW`) from it.

    Args:
        writer: the Delta loader (:meth:`~flowers_job.loaders.delta.table_loader.DeltaLoader.plan_table`).
        split_rows: each split's photos in ``images`` at ``version`` (the table check's).

    Returns:
        The two plans, and what the update did (:class:`~flowers_job.ingest.embeddings.EmbeddingCounts`
        as a dict, with the ``model_key``, the ``views`` and the table's ``version``).

    Raises:
        DataError: a photo of ``images`` has no embedding of a view after the update (the
            table was changed by another writer), or as :func:`update_embeddings`.
    """
    spec = embedding_spec(cfg)
    table = table_ref(cfg, "embeddings")
    counts = update_embeddings(
        spark, table_ref(cfg, "images"), version, table, spec, f"embed-{uuid.uuid4().hex}"
    )
    assert counts.version is not None
    rows = _counts(spark, table, counts.version, spec.model_key)
    location = str(table.detail(spark)["location"])
    plans = {}
    for split, views in (("train", list(spec.views)), ("val", [EVAL_VIEW])):
        for view in views:
            found = rows.get((split, view), (0, 0))[0]
            if found != split_rows[split]:
                raise DataError(
                    f"embeddings: {found} rows of the {split} split's {view} view under "
                    f"{spec.model_key} at version {counts.version} of {table}, "
                    f"{split_rows[split]} photos in images at version {version}"
                )
        plans[split] = writer.plan_table(
            sum(rows[(split, v)][0] for v in views),
            sum(rows[(split, v)][1] for v in views),
            location,
            counts.version,
            split,
            model_key=spec.model_key,
            views=views,
        )
    record = {**asdict(counts), "model_key": spec.model_key, "views": list(spec.views)}
    return plans, record
