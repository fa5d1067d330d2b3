"""Bad input through a real ingest: every entry under the images root ends in the images table
or in quarantine with a reason, and set-level problems stop ingest before anything is written.
"""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import pytest
from PIL import Image
from pyspark.sql import SparkSession

from flowers_job.config import JobConfig, load_config
from flowers_job.ingest.job import IngestError, IngestReport, ingest
from tests.support import PHOTOS
from tests.support.data import sample_photos
from tests.unit.vision.test_hostile_images import OTHER_FORMATS, WIDE_PNG
from tests.unit.vision.test_images import _encode, _gradient, _variants

pytestmark = [pytest.mark.timeout(600), pytest.mark.tier("gate")]

ADOBE_RGB = PHOTOS / "roses" / "4754734410_94d98463a5.jpg"  # EDGE_CASES.tsv: wide_gamut_icc
OUTSIDE = PHOTOS / "tulips" / "9446982168_06c4d71da3_n.jpg"  # not among the sampled photos

# relative path -> reason_code in quarantine, or None: in the images table
EXPECTED: dict[str, str | None] = {
    # files that decode are normalised to 8-bit RGB and kept
    "daisy/cmyk.jpg": None,
    "daisy/grayscale.jpg": None,
    "dandelion/sixteen_bit.png": None,
    "dandelion/palette.png": None,
    "roses/rgba.png": None,
    "roses/exif_rotated.jpg": None,
    "sunflowers/adobe_rgb_icc.jpg": None,
    "daisy/rosé 花 with space.jpg": None,
    "sunflowers/inside_link.jpg": None,  # a link to a file inside the root is followed
    # files that do not decode
    "tulips/truncated.jpg": "corrupt",
    "tulips/zero.jpg": "empty_file",
    "tulips/text.jpg": "not_an_image",
    "tulips/bomb.png": "too_many_pixels",
    "tulips/huge.jpg": "file_too_large",
    "dandelion/notes.txt": "unsupported_extension",
    "tulips/photoshop.jpg": "unsupported_format",  # PSD bytes named .jpg: never decoded
    "roses/sliver.png": "extreme_aspect",  # 4000x1
    # paths
    "daisy/.hidden.jpg": "hidden_path",  # a good photo, but hidden
    "daisy/._appledouble.jpg": "hidden_path",
    "roses/_drafts/draft.jpg": "hidden_path",
    "roses/.thumbs/thumb.jpg": "hidden_path",
    ".cache/cached.jpg": "hidden_path",
    "_extra/extra.jpg": "hidden_path",
    "README.txt": "not_in_label_folder",
    "sunflowers/outside.jpg": "symlink_outside_root",
    "sunflowers/outside_dir": "symlink_outside_root",
    "sunflowers/linked_dir": "symlinked_directory",
    "sunflowers/broken.jpg": "broken_symlink",
    "tulips/fifo.jpg": "not_a_regular_file",
    "dandelion/caf\\xe9.jpg": "bad_file_name",
}


def _cfg(images: Path, out: Path, *overrides: str) -> JobConfig:
    return load_config(
        None,
        ["data.image_size=64", *overrides],
        **{"data.images": images, "paths.output_dir": out},
    )


