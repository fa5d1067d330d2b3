"""The Delta loader's rank side without Spark: its epoch order
(:mod:`flowers_job.loaders.delta.order`) and :class:`DeltaReader` on real Delta tables that
delta-rs writes (on a disk, and in a bucket of a real S3 API server), with JPEGs of the real
photos: every row once per epoch across the ranks, the same pixels whichever process decodes
a step and after a restart inside the epoch, padding where a split is smaller than the
ranks' steps. The tables Spark writes, deletion vectors included, and the driver's plan:
tests/integration/test_delta_loader.py."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pytest
import torch

from flowers_job.config.data import DeltaConfig
from flowers_job.errors import ShardError
from flowers_job.loaders.base import Batch
from flowers_job.loaders.delta.order import rank_rows, shard_ranges
from flowers_job.loaders.delta.version_plan import DeltaPlan
from flowers_job.loaders.position import EpochStart
from flowers_job.vision.batch_decode import JPEG_KEY, LENGTH_KEY
from flowers_job.vision.decode_transform import DecodeTransform
from tests.support import LABELS, PHOTOS
from tests.support.data import needs_loader
from tests.support.s3 import fresh_bucket, s3_server  # noqa: F401

if TYPE_CHECKING:
    from flowers_job.loaders.delta.log import SplitFile

pytestmark = [
    pytest.mark.tier("gate"),
    pytest.mark.timeout(300),
    needs_loader("delta"),
]

ROWS = {"train": 46, "val": 10}
"""Rows of each split of the test table: two commits, so several files per split."""


def _photos() -> list[tuple[bytes, int]]:
    """Real photos as stored JPEG bytes with their label indices, as many as :data:`ROWS`."""
    found = []
    for label_index, label in enumerate(LABELS):
        for path in sorted((PHOTOS / label).glob("*.jpg"))[: -(-sum(ROWS.values()) // 5)]:
            found.append((path.read_bytes(), label_index))
    return found[: sum(ROWS.values())]


def _table(
    uri: str, storage_options: dict[str, str] | None = None, row_group_rows: int | None = None
) -> None:
    """The images table's shape (``row_id``, ``image``, ``label_index``, partitioned by
    ``split``) in two commits, written by delta-rs at ``uri``; ``row_group_rows``: the
    files' row groups (None: delta-rs's, one per file here)."""
    from deltalake import WriterProperties, write_deltalake

    photos = _photos()
    splits = [s for s, n in ROWS.items() for _ in range(n)]
    table = pa.table(
        {
            "row_id": pa.array([10_000 + 7 * i for i in range(len(photos))], pa.int64()),
            "image": pa.array([p[0] for p in photos], pa.binary()),
            "label_index": pa.array([p[1] for p in photos], pa.int64()),
            "split": splits,
        }
    )
    half = len(photos) // 2
    properties = WriterProperties(max_row_group_size=row_group_rows)
    for part, mode in [(table.slice(0, half), "error"), (table.slice(half), "append")]:
        write_deltalake(
            uri,
            part,
            partition_by=["split"],
            mode="append" if mode == "append" else "error",
            storage_options=storage_options,
            writer_properties=properties,
        )


def _plan(url: str, split: str, world_size: int, batch: int, rows: int | None = None) -> DeltaPlan:
    """The plan :meth:`DeltaLoader.plan_table` makes of ``split`` (its arithmetic; the
    driver's count is Spark's, tested with Spark)."""

    n = ROWS[split] if rows is None else rows
    real = [b - a for a, b in shard_ranges(n, world_size)]
    steps = math.ceil(max(real) / batch)
    padding = [max(0, steps - r) for r in real]
    return DeltaPlan(
        loader="delta",
        cache_dir_url=url,
        dataset_size=n,
        checksum=0,
        rows_per_shard=[r + p for r, p in zip(real, padding, strict=True)],
        checksum_per_shard=None,
        steps_per_epoch=steps,
        per_device_batch_size=batch,
        version=1,
        split=split,
        padding_per_shard=padding if any(padding) else None,
    )


def _read(
    plan: DeltaPlan,
    rank: int,
    epoch: int,
    *,
    shuffle: bool = True,
    workers: int = 0,
    transform: DecodeTransform | None = None,
    start: EpochStart | None = None,
) -> list[Batch]:
    """Rank ``rank``'s batches of ``epoch``, read as the rank reads them."""
    from flowers_job.loaders.delta.file_reader import DeltaReader

    reader = DeltaReader(
        plan,
        transform or DecodeTransform(True, 32, 36),
        rank=rank,
        shuffle=shuffle,
        seed=5,
        settings=DeltaConfig(shuffle_window_rows=8),
        workers=workers,
    )
    try:
        return list(reader.epoch(epoch, start))
    finally:
        reader.close()


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("delta") / "images"
    _table(str(path))
    return str(path)


