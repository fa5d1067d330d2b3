"""Batch scoring (driver side): a registered model over photos or a Delta table -> Delta table.

``flowers-job predict`` scores every input row on the executors and writes one output row per
input row, with the predicted label and the probabilities, or, for an input that does not
decode, a ``reason_code`` and ``reason`` (the codes of ingest's quarantine) and no
prediction: nothing is dropped. Only counts reach the driver.

**Why a pandas UDF (``mapInPandas``) and not ``mlflow.pyfunc.spark_udf``.** ``spark_udf`` maps
a batch of inputs to a batch of ``predict`` outputs: the model either scores every row of a
batch or raises, and a raise fails the task and the job. The served model refuses a batch
with a bad image (the REST contract: a 400 naming the row), so a single corrupt photo would
fail the job, and a row cannot carry a reason next to a null prediction. Here the UDF calls
the pyfunc's own :meth:`~flowers_job.serving.FlowersClassifierModel.score`, which scores the
good rows and returns a rejection for each bad one, so the REST server and batch scoring
share one decode/transform/model path and differ only in what they do with a bad row. The
UDF loads the model once per Python worker (Spark reuses its Python workers across tasks) and
scores Arrow batches in the model's own batches of ``batch_size``.

**How executors get the model.** The driver resolves the URI against the registry once
(``models:/name/version`` or ``models:/name@alias`` -> a version), downloads that version's
artifacts and ships the folder with ``SparkContext.addFile``; each executor reads it from
its ``SparkFiles`` directory. Executors on other hosts therefore need neither the registry
nor its credentials (the default registry is a sqlite file on the driver's disk), a moved
alias cannot change the model mid-job, and the registry is read once, not once per worker.
``spark_udf`` ships models the same way; what it cannot do is the per-row rejection above.

**Idempotence.** The output table's Delta commit carries, in its ``userMetadata`` (as ingest
does), a fingerprint of the input (for ``--images``: the listing's paths, sizes and
modification times and the decode settings; for ``--table``: the input table's path, id and
Delta version) and of the model (URI as given, name, resolved version). Running again with
the same input and model version writes no new Delta version.

**Probabilities as a map**, ``map<string, double>`` from label name to probability, not a
column per class: the schema stays the same for every model whatever its labels (a new model
version with another label set does not change the table's columns, and label names need no
escaping into column names); ``probabilities['roses']`` reads as easily in SQL.

Progress: a tqdm bar on the driver counts the Spark tasks of the scoring job, read from
Spark's ``StatusTracker``; the report ends with the count per predicted label and per reason.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from flowers_job.config import DataConfig

__all__ = [
    "OUTPUT_COLUMNS",
    "PREDICT_FORMAT_VERSION",
    "ModelRef",
    "PredictError",
    "PredictReport",
    "UsageError",
    "default_model",
    "predict",
    "resolve_model",
    "score_images",
]

log = logging.getLogger(__name__)

PREDICT_FORMAT_VERSION = 1
"""Bump when the output table's layout or the scoring changes: forces a rewrite."""
ROWS_PER_PARTITION = 128
"""Scoring tasks get about this many rows each (a few seconds of CPU; the progress bar's step)."""
FAIL_FAST_SECONDS = 10
"""Per-request timeout of the registry lookup and the model download, seconds (one retry)."""
PROGRESS_POLL_SECONDS = 0.5
"""How often the progress bar reads Spark's StatusTracker, seconds."""
PROGRESS_JOIN_SECONDS = 5.0
"""Longest wait for the progress thread to stop once scoring is done, seconds."""
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

_MODEL_URI = re.compile(r"models:/(?P<name>[^/@]+)(?:/(?P<version>\d+)|@(?P<alias>[^/@]+))")
_UDF_OUT = [
    T.StructField("_probs", T.ArrayType(T.DoubleType()), True),
    T.StructField("predicted_label", T.StringType(), True),
    T.StructField("probability", T.DoubleType(), True),
    T.StructField("reason_code", T.StringType(), True),
    T.StructField("reason", T.StringType(), True),
    T.StructField("scored_at", T.TimestampType(), True),
]


class PredictError(RuntimeError):
    """Scoring cannot start: unknown model, version or alias, missing input (CLI exit 1)."""