@pytest.fixture(scope="module")
def odd_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 real photos per label, plus one file or link for each case of ``EXPECTED``."""
    root = sample_photos(tmp_path_factory.mktemp("odd") / "images", per_label=3)
    outside = root.parent / "outside"
    outside.mkdir()
    real = sorted((root / "daisy").glob("*.jpg"))[0]
    variants = _variants()
    files: dict[str, bytes] = {
        "daisy/cmyk.jpg": variants["cmyk_jpeg"],
        "daisy/grayscale.jpg": variants["grayscale_l"],
        "dandelion/sixteen_bit.png": variants["png_16bit"],
        "dandelion/palette.png": variants["palette_png"],
        "roses/rgba.png": variants["rgba_png"],
        "roses/exif_rotated.jpg": variants["exif_rotated"],
        "sunflowers/adobe_rgb_icc.jpg": ADOBE_RGB.read_bytes(),
        "daisy/rosé 花 with space.jpg": real.read_bytes(),
        "tulips/truncated.jpg": real.read_bytes()[:3000],
        "tulips/zero.jpg": b"",
        "tulips/text.jpg": b"not an image\n",
        # 9 megapixels, a few KB: over data.max_image_pixels=2000000 (set below)
        "tulips/bomb.png": _encode(Image.new("L", (3000, 3000)), "PNG", optimize=True),
        "dandelion/notes.txt": b"notes\n",
        "tulips/photoshop.jpg": OTHER_FORMATS["PSD"],
        "roses/sliver.png": WIDE_PNG,
        "daisy/.hidden.jpg": real.read_bytes(),
        "daisy/._appledouble.jpg": b"\x00\x05\x16\x07 resource fork",
        "roses/_drafts/draft.jpg": real.read_bytes(),
        "roses/.thumbs/thumb.jpg": real.read_bytes(),
        ".cache/cached.jpg": real.read_bytes(),
        "_extra/extra.jpg": real.read_bytes(),
        "README.txt": b"top-level files are not images\n",
    }
    for rel, content in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(content)
    with open(root / "tulips/huge.jpg", "wb") as f:  # sparse: no disk, never read
        f.truncate(8 * 2_000_000 + 2**20 + 1)
    shutil.copy2(OUTSIDE, outside / "secret.jpg")
    (root / "sunflowers/outside.jpg").symlink_to(outside / "secret.jpg")
    (root / "sunflowers/outside_dir").symlink_to(outside)
    (root / "sunflowers/inside_link.jpg").symlink_to(os.path.join("..", "daisy", real.name))
    (root / "sunflowers/linked_dir").symlink_to("../daisy")
    (root / "sunflowers/broken.jpg").symlink_to("nowhere.jpg")
    os.mkfifo(root / "tulips/fifo.jpg")
    with open(os.path.join(os.fsencode(root / "dandelion"), b"caf\xe9.jpg"), "wb") as f:
        f.write(real.read_bytes())
    return root


@pytest.fixture(scope="module")
def ingested(
    spark: SparkSession, odd_tree: Path, tmp_path_factory: pytest.TempPathFactory
) -> IngestReport:
    cfg = _cfg(
        odd_tree,
        tmp_path_factory.mktemp("odd_out"),
        "data.max_bad_fraction=0.9",
        "data.max_image_pixels=2000000",
    )
    return ingest(spark, cfg)


def _table(spark: SparkSession, report: IngestReport, name: str) -> dict[str, dict]:
    rows = spark.read.format("delta").load(report.tables[name]).collect()
    return {r["relative_path"]: r.asDict() for r in rows}


def _entries_on_disk(root: Path) -> set[str]:
    """Every file, link and special file under ``root``; links are not followed."""
    out = set()
    for folder, dirs, files in os.walk(os.fsencode(root)):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
            rel = os.path.relpath(os.path.join(folder, name), os.fsencode(root))
            out.add(rel.decode("utf-8", "backslashreplace"))
    return out


def test_every_entry_is_accounted_for_once(spark: SparkSession, odd_tree: Path, ingested) -> None:
    images, quarantine = _table(spark, ingested, "images"), _table(spark, ingested, "quarantine")
    on_disk = _entries_on_disk(odd_tree)
    assert set(images) | set(quarantine) == on_disk
    assert not set(images) & set(quarantine)
    assert ingested.files == len(on_disk) == ingested.images_rows + ingested.quarantined_rows
    assert ingested.train_rows + ingested.val_rows + ingested.test_rows == ingested.images_rows


@pytest.mark.parametrize(("relative_path", "reason_code"), EXPECTED.items())
def test_each_case_ends_where_expected(
    spark: SparkSession, ingested, relative_path: str, reason_code: str | None
) -> None:
    images, quarantine = _table(spark, ingested, "images"), _table(spark, ingested, "quarantine")
    if reason_code is None:
        assert relative_path in images, quarantine.get(relative_path)
        img = Image.open(io.BytesIO(images[relative_path]["image"]))
        assert img.format == "JPEG" and img.mode == "RGB"  # 8-bit RGB, whatever the source
    else:
        row = quarantine[relative_path]
        assert row["reason_code"] == reason_code and row["reason"]


def test_normalisation_is_recorded_and_exif_rotation_applied(
    spark: SparkSession, odd_tree: Path, ingested
) -> None:
    images = _table(spark, ingested, "images")
    assert "mode CMYK->RGB" in images["daisy/cmyk.jpg"]["notes"]
    assert "mode I;16->RGB" in images["dandelion/sixteen_bit.png"]["notes"]
    assert "icc RGB->sRGB" in images["sunflowers/adobe_rgb_icc.jpg"]["notes"]
    rotated = images["roses/exif_rotated.jpg"]
    assert (rotated["width"], rotated["height"]) == (80, 120)  # 120x80 stored, orientation 6
    stored = Image.open(io.BytesIO(rotated["image"]))
    assert stored.height > stored.width
    inside = images["sunflowers/inside_link.jpg"]
    target = images[
        os.path.normpath(
            os.path.join("sunflowers", os.readlink(odd_tree / "sunflowers/inside_link.jpg"))
        )
    ]
    assert inside["content_sha256"] == target["content_sha256"]
    assert inside["split"] == target["split"]  # same bytes, same split


def test_refused_entries_are_never_read(spark: SparkSession, ingested) -> None:
    import hashlib

    quarantine = _table(spark, ingested, "quarantine")
    for rel in ("sunflowers/outside.jpg", "sunflowers/outside_dir", "tulips/huge.jpg"):
        assert quarantine[rel]["content_sha256"] is None, rel
    assert "outside the images root" in quarantine["sunflowers/outside.jpg"]["reason"]
    secret = hashlib.sha256(OUTSIDE.read_bytes()).hexdigest()
    assert secret not in {r["content_sha256"] for r in _table(spark, ingested, "images").values()}


def test_too_many_pixels_names_the_limit(spark: SparkSession, ingested) -> None:
    reason = _table(spark, ingested, "quarantine")["tulips/bomb.png"]["reason"]
    assert "3000x3000" in reason and "limit of 2000000 (data.max_image_pixels)" in reason


def test_another_format_and_an_extreme_aspect_are_named(spark: SparkSession, ingested) -> None:
    quarantine = _table(spark, ingested, "quarantine")
    assert "a PSD file" in quarantine["tulips/photoshop.jpg"]["reason"]
    assert "4000x1" in quarantine["roses/sliver.png"]["reason"]
    assert "data.max_aspect_ratio" in quarantine["roses/sliver.png"]["reason"]


# Set-level problems: a clear error before anything is written.


def _fails_before_writing(spark: SparkSession, images: Path, out: Path, match: str) -> None:
    with pytest.raises(IngestError, match=match):
        ingest(spark, _cfg(images, out))
    assert not (out / "tables").exists()


def test_empty_label_folder_fails_before_writing(spark: SparkSession, tmp_path: Path) -> None:
    root = sample_photos(tmp_path / "images", per_label=1)
    shutil.rmtree(root / "roses")
    (root / "roses").mkdir()
    _fails_before_writing(spark, root, tmp_path / "out", r"label folder\(s\) \['roses'\]")


def test_label_folder_with_only_hidden_files_fails(spark: SparkSession, tmp_path: Path) -> None:
    root = sample_photos(tmp_path / "images", per_label=1)
    for photo in (root / "tulips").iterdir():
        photo.rename(photo.with_name("." + photo.name))
    _fails_before_writing(spark, root, tmp_path / "out", r"\['tulips'\] .* no file")


def test_label_folder_with_no_decodable_image_fails(spark: SparkSession, tmp_path: Path) -> None:
    root = sample_photos(tmp_path / "images", per_label=1)
    for photo in (root / "daisy").iterdir():
        photo.write_bytes(b"not a photo")
    _fails_before_writing(spark, root, tmp_path / "out", r"\['daisy'\] .* no decodable image")


def test_root_with_only_hidden_folders_names_them(spark: SparkSession, tmp_path: Path) -> None:
    root = tmp_path / "images"
    for name in (".git", "_staging"):
        (root / name).mkdir(parents=True)
        (root / name / "a.jpg").write_bytes(_encode(_gradient(), "JPEG"))
    _fails_before_writing(
        spark, root, tmp_path / "out", r"no label folders \(found only \['.git', '_staging'\]"
    )
