"""Pixels: every decodable variant becomes 8-bit RGB; undecodable files get a reason code."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flowers_job.vision.images import normalize_image, open_rgb
from flowers_job.vision.limits import ImageRejected
from tests.support import PHOTOS, ROOT_DIR

pytestmark = pytest.mark.tier("gate")

REAL = PHOTOS / "daisy" / "100080576_f52e8ee070_n.jpg"  # 320x263 in MANIFEST.tsv


def _encode(img: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _gradient(w: int = 120, h: int = 80) -> Image.Image:
    x = np.linspace(0, 255, w, dtype=np.uint8)
    arr = np.stack(
        [np.tile(x, (h, 1)), np.tile(x[::-1], (h, 1)), np.full((h, w), 90, np.uint8)], -1
    )
    return Image.fromarray(arr, "RGB")


def test_real_photo_is_downscaled_and_keeps_original_size() -> None:
    out = normalize_image(REAL.read_bytes(), short_side=128)
    assert (out.width, out.height) == (320, 263)
    img = Image.open(io.BytesIO(out.jpeg))
    assert img.format == "JPEG" and img.mode == "RGB"
    assert min(img.size) == 128


def test_small_photo_is_not_upscaled() -> None:
    out = normalize_image(_encode(_gradient(60, 40), "JPEG"), short_side=256)
    assert Image.open(io.BytesIO(out.jpeg)).size == (60, 40)


def _variants() -> dict[str, bytes]:
    rgb = _gradient()
    arr16 = (np.asarray(rgb.convert("L"), dtype=np.uint16) * 257).astype(np.uint16)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise when displayed
    return {
        "cmyk_jpeg": _encode(rgb.convert("CMYK"), "JPEG"),
        "grayscale_l": _encode(rgb.convert("L"), "JPEG"),
        "png_16bit": _encode(Image.fromarray(arr16), "PNG"),
        "palette_png": _encode(rgb.convert("P"), "PNG"),
        "rgba_png": _encode(rgb.convert("RGBA"), "PNG"),
        "exif_rotated": _encode(rgb, "JPEG", exif=exif.tobytes()),
        "icc_profile": REAL.read_bytes(),
    }


@pytest.mark.parametrize(
    "kind",
    [
        "cmyk_jpeg",
        "grayscale_l",
        "png_16bit",
        "palette_png",
        "rgba_png",
        "exif_rotated",
        "icc_profile",
    ],
)
def test_decodable_variants_become_8bit_rgb(kind: str) -> None:
    content = _variants()[kind]
    img, notes, (w, h) = open_rgb(content, max_pixels=10**8)
    assert img.mode == "RGB"
    assert np.asarray(img).dtype == np.uint8
    if kind == "exif_rotated":
        assert (w, h) == (80, 120) and img.size == (80, 120)
        assert any("exif orientation 6" in n for n in notes)
    if kind == "png_16bit":
        # scaled from 16 to 8 bits, not clipped at 255
        source = np.asarray(_gradient().convert("L"), dtype=int)
        assert np.abs(np.asarray(img)[..., 0].astype(int) - source).max() <= 1
    if kind in ("cmyk_jpeg", "png_16bit", "palette_png", "rgba_png", "grayscale_l"):
        assert any(n.startswith("mode ") for n in notes)


@pytest.mark.parametrize(
    ("content", "code"),
    [
        (b"", "empty_file"),
        (b"these are not the pixels you are looking for\n", "not_an_image"),
        (REAL.read_bytes()[:4000], "corrupt"),
    ],
)
def test_undecodable_files_are_rejected_with_a_code(content: bytes, code: str) -> None:
    with pytest.raises(ImageRejected) as err:
        normalize_image(content, short_side=64)
    assert err.value.code == code


def test_pixel_limit_rejects_before_decoding(tmp_path: Path) -> None:
    with pytest.raises(ImageRejected) as err:
        normalize_image(_encode(_gradient(400, 300), "PNG"), short_side=64, max_pixels=100_000)
    assert err.value.code == "too_many_pixels"
    assert "120000" in err.value.message


def test_ingest_does_not_load_torch() -> None:
    """Ingest's driver and decode workers import this module; torch and torchvision (about
    600 MB resident per process) load only with the transforms."""
    import subprocess
    import sys

    code = (
        "import sys, flowers_job.ingest.job, flowers_job.driver.prepare; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchvision')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT_DIR,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.strip() == "[]"
