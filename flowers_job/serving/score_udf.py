"""Scoring on the executors: a registered model over a DataFrame of images, lazily.

:func:`score_images` maps a DataFrame with an ``image`` binary column to one with the
predicted label and the probabilities, one output row per input row; a row that does not
decode keeps a ``reason_code`` and ``reason`` and gets no prediction.

**Why a pandas UDF (``mapInPandas``) and not ``mlflow.pyfunc.spark_udf``.** ``spark_udf`` maps
a batch of inputs to a batch of ``predict`` outputs: the model either scores every row of a
batch or raises, and a raise fails the task and the job. The served model refuses a batch
with a bad image (the REST contract: a 400 naming the row), so a single corrupt photo would
fail the job, and a row cannot carry a reason next to a null prediction. Here the UDF calls
the pyfunc's own :meth:`~flowers_job.serving.pyfunc_model.FlowersClassifierModel.score`, which scores the
good rows and returns a rejection for each bad one, so the REST server and batch scoring
share one decode/transform/model path and differ only in what they do with a bad row. The
UDF loads the model once per Python worker (Spark reuses its Python workers across tasks),
runs it with as many torch threads as the task holds cores (:func:`task_threads`: 2 slots on 2
cores, 1 thread each, as the training ranks) and scores Arrow batches in the model's own
batches of ``batch_size``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pandas as pd
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T

from flowers_job.cluster.python_workers import prepare_worker
from flowers_job.serving.model_ref import ModelRef, resolve_model, ship_model

__all__ = ["OUTPUT_COLUMNS", "WORKER_LOADS", "score_images", "task_threads"]

OUTPUT_COLUMNS = (
    "predicted_label",
    "probability",
    "probabilities",
    "reason_code",
    "reason",
    "model_uri",
    "model_version",
    "scored_at",
)
"""Columns :func:`score_images` adds (see there for types)."""

_UDF_OUT = [
    T.StructField("predicted_label", T.StringType(), True),
    T.StructField("probability", T.DoubleType(), True),
    T.StructField("probabilities", T.MapType(T.StringType(), T.DoubleType()), True),
    T.StructField("reason_code", T.StringType(), True),
    T.StructField("reason", T.StringType(), True),
    T.StructField("model_uri", T.StringType(), True),
    T.StructField("model_version", T.LongType(), True),
    T.StructField("scored_at", T.TimestampType(), True),
]
"""What the UDF adds to the kept columns: :data:`OUTPUT_COLUMNS`, in that order, all computed in
the UDF (no ``pyspark.sql.functions`` on the driver: on a Connect session made by Connect's
own builder, which leaves ``SPARK_CONNECT_MODE_ENABLED`` unset, those build classic columns)."""


_WORKER_MODELS: dict[str, Any] = {}
"""SparkFiles folder name -> the loaded FlowersClassifierModel, once per Python worker. The
name is unique per shipment (``flowers_model_<version>_<random>``): two models, or one model
shipped to two Connect sessions, never share an entry."""
WORKER_LOADS: dict[str, int] = {}
"""SparkFiles folder name -> times this Python worker loaded it (1 while the cache holds)."""


def task_threads() -> int:
    """Torch intra-op threads for a scoring task: the cores it holds (``spark.task.cpus``,
    from the running task's context; 1 outside a task).

    An executor runs cores / ``spark.task.cpus`` tasks at once, each in its own Python
    worker; with more threads per worker than that, the workers' threads oversubscribe the
    cores (torch's default is every core of the host). Spark also sets ``OMP_NUM_THREADS``
    to the task's cores, unless ``spark.executorEnv.OMP_NUM_THREADS`` says otherwise; this
    does not depend on it.
    """
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return max(1, int(ctx.cpus())) if ctx is not None else 1


def _worker_model(name: str) -> Any:
    """The shipped model, loaded on the first call in this Python worker and reused by every
    later task the worker runs (``spark.python.worker.reuse``, on by default); torch's
    threads set to :func:`task_threads` where they differ (setting them again, even to the
    same number, slowed the next batches: docs/performance.md)."""
    import torch

    threads = task_threads()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    model = _WORKER_MODELS.get(name)
    if model is None:
        import mlflow
        from pyspark import SparkFiles

        with warnings.catch_warnings():  # MLflow's advice on type hints, once per worker
            warnings.simplefilter("ignore", UserWarning)
            model = mlflow.pyfunc.load_model(SparkFiles.get(name)).unwrap_python_model()
        _WORKER_MODELS[name] = model
        WORKER_LOADS[name] = WORKER_LOADS.get(name, 0) + 1
    return model


def _score_partitions(
    model_name: str, keep: list[str], ref: ModelRef
) -> Callable[[Iterable[pd.DataFrame]], Iterator[pd.DataFrame]]:
    """The ``mapInPandas`` function: ``keep`` columns passed on, plus ``_UDF_OUT`` (``ref``'s
    URI as given and its resolved version on every row).

    Rows that arrive with a ``reason_code`` (an entry ingest's decode refused) are not
    scored and keep their reason; every other row is scored or gets the model's rejection.
    """

    def score(batches: Iterable[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        prepare_worker()
        model = _worker_model(model_name)
        labels = list(model.label_names)
        for pdf in batches:
            n = len(pdf)
            refused = pdf["reason_code"].notna().to_numpy() if "reason_code" in pdf else None
            todo = [i for i in range(n) if refused is None or not refused[i]]
            result = model.score([pdf["image"].iat[i] for i in todo])
            out = pdf[keep].copy()
            probs: list[dict[str, float] | None] = [None] * n
            label: list[str | None] = [None] * n
            top: list[float | None] = [None] * n
            code = list(pdf["reason_code"]) if refused is not None else [None] * n
            reason = list(pdf["reason"]) if refused is not None else [None] * n
            for j, i in enumerate(todo):
                rejected = result.rejections[j]
                if rejected is not None:
                    code[i], reason[i] = rejected.code, rejected.message
                    continue
                p = result.probabilities[j]
                k = int(p.argmax())
                probs[i] = dict(zip(labels, p.tolist(), strict=True))
                label[i], top[i] = labels[k], float(p[k])
            out["predicted_label"], out["probability"], out["probabilities"] = label, top, probs
            out["reason_code"], out["reason"] = code, reason
            out["model_uri"], out["model_version"] = ref.uri, ref.version
            out["scored_at"] = pd.Timestamp.now(tz="UTC")
            yield out

    return score


def score_images(
    spark: SparkSession,
    model: ModelRef | str,
    df: DataFrame,
    *,
    tracking_uri: str | None = None,
    num_partitions: int | None = None,
) -> DataFrame:
    """Score a DataFrame with an ``image`` binary column, lazily, on the executors.

    Nothing is computed until an action; only the model's resolution and download happen
    now, on the driver (:mod:`flowers_job.serving.model_ref` says how the folder is shipped).

    Args:
        spark: the session whose executors score.
        model: a :class:`ModelRef` or ``models:/<name>/<version>`` / ``models:/<name>@<alias>``.
        df: any columns plus ``image`` (binary: file bytes, any format Pillow reads; null
            counts as an empty file). Optional ``reason_code``/``reason`` string columns: rows
            with a reason are not scored and keep it.
        tracking_uri: the MLflow store for a ``model`` given as a string (default: MLflow's
            current tracking URI).
        num_partitions: repartition ``df`` into this many partitions first (scoring runs one
            task per partition; None keeps ``df``'s partitioning).

    Returns:
        ``df`` without ``image`` plus :data:`OUTPUT_COLUMNS`: ``predicted_label`` string,
        ``probability`` double (of the predicted label), ``probabilities``
        ``map<string, double>`` (label -> probability, summing to 1), ``reason_code`` and
        ``reason`` strings (ingest's codes: ``empty_file``, ``not_an_image``, ``corrupt``,
        ``too_many_pixels``, ``decode_error``, or the input's own), ``model_uri`` string,
        ``model_version`` long, ``scored_at`` timestamp (when the row's batch was scored, UTC).
        One output row per input row; a row with a reason has null predictions.

    Raises:
        UsageError, PredictError: as :func:`resolve_model`.
        ValueError: ``df`` has no binary ``image`` column, or already has an output column.

    Classic Spark and Spark Connect alike: the model ships as a session artifact
    (:func:`~flowers_job.serving.model_ref.ship_model`) and scoring is a ``mapInPandas``.
    """
    import mlflow

    types = dict(df.dtypes)
    if types.get("image") != "binary":
        raise ValueError(f"score_images needs a binary 'image' column; the columns are {types}")
    taken = sorted(set(OUTPUT_COLUMNS) - {"reason_code", "reason"} & set(types))
    if taken:
        raise ValueError(f"score_images: the input already has the output column(s) {taken}")
    ref = (
        model
        if isinstance(model, ModelRef)
        else resolve_model(model, tracking_uri or mlflow.get_tracking_uri())
    )
    shipped = ship_model(spark, ref)
    keep = [c for c in df.columns if c not in ("image", "reason_code", "reason")]
    fields = [df.schema[c] for c in keep]
    if num_partitions is not None:
        df = df.repartition(num_partitions)
    return df.mapInPandas(
        _score_partitions(shipped.name, keep, ref), schema=T.StructType(fields + _UDF_OUT)
    )
