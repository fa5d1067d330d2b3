"""A loader cache entry grown by appending (driver side): the changes of a split between two
``images`` versions, the merged deletion list, and the decision to append or to write the
split whole (:func:`grow`). :mod:`flowers_job.loaders.cache_dir` publishes what this writes.

An entry grows from the newest entry of its lineage (docs/architecture.md, "A cache that
grows by appending"): the added rows become a new segment, written by the loader
(:meth:`~flowers_job.loaders.base.Loader.append`); the removed or replaced rows join the
deletion list (:class:`~flowers_job.loaders.base.Deletions`). The split is written whole
again (compacted) once more than ``cache.compact_dead_fraction`` of its stored rows would be
dead or it would have more than ``cache.max_segments`` segments.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from flowers_job.errors import DataError
from flowers_job.loaders.base import (
    DELETIONS_FILE,
    Deletions,
    Loader,
    ShardPlan,
    read_deletions,
    write_deletions,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from pyspark.sql import DataFrame, SparkSession

    from flowers_job.config import CacheConfig
    from flowers_job.location import Location

__all__ = ["Changes", "Growth", "MergedDeletions", "compaction_reason", "grow", "merged_deletions"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Changes:
    """A split's changes since an older version of the ``images`` table (what
    :meth:`LoaderCache.split` appends; :func:`flowers_job.driver.prepare.split_changes`
    makes it from the two versions' ``(row_id, content_sha256)``)."""

    current: DataFrame
    """The split now: ``row_id``, ``image``, ``label_index``, ``segment`` (this version)."""
    added: DataFrame
    """The rows of ``current`` the older version did not hold as they are (new, or changed
    since), same columns."""
    added_rows: int
    """Rows of ``added``."""
    removed_ids: Any
    """int64 ``[R]``: ``row_id`` of the older version's rows that ``current`` does not hold
    as they were (removed, or changed since)."""
    rows: int
    """Rows of ``current``."""


@dataclass(frozen=True)
class MergedDeletions:
    """An entry's deletion list: its older entry's and this version's removals."""

    rows: Deletions
    """On the driver (numpy), for :func:`~flowers_job.loaders.base.write_deletions`."""
    frame: DataFrame
    """The same as a Spark DataFrame: ``row_id`` long, ``before`` long."""


def merged_deletions(
    spark: SparkSession, base_url: str | None, removed_ids: Any, version: int
) -> MergedDeletions:
    """The deletion list of an entry grown to ``version``: the older entry's
    (``base_url``), and every id of ``removed_ids`` (int64 ``[R]``) dead in segments before
    ``version``; where a row id is in both, the later segment wins (copies written before
    it are dead). The list stays below ``cache.compact_dead_fraction`` of the rows, 16
    bytes each.
    """
    import numpy as np
    import pandas as pd

    base = read_deletions(base_url)
    new = np.asarray(removed_ids, dtype=np.int64)
    ids = np.concatenate([base.row_ids if base else np.empty(0, np.int64), new])
    before = np.concatenate(
        [base.before if base else np.empty(0, np.int64), np.full(len(new), version, np.int64)]
    )
    order = np.lexsort((before, ids))
    ids, before = ids[order], before[order]
    last = np.r_[ids[1:] != ids[:-1], True] if len(ids) else np.empty(0, bool)
    rows = Deletions(ids[last], before[last])
    frame = spark.createDataFrame(
        pd.DataFrame({"row_id": rows.row_ids, "before": rows.before}),
        schema="row_id long, before long",
    )
    return MergedDeletions(rows, frame)


@dataclass(frozen=True)
class Growth:
    """The entry a split would grow from."""

    entry: str
    """Its name (for the log)."""
    version: int
    """The ``images`` version it was built from."""
    plan: ShardPlan
    """Its plan (paths absolute)."""
    segments: int
    """Its segments (data folders its marker reads)."""


def compaction_reason(dead: int, stored: int, segments: int, cache: CacheConfig) -> str | None:
    """Why an entry of ``stored`` rows, ``dead`` of them dead, in ``segments`` segments, is
    written whole instead of grown: more dead rows than ``cache.compact_dead_fraction`` of
    them, or more segments than ``cache.max_segments``; None when it may grow."""
    if dead > cache.compact_dead_fraction * stored:
        return (
            f"{dead} of its {stored} rows would be dead, more than "
            f"cache.compact_dead_fraction={cache.compact_dead_fraction}"
        )
    if segments > cache.max_segments:
        return f"it would have {segments} segments, more than cache.max_segments"
    return None


# Arguments: one cache entry's growth: the loader, its split, the entry grown, the version, its
# changes, where.
def grow(  # noqa: PLR0913
    settings: CacheConfig,
    spark: SparkSession,
    loader: Loader,
    split: str,
    base: Growth,
    version: int,
    changes: Callable[[int], Changes],
    data: Location,
) -> ShardPlan | None:
    """The plan of ``base`` grown to ``version`` (:meth:`Loader.append`), its new segment
    and deletion list written under ``data``; None when the split should be written whole
    instead (too many dead rows or segments, the older version unreadable, or a plan the
    loader refuses), said in the log."""
    try:
        change = changes(base.version)
        added, removed = change.added_rows, len(change.removed_ids)
    except Exception as exc:  # the older version vacuumed, say: the split is written whole
        log.warning("%s: not appending to %s: %s", split, base.entry, exc)
        return None
    plan = base.plan
    stored = (plan.stored_rows or plan.dataset_size) + added
    dead = stored - change.rows
    segments = base.segments + 1
    why = compaction_reason(dead, stored, segments, settings)
    if why:
        log.info(
            "%s: compacting: writing the split whole instead of %s: %s", split, base.entry, why
        )
        return None
    deletions = merged_deletions(spark, plan.deletions_url, change.removed_ids, version)
    t0 = time.perf_counter()
    try:
        grown = loader.append(
            spark, plan, change.current, change.added, deletions.frame, data, split
        )
    except DataError as exc:
        log.warning("%s: not appending to %s: %s; writing the split whole", split, base.entry, exc)
        return None
    deletions_url = None
    if len(deletions.rows):
        deletions_url = (data / DELETIONS_FILE).as_uri()
        write_deletions(deletions_url, deletions.rows)
    log.info(
        "%s: appended to %s (v%d -> v%d): +%d rows, -%d rows, %d dead of %d stored, %d "
        "segments (%.1f s)",
        split,
        base.entry,
        base.version,
        version,
        added,
        removed,
        dead,
        stored,
        segments,
        time.perf_counter() - t0,
    )
    return replace(grown, deletions_url=deletions_url, stored_rows=stored)
