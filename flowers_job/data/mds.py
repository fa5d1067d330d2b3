"""Mosaic Streaming (driver side): a Delta split -> MDS shards in the run's cache, and its plan.

The split is repartitioned to ``num_partitions`` and written with Mosaic's own
``streaming.base.converters.dataframe_to_mds`` (one MDS folder per Spark partition, written
on the executors, then one merged ``index.json``), uncompressed: the images are JPEG already.

StreamingDataset gives every rank the same number of samples per epoch and, when the
sample count does not divide by ``world_size``, repeats samples to get there
(``streaming.base.partition.orig``). That repetition is avoided here: the driver appends
``(-rows) mod world_size`` padding rows (copies of real rows with ``valid = 0``), so the
written count divides evenly and Streaming repeats nothing; the training loop masks
``valid = 0`` rows out of the loss, of every metric and of the row checksum. Every real row
is then read exactly once per epoch, checked on the workers against the count and checksum
computed here.
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from flowers_job.data.shards import CHECKSUM_MODULUS, DataError, ShardPlan, check_batch_fits

__all__ = ["MDS_COLUMNS", "remove_streaming_state", "write_mds"]

log = logging.getLogger(__name__)

MDS_COLUMNS = {"row_id": "int64", "image": "bytes", "label_index": "int64", "valid": "uint8"}
"""Columns of the MDS shards and their Mosaic encodings."""
SHARD_SIZE_LIMIT_BYTES = 1 << 26
"""Largest MDS shard file (bytes), Mosaic's default (64 MiB)."""


def write_mds(
    df: DataFrame,
    out: Path,
    *,
    world_size: int,
    num_partitions: int,
    per_device_batch_size: int,
    full_batches: bool,
    split: str,
) -> ShardPlan:
    """Write the rows of ``df`` (``row_id``, ``image``, ``label_index``) as MDS under ``out``.

    Args:
        df: the split's rows.
        out: a new local (or FUSE-mounted) directory visible to every rank.
        world_size: number of ranks; the written count is padded to a multiple of it.
        num_partitions: Spark partitions, hence MDS sub-folders, of the write.
        per_device_batch_size: images per rank per step.
        full_batches: require every rank to get at least one full batch (training).
        split: the split's name, for messages.

    Returns:
        The split's :class:`ShardPlan` (``loader="streaming"``): every rank reads
        ``padded_rows / world_size`` rows in ``ceil(that / per_device_batch_size)`` steps.

    Raises:
        DataError: an empty split, a batch larger than a rank's rows (with ``full_batches``),
            the volume filling up during the write (naming the directory), or MDS files that
            do not hold the rows written.
    """
    from streaming.base.converters import dataframe_to_mds

    stats = df.agg(
        F.count(F.lit(1)).alias("rows"),
        F.sum(F.pmod("row_id", F.lit(CHECKSUM_MODULUS))).alias("checksum"),
    ).first()
    rows = int(stats["rows"]) if stats is not None else 0
    if rows == 0:
        raise DataError(f"the {split} table is empty")
    checksum = int(stats["checksum"]) if stats is not None else 0
    padding = (-rows) % world_size
    data = df.withColumn("valid", F.lit(1).cast("tinyint"))
    if padding:
        pads = df.orderBy("row_id").limit(padding).withColumn("valid", F.lit(0).cast("tinyint"))
        data = data.unionByName(pads)
    per_rank = (rows + padding) // world_size
    check_batch_fits(
        [per_rank] * world_size, per_device_batch_size, world_size, split, full_batches
    )
    try:
        dataframe_to_mds(
            data.repartition(num_partitions),
            merge_index=True,
            mds_kwargs={
                "out": str(out),
                "columns": MDS_COLUMNS,
                "compression": None,
                "size_limit": SHARD_SIZE_LIMIT_BYTES,
            },
        )
    except Exception as exc:
        if "No space left on device" in str(exc):
            raise DataError(
                f"no space left for the loader cache of the {split} table in {out.parent}; "
                "free some space or set paths.petastorm_cache_url to a larger volume"
            ) from exc
        raise
    written = _index_samples(out)
    if written != rows + padding:
        raise DataError(
            f"the MDS shards of the {split} table under {out} hold {written} samples, "
            f"{rows} rows + {padding} padding were written"
        )
    steps = math.ceil(per_rank / per_device_batch_size)
    log.info(
        "%s: %d rows (+%d padding) as MDS in %d partitions, %d rows per rank, %d steps per epoch",
        split,
        rows,
        padding,
        num_partitions,
        per_rank,
        steps,
    )
    return ShardPlan(
        loader="streaming",
        cache_dir_url=out.resolve().as_uri(),
        dataset_size=rows,
        checksum=checksum,
        rows_per_shard=[per_rank] * world_size,
        checksum_per_shard=None,
        steps_per_epoch=steps,
        per_device_batch_size=per_device_batch_size,
        padding_rows=padding,
    )


def _index_samples(out: Path) -> int:
    """Samples listed by the merged ``index.json`` (and its per-partition indexes)."""
    import json

    index = json.loads((out / "index.json").read_text())
    return sum(int(shard["samples"]) for shard in index["shards"])


SHM_DIR = Path("/dev/shm")
"""Where POSIX shared memory appears as files (Linux)."""


def remove_streaming_state(cache_dir: Path) -> list[str]:
    """Remove the shared-memory blocks and lock files of Streaming datasets read from
    ``cache_dir`` on this host; the names removed.

    Each rank removes its datasets' state when it closes its loader, and the driver
    watchdog does when the driver dies; this is the driver's last sweep after the ranks are
    gone, for a rank that was killed before it could (SIGKILL, torchrun's escalation). A
    dataset's ``<prefix>_locals`` block lists its local directories (Streaming's
    ``shared/prefix.py`` format: int32 size, then the directories and the prefix joined by
    NUL); blocks that name a directory under ``cache_dir`` are this run's.
    """
    from tempfile import gettempdir

    root = str(cache_dir.resolve())
    removed: list[str] = []
    for locals_file in sorted(SHM_DIR.glob("[0-9][0-9][0-9][0-9][0-9][0-9]_locals")):
        try:
            data = locals_file.read_bytes()
            size = int.from_bytes(data[:4], sys.byteorder, signed=True)
            dirs = data[4:size].decode("utf-8", "replace").split("\0")[:-1]
        except OSError:
            continue
        if not any(d == root or d.startswith(root + "/") for d in dirs):
            continue
        prefix = locals_file.name.split("_", 1)[0]
        for path in [*SHM_DIR.glob(f"{prefix}_*"), *Path(gettempdir()).glob(f"{prefix}_*")]:
            try:
                path.unlink()
                removed.append(path.name)
            except OSError:
                continue
    if removed:
        log.warning("removed Streaming state left by a stopped rank: %s", ", ".join(removed))
    return removed
