"""Batch scoring (driver side): a registered model over photos or a Delta table -> Delta table.

``flowers-job predict`` scores every input row on the executors and writes one output row per
input row, with the predicted label and the probabilities, or, for an input that does not
decode, a ``reason_code`` and ``reason`` (the codes of ingest's quarantine) and no
prediction: nothing is dropped. Only counts reach the driver.

Scoring itself is :func:`flowers_job.serving.score_udf.score_images` (a pandas UDF; that module says
why not ``mlflow.pyfunc.spark_udf``).

**How executors get the model**: resolved once on the driver and its files shipped as one
zip with ``SparkSession.addArtifacts(..., archive=True)``, classic Spark and Spark Connect
alike (:mod:`flowers_job.serving.model_ref`); ``spark_udf`` ships models as an archive too; what
it cannot do is the per-row rejection above.

**Idempotence.** The output table's Delta commit carries, in its ``userMetadata`` (as ingest
does), a fingerprint of the input (for ``--images``: the listing's paths, sizes and
modification times and the decode settings; for ``--table``: the input table's path, id and
Delta version) and of the model (URI as given, name, resolved version). Running again with
the same input and model version writes no new Delta version.

**Probabilities as a map**, ``map<string, double>`` from label name to probability, not a
column per class: the schema stays the same for every model whatever its labels (a new model
version with another label set does not change the table's columns, and label names need no
escaping into column names); ``probabilities['roses']`` reads as easily in SQL.

Progress: a tqdm bar on the driver counts the Spark tasks of the scoring job
(:func:`flowers_job.cluster.progress.task_progress`); the report ends with the count per
predicted label and per reason.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession

from flowers_job.cluster.progress import task_progress
from flowers_job.cluster.slots import task_slots
from flowers_job.config import DataConfig
from flowers_job.config.secrets import redact_uri, split_userinfo
from flowers_job.location import Location
from flowers_job.photos.files import (
    DECODED_SCHEMA,
    decode_partitions,
    digest,
    hash_sums,
    list_files,
    listing_key,
)
from flowers_job.photos.listing import label_folders
from flowers_job.serving.model_ref import (
    ModelRef,
    PredictError,
    Shipped,
    UsageError,
    default_model,
    resolve_model,
    ship_model,
)
from flowers_job.serving.score_udf import OUTPUT_COLUMNS, score_images
from flowers_job.tables.delta_tables import (
    is_ingest_metadata,
    read_table_metadata,
    write_table,
)
from flowers_job.tables.table_ref import TableRef
from flowers_job.vision.limits import ImageLimits

__all__ = [
    "OUTPUT_COLUMNS",
    "PREDICT_FORMAT_VERSION",
    "ROWS_PER_PARTITION",
    "ModelRef",
    "PredictError",
    "PredictReport",
    "UsageError",
    "check_input",
    "check_output_table",
    "default_model",
    "predict",
    "predict_tracking_uri",
    "resolve_model",
    "score_images",
    "scoring_partitions",
]

log = logging.getLogger(__name__)

PREDICT_FORMAT_VERSION = 1
"""Bump when the output table's layout or the scoring changes: forces a rewrite."""
ROWS_PER_PARTITION = 512
"""Scoring tasks get at least about this many rows each (about 10 s of one core at 224 px).

A task costs about 0.6 s beyond its rows (the Python worker's round trip, the shuffle
block's fetch, the first batch): fewer, larger tasks scored the photos faster
(docs/performance.md)."""


def predict_tracking_uri(
    configured: str | None,
    default_store: str,
    summary_uri: str | None,
    *,
    from_output: bool = False,
    environ: Mapping[str, str] = os.environ,
) -> str:
    """The MLflow store ``predict`` resolves the model in.

    In order: ``tracking.tracking_uri`` (``configured``), the environment's
    ``MLFLOW_TRACKING_URI``, with ``from_output`` (``--tracking-uri-from-output``) the
    ``mlflow_tracking_uri`` of the output folder's summary.json (``summary_uri``), else
    ``default_store`` (the sqlite store under ``--output-dir``). Without the flag a
    summary.json never chooses the server: whoever can write that folder could otherwise
    send the configured credentials (MLFLOW_TRACKING_USERNAME/PASSWORD) to a host of theirs.
    A summary's URI is taken without its user info (:func:`flowers_job.config.secrets.split_userinfo`).
    """
    if configured:
        return configured
    if environ.get("MLFLOW_TRACKING_URI"):
        return environ["MLFLOW_TRACKING_URI"]
    if from_output and summary_uri:
        return split_userinfo(summary_uri)[0]
    if summary_uri and summary_uri != default_store:
        log.warning(
            "summary.json names the MLflow store %s, not used without "
            "--tracking-uri-from-output: using %s",
            redact_uri(summary_uri),
            default_store,
        )
    return default_store


