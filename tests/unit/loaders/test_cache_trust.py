"""Nothing planted in a loader cache folder runs in the job: Petastorm's ranks open only the
plan's own Parquet files (never a folder, whose ``_common_metadata`` Petastorm would
unpickle), and the cache refuses a published entry that this job did not write.

The planted pickle is live: Petastorm's own ``get_schema_from_dataset_url`` on the folder
runs it (the last test shows it), so a test that opened the folder would fail here.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any, cast

import pytest

from flowers_job.config import JobConfig, load_config
from flowers_job.errors import DataError
from flowers_job.loaders.base import Sharding
from flowers_job.loaders.cache_dir import CACHE_FORMAT, LoaderCache
from flowers_job.loaders.cache_marker import ENTRIES, ENTRY_FILE
from flowers_job.location import Location
from flowers_job.vision.decode_transform import DecodeTransform
from tests.support import LABELS, PHOTOS
from tests.support.data import loader_skip_reason

pytestmark = [pytest.mark.timeout(300), pytest.mark.tier("gate")]
_PETASTORM = loader_skip_reason("petastorm")
petastorm_only = pytest.mark.skipif(_PETASTORM is not None, reason=str(_PETASTORM))

UNISCHEMA_KEY = b"dataset-toolkit.unischema.v1"
"""The metadata key Petastorm unpickles its schema from (petastorm.etl.dataset_metadata)."""


class _Planted:
    """A pickle that creates ``marker`` when unpickled: through ``builtins.exec``, which
    Petastorm's "restricted" unpickler allows."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _planted_cache(folder: Path, marker: Path, rows_per_file: int = 3) -> list[str]:
    """A Petastorm cache as the job writes it (two ``part-*.parquet`` files: ``row_id``,
    ``image`` of real JPEGs, ``label_index``), with the planted pickle under Petastorm's key
    in every file's footer, in ``_common_metadata`` and in ``_metadata``. Returns the files'
    ``file://`` URLs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    photos = sorted((PHOTOS / LABELS[0]).glob("*.jpg"))[: 2 * rows_per_file]
    payload = pickle.dumps(_Planted(marker), protocol=2)
    folder.mkdir(parents=True)
    urls = []
    for i in range(2):
        ids = range(i * rows_per_file, (i + 1) * rows_per_file)
        table = pa.table(
            {
                "row_id": pa.array(ids, pa.int64()),
                "image": pa.array([photos[j].read_bytes() for j in ids], pa.binary()),
                "label_index": pa.array([0] * rows_per_file, pa.int64()),
            }
        ).replace_schema_metadata({UNISCHEMA_KEY: payload})
        path = folder / f"part-{i:05d}-0a1b-c000.parquet"
        pq.write_table(table, path)
        urls.append(path.resolve().as_uri())
    for name in ("_common_metadata", "_metadata"):
        pq.write_metadata(table.schema, folder / name)
    return urls


def _plan(folder: Path, urls: list[str]) -> Any:
    from flowers_job.loaders.petastorm.plan import PetastormPlan

    return PetastormPlan(
        loader="petastorm",
        cache_dir_url=folder.resolve().as_uri(),
        dataset_size=6,
        checksum=sum(range(6)),
        rows_per_shard=[6],
        checksum_per_shard=[sum(range(6))],
        steps_per_epoch=2,
        per_device_batch_size=3,
        file_urls=urls,
    )


def _rows(plan: Any) -> list[int]:
    from flowers_job.loaders.petastorm.logs import quiet_petastorm
    from flowers_job.loaders.petastorm.reader import shard_batches

    quiet_petastorm()
    tf = DecodeTransform(False, 32, 37)
    batches = shard_batches(plan, 0, 1, tf, shuffle=False, seed=0)
    return sorted(i for b in batches for i in b["row_id"].tolist())


@petastorm_only
def test_the_ranks_read_the_plans_files_and_unpickle_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    folder = tmp_path / "petastorm-train"
    urls = _planted_cache(folder, marker)
    assert _rows(_plan(folder, urls)) == list(range(6))
    assert not marker.exists()


@petastorm_only
@pytest.mark.parametrize(
    "tamper",
    ["the folder", "a folder named as a part", "a file outside", "a file named twice", "none"],
)
def test_a_plan_that_names_anything_but_its_own_files_is_refused_unopened(
    tmp_path: Path, tamper: str
) -> None:
    marker = tmp_path / "unpickled"
    folder = tmp_path / "petastorm-train"
    urls = _planted_cache(folder, marker)
    other = tmp_path / "elsewhere"
    _planted_cache(other, marker)
    named_part = folder / "part-00009-x.parquet"
    if tamper == "a folder named as a part":
        named_part.symlink_to(other, target_is_directory=True)
    file_urls = {
        "the folder": [folder.resolve().as_uri()],
        "a folder named as a part": [named_part.as_uri()],
        "a file outside": [urls[0], (other / Path(urls[1]).name).as_uri()],
        "a file named twice": [urls[0], urls[0]],
        "none": [],
    }[tamper]
    with pytest.raises(DataError, match="Petastorm") as err:
        _rows(_plan(folder, file_urls))
    assert "remove the cache entry" in str(err.value) or "names no Parquet" in str(err.value)
    assert not marker.exists()


@petastorm_only
def test_the_planted_pickle_runs_when_petastorm_opens_the_folder(tmp_path: Path) -> None:
    """The control: what the checks keep the ranks from doing."""
    from petastorm.etl.dataset_metadata import get_schema_from_dataset_url

    marker = tmp_path / "unpickled"
    folder = tmp_path / "petastorm-train"
    _planted_cache(folder, marker)
    get_schema_from_dataset_url(folder.resolve().as_uri())
    assert marker.exists()


FIELDS = {"table": "/t/images", "version": 3, "split": "train", "loader": "petastorm"}


def _cfg(tmp_path: Path) -> JobConfig:
    return load_config(
        None,
        ["data.loader=petastorm", f"paths.cache_url={(tmp_path / 'cache').resolve().as_uri()}"],
        **{"paths.output_dir": tmp_path / "out"},
    )


DATA = "data-run-0a1b2c3d4e5f"


def _entry(
    root: Path, fields: dict[str, Any] | None, plan: dict[str, Any], data: str = DATA
) -> Path:
    """A published entry of ``root``, as :meth:`LoaderCache._write` leaves one (its marker
    holds ``fields`` with the cache format added; none when ``fields`` is None). ``{entry}``
    in the plan's strings stands for the entry's data folder."""
    from flowers_job.loaders.cache_marker import entry_key

    name = f"petastorm-train-v3-{entry_key({**FIELDS, 'cache_format': CACHE_FORMAT})}"
    entry = root / ENTRIES / name
    (entry / DATA).mkdir(parents=True)
    here = f"{{cache}}/{ENTRIES}/{name}/{data}"
    stored = json.loads(json.dumps(plan).replace("{entry}", here))
    marker: dict[str, Any] = {"bytes": 1, "data": data, "segments": [[name, data]], "plan": stored}
    if fields is not None:
        marker["fields"] = {**fields, "cache_format": CACHE_FORMAT}
    (entry / ENTRY_FILE).write_text(json.dumps(marker))
    return entry


def _split(tmp_path: Path) -> Any:
    from flowers_job.loaders.petastorm.loader import PetastormLoader

    cfg = _cfg(tmp_path)
    root = tmp_path / "cache"
    cache = LoaderCache(cfg.cache, Location.of(root), "run-test", Location.of(root / "run-test"))

    def written() -> Any:
        raise AssertionError("a published entry is reused, never written again")

    sharding = Sharding(cfg.world_size, cfg.num_partitions, cfg.train.per_device_batch_size)
    loader = PetastormLoader(sharding, "/t/images")
    plan, use = cache.split(cast(Any, None), loader, "train", FIELDS, written, 0)
    return plan, use


def _stored_plan(files: list[str]) -> dict[str, Any]:
    return {
        "loader": "petastorm",
        "cache_dir_url": "{entry}",
        "dataset_size": 6,
        "checksum": 15,
        "rows_per_shard": [6],
        "checksum_per_shard": [15],
        "steps_per_epoch": 2,
        "per_device_batch_size": 3,
        "file_urls": files,
        "max_image_bytes": 0,
    }


@petastorm_only
def test_an_entry_this_job_wrote_is_reused(tmp_path: Path) -> None:
    entry = _entry(tmp_path / "cache", FIELDS, _stored_plan(["{entry}/part-00000-a.parquet"]))
    plan, use = _split(tmp_path)
    data = (entry / DATA).resolve().as_uri()
    assert use.reused and plan.file_urls == [f"{data}/part-00000-a.parquet"]
    assert plan.cache_dir_url == data


@petastorm_only
@pytest.mark.parametrize(
    ("fields", "files", "data", "what"),
    [
        (None, ["{entry}/part-00000-a.parquet"], DATA, "entry.json does not describe"),
        ({**FIELDS, "version": 4}, ["{entry}/part-00000-a.parquet"], DATA, "does not describe"),
        (FIELDS, ["file:///dbfs/tmp/evil"], DATA, "names 'file:///dbfs/tmp/evil', outside"),
        (FIELDS, ["{entry}/../../evil/part-0.parquet"], DATA, "outside the entry"),
        (FIELDS, ["{entry}/part-00000-a.parquet"], "../../evil", "no data folder of its own"),
        (FIELDS, ["{entry}/part-00000-a.parquet"], "elsewhere", "no data folder of its own"),
    ],
)
def test_an_entry_this_job_did_not_write_is_refused(
    tmp_path: Path, fields: dict[str, Any] | None, files: list[str], data: str, what: str
) -> None:
    entry = _entry(tmp_path / "cache", fields, _stored_plan(files), data)
    with pytest.raises(DataError, match="not written by this job") as err:
        _split(tmp_path)
    assert what in str(err.value) and str(entry) in str(err.value)
    assert (entry / ENTRY_FILE).is_file()  # left as it is: someone else's folder