class UsageError(PredictError):
    """The command line is wrong: a malformed model URI, no model to use (CLI exit 2)."""


@dataclass(frozen=True)
class ModelRef:
    """A registered model version, resolved on the driver.

    Attributes:
        uri: the URI as the user gave it (``models:/name/3`` or ``models:/name@champion``).
        name: registered model name.
        version: the version the URI resolved to (an alias resolved once, before scoring).
        tracking_uri: the MLflow store (tracking and registry) it was resolved in.
    """

    uri: str
    name: str
    version: int
    tracking_uri: str

    @property
    def version_uri(self) -> str:
        """``models:/name/version``: the exact version, whatever an alias says later."""
        return f"models:/{self.name}/{self.version}"


@dataclass(frozen=True)
class PredictReport:
    """What ``predict`` scored and wrote.

    Attributes:
        output_table: path of the output Delta table.
        input: the images root or the input table.
        input_rows: entries listed under the images root, or rows of the input table.
        output_rows: rows of the output table (equal to ``input_rows``: nothing is dropped).
        written: False when the table already held this input scored by this model version
            (idempotent re-run: no new Delta version).
        delta_version: the output table's latest Delta version.
        model_uri, model_name, model_version: the model as given and as resolved.
        label_counts: output rows per predicted label (rejected rows are not counted here).
        reason_counts: output rows per ``reason_code`` (rows without a prediction).
        seconds: wall time of the scoring job (decode, score, write), seconds; 0 if not written.
        images_per_second: ``input_rows / seconds``; 0 if not written.
        fingerprint: hash of the input and the model in the table's commit metadata.
    """

    output_table: str
    input: str
    input_rows: int
    output_rows: int
    written: bool
    delta_version: int
    model_uri: str
    model_name: str
    model_version: int
    label_counts: dict[str, int] = field(default_factory=dict)
    reason_counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    images_per_second: float = 0.0
    fingerprint: str = ""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


# ---------------------------------------------------------------- the model, on the driver


@contextmanager
def _no_download_bar() -> Iterator[None]:
    """MLflow's per-file download bar off within the block (predict has its own bar)."""
    from mlflow import environment_variables as mlflow_env

    bar = mlflow_env.MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR
    raw = bar.get_raw()
    bar.set(False)
    try:
        yield
    finally:
        if raw is None:
            bar.unset()
        else:
            bar.set(raw)


def default_model(output_dir: Path) -> tuple[str, str | None]:
    """The model the last ``run``/``train`` in ``output_dir`` registered.

    Returns:
        ``(models:/<name>/<version>, tracking_uri)`` from ``output_dir/summary.json``
        (``registered_model_name``, ``registered_model_version``, ``mlflow_tracking_uri``;
        the URI is None when the summary has none).

    Raises:
        PredictError: no readable summary.json, or it names no registered model version.
    """
    path = output_dir / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        raise PredictError(
            f"no --model given and no {path}: run flowers-job run/train with this "
            "--output-dir first, or give --model models:/<name>/<version>"
        ) from None
    except (OSError, ValueError) as exc:
        raise PredictError(f"cannot read {path}: {exc}") from None
    name, version = summary.get("registered_model_name"), summary.get("registered_model_version")
    if not name or version is None:
        raise PredictError(
            f"{path} names no registered model version (registered_model_name={name!r}, "
            f"registered_model_version={version!r}); give --model models:/<name>/<version>"
        )
    uri = summary.get("mlflow_tracking_uri")
    return f"models:/{name}/{int(version)}", str(uri) if uri else None


