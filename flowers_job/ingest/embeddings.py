"""The ``embeddings`` Delta table: a frozen backbone's features of every photo of ``images``,
computed by Spark tasks once per photo, backbone, transform and view, and kept in step with
``images`` incrementally.

**Rows.** One per (``images`` row, view) and :attr:`~flowers_job.vision.views.EmbeddingSpec.model_key`:
the row's ``row_id``, ``relative_path``, ``content_sha256``, ``label_index`` and ``split``, the
``model_key``, the ``view`` (:data:`~flowers_job.vision.views.VIEWS`) and ``features``
(``array<float>``, the backbone's pooled output). Partitioned by ``model_key``, ``view`` and
``split``, so a training read of one backbone's views of one split opens only their files.

**Incremental** (:func:`update_embeddings`), against ``images`` at one version:

- a row of ``images`` without its (``row_id``, ``content_sha256``, ``view``) for this
  ``model_key`` is embedded, unless a row with the same content already has that view's
  features, which are copied (a photo moved to another folder costs no forward pass);
- a row of the table whose (``row_id``, ``content_sha256``) is no longer live in ``images``
  leaves it, for every ``model_key``; a live one whose ``label_index`` or ``split`` changed is
  updated in place, without a forward pass;
- another backbone, weights file or transform is another ``model_key``: new rows, never
  mixed with these; views beyond the configured ones stay, unread.

All of it is one ``MERGE`` commit carrying the ``images`` version, the ``model_key`` and the
views (``userMetadata``), or no commit when nothing changed: a reader never sees half an
update.

**What changed, found at the cost of the change.** The table's commits name the ``images``
version it was last brought in step with for this ``model_key`` and views
(:func:`_table_state`):

- the version asked for: the table is in step and nothing is read (an unchanged run costs a
  read of the log);
- an older one: ``images``' change data feed since then names the photos added, changed and
  deleted (:func:`_changes_from_feed`; ``images`` records it,
  :data:`~flowers_job.tables.delta_tables.IMAGES_PROPERTIES`), and only those are compared
  with the table, the photos to embed read from the files the feed added;
- not known, or the feed cannot be read (not recorded for a version of the range, or a
  file of it vacuumed): the whole tables are compared (:func:`_changes`).

Each comparison runs once: its result (the change, small beside the tables) is checkpointed
on the executors (``localCheckpoint``) for the counts, the embedding tasks and the
``MERGE``. A lost executor's checkpoint cannot be recomputed: the update then fails,
committing nothing, and the next run does it again. (``persist`` keeps the plan over the
table instead, which Delta rebuilds when the ``MERGE`` commits: the same update took as
long as with no cache at all.)

**Tasks.** The rows to embed are spread over tasks of at most :data:`ROWS_PER_TASK` photos;
each task's Python worker builds the backbone once (Spark reuses its workers) and decodes
each photo once for all its views, with as many torch threads as the task holds cores.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark.sql import types as T

from flowers_job.cluster.python_workers import prepare_worker
from flowers_job.errors import DataError
from flowers_job.tables.delta_tables import (
    MAINTENANCE_OPERATIONS,
    TABLE_PROPERTIES,
    commit_metadata,
    ensure_properties,
    merge_into,
    write_table,
)
from flowers_job.tables.table_ref import TableRef

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import DataFrame, SparkSession

    from flowers_job.vision.views import EmbeddingSpec

log = logging.getLogger(__name__)

__all__ = [
    "BROADCAST_ROWS",
    "EMBEDDINGS_PROPERTIES",
    "EMBEDDINGS_SCHEMA",
    "PARTITION_BY",
    "ROWS_PER_TASK",
    "EmbeddingCounts",
    "update_embeddings",
]

EMBEDDINGS_SCHEMA = T.StructType(
    [
        T.StructField("row_id", T.LongType()),
        T.StructField("relative_path", T.StringType()),
        T.StructField("content_sha256", T.StringType()),
        T.StructField("label_index", T.IntegerType()),
        T.StructField("split", T.StringType()),
        T.StructField("model_key", T.StringType()),
        T.StructField("view", T.StringType()),
        T.StructField("features", T.ArrayType(T.FloatType())),
    ]
)
"""The ``embeddings`` table's columns."""

PARTITION_BY = ("model_key", "view", "split")