def test_shard_ranges_cover_the_rows_once_in_balanced_parts() -> None:
    for rows, world_size in [(0, 3), (2, 4), (10, 3), (46, 2), (1_000_003, 8)]:
        ranges = shard_ranges(rows, world_size)
        assert ranges[0][0] == 0 and ranges[-1][1] == rows
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        lengths = [b - a for a, b in ranges]
        assert max(lengths) - min(lengths) <= 1 and len(ranges) == world_size


@pytest.mark.parametrize("shuffle", [True, False])
def test_every_row_is_in_one_rank_once_and_the_order_is_the_seeds(shuffle: bool) -> None:
    files = [5, 0, 17, 3, 40, 1]
    total = sum(files)

    def epoch(e: int, seed: int = 1) -> list[list[tuple[int, int]]]:
        return [
            list(zip(r.file.tolist(), r.row.tolist(), strict=True))
            for span in shard_ranges(total, 3)
            for r in [rank_rows(files, span, seed=seed, epoch=e, shuffle=shuffle, window=6)]
        ]

    every = sorted(x for rank in epoch(1) for x in rank)
    assert every == [(f, r) for f, n in enumerate(files) for r in range(n)]
    assert epoch(2) == epoch(2)  # a function of (seed, epoch)
    assert (epoch(1) != epoch(2)) == shuffle and (epoch(1, seed=2) != epoch(1)) == shuffle
    if not shuffle:  # the stored order, split into contiguous ranges
        assert [x for rank in epoch(1) for x in rank] == every


def test_a_window_mixes_only_its_own_rows() -> None:
    """Training shuffles each window of a rank's range: the window's rows are the ones of
    the same window of the files' order, so a rank holds at most a window's images."""
    files = [30, 30, 30]
    shuffled = rank_rows(files, (0, 90), seed=3, epoch=1, shuffle=True, window=16)
    plain = rank_rows(files, (0, 90), seed=3, epoch=1, shuffle=True, window=1)
    for w in range(0, 90, 16):
        got = set(
            zip(shuffled.file[w : w + 16].tolist(), shuffled.row[w : w + 16].tolist(), strict=True)
        )
        assert got == set(
            zip(plain.file[w : w + 16].tolist(), plain.row[w : w + 16].tolist(), strict=True)
        )


@pytest.mark.parametrize("world_size", [1, 3])
def test_each_epoch_reads_every_row_once_across_the_ranks(table: str, world_size: int) -> None:
    plan = _plan(table, "train", world_size, batch=4)
    ids = {10_000 + 7 * i for i in range(ROWS["train"])}
    orders = []
    for epoch in (1, 2):
        read: list[int] = []
        for rank in range(world_size):
            batches = _read(plan, rank, epoch)
            assert len(batches) == plan.steps_per_epoch
            assert sum(len(b["row_id"]) for b in batches) == plan.rows_per_shard[rank]
            for b in batches:
                assert (
                    b["image"].shape[1:] == (3, 32, 32)
                    and b["image"].dtype.is_floating_point is False
                )
                read += b["row_id"][b["valid"]].tolist()
        assert sorted(read) == sorted(ids)
        orders.append(read)
    assert orders[0] != orders[1]  # a new order every epoch


