"""``data.images`` in an object store: ingest lists and reads
``s3a://bucket/photos`` through pyarrow on the executors, against a real S3 server (moto's
``ThreadedMotoServer``), with every key in the images or the quarantine table, and
incremental re-runs as for a folder.

The tests' Spark session has no ``hadoop-aws`` jar, so Spark's own file sources cannot read
``s3a://`` there: an ingest that passes here read the images root only through pyarrow, never
through a Spark file source.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from flowers_job.config import ConfigError, JobConfig, load_config
from flowers_job.ingest.job import IngestError, check_images_root, ingest
from flowers_job.photos.listing import label_folders, list_entry, listing_units, read_listed_file
from flowers_job.vision.limits import ImageRejected
from tests.support import LABELS, PHOTOS
from tests.support.s3 import S3Store, s3_server  # noqa: F401 (fixture)

pytestmark = [pytest.mark.timeout(600), pytest.mark.tier("gate")]

BUCKET = "flowers-images-test"
SECRET = "images-test-secret-never-shown"
PER_LABEL = 6


@dataclass(frozen=True)
class S3:
    """A moto S3 server with :data:`BUCKET`, and a boto3 client of it."""

    endpoint: str
    client: Any
    env: dict[str, str]

    def put(self, key: str, body: bytes) -> None:
        self.client.put_object(Bucket=BUCKET, Key=key, Body=body)

    def mtime_ns(self, key: str) -> int:
        """The key's ``LastModified`` in a LIST (milliseconds on S3), in ns."""
        listed = self.client.list_objects_v2(Bucket=BUCKET, Prefix=key)["Contents"][0]
        return round(listed["LastModified"].timestamp() * 1000) * 1_000_000


@pytest.fixture(scope="module")
def s3(spark: SparkSession, s3_server: str) -> Iterator[S3]:  # noqa: F811 (the fixture)
    """:data:`BUCKET` on the session's moto server (tests/support/s3.py). The AWS_* variables reach
    pyarrow in this process (``os.environ``) and in Spark's Python workers
    (``SparkContext.environment``, as ``spark.executorEnv.*`` does on a cluster)."""
    store = S3Store(s3_server, BUCKET, ("images-test", SECRET)).create()
    env = {**store.env(), "AWS_EC2_METADATA_DISABLED": "true"}
    sc_env = spark.sparkContext.environment
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
            mp.setitem(sc_env, k, v)
        yield S3(store.endpoint, store.client(), env)


def _photo(label: str, index: int) -> bytes:
    return sorted((PHOTOS / label).glob("*.jpg"))[index].read_bytes()


EDGE_CASES = {
    "daisy/.DS_Store": (b"\0\0\0\1Bud1", "hidden_path"),
    ".thumbnails/daisy/a.jpg": (b"jpeg?", "hidden_path"),
    "root.jpg": (b"jpeg?", "not_in_label_folder"),
    "roses/empty.jpg": (b"", "empty_file"),
    "tulips/notes.txt": (b"taken in May\n", "unsupported_extension"),
    "sunflowers/fake.jpg": (b"not a jpeg at all\n", "not_an_image"),
    "dandelion//double.jpg": (b"jpeg?", "bad_file_name"),
}
"""Keys that end in quarantine, with their content and reason."""
MARKERS = ("sunflowers/", "tulips/sub/")
"""Empty folder markers: not files, in neither table."""


@pytest.fixture(scope="module")
def sample(s3: S3) -> dict[str, str | None]:
    """30 real photos (6 per label) under ``photos/`` with :data:`EDGE_CASES` and
    :data:`MARKERS`; returns every key (relative to ``photos/``) -> its reason (None:
    a photo)."""
    keys: dict[str, str | None] = {}
    for label in LABELS:
        for i in range(PER_LABEL):
            rel = f"{label}/{i:02d}.jpg"
            s3.put(f"photos/{rel}", _photo(label, i))
            keys[rel] = None
    for rel, (body, reason) in EDGE_CASES.items():
        s3.put(f"photos/{rel}", body)
        keys[rel] = reason
    for marker in MARKERS:
        s3.put(f"photos/{marker}", b"")
    return keys


