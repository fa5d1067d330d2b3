"""Mosaic Streaming (``data.loader=streaming``): both sides of the loader.

**Driver side.** Each split is repartitioned to ``num_partitions`` and written, uncompressed
(the images are JPEG already), with Mosaic's own ``dataframe_to_mds`` (one MDS folder per
Spark partition, written on the executors, then one merged ``index.json``).
StreamingDataset gives every rank the same number of samples per epoch and, when the count
does not divide by ``world_size``, repeats samples (``streaming.base.partition.orig``).
Instead, the driver appends ``(-rows) mod world_size`` padding rows (copies of real rows
with ``valid = 0``), so Streaming repeats nothing; the training loop masks them out of the
loss, every metric and the row checksum. Every real row is read exactly once per epoch,
checked on the ranks against the count and checksum computed here.

**An entry grown by appending** (:meth:`StreamingLoader.append`) holds several MDS folders,
one per segment; the new one is padded so that all samples divide by ``world_size``. The
ranks read them as one ``StreamingDataset`` of several ``Stream``s and mask the deletion
list's dead rows like padding (``valid = 0``): every rank still reads the same number of
rows, every live row once.

**Rank side.** :class:`StreamingReader`: ``StreamingDataset`` and ``StreamingDataLoader``;
Streaming splits (and, for training, shuffles) the whole split across the ranks every
epoch. It needs the same number of ranks on every host
(:meth:`StreamingLoader.check_layout`), and reads with the shard of
:class:`~flowers_job.runtime.layout.HostLayout` as its rank. A checkpoint inside an epoch resumes
through Streaming's own ``sample_in_epoch``; the cache is written per world size (its padding
and partitions), so at another world size that epoch starts again (``train/resume.py``).

The stack: ``mosaicml-streaming``, pre-installed on Databricks Runtime ML 15.2 and later
(0.12.0 on 17.3 LTS), without its ``spark`` extra, which pins ``pyspark<4``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import tempfile
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowers_job.errors import DataError, ShardError
from flowers_job.loaders.base import (
    SEGMENT_COLUMN,
    Batch,
    Deletions,
    Loader,
    ShardPlan,
    check_batch_fits,
    live_mask,
    read_deletions,
    row_stats,
)
from flowers_job.loaders.position import CursorReader, EpochCursor, EpochStart, epoch_seed
from flowers_job.loaders.streaming.library import import_streaming
from flowers_job.loaders.streaming.remote import (
    dataset_source,
    enter_host_cache,
    leave_host_cache,
    mds_out,
)
from flowers_job.location import Location
from flowers_job.runtime.parent_watch import at_driver_death
from flowers_job.vision.batch_decode import JPEG_KEY, LENGTH_KEY

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from flowers_job.config import LoadersConfig
    from flowers_job.config.model import StreamingConfig
    from flowers_job.runtime.layout import HostLayout
    from flowers_job.vision.decode_transform import DecodeTransform

__all__ = [
    "MDS_COLUMNS",
    "StreamingLoader",
    "StreamingPlan",
    "StreamingReader",
    "import_streaming",
    "remove_streaming_state",
    "write_mds",
]

log = logging.getLogger(__name__)

MDS_COLUMNS = {
    "row_id": "int64",
    "image": "bytes",
    "label_index": "int64",
    "valid": "uint8",
    SEGMENT_COLUMN: "int64",
}
"""Columns of the MDS shards and their Mosaic encodings."""
SHARD_SIZE_LIMIT_BYTES = 1 << 26
"""Largest MDS shard file (bytes), Mosaic's default (64 MiB)."""
SHM_DIR = Path("/dev/shm")
"""Where POSIX shared memory appears as files (Linux)."""


@dataclass(frozen=True)
class StreamingPlan(ShardPlan):
    """A :class:`ShardPlan` plus the padding rows appended with ``valid = 0`` so that the
    written count divides by ``world_size``."""

    padding_rows: int = 0


