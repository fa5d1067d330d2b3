"""The split of every photo into train, val and test: each class in proportion, by a hash of
the photo's content and the split seed, so that a photo keeps its split across ingests and
byte-identical photos share one (no leakage); an incremental ingest fills what each class
lacks from its new photos only."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.window import Window

from flowers_job.errors import IngestError

if TYPE_CHECKING:
    from flowers_job.config.data import DataConfig

__all__ = ["SPLIT_ORDER", "Resplit", "full_splits", "incremental_splits", "split_quotas"]

SPLIT_ORDER = ("val", "test", "train")
"""The order in which a class's photos, ranked by their split hash, fill the splits."""


class Resplit(Exception):
    """An incremental ingest cannot keep every class in every split without moving photos
    that are already split (a class lost its last photo of a split and no new photo of it
    arrived): :mod:`flowers_job.ingest.job` runs a full rebuild instead, which splits every
    class afresh. The message says which classes and why."""


def _split_hash(data: DataConfig) -> Column:
    """A photo's split hash: SHA-256 of (``split_seed``, content) -> uniform in [0, 1)."""
    digest = F.sha2(F.concat_ws(":", F.lit(str(data.split_seed)), "content_sha256"), 256)
    return F.conv(F.substring(digest, 1, 13), 16, 10).cast("double") / float(16**13)


def split_quotas(
    units: Mapping[str, int], val_fraction: float, test_fraction: float, images: object = ""
) -> dict[str, tuple[int, int]]:
    """How many of each class's ``units`` (distinct photos) go to val and to test:
    ``round(n * fraction)``, at least 1 each, and at least 1 left for train.

    Args:
        units: class (label) -> its number of distinct photos.
        val_fraction, test_fraction: ``data.val_fraction`` and ``data.test_fraction``, both
            in (0, 1) with a sum below 1 (:class:`~flowers_job.config.data.DataConfig`).
        images: the images root, for the message.

    Returns:
        class -> ``(val, test)`` photo counts; train gets the rest (``n - val - test >= 1``).

    Raises:
        IngestError: a class with fewer photos than the three splits (train, val, test),
            naming each such class and its count.
    """
    small = {label: n for label, n in sorted(units.items()) if n < len(SPLIT_ORDER)}
    if small:
        raise IngestError(
            "data.images: each class is split into train, val and test in proportion, so "
            f"needs {len(SPLIT_ORDER)} distinct photos or more; "
            + ", ".join(f"class {label!r} has {n}" for label, n in small.items())
            + f" (under {images}): add photos, or remove the folder; nothing was written"
        )
    quotas = {}
    for label, n in units.items():
        val, test = max(1, round(n * val_fraction)), max(1, round(n * test_fraction))
        while val + test > n - 1:  # keep one for train: take from the larger of the two
            if val >= test:
                val -= 1
            else:
                test -= 1
        quotas[label] = (val, test)
    return quotas


def _quota(quotas: Mapping[str, tuple[int, int]], which: int) -> Column:
    """``quotas[stratum][which]`` as a column (0 for a stratum it does not name)."""
    if not quotas:
        return F.lit(0)
    pairs = [x for label, q in sorted(quotas.items()) for x in (F.lit(label), F.lit(q[which]))]
    return F.coalesce(F.create_map(*pairs)[F.col("stratum")], F.lit(0))


def _rank_splits(
    data: DataConfig, units: DataFrame, quotas: Mapping[str, tuple[int, int]]
) -> DataFrame:
    """``(content_sha256, split)`` for ``units`` (``content_sha256``, ``stratum``): in each
    stratum, the units ranked by their split hash (then content, for ties): the first
    ``quotas[stratum][0]`` go to val, the next ``[1]`` to test, the rest to train."""
    rank = F.row_number().over(
        Window.partitionBy("stratum").orderBy(_split_hash(data), "content_sha256")
    )
    val, test = _quota(quotas, 0), _quota(quotas, 1)
    split = F.when(rank <= val, "val").when(rank <= val + test, "test").otherwise("train")
    return units.select("content_sha256", split.alias("split"))


def _units(good: DataFrame) -> DataFrame:
    """One row per distinct photo (``content_sha256``) of ``good`` with its ``stratum``: the
    first of its labels (byte-identical photos under two labels are one unit, so they share
    a split: no leakage between splits)."""
    return good.groupBy("content_sha256").agg(F.min("label").alias("stratum"))


def full_splits(data: DataConfig, good: DataFrame) -> DataFrame:
    """``(content_sha256, split)`` for every image of a full rebuild: each class split in
    proportion, by rank of the split hash (:func:`split_quotas`, :func:`_rank_splits`).

    Raises:
        IngestError: a class too small for every split (:func:`split_quotas`).
    """
    units = _units(good)
    counts = {r["stratum"]: int(r["count"]) for r in units.groupBy("stratum").count().collect()}
    quotas = split_quotas(counts, data.val_fraction, data.test_fraction, data.images)
    return _rank_splits(data, units, quotas)


def incremental_splits(data: DataConfig, kept: DataFrame, good: DataFrame) -> DataFrame:
    """``(content_sha256, split)`` for the images of an incremental ingest: a photo already
    in ``kept`` (``label``, ``content_sha256``, ``split``: the stored images that stay)
    keeps its split; the new ones (in ``good``) of each class fill what the class lacks of
    its quotas for its size after this ingest (val first, then test), the rest go to train,
    ranked by split hash as in a full rebuild.

    Raises:
        IngestError: a class too small for every split (:func:`split_quotas`).
        Resplit: a class would have no photo in a split (its last one is gone, and no new
            photo of it arrived): only moving stored photos could mend it.
    """
    kept_units = kept.groupBy("content_sha256").agg(
        F.min("label").alias("stratum"), F.min("split").alias("split")
    )
    new_units = _units(good).join(
        kept_units.select("content_sha256"), "content_sha256", "left_anti"
    )
    have: dict[str, dict[str, int]] = {}
    for r in kept_units.groupBy("stratum", "split").count().collect():
        have.setdefault(r["stratum"], {})[r["split"]] = int(r["count"])
    new = {r["stratum"]: int(r["count"]) for r in new_units.groupBy("stratum").count().collect()}
    totals = {s: sum(have.get(s, {}).values()) + new.get(s, 0) for s in set(have) | set(new)}
    targets = split_quotas(totals, data.val_fraction, data.test_fraction, data.images)
    quotas, short = {}, []
    for stratum, (val, test) in targets.items():
        held, n_new = have.get(stratum, {}), new.get(stratum, 0)
        add_val = min(max(0, val - held.get("val", 0)), n_new)
        add_test = min(max(0, test - held.get("test", 0)), n_new - add_val)
        quotas[stratum] = (add_val, add_test)
        after = (
            held.get("val", 0) + add_val,
            held.get("test", 0) + add_test,
            held.get("train", 0) + n_new - add_val - add_test,
        )
        if not all(after):
            short.append(f"{stratum!r} (val, test, train: {after})")
    if short:
        raise Resplit(
            f"class(es) {', '.join(short)} would miss a split, and only moving photos already "
            "split can mend it"
        )
    return kept_units.select("content_sha256", "split").unionByName(
        _rank_splits(data, new_units, quotas)
    )
