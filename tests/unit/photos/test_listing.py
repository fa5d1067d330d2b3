"""The images tree as ingest lists it: every entry gets a verdict, nothing is skipped, and
a sharded listing (one large folder over several Spark tasks) reports each entry once."""

from __future__ import annotations

import os
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from flowers_job.photos.listing import (
    entry_shard,
    label_folders,
    list_entry,
    read_listed_file,
)
from flowers_job.vision.limits import ImageRejected

pytestmark = pytest.mark.tier("gate")


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    """An images root with one entry of every kind, and a folder outside it."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    for folder in ("daisy/sub", "daisy/.thumbs", "daisy/_drafts", "roses", ".git", "_extra"):
        (root / folder).mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.jpg").write_bytes(b"outside")
    files = [
        "daisy/a.jpg",
        "daisy/sub/nested.jpg",
        "daisy/rosé 花 with space.jpg",
        "daisy/.hidden.jpg",
        "daisy/._a.jpg",
        "daisy/_underscore.jpg",
        "daisy/.thumbs/t.jpg",
        "daisy/_drafts/d.jpg",
        "roses/r.jpg",
        "roses/empty.jpg",
        ".git/config",
        "_extra/x.jpg",
        "README.txt",
    ]
    for rel in files:
        (root / rel).write_bytes(b"" if rel.endswith("empty.jpg") else rel.encode())
    (root / "roses/inside.jpg").symlink_to("../daisy/a.jpg")
    (root / "roses/outside.jpg").symlink_to(outside / "secret.jpg")
    (root / "roses/outside_dir").symlink_to(outside)
    (root / "roses/linked_dir").symlink_to("../daisy")
    (root / "roses/broken.jpg").symlink_to("nowhere.jpg")
    (root / "top_link").symlink_to(outside)
    os.mkfifo(root / "roses/fifo.jpg")
    with open(os.path.join(os.fsencode(root / "roses"), b"caf\xe9.jpg"), "wb") as f:
        f.write(b"latin-1 name")
    return root, outside


def _listing(root: Path) -> dict[str, tuple[str | None, str, str | None]]:
    labels, others = label_folders(str(root))
    out = {}
    for name in labels + others:
        for entry in list_entry(str(root), name, set(labels)):
            assert entry.relative_path not in out
            out[entry.relative_path] = (entry.label, entry.kind, entry.reason_code)
    return out


def test_label_folders_are_real_visible_directories(tmp_path: Path) -> None:
    root, _ = _tree(tmp_path)
    assert label_folders(str(root)) == (
        ["daisy", "roses"],
        [".git", "README.txt", "_extra", "top_link"],
    )


def test_every_entry_gets_a_verdict(tmp_path: Path) -> None:
    root, _ = _tree(tmp_path)
    assert _listing(root) == {
        "daisy/a.jpg": ("daisy", "file", None),
        "daisy/sub/nested.jpg": ("daisy", "file", None),
        "daisy/rosé 花 with space.jpg": ("daisy", "file", None),
        "daisy/.hidden.jpg": ("daisy", "file", "hidden_path"),
        "daisy/._a.jpg": ("daisy", "file", "hidden_path"),
        "daisy/_underscore.jpg": ("daisy", "file", "hidden_path"),
        "daisy/.thumbs/t.jpg": ("daisy", "file", "hidden_path"),
        "daisy/_drafts/d.jpg": ("daisy", "file", "hidden_path"),
        "roses/r.jpg": ("roses", "file", None),
        "roses/empty.jpg": ("roses", "file", None),  # read, then quarantined as empty_file
        "roses/inside.jpg": ("roses", "symlink", None),  # a link inside the root is followed
        "roses/outside.jpg": ("roses", "symlink", "symlink_outside_root"),
        "roses/outside_dir": ("roses", "symlink", "symlink_outside_root"),
        "roses/linked_dir": ("roses", "symlink", "symlinked_directory"),
        "roses/broken.jpg": ("roses", "symlink", "broken_symlink"),
        "roses/fifo.jpg": ("roses", "other", "not_a_regular_file"),
        "roses/caf\\xe9.jpg": ("roses", "file", "bad_file_name"),
        ".git/config": (None, "file", "hidden_path"),
        "_extra/x.jpg": (None, "file", "hidden_path"),
        "README.txt": (None, "file", "not_in_label_folder"),
        "top_link": (None, "symlink", "symlink_outside_root"),
    }


def test_links_out_of_the_root_are_not_followed(tmp_path: Path) -> None:
    root, outside = _tree(tmp_path)
    (outside / "deep").mkdir()
    (outside / "deep" / "more.jpg").write_bytes(b"x")
    listed = _listing(root)
    assert not any("secret" in p or "more" in p for p in listed)
    entry = next(list_entry(str(root), "top_link", {"daisy", "roses"}))
    assert entry.num_bytes is None and entry.mtime_ns is None  # the target is not examined
    assert str(outside) in (entry.reason or "")


def test_a_file_swapped_for_a_link_out_of_the_root_is_not_read(tmp_path: Path) -> None:
    root, outside = _tree(tmp_path)
    assert read_listed_file(str(root), "daisy/a.jpg") == b"daisy/a.jpg"
    assert read_listed_file(str(root), "roses/inside.jpg") == b"daisy/a.jpg"
    (root / "daisy/a.jpg").unlink()
    (root / "daisy/a.jpg").symlink_to(outside / "secret.jpg")  # after the listing
    with pytest.raises(ImageRejected) as err:
        read_listed_file(str(root), "daisy/a.jpg")
    assert err.value.code == "symlink_outside_root"


@pytest.mark.timeout(30)
def test_reading_a_fifo_or_a_vanished_file_is_a_reason_not_a_hang(tmp_path: Path) -> None:
    root, _ = _tree(tmp_path)
    with pytest.raises(ImageRejected) as err:
        read_listed_file(str(root), "roses/fifo.jpg")
    assert err.value.code == "not_a_regular_file"
    (root / "roses/r.jpg").unlink()
    with pytest.raises(ImageRejected) as err:
        read_listed_file(str(root), "roses/r.jpg")
    assert err.value.code == "unreadable" and "No such file" in err.value.message


@pytest.mark.parametrize("shards", [2, 3, 7])
def test_shards_report_every_entry_exactly_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shards: int
) -> None:
    """The units of a sharded listing together give the full listing, each entry once: an
    unreadable directory (scandir refused, as without permission) is reported once, not by
    every unit that walks past it."""
    root, _ = _tree(tmp_path)
    blocked = str(root / "daisy" / "sub")
    real_scandir = os.scandir

    def scandir(path: str) -> Any:
        if os.path.realpath(path) == os.path.realpath(blocked):
            raise PermissionError(13, "Permission denied", path)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    full = _listing(root)
    assert full["daisy/sub"] == ("daisy", "directory", "unreadable_directory")
    labels, others = label_folders(str(root))
    parts: list[tuple[str, tuple[str | None, str, str | None]]] = []
    for name in labels + others:
        for index in range(shards):
            for entry in list_entry(str(root), name, set(labels), (index, shards)):
                if entry.reason_code != "bad_file_name":  # shown as it is on disk
                    assert entry_shard(entry.relative_path, shards) == index
                parts.append((entry.relative_path, (entry.label, entry.kind, entry.reason_code)))
    assert len(parts) == len(full) and dict(parts) == full


def test_shard_rule_is_stable_and_spreads_entries() -> None:
    """crc32 of the path: the same unit in every process; 1,000 names spread over 4 units."""
    assert entry_shard("daisy/a.jpg", 4) == zlib.crc32(b"daisy/a.jpg") % 4
    counts = Counter(entry_shard(f"daisy/{i:05d}.jpg", 4) for i in range(1000))
    assert sorted(counts) == [0, 1, 2, 3] and min(counts.values()) > 200


def test_one_large_folder_is_listed_by_several_tasks(spark: SparkSession, tmp_path: Path) -> None:
    """400 files in one label folder: the Spark listing holds exactly the entries of a full
    walk, none twice, and they come from more than one task."""
    from pyspark.sql import functions as F

    from flowers_job.photos.files import list_files

    root = tmp_path / "root"
    (root / "daisy" / "sub").mkdir(parents=True)
    for i in range(400):
        (root / "daisy" / f"{i:04d}.jpg").write_bytes(b"x")
    (root / "daisy" / "sub" / "nested.jpg").write_bytes(b"y")
    labels, others = label_folders(str(root))
    listing = list_files(spark, str(root), labels, labels + others, shards=4)
    rows = listing.select("relative_path", F.spark_partition_id().alias("task")).collect()
    paths = [r["relative_path"] for r in rows]
    assert len(paths) == len(set(paths)) == 401
    assert set(paths) == set(_listing(root))
    assert len({r["task"] for r in rows}) > 1


def test_many_folders_are_listed_in_two_tasks_per_slot(spark: SparkSession, tmp_path: Path) -> None:
    """7 label folders of 4 units each (28 units) are listed by 2 tasks per task slot, not
    one task per unit: each Python task has a fixed cost (flowers_job.photos.files), and every
    entry is still listed once."""
    from flowers_job.photos.files import list_files, listing_shards

    root = tmp_path / "root"
    for label in range(7):
        (root / f"label{label}").mkdir(parents=True)
        for i in range(9):
            (root / f"label{label}" / f"{i}.jpg").write_bytes(b"x")
    labels, others = label_folders(str(root))
    listing = list_files(spark, str(root), labels, labels + others, shards=4)
    assert listing.rdd.getNumPartitions() == listing_shards(spark) == 4  # local[2]
    paths = [r["relative_path"] for r in listing.select("relative_path").collect()]
    assert len(paths) == len(set(paths)) == 63
    assert set(paths) == set(_listing(root))