class StreamingLoader(Loader):
    """Mosaic's MDS writer on the driver, ``StreamingDataset`` on the ranks."""

    name = "streaming"
    distribution = "mosaicml-streaming"
    module = "streaming"
    extra = "flowers-job[streaming]"
    plan_type = StreamingPlan

    @classmethod
    def import_library(cls) -> types.ModuleType:
        return import_streaming()

    def write(
        self, spark: SparkSession, df: DataFrame, cache_dir: Location, split: str
    ) -> ShardPlan:
        """Write ``df`` as MDS shards in ``<cache>/mds-<split>`` (:func:`write_mds`).

        Raises:
            DataError: as :func:`write_mds`.
        """
        sharding = self.sharding
        return write_mds(
            df,
            cache_dir / f"mds-{split}",
            world_size=sharding.world_size,
            num_partitions=sharding.num_partitions,
            per_device_batch_size=sharding.per_device_batch_size,
            full_batches=split == "train",
            split=split,
        )

    def append(
        self,
        spark: SparkSession,
        base: ShardPlan,
        current: DataFrame,
        added: DataFrame,
        deletions: DataFrame,
        cache_dir: Location,
        split: str,
    ) -> ShardPlan:
        """``base``'s MDS folders, then ``added`` written as MDS under
        ``<cache_dir>/mds-<split>`` with the padding rows (``valid = 0``) that make the
        samples of all segments divide by ``world_size``. The ranks read every segment as
        one ``StreamingDataset`` of several streams and mask the dead rows like padding
        (:func:`~flowers_job.loaders.base.live_mask`): every rank still reads
        ``samples / world_size`` rows, every live row once. ``deletions`` is not read here:
        the live rows' count and checksum are ``current``'s.

        Raises:
            DataError: a batch larger than a rank's rows (training), or MDS files that do
                not hold the rows written.
        """
        from pyspark.sql import functions as F

        assert isinstance(base, StreamingPlan), base
        sharding = self.sharding
        world_size = sharding.world_size
        rows, checksum = row_stats(current)
        dirs = [*base.segment_dirs, base.cache_dir_url]
        stored = sum(_index_samples(Location.of(d)) for d in dirs)
        n_added = added.count()
        padding = (-(stored + n_added)) % world_size
        if n_added:
            out = cache_dir / f"mds-{split}"
            data = added.withColumn("valid", F.lit(1).cast("tinyint"))
            if padding:  # copies of added rows, as many times as needed
                copies = -(-padding // n_added)
                pads = (
                    added.crossJoin(spark.range(copies).withColumnRenamed("id", "_copy"))
                    .drop("_copy")
                    .limit(padding)
                    .withColumn("valid", F.lit(0).cast("tinyint"))
                )
                data = data.unionByName(pads)
            _write_frame(data, out, min(sharding.num_partitions, n_added + padding), split)
            written = _index_samples(out)
            if written != n_added + padding:
                raise DataError(
                    f"the MDS shards of the rows added to the {split} table under {out} hold "
                    f"{written} samples, {n_added} rows + {padding} padding were written"
                )
            dirs.append(out.as_uri())
        per_rank = (stored + n_added + padding) // world_size
        batch = sharding.per_device_batch_size
        check_batch_fits([per_rank] * world_size, batch, world_size, split, split == "train")
        return StreamingPlan(
            loader=self.name,
            cache_dir_url=dirs[-1],
            dataset_size=rows,
            checksum=checksum,
            rows_per_shard=[per_rank] * world_size,
            checksum_per_shard=None,
            steps_per_epoch=math.ceil(per_rank / batch),
            per_device_batch_size=batch,
            segment_dirs=dirs[:-1],
            padding_rows=base.padding_rows + padding,
        )

    def release(self, cache_dir: Path | None) -> None:
        """The driver's last sweep of this host's Streaming state once the ranks are gone."""
        if cache_dir is not None:
            remove_streaming_state(cache_dir)

    @classmethod
    def sweep(cls, cache_dir: Path) -> list[str]:
        return remove_streaming_state(cache_dir)

    places_ranks = True

    @classmethod
    def check_layout(cls, layout: HostLayout) -> None:
        """Mosaic Streaming needs the same number of ranks on every host (its nodes are
        equal); in which order Spark placed them does not matter (:class:`HostLayout`)."""
        if not layout.equal:
            raise RuntimeError(
                "data.loader=streaming: Mosaic Streaming needs the same number of ranks on "
                f"every host, and this run's ranks are placed unequally ({layout.describe()}): "
                "use data.loader=petastorm, or a distributed.num_processes that fills every "
                "host's task slots equally (executors of equal size, one slot per GPU)"
            )

    @classmethod
    def memory_settings(cls, settings: LoadersConfig) -> dict[str, str]:
        """The prefetch depth: batches each reader holds decoded ahead of the loop."""
        return {"loaders.streaming.prefetch_batches": str(settings.streaming.prefetch_batches)}

    # Arguments: the loader interface's calls (Loader.open, Loader.append): their arguments are the
    # interface's.
    @classmethod
    def open(  # noqa: PLR0913
        cls,
        plan: ShardPlan,
        transform: DecodeTransform,
        *,
        rank: int,
        world_size: int,
        num_nodes: int,
        shuffle: bool,
        seed: int,
        settings: LoadersConfig,
        workers: int,
        pin_memory: bool = False,
    ) -> StreamingReader:
        """``StreamingDataset`` reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
        ``LOCAL_WORLD_SIZE`` from the environment when it is built
        (:func:`flowers_job.runtime.process_group.describe_hosts` sets the last two; ``RANK`` is set
        to the shard ``rank`` while it is built)."""
        logging.getLogger("streaming").setLevel(logging.WARNING)  # per-dataset INFO lines
        return StreamingReader(
            plan,
            transform,
            shuffle=shuffle,
            seed=seed,
            rank=rank,
            num_nodes=num_nodes,
            num_workers=workers,
            prefetch_factor=settings.streaming.prefetch_batches,
            pin_memory=pin_memory,
            settings=settings.streaming,
        )


def write_mds(
    df: DataFrame,
    out: Location | Path,
    *,
    world_size: int,
    num_partitions: int,
    per_device_batch_size: int,
    full_batches: bool,
    split: str,
) -> StreamingPlan:
    """Write the rows of ``df`` (``row_id``, ``image``, ``label_index``) as MDS under ``out``.

    Args:
        df: the split's rows.
        out: a new directory visible to every rank: local (or FUSE-mounted), or in an
            object store (:mod:`flowers_job.loaders.streaming.remote`).
        world_size: number of ranks; the written count is padded to a multiple of it.
        num_partitions: Spark partitions, hence MDS sub-folders, of the write.
        per_device_batch_size: images per rank per step.
        full_batches: require every rank to get at least one full batch (training).
        split: the split's name, for messages.

    Returns:
        The split's :class:`StreamingPlan`: every rank reads ``padded_rows / world_size``
        rows in ``ceil(that / per_device_batch_size)`` steps.

    Raises:
        DataError: an empty split, a batch larger than a rank's rows (with ``full_batches``),
            the volume filling up during the write (naming the directory), or MDS files that
            do not hold the rows written.
    """
    from pyspark.sql import functions as F

    import_streaming()
    out = Location.of(out)
    rows, checksum = row_stats(df)
    if rows == 0:
        raise DataError(f"the {split} table is empty")
    padding = (-rows) % world_size
    if SEGMENT_COLUMN not in df.columns:  # rows not from the images table (benchmarks)
        df = df.withColumn(SEGMENT_COLUMN, F.lit(0).cast("long"))
    data = df.withColumn("valid", F.lit(1).cast("tinyint"))
    if padding:
        # the rows with the smallest ids, found by sorting row_id alone (not the images)
        first_ids = df.select("row_id").orderBy("row_id").limit(padding)
        pads = df.join(F.broadcast(first_ids), "row_id", "left_semi").withColumn(
            "valid", F.lit(0).cast("tinyint")
        )
        data = data.unionByName(pads)
    per_rank = (rows + padding) // world_size
    check_batch_fits(
        [per_rank] * world_size, per_device_batch_size, world_size, split, full_batches
    )
    _write_frame(data, out, num_partitions, split)
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
    return StreamingPlan(
        loader=StreamingLoader.name,
        cache_dir_url=out.as_uri(),
        dataset_size=rows,
        checksum=checksum,
        rows_per_shard=[per_rank] * world_size,
        checksum_per_shard=None,
        steps_per_epoch=steps,
        per_device_batch_size=per_device_batch_size,
        padding_rows=padding,
    )


def _write_frame(data: DataFrame, out: Location, num_partitions: int, split: str) -> None:
    """``dataframe_to_mds`` of ``data`` (:data:`MDS_COLUMNS`) in ``num_partitions`` Spark
    partitions, uncompressed, with one merged ``index.json``.

    In an object store, each task writes its shards in a temp folder and uploads them
    (``keep_local=False``: each file is removed once uploaded), and the partitions' indexes
    are merged from the store (``merge_index(out)``). With ``merge_index=True`` instead,
    ``dataframe_to_mds`` keeps every task's shards on its host's disk for the merge, and
    removes them afterwards only on the driver's host: on a cluster each executor would
    keep a copy of its part of the cache in its temp folder for good (docs/known-issues.md).

    Raises:
        DataError: the volume filled up (naming the directory).
    """
    import_streaming()
    from streaming.base.converters import dataframe_to_mds
    from streaming.base.util import merge_index

    target = mds_out(out.url)
    remote = {} if out.is_local else {"keep_local": False}
    try:
        dataframe_to_mds(
            data.repartition(num_partitions),
            merge_index=out.is_local,
            mds_kwargs={
                "out": target,
                "columns": MDS_COLUMNS,
                "compression": None,
                "size_limit": SHARD_SIZE_LIMIT_BYTES,
                **remote,
            },
        )
        if remote:
            merge_index(target, keep_local=False)
    except Exception as exc:
        if "No space left on device" in str(exc):
            raise DataError(
                f"no space left for the loader cache of the {split} table in {out.parent}; "
                "free some space or set paths.cache_url to a larger volume"
            ) from exc
        raise


def _index_samples(out: Location) -> int:
    """Samples listed by the merged ``index.json`` (and its per-partition indexes)."""
    index = json.loads((out / "index.json").read_text())
    return sum(int(shard["samples"]) for shard in index["shards"])


def remove_streaming_state(cache_dir: Path) -> list[str]:
    """Remove the shared-memory blocks and lock files of Streaming datasets read from
    ``cache_dir`` on this host; the names removed.

    Each rank removes its datasets' state when it closes its reader, and the driver
    watchdog does when the driver dies; this is the driver's last sweep after the ranks are
    gone, for a rank that was killed before it could (SIGKILL, torchrun's escalation). A
    dataset's ``<prefix>_locals`` block lists its local directories (Streaming's
    ``shared/prefix.py`` format: int32 size, then the directories and the prefix joined by
    NUL); blocks that name a directory under ``cache_dir`` are this run's.
    """
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
        for path in [
            *SHM_DIR.glob(f"{prefix}_*"),
            *Path(tempfile.gettempdir()).glob(f"{prefix}_*"),
        ]:
            try:
                path.unlink()
                removed.append(path.name)
            except OSError:
                continue
    if removed:
        log.warning("removed Streaming state left by a stopped rank: %s", ", ".join(removed))
    return removed


class StreamingReader(CursorReader):
    """Mosaic Streaming: ``StreamingDataset`` + ``StreamingDataLoader`` over the MDS shards.

    Built once per split and process (building it is a collective: every rank builds the
    same datasets in the same order). Streaming partitions the epoch's sample ids over the
    ranks (``partition_algo='orig'``); with the driver's padding every rank gets
    ``rows_per_shard[rank]`` rows and no sample is repeated. The epoch is set through
    Streaming's own resume state (``load_state_dict``) before each pass, so its shuffle
    (``py1e``, seeded by ``shuffle_seed + epoch``) is a function of ``(seed, epoch)``.
    """

    # Arguments: the loader interface's calls (Loader.open, Loader.append): their arguments are the
    # interface's.
    def __init__(  # noqa: PLR0913
        self,
        plan: ShardPlan,
        transform: DecodeTransform,
        *,
        shuffle: bool,
        seed: int,
        num_nodes: int,
        rank: int = 0,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        pin_memory: bool = False,
        settings: StreamingConfig | None = None,
    ) -> None:
        import torch

        from flowers_job.runtime.process_group import shard_environment

        import_streaming()
        from streaming import StreamingDataLoader

        self.plan, self.steps_per_epoch, self.seed = plan, plan.steps_per_epoch, seed
        self.num_nodes, self.rank = num_nodes, rank
        self.deletions: Deletions | None = read_deletions(plan.deletions_url)
        with shard_environment(rank):  # Streaming's node: RANK // LOCAL_WORLD_SIZE
            self.sources = [
                dataset_source(url, settings) for url in [*plan.segment_dirs, plan.cache_dir_url]
            ]
            for source in self.sources:
                enter_host_cache(source)
            self.dataset = _decoding_dataset(
                **_dataset_kwargs(self.sources),
                transform=transform,
                batch_size=plan.per_device_batch_size,
                shuffle=shuffle,
                shuffle_seed=seed,
                num_canonical_nodes=num_nodes,
            )
        at_driver_death(self._release)  # os._exit skips atexit: no shared memory left
        self.loader = StreamingDataLoader(
            self.dataset,
            batch_size=plan.per_device_batch_size,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            pin_memory=pin_memory,
            persistent_workers=False,
            drop_last=False,
            # worker seeds from its own generator: a draw from the loader's stream shifts it
            generator=torch.Generator().manual_seed(seed),
            collate_fn=collate_jpegs if transform.undecoded else None,
        )

    def epoch(self, epoch: int, start: EpochStart | None = None) -> Iterator[Batch]:
        """The epoch's batches (:meth:`ShardReader.epoch`); from a mid-epoch ``start``,
        without the samples all ranks consumed (steps x batch x ranks), unread."""
        first = start.step if start is not None else 0
        world_size = len(self.plan.rows_per_shard)
        self.dataset.load_state_dict(
            {
                "epoch": epoch - 1,
                "sample_in_epoch": first * self.plan.per_device_batch_size * world_size,
                "num_canonical_nodes": self.num_nodes,
                "shuffle_seed": self.seed,
                "initial_physical_nodes": self.num_nodes,
            }
        )
        self._cursor = cursor = EpochCursor(epoch_seed(self.seed, epoch, self.rank))
        if start is not None:  # Streaming skipped the samples; the stream continues
            cursor.restore(start)
        for batch in cursor.wrap(lambda: self.loader):
            if cursor.step > self.steps_per_epoch:
                raise ShardError(
                    f"Streaming yielded more than the planned {self.steps_per_epoch} batches"
                )
            images = {k: batch[k] for k in ("image", JPEG_KEY, LENGTH_KEY) if k in batch}
            row_id = batch["row_id"].long()
            valid = batch["valid"].bool()
            if self.deletions is not None:  # dead rows count as padding
                valid &= live_mask(row_id, batch[SEGMENT_COLUMN].long(), self.deletions)
            yield {
                **images,
                "label_index": batch["label_index"].long(),
                "row_id": row_id,
                "valid": valid,
            }
        if cursor.step != self.steps_per_epoch:
            raise ShardError(
                f"Streaming yielded {cursor.step - first} batches from step {first}, the plan "
                f"expects {self.steps_per_epoch}"
            )

    def close(self) -> None:
        """Remove the lock files Streaming leaves in the temp dir: it never removes them, and
        every later run on the host then skips their prefix. Its shared-memory blocks go
        with Streaming's own ``atexit`` handlers when the process exits."""
        import_streaming()
        from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK

        for source in self.sources:
            leave_host_cache(source)
        prefix = getattr(self.dataset, "_shm_prefix_int", None)
        if prefix is None:
            return
        for name in (BARRIER_FILELOCK, CACHE_FILELOCK):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(tempfile.gettempdir(), f"{prefix:06}_{name}"))

    def _release(self) -> None:
        """The watchdog's cleanup: ``os._exit`` skips the ``atexit`` handlers, so unlink
        Streaming's shared-memory blocks here, then remove the lock files."""
        from multiprocessing import shared_memory

        import_streaming()
        from streaming.base.constant import SHM_TO_CLEAN

        prefix = getattr(self.dataset, "_shm_prefix_int", None)
        for name in SHM_TO_CLEAN if prefix is not None else ():
            with contextlib.suppress(OSError, ValueError):
                block = shared_memory.SharedMemory(f"{prefix:06}_{name}")
                block.close()
                block.unlink()
        self.close()