def test_a_step_has_the_same_pixels_in_any_process_and_after_a_restart(table: str) -> None:
    plan = _plan(table, "train", 2, batch=4)
    own = _read(plan, 1, 3)
    workers = _read(plan, 1, 3, workers=2)
    resumed = _read(plan, 1, 3, start=EpochStart(step=2, state={"step": 2}))
    assert len(resumed) == len(own) - 2
    for a, b in zip(own, workers, strict=True):
        assert a["row_id"].tolist() == b["row_id"].tolist()
        assert bool((a["image"] == b["image"]).all())
    for a, b in zip(own[2:], resumed, strict=True):
        assert a["row_id"].tolist() == b["row_id"].tolist()
        assert bool((a["image"] == b["image"]).all())


def test_files_of_many_row_groups_are_read_forward_once_a_window_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row groups of 3 rows read 2 rows a batch, windows of 8: each file a rank needs is
    opened once per epoch (once more for a restart's first window) and read forward, every
    row once across the ranks, and a restart inside the epoch reads the same steps."""
    from flowers_job.loaders.delta import file_reader

    uri = str(tmp_path / "images")
    _table(uri, row_group_rows=3)
    import pyarrow.parquet as pq

    assert max(pq.ParquetFile(f).metadata.num_row_groups for f in tmp_path.rglob("*.parquet")) > 3
    monkeypatch.setattr(file_reader, "BATCH_ROWS", 2)
    opened: list[str] = []
    real_cursor = file_reader._Cursor

    def counted(file: SplitFile, start: int, columns: list[str]) -> file_reader._Cursor:
        opened.append(file.url)
        return real_cursor(file, start, columns)

    monkeypatch.setattr(file_reader, "_Cursor", counted)
    plan = _plan(uri, "train", 2, batch=4)
    read = []
    for rank in range(2):
        opened.clear()
        batches = _read(plan, rank, 1)
        assert len(opened) == len(set(opened))  # no file opened twice in the epoch
        read += [i for b in batches for i in b["row_id"][b["valid"]].tolist()]
        resumed = _read(plan, rank, 1, start=EpochStart(step=5, state={"step": 5}))
        for a, b in zip(batches[5:], resumed, strict=True):
            assert a["row_id"].tolist() == b["row_id"].tolist()
            assert bool((a["image"] == b["image"]).all())
    assert sorted(read) == [10_000 + 7 * i for i in range(ROWS["train"])]


def test_a_split_smaller_than_the_ranks_steps_is_padded_never_empty(table: str) -> None:
    """10 val rows over 16 ranks: 6 ranks hold none, and read one padding row each."""
    plan = _plan(table, "val", 16, batch=8)
    read: list[int] = []
    for rank in range(16):
        batches = _read(plan, rank, 1, shuffle=False)
        assert [len(b["row_id"]) for b in batches] == [1]
        read += batches[0]["row_id"][batches[0]["valid"]].tolist()
        assert bool(batches[0]["valid"][0]) == (rank < 10)
    assert sorted(read) == [10_000 + 7 * i for i in range(ROWS["train"], sum(ROWS.values()))]


def test_undecoded_steps_carry_the_stored_jpegs(table: str) -> None:
    plan = _plan(table, "val", 2, batch=8)
    batches = _read(
        plan, 0, 1, shuffle=False, transform=DecodeTransform(False, 32, 36, undecoded=True)
    )
    b = batches[0]
    assert b[JPEG_KEY].dtype.is_floating_point is False and b[JPEG_KEY].shape[0] == 5
    first = bytes(b[JPEG_KEY][0, : int(b[LENGTH_KEY][0])].numpy())
    assert first[:2] == b"\xff\xd8"  # a JPEG


def test_rows_other_than_the_plans_are_refused_naming_the_rank(table: str) -> None:
    from flowers_job.loaders.delta.file_reader import DeltaReader

    plan = _plan(table, "train", 2, batch=4, rows=ROWS["train"] + 1)
    with pytest.raises(ShardError, match=r"rank 1: the train split of .* holds 46 live rows"):
        DeltaReader(
            plan,
            DecodeTransform(True, 32, 36),
            rank=1,
            shuffle=True,
            seed=0,
            settings=DeltaConfig(),
        )


def test_the_ranks_read_the_table_in_a_bucket(
    s3_server: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The table in a bucket of a real S3 API server (moto), named ``s3a://`` as Spark
    names it; the endpoint and credentials from the standard variables only."""
    store = fresh_bucket(s3_server)
    for key, value in store.env().items():
        monkeypatch.setenv(key, value)
    from flowers_job.loaders.delta.log import delta_uri, storage_options

    url = store.url("tables/images")
    _table(delta_uri(url), storage_options(url))
    plan = _plan(url, "train", 2, batch=4)
    read = [
        i
        for rank in range(2)
        for b in _read(plan, rank, 1)
        for i in b["row_id"][b["valid"]].tolist()
    ]
    assert sorted(read) == [10_000 + 7 * i for i in range(ROWS["train"])]
    assert np.all(np.diff(sorted(read)) == 7)


def test_the_embeddings_table_is_read_as_features_of_the_planned_key_and_views(
    tmp_path: Path,
) -> None:
    """A plan with a ``model_key`` reads the embeddings table's ``features`` of that key's
    planned views only (another key's rows and an unplanned view left unread): every
    (photo, view) row once per epoch across 2 ranks, float32 ``[B, F]`` batches, padding
    included, and the same batches after a restart inside the epoch."""
    from deltalake import write_deltalake

    uri, dim, photos = str(tmp_path / "embeddings"), 6, 13
    rows: dict[str, list[object]] = {k: [] for k in ("row_id", "features", "label_index")}
    parts: dict[str, list[str]] = {"model_key": [], "view": [], "split": []}
    for key, view, i in itertools.product(
        ("a|1", "b|2"), ("centre", "mirror", "zoom"), range(photos)
    ):
        rows["row_id"].append(500 + i)
        view_code, key_code = ("centre", "mirror", "zoom").index(view) + 1, key[-1]
        rows["features"].append([float(i), float(view_code), float(key_code), *([0.5] * (dim - 3))])
        rows["label_index"].append(i % 5)
        for name, value in (("model_key", key), ("view", view), ("split", "train")):
            parts[name].append(value)
    table = pa.table(
        {
            "row_id": pa.array(rows["row_id"], pa.int64()),
            "features": pa.array(rows["features"], pa.list_(pa.float32())),
            "label_index": pa.array(rows["label_index"], pa.int32()),
            **parts,
        }
    )
    write_deltalake(uri, table, partition_by=["model_key", "view", "split"])
    base = _plan(uri, "train", 2, batch=4, rows=2 * photos)
    plan = DeltaPlan(
        **{**base.to_dict(), "version": 0, "model_key": "a|1", "views": ["centre", "mirror"]}
    )
    seen: list[tuple[int, float]] = []
    for rank in range(2):
        batches = _read(plan, rank, 1)
        assert len(batches) == plan.steps_per_epoch
        for b in batches:
            assert b["features"].dtype == torch.float32 and b["features"].shape[1] == dim
            assert "image" not in b
            keep = b["valid"].numpy()
            feats = b["features"].numpy()[keep]
            assert (b["row_id"].numpy()[keep] == 500 + feats[:, 0]).all()
            assert (feats[:, 2] == 1.0).all()  # key a|1 only
            seen += [
                (int(r), float(v))
                for r, v in zip(b["row_id"].numpy()[keep], feats[:, 1], strict=True)
            ]
        again = _read(plan, rank, 1, start=EpochStart(step=2, state={"step": 2}))
        assert all(
            torch.equal(x["features"], y["features"]) and torch.equal(x["row_id"], y["row_id"])
            for x, y in zip(batches[2:], again, strict=True)
        )
    # each photo's centre (1) and mirror (2) once, never its zoom (3)
    assert sorted(seen) == sorted((500 + i, float(v)) for i in range(photos) for v in (1, 2))