def _cfg(images: str, out: Path) -> JobConfig:
    return load_config(
        None,
        ["data.image_size=32", "data.max_bad_fraction=0.3"],
        **{"data.images": images, "paths.output_dir": out},
    )


def _table(spark: SparkSession, path: str, *cols: str) -> dict[str, tuple[Any, ...]]:
    rows = spark.read.format("delta").load(path).select("relative_path", *cols).collect()
    return {r["relative_path"]: tuple(r)[1:] for r in rows}


def test_ingest_from_an_object_store_lists_every_key_and_reingests_only_changes(
    spark: SparkSession, s3: S3, sample: dict[str, str | None], tmp_path: Path
) -> None:
    """Every key under ``s3a://<bucket>/photos`` is in exactly one table, photos with the
    object's URI, size and time, the rest with their reason; folder markers in neither.
    A re-run after one object is added and one rewritten decodes those two only; a third
    run on the same objects writes nothing."""
    root = f"s3a://{BUCKET}/photos"
    cfg = _cfg(f"{root}/", tmp_path / "out")
    first = ingest(spark, cfg)
    photos = {k for k, reason in sample.items() if reason is None}
    assert first.mode == "full: no tables yet"
    assert (first.files, first.images_rows) == (len(sample), len(photos))
    assert first.label_names == LABELS

    images = _table(spark, first.tables["images"], "source_path", "label", "num_bytes", "mtime_ns")
    assert set(images) == photos
    for rel, (source, label, size, mtime) in images.items():
        assert source == f"{root}/{rel}" and label == rel.split("/")[0]
        assert size == len(_photo(label, int(rel[-6:-4])))
        assert mtime == s3.mtime_ns(f"photos/{rel}"), rel
    quarantine = _table(spark, first.tables["quarantine"], "reason_code", "reason")
    assert {k: v[0] for k, v in quarantine.items()} == {
        k: r for k, r in sample.items() if r is not None
    }
    assert "empty segment" in quarantine["dandelion//double.jpg"][1]

    s3.put("photos/daisy/added.jpg", _photo("daisy", 20))
    s3.put("photos/tulips/00.jpg", _photo("tulips", 21))  # rewritten: new bytes and size
    second = ingest(spark, cfg)
    assert (second.mode, second.files_decoded) == ("incremental", 2)
    assert (second.rows_inserted, second.rows_updated, second.rows_deleted) == (1, 1, 0)
    assert (second.files, second.images_rows) == (len(sample) + 1, len(photos) + 1)
    after = _table(spark, second.tables["images"], "num_bytes")
    assert after["tulips/00.jpg"] == (len(_photo("tulips", 21)),)

    third = ingest(spark, cfg)
    assert (third.mode, third.written, third.files_decoded) == ("unchanged", False, 0)


def test_a_bad_object_store_root_names_the_setting_and_the_uri(
    s3: S3, sample: dict[str, str | None], tmp_path: Path
) -> None:
    """No bucket, no key under the prefix, or no label folder: an IngestError naming
    ``data.images`` and the URI, before any Spark work, with no credential in it."""
    cases = {
        "s3a://no-such-bucket-here/photos": "NO_SUCH_BUCKET",
        f"s3a://{BUCKET}/nothing": "no object under this prefix",
        f"s3a://{BUCKET}/photos/daisy": "has no label folders (found only ['.DS_Store',",
    }
    for uri, expected in cases.items():
        with pytest.raises(IngestError) as err:
            check_images_root(_cfg(uri, tmp_path))
        message = str(err.value)
        assert message.startswith("data.images: ") and uri in message, message
        assert expected in message, message
        assert SECRET not in message and os.environ["AWS_SECRET_ACCESS_KEY"] == SECRET


