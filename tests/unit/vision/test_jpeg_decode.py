"""TorchCodec's JPEG decode against Pillow's (the ingest and serving decoder) on the real
photos, the EXIF orientations and a CMYK JPEG among them; and the torchvision fallback of
runtimes without TorchCodec."""

from __future__ import annotations

import csv
import io
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flowers_job.vision import jpeg_decode
from flowers_job.vision.decode_transform import DecodeTransform
from flowers_job.vision.images import open_rgb
from tests.support import LABELS, PHOTOS

pytestmark = pytest.mark.tier("gate")

HAS_TORCHCODEC = jpeg_decode.decoder_name() == "torchcodec"
needs_torchcodec = pytest.mark.skipif(
    not HAS_TORCHCODEC, reason="TorchCodec is not installed in this environment"
)
EDGE_KINDS = ("no_jfif_header", "monochrome_content_in_rgb", "small_side_under_150")
"""Kinds of EDGE_CASES.tsv whose pixels Pillow decodes without a colour conversion."""


def _edge_cases(kinds: tuple[str, ...], per_kind: int) -> list[Path]:
    with (PHOTOS / "EDGE_CASES.tsv").open() as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    out: list[Path] = []
    for kind in kinds:
        out += [PHOTOS / r["relative_path"] for r in rows if r["kind"] == kind][:per_kind]
    return out


def _converted(path: Path) -> bool:
    """Whether Pillow's decode converts the photo's colours (an ICC profile to sRGB)."""
    _, notes, _ = open_rgb(path.read_bytes())
    return any(note.startswith("icc ") and "ignored" not in note for note in notes)


def _photos() -> list[Path]:
    """12 photos of each label whose colours Pillow does not convert, and a few of each plain
    edge case."""
    out = []
    for label in LABELS:
        out += [p for p in sorted((PHOTOS / label).glob("*.jpg"))[:20] if not _converted(p)][:12]
    return out + _edge_cases(EDGE_KINDS, 3)


def _pillow(content: bytes) -> torch.Tensor:
    img, _, _ = open_rgb(content)
    return torch.from_numpy(np.array(img)).permute(2, 0, 1)


def _variants(path: Path) -> Iterator[tuple[str, bytes]]:
    """The photo, then saved again with EXIF orientations 3, 6 and 8, and as CMYK."""
    content = path.read_bytes()
    yield "as is", content
    with Image.open(io.BytesIO(content)) as img:
        img.load()
        for orientation in (3, 6, 8):
            exif = img.getexif()
            exif[0x0112] = orientation
            buf = io.BytesIO()
            img.save(buf, "JPEG", quality=95, exif=exif)
            yield f"orientation {orientation}", buf.getvalue()
        buf = io.BytesIO()
        img.convert("CMYK").save(buf, "JPEG", quality=95)
        yield "CMYK", buf.getvalue()


def _mean_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.int() - b.int()).abs().float().mean())


@needs_torchcodec
def test_torchcodec_decodes_the_real_photos_as_pillow_does() -> None:
    """Same shape and the same pixels within a grey level on average, for 60 photos without
    a colour profile to convert and a few of each plain edge case."""
    photos = _photos()
    assert len(photos) >= 66
    worst = 0.0
    for path in photos:
        content = path.read_bytes()
        ours, theirs = jpeg_decode.decode_jpeg(content), _pillow(content)
        assert ours.dtype == torch.uint8
        assert ours.shape == theirs.shape, path.name
        worst = max(worst, _mean_abs(ours, theirs))
    assert worst <= 1.0


@needs_torchcodec
@pytest.mark.parametrize("index", [0, 20, 40])
def test_exif_orientation_and_cmyk_match_pillow(index: int) -> None:
    path = _photos()[index]
    for name, content in _variants(path):
        ours = jpeg_decode.decode_jpeg(content)
        theirs = _pillow(content)
        assert ours.shape == theirs.shape, name
        assert _mean_abs(ours, theirs) <= 1.0, name


@needs_torchcodec
def test_a_wide_gamut_photo_differs_only_by_pillows_colour_conversion() -> None:
    """Pillow converts an embedded wide-gamut profile to sRGB, TorchCodec does not: serving
    sends such files to Pillow (its plain JPEGs have no profile), and the stored images,
    converted at ingest, carry none."""
    (path,) = _edge_cases(("wide_gamut_icc",), 1)
    content = path.read_bytes()
    ours, theirs = jpeg_decode.decode_jpeg(content), _pillow(content)
    assert ours.shape == theirs.shape
    assert _mean_abs(ours, theirs) < 16


def test_the_torchvision_fallback_decodes_upright_photos_as_pillow_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where TorchCodec is missing (the Databricks runtimes), torchvision.io decodes a batch
    the same way."""
    monkeypatch.setattr(jpeg_decode, "_torchcodec", lambda: None)
    assert jpeg_decode.decoder_name() == "torchvision"
    photos = _photos()[:10]
    rows = [torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8) for p in photos]
    with warnings.catch_warnings():  # torchvision 0.29 deprecates its decoders
        warnings.simplefilter("ignore")
        images = jpeg_decode.decode_jpegs(rows, torch.device("cpu"))
    for path, image in zip(photos, images, strict=True):
        assert _mean_abs(image, _pillow(path.read_bytes())) <= 1.0, path.name


def test_a_damaged_jpeg_raises_runtime_error() -> None:
    content = _photos()[0].read_bytes()
    with pytest.raises(RuntimeError):
        jpeg_decode.decode_jpeg(content[:100])


@needs_torchcodec
@pytest.mark.parametrize("train", [False, True])
def test_the_ranks_decode_matches_the_pillow_path(
    train: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DecodeTransform's TorchCodec path (a tensor through the transforms) against its Pillow
    path (an image through the same transforms): evaluation's crops agree within rounding
    of the resize; training's draw the same shapes."""
    photos = _photos()[:8]
    torch.manual_seed(0)
    fast = [DecodeTransform(train, 224, 256).decode(p.read_bytes()) for p in photos]
    monkeypatch.setattr(jpeg_decode, "_torchcodec", lambda: None)
    torch.manual_seed(0)
    slow = [DecodeTransform(train, 224, 256).decode(p.read_bytes()) for p in photos]
    for a, b in zip(fast, slow, strict=True):
        assert a.shape == b.shape == (3, 224, 224)
        assert a.dtype == b.dtype == torch.uint8
        if not train:
            assert _mean_abs(a, b) <= 2.0