PHOTOS_PER_PASS = 32
"""Photos a task decodes and embeds at a time (their views in forward passes of 32): what
one pass holds in memory is about 32 decoded photos and their crops, whatever Arrow's batch
size (``spark.sql.execution.arrow.maxRecordsPerBatch``)."""

ROWS_PER_TASK = 256
"""Photos per embedding task at most: on 2 cores, EfficientNet-Lite2's two views of 256 photos
take about half a minute, so a lost task costs little and the tasks fill every slot."""

EMBEDDINGS_PROPERTIES = {
    **TABLE_PROPERTIES,
    "delta.autoOptimize.optimizeWrite": "true",
}
"""The ``embeddings`` table's Delta properties: deletion vectors, and Delta's optimized write
(Delta's documentation, "Optimized writes"): each write shuffles its rows by partition
before writing them, so a partition gets a few large files, not one small file per
embedding task (:data:`ROWS_PER_TASK` photos, about 85 rows a split) that every later
read, ``MERGE`` and rank opens. Set by the first write, and before an update writes a table
written without it."""

BROADCAST_ROWS = 500_000
"""At most this many changed photos (their ``content_sha256``, 64 characters each) are
broadcast to the tasks that read the table's key columns, so that read moves no other row;
past it, Spark plans the join."""

_KEY = ("row_id", "content_sha256", "view")
_LIVE = ("row_id", "relative_path", "content_sha256", "label_index", "split")


@dataclass(frozen=True)
class EmbeddingCounts:
    """What :func:`update_embeddings` did: rows ``embedded`` (a forward pass each),
    ``copied`` (features of the same content and view), ``updated`` (label or split),
    ``deleted``; ``version`` the table's version after it (None: no table yet and nothing
    to write); ``seconds`` of wall time; ``method``, how the change was found: ``write``
    (no table: every photo), ``log`` (the commits say the table is in step: nothing
    read), ``feed`` (``images``' change data feed since the last update) or ``tables``
    (the whole tables compared)."""

    embedded: int
    copied: int
    updated: int
    deleted: int
    version: int | None
    seconds: float
    method: str = "tables"

    @property
    def changed(self) -> bool:
        return bool(self.embedded or self.copied or self.updated or self.deleted)


_WORKER_BACKBONES: dict[str, Any] = {}
"""model_key -> (backbone, normalize), built once per Python worker."""


def _worker_backbone(spec: EmbeddingSpec) -> Any:
    """The frozen backbone of ``spec`` and its input normalisation, built on the first call
    in this Python worker, on a GPU where the task's worker has one, with the allocator
    tuned as the ranks' (:func:`~flowers_job.runtime.allocator.tune_this_process`); torch's
    threads set to the task's cores."""
    import torch

    from flowers_job.runtime.allocator import tune_this_process
    from flowers_job.runtime.devices import serving_device
    from flowers_job.serving.score_udf import task_threads
    from flowers_job.vision.backbones import build_model, preprocessing_for
    from flowers_job.vision.precision import DeviceNormalize

    threads = task_threads()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    built = _WORKER_BACKBONES.get(spec.model_key)
    if built is None:
        tune_this_process()  # where the executor's environment lacks the allocator's tuning
        device = serving_device()
        model = build_model(
            spec.architecture,
            1,
            spec.weights,  # type: ignore[arg-type]
            weights_path=spec.weights_path,
            freeze_backbone=True,
        )
        backbone = model.backbone.eval()
        backbone.to(device, memory_format=torch.channels_last)  # type: ignore[call-overload]
        pre = preprocessing_for(spec.architecture)
        built = (backbone, DeviceNormalize(pre.mean, pre.std, device))
        _WORKER_BACKBONES[spec.model_key] = built
    return built


def _embed_rows(pdf: pd.DataFrame, spec: EmbeddingSpec) -> pd.DataFrame:
    """One pass: ``pdf``'s photos decoded, their views embedded, one
    :data:`EMBEDDINGS_SCHEMA` row per view.

    Raises:
        DataError: a stored image does not decode, naming its ``relative_path``.
    """
    import pandas as pd

    from flowers_job.vision.images import open_rgb
    from flowers_job.vision.views import embed_views

    backbone, normalize = _worker_backbone(spec)
    images = []
    for path, content in zip(pdf["relative_path"], pdf["image"], strict=True):
        try:
            images.append(open_rgb(bytes(content))[0])
        except Exception as exc:
            raise DataError(
                f"embeddings: the stored image of {path} does not decode "
                f"({type(exc).__name__}: {exc})"
            ) from exc
    views = [list(v) for v in pdf["views"]]
    features = embed_views(backbone, images, spec, views, normalize)
    rows = pdf.loc[pdf.index.repeat([len(v) for v in views]), list(_LIVE)]
    rows = rows.reset_index(drop=True)
    rows["model_key"] = spec.model_key
    rows["view"] = [v for names in views for v in names]
    rows["features"] = [row for block in features for row in block]
    return pd.DataFrame(rows, columns=EMBEDDINGS_SCHEMA.fieldNames())