def collate_jpegs(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The DataLoader's collate for undecoded samples (``image``: uint8 ``[length]``): the
    JPEGs as ``jpeg`` uint8 ``[B, longest]`` zero-padded rows and ``jpeg_length`` int64
    ``[B]`` (:mod:`flowers_job.vision.batch_decode`); the other columns as torch collates
    them. Module-level: DataLoader worker processes pickle it."""
    import torch
    from torch.nn.utils.rnn import pad_sequence
    from torch.utils.data import default_collate

    jpegs = [s.pop("image") for s in samples]
    batch: dict[str, Any] = default_collate(samples)
    batch[JPEG_KEY] = pad_sequence(jpegs, batch_first=True)
    batch[LENGTH_KEY] = torch.tensor([len(j) for j in jpegs], dtype=torch.int64)
    return batch


def _dataset_kwargs(sources: list[dict[str, Any]]) -> dict[str, Any]:
    """``StreamingDataset``'s arguments for the segments' ``sources``
    (:func:`~flowers_job.loaders.streaming.remote.dataset_source`): one segment as before
    (``local``, ``remote``, ``cache_limit``); several as ``streams``, one ``Stream`` each,
    every sample once per epoch (no ``proportion``, ``repeat`` or ``choose``)."""
    if len(sources) == 1:
        return dict(sources[0])
    import_streaming()
    from streaming import Stream

    streams = [Stream(remote=s.get("remote"), local=s["local"]) for s in sources]
    limits = {s.get("cache_limit") for s in sources}
    return {"streams": streams, **({"cache_limit": limits.pop()} if limits != {None} else {})}


def _decoding_dataset(transform: DecodeTransform, **kwargs: Any) -> Any:
    """A ``StreamingDataset`` whose samples come out decoded: ``image`` uint8 ``[3, S, S]``."""
    import_streaming()
    from streaming import StreamingDataset

    class DecodingDataset(StreamingDataset):
        def get_item(self, sample_id: int, retry: int = 7) -> Any:
            sample = super().get_item(sample_id, retry)
            sample["image"] = transform.decode(sample["image"])
            return sample

    return DecodingDataset(partition_algo="orig", **kwargs)