def test_odd_keys_are_listed_once_each_with_a_verdict(s3: S3) -> None:
    """Without Spark: a key with an empty first segment (``odd//top.jpg``, which pyarrow
    shows as a prefix named like the root) is no label and is ``bad_file_name``; a
    non-empty key ending in ``/`` is listed without its ``/`` and is ``unreadable`` when
    read; an empty marker is in no unit; each key is listed by exactly one unit."""
    for key, body in {
        "odd/daisy/a.jpg": b"jpeg?",
        "odd//top.jpg": b"jpeg?",
        "odd/daisy/m/": b"not a marker",
        "odd/daisy/marker/": b"",
        "odd/x.jpg": b"jpeg?",
    }.items():
        s3.put(key, body)
    root = f"s3a://{BUCKET}/odd"
    labels, others = label_folders(root)
    assert (labels, others) == (["daisy"], ["/", "x.jpg"])
    listed = [
        e for unit in listing_units(root, labels, others) for e in list_entry(root, unit, {"daisy"})
    ]
    verdicts = {e.relative_path: (e.label, e.reason_code) for e in listed}
    assert len(listed) == len(verdicts) == 4
    assert verdicts == {
        "daisy/a.jpg": ("daisy", None),
        "daisy/m": ("daisy", None),
        "/top.jpg": (None, "bad_file_name"),
        "x.jpg": (None, "not_in_label_folder"),
    }
    assert read_listed_file(root, "daisy/a.jpg") == b"jpeg?"
    with pytest.raises(ImageRejected) as err:
        read_listed_file(root, "daisy/m")
    assert err.value.code == "unreadable"


def test_a_label_folder_is_listed_in_key_ranges_each_key_once(
    s3: S3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On S3 a label folder is split by the first character of its keys'
    names (a skip scan of one-key LISTs), one unit per range, and past ``MAX_RANGES`` one
    last range takes the rest (non-ASCII names too). Every key is in exactly one range; an
    empty folder marker is in none."""
    from flowers_job.photos import object_listing

    names = ["0.jpg", "05.jpg", "1a/x.jpg", "1b.jpg", "9.jpg", "a.jpg", "é.jpg", "ü/b.jpg"]
    for name in names:
        s3.put(f"ranges/daisy/{name}", b"jpeg?")
    s3.put("ranges/daisy/z/", b"")  # a folder marker
    root = f"s3a://{BUCKET}/ranges"
    labels, others = label_folders(root)
    assert (labels, others) == (["daisy"], [])

    def listed(units: list[str]) -> list[str]:
        return [e.relative_path for u in units for e in list_entry(root, u, {"daisy"})]

    units = listing_units(root, labels, others)
    assert [u.removeprefix("daisy/\x00") for u in units] == ["0", "1", "9", "a", "z", "é", "ü"]
    assert sorted(listed(units)) == sorted(f"daisy/{n}" for n in names)
    monkeypatch.setattr(object_listing, "MAX_RANGES", 3)
    units = listing_units(root, labels, others)
    assert len(units) == 4 and units[-1].startswith("daisy/\x01")
    found = listed(units)
    assert sorted(found) == sorted(f"daisy/{n}" for n in names) and len(set(found)) == len(found)


def test_the_setting_keeps_a_uri_as_given_and_refuses_credentials_in_it(tmp_path: Path) -> None:
    """``data.images``: a URI stays a string (a ``Path`` would fold its ``//``), less its
    trailing ``/``; a local path stays a ``Path``; a URI with credentials is a config error
    that does not repeat them."""
    assert _cfg(f"s3a://{BUCKET}/photos/", tmp_path).data.images == f"s3a://{BUCKET}/photos"
    assert _cfg("photos", tmp_path).data.images == Path("photos")
    with pytest.raises(ConfigError) as err:
        _cfg(f"s3a://AKIDEXAMPLE:{SECRET}@{BUCKET}/photos", tmp_path)
    assert "data.images: credentials in the URI are refused" in str(err.value)
    assert SECRET not in str(err.value) and "AKIDEXAMPLE" not in str(err.value)