def _embed_partitions(
    spec: EmbeddingSpec,
) -> Callable[[Iterable[pd.DataFrame]], Iterator[pd.DataFrame]]:
    """The ``mapInPandas`` function: rows of :data:`_LIVE` plus ``image`` (stored bytes) and
    ``views`` (``array<string>``) in, one :data:`EMBEDDINGS_SCHEMA` row per view out,
    :data:`PHOTOS_PER_PASS` photos at a time.

    Raises (in the task):
        DataError: a stored image does not decode, naming its ``relative_path``.
    """

    def embed(batches: Iterable[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        prepare_worker()
        for batch in batches:
            for start in range(0, len(batch), PHOTOS_PER_PASS):
                yield _embed_rows(batch.iloc[start : start + PHOTOS_PER_PASS], spec)

    return embed


def _embedded(spark: SparkSession, todo: DataFrame, live: DataFrame, spec: EmbeddingSpec) -> Any:
    """``todo``'s keys (:data:`_LIVE` + ``view``) with their features: each photo decoded
    once for all its views, in tasks of at most :data:`ROWS_PER_TASK` photos."""
    from pyspark.sql import functions as F

    photos = todo.groupBy(*_LIVE).agg(F.sort_array(F.collect_list("view")).alias("views"))
    n = photos.count()
    images = live.select("row_id", "content_sha256", "image")
    work = photos.join(images, ["row_id", "content_sha256"]).repartition(
        max(1, math.ceil(n / ROWS_PER_TASK)), "row_id"
    )
    return work.mapInPandas(_embed_partitions(spec), schema=EMBEDDINGS_SCHEMA)


def update_embeddings(
    spark: SparkSession,
    images: TableRef,
    version: int,
    table: TableRef,
    spec: EmbeddingSpec,
    run_id: str,
) -> EmbeddingCounts:
    """Bring ``table`` (the embeddings) in step with ``images`` at ``version`` for ``spec``:
    what the module docstring lists, in one commit carrying ``run_id``, ``images_version``
    and ``model_key``, or none when nothing changed.

    Returns:
        :class:`EmbeddingCounts`.

    Raises:
        DataError: a stored image does not decode (naming it), or another writer committed
            to ``table`` at the same time.
    """
    import time

    t0 = time.perf_counter()
    meta = {
        "run_id": run_id,
        "images_version": version,
        "model_key": spec.model_key,
        "views": list(spec.views),
    }
    state = _table_state(spark, table, meta)
    if state is None:
        live = images.read(spark, version).select(*_LIVE, "image")
        rows = _embedded(spark, _wanted(spark, live, spec), live, spec)
        write_table(spark, rows, table, meta, PARTITION_BY, EMBEDDINGS_PROPERTIES)
        embedded = table.read(spark).count()
        return EmbeddingCounts(
            embedded, 0, 0, 0, _version(spark, table), time.perf_counter() - t0, "write"
        )
    latest, base = state
    if base == version:
        return EmbeddingCounts(0, 0, 0, 0, latest, time.perf_counter() - t0, "log")
    current = table.read(spark)
    found = None
    if base is not None and base < version:
        found = _changes_from_feed(spark, images, base, version, current, spec)
    if found is None:
        live = images.read(spark, version).select(*_LIVE, "image")
        found = (
            _changes(current, _wanted(spark, live, spec), live, spec.model_key),
            live,
            "tables",
        )
    changes, live, method = found
    counts = {
        "embedded": changes.todo.count(),
        "copied": changes.copied.count(),
        "updated": changes.relabeled.count(),
        "gone": changes.gone.count(),
    }
    if not any(counts.values()):
        return EmbeddingCounts(0, 0, 0, 0, _version(spark, table), time.perf_counter() - t0, method)
    ensure_properties(spark, table, EMBEDDINGS_PROPERTIES)
    deleted = _merge(spark, table, _source(spark, current, changes, counts, live, spec), meta)
    return EmbeddingCounts(
        counts["embedded"],
        counts["copied"],
        counts["updated"],
        deleted,
        _version(spark, table),
        time.perf_counter() - t0,
        method,
    )


def _source(
    spark: SparkSession,
    current: DataFrame,
    changes: _Changes,
    counts: dict[str, int],
    live: DataFrame,
    spec: EmbeddingSpec,
) -> DataFrame:
    """The ``MERGE``'s source (:func:`_merge`): the rows of ``changes.todo`` embedded from
    the stored images of ``live``, the copied ones with their twins' features (inserts),
    the relabeled keys (updates), and each gone photo under every (``model_key``,
    ``view``) the table holds (deletes); ``counts`` of them as :func:`update_embeddings`
    counted them."""
    from pyspark.sql import functions as F

    names = EMBEDDINGS_SCHEMA.fieldNames()
    inserted = _embedded(spark, changes.todo, live, spec)
    if counts["copied"]:
        twins = _with_twins_features(current, changes.copied, counts["copied"], spec.model_key)
        inserted = inserted.unionByName(twins.select(*names))
    return (
        inserted.withColumn("_op", F.lit("insert"))
        .unionByName(_keyed(changes.relabeled, "update", spec.model_key, names))
        .unionByName(_keyed(changes.gone.crossJoin(_all_keys(current)), "delete", None, names))
    )


def _wanted(spark: SparkSession, live: DataFrame, spec: EmbeddingSpec) -> DataFrame:
    """:data:`_LIVE` + ``view``: each of ``live``'s photos under each of ``spec``'s views."""
    views = spark.createDataFrame([(v,) for v in spec.views], "view string")
    return live.select(*_LIVE).crossJoin(views)


def _table_state(
    spark: SparkSession, table: TableRef, meta: dict[str, object]
) -> tuple[int, int | None] | None:
    """None when there is no table yet; else its latest version and the ``images`` version
    it was last brought in step with for ``meta``'s ``model_key`` and views (None: not
    known), from one read of its last 50 commits, newest first:

    - a maintenance commit (VACUUM, OPTIMIZE) changes no row: skipped;
    - this job's update of another ``model_key``, or of fewer views, wrote or deleted rows
      only of photos that changed in ``images`` after this key's own update, which the
      change since then names again: skipped;
    - this job's update of the ``model_key`` with every view of ``meta``: its
      ``images_version`` is the answer;
    - any other commit (not this job's, or none of these within 50): not known.
    """
    if not table.exists(spark):
        return None
    rows = table.history(spark, 50).select("version", "operation", "userMetadata").collect()
    if not rows:
        return None
    latest = int(rows[0]["version"])
    for row in rows:
        if row["operation"] in MAINTENANCE_OPERATIONS:
            continue
        last = commit_metadata(row["userMetadata"])
        if last is None or "images_version" not in last:
            return latest, None
        if _covers(last, meta):
            version = last["images_version"]
            return latest, int(version) if isinstance(version, int) else None
    return latest, None


def _covers(last: dict[str, object], meta: dict[str, object]) -> bool:
    """Whether an update that committed ``last`` (its metadata) wrote what ``meta``'s
    would: the same ``model_key``, with every view of ``meta``."""
    views = last.get("views")
    return (
        last.get("model_key") == meta["model_key"]
        and isinstance(views, list)
        and set(meta["views"]) <= set(views)  # type: ignore[call-overload]
    )


@dataclass(frozen=True)
class _Changes:
    """What :func:`update_embeddings` changes (:func:`_changes`), each checkpointed on the
    executors: computed once, however often the counts, the embedding tasks and the
    ``MERGE`` read it."""

    todo: DataFrame
    copied: DataFrame
    relabeled: DataFrame
    gone: DataFrame


def _changes(current: DataFrame, wanted: DataFrame, live: DataFrame, model_key: str) -> _Changes:
    """What :func:`update_embeddings` changes in the table read as ``current`` to hold
    ``wanted`` (:data:`_LIVE` + ``view`` of every photo of ``images``, ``live``) for
    ``model_key``, found by comparing the whole tables: :func:`_diff` of this key's rows,
    and ``gone``, (``row_id``, ``content_sha256``) of the table no longer live. Each
    comparison reads the tables' key columns once."""
    gone = (
        current.select("row_id", "content_sha256")
        .distinct()
        .join(live.select("row_id", "content_sha256"), ["row_id", "content_sha256"], "left_anti")
        .localCheckpoint()
    )
    return _diff(_mine(current, model_key), wanted, gone)


def _changes_from_feed(
    spark: SparkSession,
    images: TableRef,
    base: int,
    version: int,
    current: DataFrame,
    spec: EmbeddingSpec,
) -> tuple[_Changes, DataFrame, str] | None:
    """What :func:`update_embeddings` changes, found from ``images``' change data feed
    after ``base`` (the ``images`` version the table was last brought in step with for
    ``spec``) up to ``version``, instead of comparing the tables:

    - each (``row_id``, ``content_sha256``) the feed names ends as its last change says
      (by ``_commit_version``; within one commit an insert or post-image after a delete or
      pre-image): live with those columns, or gone;
    - the live ones are :func:`_diff`'d against this key's rows of the same contents only
      (the keys themselves and their twins), one read of the table's key columns;
    - the photos to embed are read from the feed's inserted rows: only the files added
      since ``base``, never the rest of ``images``' image bytes.

    Returns:
        The changes, the inserted photos (``row_id``, ``content_sha256``, ``image``), and
        ``"feed"``; None (logged) when the feed cannot be read: a version of the range did
        not record it (``images`` written before
        :data:`~flowers_job.tables.delta_tables.IMAGES_PROPERTIES`), or a file it
        needs was vacuumed. The caller then compares the tables.
    """
    from pyspark.errors import PySparkException
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    after = F.col("_change_type").isin("insert", "update_postimage")
    last = Window.partitionBy("row_id", "content_sha256").orderBy(
        F.desc("_commit_version"), F.desc("_after")
    )
    try:
        feed = images.changes(spark, base + 1, version)
        # two reads, each filtered on the change type, which Delta's reader applies: the
        # added rows' columns from the files added; the removed rows' keys alone, from the
        # files whose deletion vectors changed (read whole, docs/known-issues.md)
        added = feed.where(after).select(*_LIVE, "_commit_version", F.lit(True).alias("_after"))
        removed = feed.where(F.col("_change_type").isin("delete", "update_preimage")).select(
            "row_id", "content_sha256", "_commit_version", F.lit(False).alias("_after")
        )
        net = (
            added.unionByName(removed, allowMissingColumns=True)
            .withColumn("_n", F.row_number().over(last))
            .where("_n = 1")
            .drop("_n", "_commit_version")
            .localCheckpoint()
        )
    except PySparkException as exc:
        log.info(
            "embeddings: images' change data feed after version %d cannot be read (%s): "
            "comparing the tables instead",
            base,
            exc.getCondition() or type(exc).__name__,
        )
        return None
    live = net.where("_after").select(*_LIVE)
    contents = live.select("content_sha256").distinct()
    if net.count() <= BROADCAST_ROWS:
        contents = F.broadcast(contents)
    near = _mine(current, spec.model_key).join(contents, "content_sha256", "left_semi")
    gone = net.where("NOT _after").select("row_id", "content_sha256")
    photos = (
        feed.where(after)
        .select("row_id", "content_sha256", "image")
        .dropDuplicates(["row_id", "content_sha256"])
    )
    return _diff(near.localCheckpoint(), _wanted(spark, live, spec), gone), photos, "feed"


def _mine(current: DataFrame, model_key: str) -> DataFrame:
    """The key columns of the table's rows of ``model_key``: :data:`_KEY`, ``label_index``
    and ``split``."""
    from pyspark.sql import functions as F

    return current.where(F.col("model_key") == model_key).select(*_KEY, "label_index", "split")


def _diff(mine: DataFrame, wanted: DataFrame, gone: DataFrame) -> _Changes:
    """The :class:`_Changes` that bring ``mine`` (:func:`_mine`, of one ``model_key``; at
    least every row of the contents ``wanted`` names) to ``wanted`` (:data:`_LIVE` +
    ``view``), with ``gone`` as given:

    - ``todo``: keys of ``wanted`` that ``mine`` lacks (:data:`_LIVE` + ``view``), to embed;
    - ``copied``: the same, whose content and view another row holds
      (:func:`_with_twins_features` fetches them);
    - ``relabeled``: keys whose ``label_index`` or ``split`` changed (the new ones).

    Each is computed here, once (``localCheckpoint``, eager): one Spark job reads
    ``mine`` for the new keys, one for their twins, one for the relabeled keys, two more
    split the new keys in two. Each result holds about the size of the change.
    """
    from pyspark.sql import functions as F

    new = wanted.join(mine.select(*_KEY), list(_KEY), "left_anti").localCheckpoint()
    twins = (
        mine.select("content_sha256", "view")
        .join(new.select("content_sha256", "view"), ["content_sha256", "view"], "left_semi")
        .distinct()
        .localCheckpoint()
    )
    copied = new.join(twins, ["content_sha256", "view"], "left_semi").localCheckpoint()
    todo = new.join(twins, ["content_sha256", "view"], "left_anti").localCheckpoint()
    relabeled = (
        mine.alias("t")
        .join(wanted.alias("s"), list(_KEY))
        .where("NOT (t.label_index <=> s.label_index) OR NOT (t.split <=> s.split)")
        .select(*_KEY, F.col("s.label_index"), F.col("s.split"))
        .localCheckpoint()
    )
    return _Changes(todo, copied, relabeled, gone)


def _with_twins_features(
    current: DataFrame, copied: DataFrame, n: int, model_key: str
) -> DataFrame:
    """``copied``'s keys (``n`` rows) with the ``features`` of a row of the same content and
    view under ``model_key``, and that ``model_key``. Only called when there are such keys:
    the comparison that finds them reads the key columns alone; this reads the features of
    the twins only (a semi join before the de-duplication, so no other row's features move)."""
    from pyspark.sql import functions as F

    wanted = copied.select("content_sha256", "view").distinct()
    if n <= BROADCAST_ROWS:
        wanted = F.broadcast(wanted)
    donors = (
        current.where(F.col("model_key") == model_key)
        .select("content_sha256", "view", "features")
        .join(wanted, ["content_sha256", "view"], "left_semi")
        .dropDuplicates(["content_sha256", "view"])
    )
    return copied.join(donors, ["content_sha256", "view"]).withColumn("model_key", F.lit(model_key))


def _all_keys(current: DataFrame) -> DataFrame:
    """Every (``model_key``, ``view``) the table holds: a gone photo leaves under each."""
    return current.select("model_key", "view").distinct()


def _keyed(df: DataFrame, op: str, model_key: str | None, names: list[str]) -> DataFrame:
    """``df`` as MERGE source rows of operation ``op`` (the columns it lacks null)."""
    from pyspark.sql import functions as F

    if model_key is not None:
        df = df.withColumn("model_key", F.lit(model_key))
    for field in EMBEDDINGS_SCHEMA.fields:
        if field.name not in df.columns:
            df = df.withColumn(field.name, F.lit(None).cast(field.dataType))
    return df.select(*names).withColumn("_op", F.lit(op))


def _merge(spark: SparkSession, table: TableRef, source: DataFrame, meta: dict[str, object]) -> int:
    """One ``MERGE`` of ``source`` (:data:`EMBEDDINGS_SCHEMA` + ``_op``: insert, update or
    delete) into ``table`` on (``row_id``, ``content_sha256``, ``model_key``, ``view``),
    committing ``meta``.

    Returns:
        Rows deleted (Delta's ``numTargetRowsDeleted``).
    """
    names = EMBEDDINGS_SCHEMA.fieldNames()
    metrics = merge_into(
        spark,
        table,
        source,
        "ON t.row_id = s.row_id AND t.content_sha256 = s.content_sha256 "
        "AND t.model_key = s.model_key AND t.view = s.view "
        "WHEN MATCHED AND s._op = 'delete' THEN DELETE "
        "WHEN MATCHED AND s._op = 'update' THEN UPDATE SET "
        "label_index = s.label_index, split = s.split "
        f"WHEN NOT MATCHED AND s._op = 'insert' THEN INSERT ({', '.join(names)}) "
        f"VALUES ({', '.join(f's.{c}' for c in names)})",
        meta,
    )
    return int(metrics.get("numTargetRowsDeleted", 0))


def _version(spark: SparkSession, table: TableRef) -> int | None:
    """The table's latest version."""
    row = table.history(spark, 1).select("version").first()
    return None if row is None else int(row["version"])