def resolve_model(model_uri: str, tracking_uri: str) -> ModelRef:
    """Resolve ``models:/<name>/<version>`` or ``models:/<name>@<alias>`` in the registry.

    One registry lookup, with MLflow's HTTP client held to one retry and
    :data:`FAIL_FAST_SECONDS` per request.

    Raises:
        UsageError: ``model_uri`` is not of either form.
        PredictError: the store cannot be read, or has no such model, version or alias (the
            message lists the versions and aliases it has).
    """
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from flowers_job.tracking import _fail_fast

    m = _MODEL_URI.fullmatch(model_uri)
    if m is None:
        raise UsageError(
            f"--model {model_uri!r}: expected models:/<name>/<version> or models:/<name>@<alias>"
        )
    name, alias = m["name"], m["alias"]
    try:
        with _fail_fast(FAIL_FAST_SECONDS):
            client = MlflowClient(tracking_uri=tracking_uri)
            try:
                mv = (
                    client.get_model_version_by_alias(name, alias)
                    if alias
                    else client.get_model_version(name, m["version"])
                )
            except MlflowException as exc:
                # a missing version: RESOURCE_DOES_NOT_EXIST; a missing alias (sqlite store,
                # MLflow 3): INVALID_PARAMETER_VALUE
                if exc.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                    raise
                raise PredictError(
                    f"--model {model_uri}: {_what_exists(client, name)} in the MLflow store "
                    f"{tracking_uri}"
                ) from None
    except PredictError:
        raise
    except Exception as exc:
        raise PredictError(
            f"--model {model_uri}: the MLflow store {tracking_uri} cannot be read: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return ModelRef(model_uri, name, int(mv.version), tracking_uri)


def _what_exists(client: Any, name: str) -> str:
    """``"registered model 'x' has versions [1, 2] and aliases ['champion']"``, or that
    there is no such model (with the names there are)."""
    from mlflow.exceptions import MlflowException

    try:
        model = client.get_registered_model(name)
    except MlflowException:
        names = sorted(m.name for m in client.search_registered_models(max_results=20))
        return f"no registered model named {name!r} (registered: {names})"
    versions = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
    aliases = sorted(model.aliases or {})
    return f"registered model {name!r} has versions {versions} and aliases {aliases}, not this one"


@dataclass(frozen=True)
class _Shipped:
    """A model version downloaded on the driver and added to the SparkContext's files."""

    name: str  # the folder's name in SparkFiles
    label_names: list[str]
    model_config: dict[str, Any]


_SHIPPED: dict[tuple[str, str, str], _Shipped] = {}
"""(Spark application id, tracking URI, models:/name/version) -> the folder already shipped."""


def _ship_model(spark: SparkSession, ref: ModelRef) -> _Shipped:
    """Download ``ref``'s artifacts once per driver process and ``addFile`` the folder."""
    import mlflow
    from mlflow.models import Model

    from flowers_job.tracking import _fail_fast

    key = (spark.sparkContext.applicationId, ref.tracking_uri, ref.version_uri)
    shipped = _SHIPPED.get(key)
    if shipped is not None:
        return shipped
    parent = tempfile.mkdtemp(prefix="flowers-model-")
    atexit.register(shutil.rmtree, parent, True)
    name = f"flowers_model_{ref.version}_{uuid.uuid4().hex[:8]}"
    client = mlflow.MlflowClient(tracking_uri=ref.tracking_uri)
    source = client.get_model_version_download_uri(ref.name, str(ref.version))
    with _fail_fast(FAIL_FAST_SECONDS), _no_download_bar():
        local = mlflow.artifacts.download_artifacts(
            artifact_uri=source,
            dst_path=os.path.join(parent, "download"),
            tracking_uri=ref.tracking_uri,
        )
    folder = os.path.join(parent, name)
    os.rename(local, folder)
    flavor = Model.load(folder).flavors["python_function"]
    conf = flavor.get("config") or flavor.get("model_config") or {}
    spark.sparkContext.addFile(folder, recursive=True)
    shipped = _Shipped(name, [str(x) for x in conf["label_names"]], dict(conf))
    _SHIPPED[key] = shipped
    return shipped


# ---------------------------------------------------------------- scoring, on the executors

_WORKER_MODELS: dict[str, Any] = {}
"""SparkFiles folder name -> the loaded FlowersClassifierModel, once per Python worker."""


def _worker_model(name: str) -> Any:
    """The shipped model, loaded on the first call in this Python worker."""
    model = _WORKER_MODELS.get(name)
    if model is None:
        import mlflow
        from pyspark import SparkFiles

        with warnings.catch_warnings():  # MLflow's advice on type hints, once per worker
            warnings.simplefilter("ignore", UserWarning)
            model = mlflow.pyfunc.load_model(SparkFiles.get(name)).unwrap_python_model()
        _WORKER_MODELS[name] = model
    return model


def _score_partitions(
    model_name: str, keep: list[str]
) -> Callable[[Iterable[pd.DataFrame]], Iterator[pd.DataFrame]]:
    """The ``mapInPandas`` function: ``keep`` columns passed on, plus ``_UDF_OUT``.

    Rows that arrive with a ``reason_code`` (an entry ingest's decode refused) are not
    scored and keep their reason; every other row is scored or gets the model's rejection.
    """

    def score(batches: Iterable[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        model = _worker_model(model_name)
        labels = list(model.label_names)
        for pdf in batches:
            n = len(pdf)
            refused = pdf["reason_code"].notna().to_numpy() if "reason_code" in pdf else None
            todo = [i for i in range(n) if refused is None or not refused[i]]
            result = model.score([pdf["image"].iat[i] for i in todo])
            out = pdf[keep].copy()
            probs: list[list[float] | None] = [None] * n
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
                probs[i], label[i], top[i] = p.tolist(), labels[k], float(p[k])
            out["_probs"], out["predicted_label"], out["probability"] = probs, label, top
            out["reason_code"], out["reason"] = code, reason
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
    now, on the driver (:mod:`flowers_job.predict` says why the folder is shipped).

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
    shipped = _ship_model(spark, ref)
    keep = [c for c in df.columns if c not in ("image", "reason_code", "reason")]
    fields = [df.schema[c] for c in keep]
    if num_partitions is not None:
        df = df.repartition(num_partitions)
    scored = df.mapInPandas(
        _score_partitions(shipped.name, keep), schema=T.StructType(fields + _UDF_OUT)
    )
    labels = F.array(*(F.lit(x) for x in shipped.label_names))
    return scored.select(
        *keep,
        "predicted_label",
        "probability",
        F.when(F.col("_probs").isNotNull(), F.map_from_arrays(labels, F.col("_probs"))).alias(
            "probabilities"
        ),
        "reason_code",
        "reason",
        F.lit(ref.uri).alias("model_uri"),
        F.lit(ref.version).cast("long").alias("model_version"),
        "scored_at",
    )


# ---------------------------------------------------------------- predict, on the driver


def check_input(images: Path | None, table: Path | None) -> None:
    """Fail before Spark starts when the input is missing.

    Raises:
        UsageError: neither or both of ``images`` and ``table``.
        PredictError: ``images`` is not a directory, or ``table`` has no Delta log.
    """
    if (images is None) == (table is None):
        raise UsageError("give exactly one of --images DIR and --table PATH")
    if images is not None and not images.is_dir():
        raise PredictError(f"--images {images}: not a directory")
    if table is not None and not (table / "_delta_log").is_dir():
        raise PredictError(f"--table {table}: not a Delta table (no {table / '_delta_log'})")


def _partitions(spark: SparkSession, rows: int) -> int:
    return max(2 * spark.sparkContext.defaultParallelism, math.ceil(rows / ROWS_PER_PARTITION))


def _image_rows(
    spark: SparkSession, images: Path, data: DataConfig, shipped: _Shipped
) -> tuple[DataFrame, DataFrame, int, dict[str, object]]:
    """The photos under ``images`` listed and decoded as ingest does, one row per entry.

    Returns:
        ``(rows, listing, entries, input fingerprint)``: ``rows`` has ``path, relative_path,
        [label], content_sha256, reason_code, reason, image`` (the image normalised to the
        model's ``resize_size`` short side, as ingest stores training photos); ``listing``
        is persisted and must be unpersisted by the caller.
    """
    from flowers_job.data.ingest import (
        _DECODED,
        _decode_partitions,
        _fingerprint,
        _list_files,
        _summarise_listing,
    )
    from flowers_job.data.listing import label_folders

    root = os.path.realpath(images)
    labels, others = label_folders(root)
    listing = (
        _list_files(spark, root, labels, labels + others)
        # a file directly in the root is a photo without a label here, not a misplaced one
        .withColumn(
            "reason",
            F.when(F.col("reason_code") == "not_in_label_folder", None).otherwise(F.col("reason")),
        )
        .withColumn(
            "reason_code",
            F.when(F.col("reason_code") == "not_in_label_folder", None).otherwise(
                F.col("reason_code")
            ),
        )
        .persist(StorageLevel.DISK_ONLY)
    )
    short_side = int(shipped.model_config["resize_size"])
    max_pixels = int(shipped.model_config["max_pixels"])
    settings = {
        "input": "images",
        "root": root,
        "short_side": short_side,
        "jpeg_quality": data.jpeg_quality,
        "max_image_pixels": max_pixels,
        "extensions": sorted(e.lower() for e in data.extensions),
    }
    groups = _summarise_listing(listing)
    entries = sum(int(g["n"]) for g in groups)
    decode = _decode_partitions(
        root, short_side, data.jpeg_quality, max_pixels, tuple(data.extensions)
    )
    columns = ["path", "relative_path", *(["label"] if labels else []), "content_sha256"]
    rows = (
        listing.select("relative_path", "label", "num_bytes", "reason_code", "reason")
        .repartition(_partitions(spark, entries), "relative_path")
        .mapInPandas(decode, schema=_DECODED)
        .select(*columns, "reason_code", "reason", "image")
    )
    return rows, listing, entries, {"listing": _fingerprint(groups, settings)}


def _table_rows(spark: SparkSession, table: Path) -> tuple[DataFrame, int, dict[str, object]]:
    """The input Delta table's ``row_id, [path], [label], image`` and its fingerprint.

    Raises:
        PredictError: no ``row_id`` or binary ``image`` column.
    """
    from delta.tables import DeltaTable

    delta = DeltaTable.forPath(spark, str(table))
    last = delta.history(1).select("version").first()
    detail = delta.detail().select("id").first()
    df = delta.toDF()
    types = dict(df.dtypes)
    if types.get("image") != "binary" or "row_id" not in types:
        raise PredictError(
            f"--table {table}: needs a row_id column and a binary image column "
            f"(the tables under <output-dir>/tables have them); its columns are {types}"
        )
    columns = ["row_id", *(c for c in ("path", "label") if c in types), "image"]
    rows = int(df.count())
    meta = {
        "input": "table",
        "path": os.path.realpath(table),
        "table_id": detail["id"] if detail else None,
        "version": int(last["version"]) if last else None,
    }
    return df.select(*columns), rows, meta


@contextmanager
def _progress(spark: SparkSession, description: str) -> Iterator[None]:
    """A tqdm bar of the Spark tasks of the jobs run in the block (StatusTracker, polled
    every :data:`PROGRESS_POLL_SECONDS`); the thread is stopped within
    :data:`PROGRESS_JOIN_SECONDS` when the block ends."""
    from tqdm import tqdm

    sc = spark.sparkContext
    group = f"flowers-predict-{uuid.uuid4().hex[:8]}"
    properties = ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel")
    before = {key: sc.getLocalProperty(key) for key in properties}
    sc.setJobGroup(group, description)
    tracker = sc.statusTracker()
    done = threading.Event()

    def counts() -> tuple[int, int]:
        total = completed = 0
        for job_id in tracker.getJobIdsForGroup(group):
            job = tracker.getJobInfo(job_id)
            for stage_id in job.stageIds if job else []:
                stage = tracker.getStageInfo(stage_id)
                if stage is not None:
                    total += stage.numTasks
                    # a stage skipped (its shuffle output reused) never completes a task
                    done_job = job is not None and job.status == "SUCCEEDED"
                    completed += stage.numTasks if done_job else stage.numCompletedTasks
        return total, completed

    def poll(bar: Any) -> None:
        while not done.wait(PROGRESS_POLL_SECONDS):
            total, completed = counts()
            bar.total = max(total, 1)
            bar.update(completed - bar.n)

    with tqdm(desc=description, unit="task", total=1, dynamic_ncols=True) as bar:
        thread = threading.Thread(target=poll, args=(bar,), name=group, daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join(PROGRESS_JOIN_SECONDS)
            for key, value in before.items():  # None removes the property
                sc.setLocalProperty(key, value)  # type: ignore[arg-type]
            total, completed = counts()
            bar.total = max(total, 1)
            bar.update(completed - bar.n)


def _counts(spark: SparkSession, path: Path) -> tuple[int, dict[str, int], dict[str, int]]:
    """Rows, rows per predicted label, rows per reason of the output table (a few rows)."""
    stats = (
        spark.read.format("delta")
        .load(str(path))
        .groupBy("predicted_label", "reason_code")
        .count()
        .collect()
    )
    labels: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for r in stats:
        if r["predicted_label"] is not None:
            labels[r["predicted_label"]] = labels.get(r["predicted_label"], 0) + int(r["count"])
        if r["reason_code"] is not None:
            reasons[r["reason_code"]] = reasons.get(r["reason_code"], 0) + int(r["count"])
    return sum(int(r["count"]) for r in stats), dict(sorted(labels.items())), reasons


def predict(
    spark: SparkSession,
    model: ModelRef,
    output_table: Path,
    *,
    images: Path | None = None,
    table: Path | None = None,
    data: DataConfig | None = None,
) -> PredictReport:
    """Score every photo under ``images`` (or row of the Delta ``table``) into ``output_table``.

    Args:
        spark: the session.
        model: the resolved model (:func:`resolve_model`).
        output_table: the output Delta table's path (overwritten when the input or the model
            version changed; left alone otherwise).
        images: a folder of photos: ``<images>/<label>/<file>`` (the label is kept) or files
            directly in it (no label); listed and decoded exactly as ingest does.
        table: a Delta table with ``row_id`` and binary ``image`` (``path`` and ``label`` are
            kept when present), e.g. ``<output-dir>/tables/images``.
        data: ``jpeg_quality`` and ``extensions`` of the decode (default: the config's
            defaults); the stored short side and pixel limit are the model's own.

    Returns:
        A :class:`PredictReport`: counts, whether a new Delta version was written, wall time
        (seconds) and throughput (images/s) of the scoring job.

    Raises:
        UsageError, PredictError: as :func:`check_input`, or a ``table`` without the columns.
    """
    from flowers_job.data.ingest import _write, read_table_metadata

    check_input(images, table)
    data = data or DataConfig()
    shipped = _ship_model(spark, model)
    listing: DataFrame | None = None
    try:
        if images is not None:
            rows, listing, input_rows, source = _image_rows(spark, images, data, shipped)
            partitions = None  # already partitioned by the decode
        else:
            assert table is not None
            rows, input_rows, source = _table_rows(spark, table)
            partitions = _partitions(spark, input_rows)
        model_key = {"uri": model.uri, "name": model.name, "version": model.version}
        text = json.dumps(
            {"format": PREDICT_FORMAT_VERSION, "input": source, "model": model_key},
            sort_keys=True,
        )
        fingerprint = hashlib.sha256(text.encode()).hexdigest()
        previous = read_table_metadata(spark, output_table) or {}
        written = previous.get("fingerprint") != fingerprint
        seconds = 0.0
        if written:
            scored = score_images(spark, model, rows, num_partitions=partitions)
            meta: dict[str, object] = {
                "fingerprint": fingerprint,
                "run_id": uuid.uuid4().hex,
                "kind": "predictions",
                "input": source,
                "model": model_key,
            }
            t0 = time.perf_counter()
            with _progress(spark, f"scoring {input_rows} rows with {model.version_uri}"):
                _write(spark, scored, output_table, meta)
            seconds = time.perf_counter() - t0
        else:
            log.info("%s already holds this input scored by %s", output_table, model.version_uri)
    finally:
        if listing is not None:
            listing.unpersist()
    from delta.tables import DeltaTable

    last = DeltaTable.forPath(spark, str(output_table)).history(1).select("version").first()
    output_rows, label_counts, reason_counts = _counts(spark, output_table)
    return PredictReport(
        output_table=str(output_table),
        input=str(images if images is not None else table),
        input_rows=input_rows,
        output_rows=output_rows,
        written=written,
        delta_version=int(last["version"]) if last else -1,
        model_uri=model.uri,
        model_name=model.name,
        model_version=model.version,
        label_counts=label_counts,
        reason_counts=reason_counts,
        seconds=seconds,
        images_per_second=input_rows / seconds if seconds > 0 else 0.0,
        fingerprint=fingerprint,
    )
