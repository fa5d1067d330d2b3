"""Data that grows: an incremental ingest decodes only what changed and leaves the tables
row for row as a fresh full ingest of the same folder would, but for the split (stored photos
keep theirs); VACUUM keeps the versions that the loader cache names."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from delta.tables import DeltaTable
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from flowers_job.config import JobConfig, load_config
from flowers_job.driver.pipeline import run_ingest
from flowers_job.ingest.job import ingest
from flowers_job.tables.delta_tables import TABLE_NAMES, checked_tables
from tests.support import LABELS, PHOTOS
from tests.support.data import sample_photos

pytestmark = [pytest.mark.timeout(600), pytest.mark.tier("full")]

SETTINGS = (
    "data.image_size=32",
    "data.val_fraction=0.3",
    "data.test_fraction=0.3",
    "data.max_bad_fraction=0.3",
)
SHORT_RETENTION = ("data.retention_hours=0", "data.allow_short_retention=true")


def _cfg(images: Path, out: Path, *overrides: str) -> JobConfig:
    return load_config(
        None, [*SETTINGS, *overrides], **{"data.images": images, "paths.output_dir": out}
    )


def _contents(
    spark: SparkSession, path: str, drop: tuple[str, ...] = ()
) -> list[tuple[object, ...]]:
    """Every row and column of a Delta table but ``drop``, binary columns as SHA-256, in a
    fixed order."""
    df = spark.read.format("delta").load(path).drop(*drop)
    cols = [F.sha2(c, 256).alias(c) if t == "binary" else F.col(c) for c, t in df.dtypes]
    return sorted((tuple(r) for r in df.select(*cols).collect()), key=repr)


def _splits(spark: SparkSession, path: str) -> dict[str, str]:
    """``relative_path`` -> ``split`` of every row of the ``images`` table at ``path``."""
    rows = spark.read.format("delta").load(path).select("relative_path", "split").collect()
    return {r["relative_path"]: r["split"] for r in rows}


def _photo(label: str, index: int) -> bytes:
    return sorted((PHOTOS / label).glob("*.jpg"))[index].read_bytes()


def _in_every_split(split_counts: dict[str, dict[str, int]]) -> bool:
    """Every class has at least one image in each of train, val and test."""
    return sorted(split_counts) == sorted(LABELS) and all(
        counts.get(s, 0) > 0 for counts in split_counts.values() for s in ("train", "val", "test")
    )


def test_an_incremental_ingest_equals_a_fresh_full_one_row_by_row(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Add, change (same path, new bytes), delete, rename, a file that becomes broken and a
    broken file that is fixed, in one re-run: only those five files are decoded, the counts
    say what moved, and both tables equal a fresh full ingest of the folder, every column but
    the split: stored photos keep theirs (new ones fill what their class lacks), where a
    fresh ingest splits every class afresh. Every class stays in every split."""
    images = sample_photos(tmp_path / "images", per_label=4)
    (images / "tulips" / "fixed.jpg").write_bytes(b"not an image yet\n")
    cfg = _cfg(images, tmp_path / "out")
    first = ingest(spark, cfg)
    assert (first.mode, first.images_rows, first.quarantined_rows) == ("full: no tables yet", 20, 1)
    assert _in_every_split(first.split_counts), first.split_counts
    split_before = _splits(spark, first.tables["images"])

    def a_train_photo(label: str) -> Path:
        # 4 photos of a class split 1 val, 1 test, 2 train: losing one of train keeps the
        # class in every split without moving a stored photo (no full rebuild)
        return images / min(
            p for p, s in split_before.items() if s == "train" and p.startswith(f"{label}/")
        )

    daisy, sunflowers = (sorted((images / n).glob("*.jpg"))[0] for n in ("daisy", "sunflowers"))
    dandelion, breaks = a_train_photo("dandelion"), a_train_photo("roses")
    (images / "daisy" / "added.jpg").write_bytes(_photo("daisy", 11))
    daisy.write_bytes(_photo("daisy", 12))  # changed: same path, new bytes
    os.utime(daisy, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    dandelion.unlink()
    sunflowers.rename(sunflowers.with_name("renamed.jpg"))
    breaks.write_bytes(breaks.read_bytes()[:2000])  # becomes broken: truncated
    (images / "tulips" / "fixed.jpg").write_bytes(_photo("tulips", 10))

    second = ingest(spark, cfg)
    assert second.mode == "incremental" and second.written
    assert second.files_decoded == 5  # added, changed, renamed, broken, fixed
    # images: + added, renamed, fixed; ~ changed; - dandelion, the old name, the broken one
    assert (second.rows_inserted, second.rows_updated, second.rows_deleted) == (3, 1, 3)
    assert second.rows_quarantined == 1 and second.quarantine_reasons == {"corrupt": 1}
    assert (second.images_rows, second.quarantined_rows, second.files) == (20, 1, 21)
    assert checked_tables(spark, cfg).meta["fingerprint"] == second.fingerprint
    # the DELETE marked the deleted and replaced rows in deletion vectors: it copied no row
    # of the files those rows shared with unchanged photos; then one append
    append, delete = DeltaTable.forPath(spark, second.tables["images"]).history(2).collect()
    assert (append["operation"], delete["operation"]) == ("WRITE", "DELETE")
    metrics = delete["operationMetrics"]
    assert int(metrics["numDeletionVectorsAdded"]) > 0, metrics
    assert int(metrics["numCopiedRows"]) == 0, metrics
    assert int(metrics["numDeletedRows"]) == 4, metrics  # 3 deleted, 1 replaced
    assert json.loads(delete["userMetadata"])["flowers_job"]["partial"] == "delete"
    # photos that did not change stayed in their split, and every class is in every split
    after = _splits(spark, second.tables["images"])
    gone = {str(p.relative_to(images)) for p in (daisy, dandelion, sunflowers, breaks)}
    unchanged = set(split_before) - gone
    assert len(unchanged) == 16 and unchanged <= set(after)
    assert {p: after[p] for p in unchanged} == {p: split_before[p] for p in unchanged}
    assert _in_every_split(second.split_counts), second.split_counts

    fresh = ingest(spark, _cfg(images, tmp_path / "fresh"))
    assert fresh.mode == "full: no tables yet"
    assert _in_every_split(fresh.split_counts), fresh.split_counts
    for name in TABLE_NAMES:
        assert _contents(spark, second.tables[name], ("split",)) == _contents(
            spark, fresh.tables[name], ("split",)
        ), name
    # unchanged input: no new version, nothing decoded
    versions = {
        n: DeltaTable.forPath(spark, p).history(1).first()["version"]  # type: ignore[index]
        for n, p in second.tables.items()
    }
    third = ingest(spark, cfg)
    assert (third.mode, third.written, third.files_decoded) == ("unchanged", False, 0)
    assert versions == {
        n: DeltaTable.forPath(spark, p).history(1).first()["version"]  # type: ignore[index]
        for n, p in second.tables.items()
    }


def test_too_many_bad_files_counts_the_whole_table_after_the_change(
    spark: SparkSession, tmp_path: Path
) -> None:
    """``max_bad_fraction`` applies to the tables as they would be after the change: one more
    broken file on top of those already quarantined fails, and nothing is written."""
    images = sample_photos(tmp_path / "images", per_label=3)
    (images / "roses" / "bad1.jpg").write_bytes(b"no")
    cfg = _cfg(images, tmp_path / "out", "data.max_bad_fraction=0.1")
    first = ingest(spark, cfg)
    assert first.quarantined_rows == 1
    history = {n: DeltaTable.forPath(spark, p).history().count() for n, p in first.tables.items()}
    (images / "tulips" / "bad2.jpg").write_bytes(b"no")  # 2 of 17 = 11.8% > 10%
    from flowers_job.ingest.job import IngestError

    with pytest.raises(IngestError, match=r"2 of 17 files .* not_an_image 2"):
        ingest(spark, cfg)
    assert {n: DeltaTable.forPath(spark, p).history().count() for n, p in first.tables.items()} == (
        history
    )


def version_readable(spark: SparkSession, table: str, version: int) -> bool:
    """Whether every image of Delta ``version`` of the table at ``table`` can be read (its
    files not vacuumed)."""
    try:
        df = spark.read.format("delta").option("versionAsOf", version).load(table)
        return df.select(F.sum(F.length("image"))).first() is not None
    except Exception:
        return False


def test_vacuum_keeps_the_versions_the_loader_cache_names(
    spark: SparkSession, tmp_path: Path
) -> None:
    """With ``data.retention_hours=0`` (and ``data.allow_short_retention``), an ingest that
    writes under the output's lease (:func:`run_ingest`, as the CLI runs it) removes the files
    of older versions, except those of a version a loader cache entry was built from. The
    changes are full rebuilds (``--full``): an incremental MERGE marks rows in deletion
    vectors and leaves every data file of the older versions in use."""
    from flowers_job.loaders.cache_marker import ENTRIES, ENTRY_FILE

    images = sample_photos(tmp_path / "images", per_label=4)  # 3 per class after a deletion
    cfg = _cfg(images, tmp_path / "out", *SHORT_RETENTION)
    first = run_ingest(spark, cfg)
    kept = checked_tables(spark, cfg).versions["images"]
    # an entry of the loader cache built from that version (as prepare_data writes it)
    entry = tmp_path / "out" / "loader_cache" / ENTRIES / f"streaming-train-v{kept}-x"
    entry.mkdir(parents=True)
    fields = {"table": first.tables["images"], "version": kept}
    marker = {"fields": fields, "bytes": 0, "data": "data-run-x", "plan": {}}
    (entry / ENTRY_FILE).write_text(json.dumps(marker))

    def readable(version: int) -> bool:
        return version_readable(spark, first.tables["images"], version)

    rebuild = _cfg(images, tmp_path / "out", *SHORT_RETENTION, "data.full_ingest=true")
    (images / "daisy" / sorted(os.listdir(images / "daisy"))[0]).unlink()
    assert run_ingest(spark, rebuild).mode.startswith("full")  # removes every file of `kept`
    assert readable(kept)  # protected by the cache entry
    shutil.rmtree(entry)
    (images / "roses" / sorted(os.listdir(images / "roses"))[0]).unlink()
    run_ingest(spark, rebuild)
    assert not readable(kept)
    assert readable(checked_tables(spark, cfg).versions["images"])


def test_counts_travel_with_the_commit_and_a_merge_with_nothing_to_change_is_skipped(
    spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new photo changes only ``images``: the quarantine keeps its
    commit (named under ``kept`` in the images commit; hidden and broken entries, whose
    verdicts come again, count as no change) and training accepts the pair. Each report's
    counts are those of the tables, and an unchanged ingest reads neither table for them.
    A fixed broken file changes the quarantine again: it is MERGEd, and ``kept`` is gone;
    ``images`` too, past ``MAX_DELETE_PATHS``."""
    from flowers_job.ingest import job
    from flowers_job.ingest import write as ingest_write
    from flowers_job.ingest.counts import scan_counts
    from flowers_job.tables.table_ref import table_ref

    images = sample_photos(tmp_path / "images", per_label=4)
    broken = images / "tulips" / "broken.jpg"
    broken.write_bytes(b"not an image\n")
    (images / "daisy" / ".DS_Store").write_bytes(b"\0")
    cfg = _cfg(images, tmp_path / "out")
    tables = {name: table_ref(cfg, name) for name in TABLE_NAMES}

    def version(name: str) -> int:
        return int(tables[name].history(spark, 1).first()["version"])  # type: ignore[index]

    def scanned(report: object) -> None:
        counts = scan_counts(spark, tables)
        assert report.split_counts == counts.splits  # type: ignore[attr-defined]
        assert report.quarantine_reasons == counts.quarantine  # type: ignore[attr-defined]

    first = ingest(spark, cfg)
    assert first.quarantine_reasons == {"not_an_image": 1, "hidden_path": 1}
    scanned(first)
    q_version, first_run = version("quarantine"), checked_tables(spark, cfg).meta["run_id"]

    (images / "daisy" / "added.jpg").write_bytes(_photo("daisy", 11))
    second = ingest(spark, cfg)
    assert (second.mode, second.rows_inserted, second.rows_quarantined) == ("incremental", 1, 0)
    assert version("quarantine") == q_version  # no MERGE, no commit
    meta = checked_tables(spark, cfg).meta  # training accepts the pair
    assert meta["fingerprint"] == second.fingerprint and meta["kept"] == {"quarantine": first_run}
    scanned(second)

    def no_scan(*args: object) -> None:
        raise AssertionError("an unchanged ingest read the tables for its counts")

    monkeypatch.setattr(job, "scan_counts", no_scan)
    third = ingest(spark, cfg)
    assert (third.mode, third.images_rows, third.quarantined_rows) == ("unchanged", 21, 2)
    assert (third.split_counts, third.quarantine_reasons) == (
        second.split_counts,
        second.quarantine_reasons,
    )
    monkeypatch.undo()

    broken.write_bytes(_photo("tulips", 10))
    (images / "daisy" / "added.jpg").unlink()
    # past MAX_DELETE_PATHS (here 0) images' deletions are one MERGE
    monkeypatch.setattr(ingest_write, "MAX_DELETE_PATHS", 0)
    fourth = ingest(spark, cfg)
    assert fourth.mode == "incremental" and fourth.quarantine_reasons == {"hidden_path": 1}
    assert (fourth.rows_inserted, fourth.rows_deleted, fourth.images_rows) == (1, 1, 21)
    last = tables["images"].history(spark, 1).first()
    assert last is not None and last["operation"] == "MERGE"
    assert version("quarantine") > q_version
    meta = checked_tables(spark, cfg).meta
    assert meta["fingerprint"] == fourth.fingerprint and "kept" not in meta
    scanned(fourth)


def test_an_ingest_stopped_between_its_images_commits_is_resumed_incrementally(
    spark: SparkSession, tmp_path: Path
) -> None:
    """`flowers-job ingest` is killed (SIGKILL, with its JVM) after its DELETE of the gone
    and changed rows and before its append: training refuses the tables, naming the run,
    and the next ingest resumes incrementally (no full rebuild) to the tables a fresh ingest
    writes, but for the split."""
    from flowers_job.errors import DataError
    from tests.support.faults import kill_ingest_at_pause

    images = sample_photos(tmp_path / "images", per_label=4)
    cfg = _cfg(images, tmp_path / "out")
    first = ingest(spark, cfg)
    split_before = _splits(spark, first.tables["images"])
    daisy = sorted((images / "daisy").glob("*.jpg"))[0]
    daisy.write_bytes(_photo("daisy", 12))  # changed
    gone = min(p for p, s in split_before.items() if s == "train" and p.startswith("roses/"))
    (images / gone).unlink()
    (images / "tulips" / "added.jpg").write_bytes(_photo("tulips", 11))

    kill_ingest_at_pause(images, cfg.paths.output_dir, "images_deletes", SETTINGS)
    assert len(_splits(spark, first.tables["images"])) == 18  # the two rows deleted, no append
    with pytest.raises(DataError, match="stopped between its commits"):
        checked_tables(spark, cfg)

    again = ingest(spark, cfg)
    assert again.mode == "incremental" and again.files_decoded == 2, again
    assert (again.images_rows, again.rows_inserted, again.rows_deleted) == (20, 2, 0)
    assert checked_tables(spark, cfg).meta["fingerprint"] == again.fingerprint
    unchanged = {
        p: s for p, s in split_before.items() if p not in (gone, str(daisy.relative_to(images)))
    }
    after = _splits(spark, again.tables["images"])
    assert {p: after[p] for p in unchanged} == unchanged
    fresh = ingest(spark, _cfg(images, tmp_path / "fresh"))
    for name in TABLE_NAMES:
        assert _contents(spark, again.tables[name], ("split",)) == _contents(
            spark, fresh.tables[name], ("split",)
        ), name