@dataclass(frozen=True)
class PredictReport:
    """What ``predict`` scored and wrote.

    Attributes:
        output_table: path or catalog name of the output Delta table.
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


def check_input(images: Path | None, table: Path | TableRef | None) -> None:
    """Fail before Spark starts when the input is missing.

    Raises:
        UsageError: neither or both of ``images`` and ``table``.
        PredictError: ``images`` is not a directory, or ``table`` (a path; a catalog table
            is checked once Spark is up) has no Delta log.
    """
    if (images is None) == (table is None):
        raise UsageError("give exactly one of --images DIR and --table PATH")
    if images is not None and not images.is_dir():
        raise PredictError(f"--images {images}: not a directory")
    path = Location.of(table) if isinstance(table, Path) else getattr(table, "path", None)
    if path is not None and not (path / "_delta_log").is_dir():
        raise PredictError(f"--table {path}: not a Delta table (no {path / '_delta_log'})")


def check_output_table(
    spark: SparkSession, output_table: TableRef, table: TableRef | None = None
) -> None:
    """Refuse an ``--output-table`` that is one of the job's input tables, before anything
    is read or written: ``predict`` overwrites its output, schema included.

    The job's input tables are the ones ingest wrote (``images``, ``quarantine``, an older
    layout's ``train``/``val``/``test``): their latest commit carries ingest's metadata
    (:func:`~flowers_job.tables.delta_tables.is_ingest_metadata`), wherever they are and
    however they are named; and this run's input ``table``: the same path or catalog name
    (:meth:`~flowers_job.tables.table_ref.TableRef.key`) or, both existing, the same Delta
    table id (a catalog name and its location).

    Raises:
        UsageError: (exit 2) naming the output table and the input table it is.
    """
    if table is not None:
        same = output_table.key(spark) == table.key(spark)
        if not same and output_table.exists(spark) and table.exists(spark):
            same = output_table.table_id(spark) == table.table_id(spark)
        if same:
            raise UsageError(
                f"--output-table {output_table} is the input table --table {table}: predict "
                "overwrites its output table, schema included; name another output table"
            )
    if not output_table.exists(spark):
        return
    meta = read_table_metadata(spark, output_table)
    if is_ingest_metadata(meta):
        assert meta is not None
        raise UsageError(
            f"--output-table {output_table} is one of the job's input tables: flowers-job "
            f"ingest wrote it (run {meta.get('run_id')}; the {output_table.table} table of "
            f"labels {meta.get('label_names')}), and predict overwrites its output table, "
            "schema included; name another output table"
        )


def scoring_partitions(rows: int, slots: int) -> int:
    """Scoring tasks for ``rows`` rows on ``slots`` task slots: a multiple of ``slots``, so
    the last wave keeps every slot busy, of :data:`ROWS_PER_PARTITION` rows or more each
    (one wave of one task per slot below that). ``scoring_partitions(3670, 2) == 6``."""
    return slots * max(1, rows // (slots * ROWS_PER_PARTITION))


def _partitions(spark: SparkSession, rows: int) -> int:
    return scoring_partitions(rows, task_slots(spark))


def _image_rows(
    spark: SparkSession, images: Path, data: DataConfig, shipped: Shipped
) -> tuple[DataFrame, DataFrame, int, dict[str, object]]:
    """The photos under ``images`` listed and decoded as ingest does, one row per entry.

    Returns:
        ``(rows, listing, entries, input fingerprint)``: ``rows`` has ``path, relative_path,
        [label], content_sha256, reason_code, reason, image`` (the image normalised to the
        model's ``resize_size`` short side, as ingest stores training photos); ``listing``
        is persisted and must be unpersisted by the caller.
    """
    root = os.path.realpath(images)
    labels, others = label_folders(root)
    found = list_files(spark, root, labels, labels + others)
    # a file directly in the root is a photo without a label here, not a misplaced one (SQL
    # expressions, not pyspark.sql.functions: :data:`flowers_job.serving.score_udf._UDF_OUT`)
    in_root = "reason_code = 'not_in_label_folder'"
    listing = found.selectExpr(
        *(
            f"IF({in_root}, NULL, {c}) AS {c}" if c in ("reason", "reason_code") else f"`{c}`"
            for c in found.columns
        )
    ).persist(StorageLevel.DISK_ONLY)
    short_side = int(shipped.model_config["resize_size"])
    max_pixels = int(shipped.model_config["max_pixels"])
    limits = replace(ImageLimits.from_data(data), max_pixels=max_pixels)
    settings = {
        "input": "images",
        "root": root,
        "short_side": short_side,
        "jpeg_quality": data.jpeg_quality,
        "max_image_pixels": max_pixels,
        "extensions": sorted(e.lower() for e in data.extensions),
        "limits": limits.model_config(),
    }
    groups = hash_sums(listing, listing_key(), by=("label", "reason_code"))
    entries = sum(int(g["n"]) for g in groups)
    decode = decode_partitions(
        root, short_side, data.jpeg_quality, max_pixels, tuple(data.extensions), limits=limits
    )
    columns = ["relative_path", *(["label"] if labels else []), "content_sha256"]
    rows = (
        listing.select("relative_path", "label", "num_bytes", "reason_code", "reason")
        .repartition(_partitions(spark, entries), "relative_path")
        .mapInPandas(decode, schema=DECODED_SCHEMA)
        .withColumnRenamed("source_path", "path")
        .select("path", *columns, "reason_code", "reason", "image")
    )
    return rows, listing, entries, {"listing": digest(groups, settings=settings)}


def _table_rows(
    spark: SparkSession, table: TableRef, split: str | None = None
) -> tuple[DataFrame, int, dict[str, object]]:
    """The input Delta table's ``row_id, [path], [label], image`` (its rows of ``split``
    when given: a partition of the ``images`` table) and its fingerprint. ``path`` is the
    table's ``source_path`` (the ``images`` table's since ingest format 5) or ``path``.

    Raises:
        PredictError: no such catalog table, no ``row_id`` or binary ``image`` column, or
            ``split`` given for a table without a ``split`` column.
    """
    if not table.exists(spark):
        raise PredictError(f"--table {table}: no such table")
    last = table.history(spark, 1).select("version").first()
    detail = table.detail(spark)
    df = table.read(spark)
    types = dict(df.dtypes)
    if types.get("image") != "binary" or "row_id" not in types:
        raise PredictError(
            f"--table {table}: needs a row_id column and a binary image column "
            f"(the tables under <output-dir>/tables have them); its columns are {types}"
        )
    if split is not None:
        if "split" not in types:
            raise PredictError(f"--split {split}: the table {table} has no split column")
        df = df.where(df["split"] == split)
    source = next((c for c in ("source_path", "path") if c in types), None)
    columns = [
        df["row_id"],
        *([df[source].alias("path")] if source else []),
        *([df["label"]] if "label" in types else []),
        df["image"],
    ]
    rows = int(df.count())
    meta = {
        "input": "table",
        **(
            {"name": table.describe()}
            if table.in_catalog
            else {"path": os.path.realpath(str(table.path))}
        ),
        "table_id": detail["id"] if detail else None,
        "version": int(last["version"]) if last else None,
        **({"split": split} if split is not None else {}),
    }
    return df.select(*columns), rows, meta


def _counts(spark: SparkSession, table: TableRef) -> tuple[int, dict[str, int], dict[str, int]]:
    """Rows, rows per predicted label, rows per reason of the output table (a few rows)."""
    stats = table.read(spark).groupBy("predicted_label", "reason_code").count().collect()
    labels: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for r in stats:
        if r["predicted_label"] is not None:
            labels[r["predicted_label"]] = labels.get(r["predicted_label"], 0) + int(r["count"])
        if r["reason_code"] is not None:
            reasons[r["reason_code"]] = reasons.get(r["reason_code"], 0) + int(r["count"])
    return sum(int(r["count"]) for r in stats), dict(sorted(labels.items())), reasons


def _output_metadata(source: object, model: ModelRef) -> dict[str, object]:
    """The output table's commit metadata: what was scored (``source``) by which model
    version, and its ``fingerprint`` (SHA-256 of both and :data:`PREDICT_FORMAT_VERSION`),
    which decides whether a later ``predict`` writes again."""
    model_key = {"uri": model.uri, "name": model.name, "version": model.version}
    text = json.dumps(
        {"format": PREDICT_FORMAT_VERSION, "input": source, "model": model_key}, sort_keys=True
    )
    return {
        "fingerprint": hashlib.sha256(text.encode()).hexdigest(),
        "run_id": uuid.uuid4().hex,
        "kind": "predictions",
        "input": source,
        "model": model_key,
    }


def predict(
    spark: SparkSession,
    model: ModelRef,
    output_table: Path | TableRef,
    *,
    images: Path | None = None,
    table: Path | TableRef | None = None,
    split: str | None = None,
    data: DataConfig | None = None,
) -> PredictReport:
    """Score every photo under ``images`` (or row of the Delta ``table``) into ``output_table``.

    Args:
        spark: the session.
        model: the resolved model (:func:`resolve_model`).
        output_table: the output Delta table: a path, or a catalog table
            (:class:`~flowers_job.tables.table_ref.TableRef`, written with ``saveAsTable``);
            overwritten when the input or the model version changed, left alone otherwise.
        images: a folder of photos: ``<images>/<label>/<file>`` (the label is kept) or files
            directly in it (no label); listed and decoded exactly as ingest does.
        table: a Delta table with ``row_id`` and binary ``image`` (``path`` and ``label`` are
            kept when present), e.g. ``<output-dir>/tables/images``: a path or a catalog
            table.
        split: with ``table``, score only its rows of this split (``train``, ``val``,
            ``test``: a partition of the ``images`` table).
        data: ``jpeg_quality`` and ``extensions`` of the decode (default: the config's
            defaults); the stored short side and pixel limit are the model's own.

    Returns:
        A :class:`PredictReport`: counts, whether a new Delta version was written, wall time
        (seconds) and throughput (images/s) of the scoring job.

    Raises:
        UsageError, PredictError: as :func:`check_input`, or a ``table`` without the columns.
        UsageError: the output table is one of the job's input tables
            (:func:`check_output_table`).

    ``spark`` may be a classic or a Spark Connect session: the same code runs on both.
    """
    check_input(images, table)
    if isinstance(output_table, Path):
        output_table = TableRef(path=Location.of(output_table))
    if isinstance(table, Path):
        table = TableRef(path=Location.of(table))
    check_output_table(spark, output_table, table)
    data = data or DataConfig()
    shipped = ship_model(spark, model)
    listing: DataFrame | None = None
    try:
        if images is not None:
            rows, listing, input_rows, source = _image_rows(spark, images, data, shipped)
            partitions = None  # already partitioned by the decode
        else:
            assert table is not None
            rows, input_rows, source = _table_rows(spark, table, split)
            partitions = _partitions(spark, input_rows)
        meta = _output_metadata(source, model)
        fingerprint = str(meta["fingerprint"])
        written = (read_table_metadata(spark, output_table) or {}).get("fingerprint") != fingerprint
        seconds = 0.0
        if written:
            scored = score_images(spark, model, rows, num_partitions=partitions)
            t0 = time.perf_counter()
            with task_progress(spark, f"scoring {input_rows} rows with {model.version_uri}"):
                write_table(spark, scored, output_table, meta)
            seconds = time.perf_counter() - t0
        else:
            log.info("%s already holds this input scored by %s", output_table, model.version_uri)
    finally:
        if listing is not None:
            listing.unpersist()
    last = output_table.history(spark, 1).select("version").first()
    output_rows, label_counts, reason_counts = _counts(spark, output_table)
    return PredictReport(
        output_table=output_table.describe(),
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
