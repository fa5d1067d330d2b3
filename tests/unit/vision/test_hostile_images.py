"""Hostile and odd images: only the configured formats are decoded, and an image
costs memory bounded by its pixels, at ingest (the decode function of the ingest tasks), in
predict and in the served model (:class:`~flowers_job.serving.scorer.Scorer`).

Every file is crafted here; the memory checks run the decode in a fresh Python process and
read its peak resident size (``ru_maxrss``) before and after."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from flowers_job.config.data import DataConfig
from flowers_job.photos.files import decode_partitions
from flowers_job.vision.colour import to_rgb
from flowers_job.vision.images import normalize_image, open_rgb
from flowers_job.vision.limits import ImageLimits, ImageRejected, check_size, sniff_format
from tests.support import PHOTOS, ROOT_DIR

pytestmark = pytest.mark.tier("gate")

MB = 2**20


def _encode(img: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _psd(width: int = 8, height: int = 6) -> bytes:
    """A minimal RGB Photoshop file (Adobe's "Photoshop File Formats Specification": the
    26-byte header, three empty sections, raw planar 8-bit channels): Pillow's PSD plugin,
    the one CVE-2026-25990 is in, decodes it when it is allowed to."""
    header = b"8BPS" + struct.pack(">H6xHIIHH", 1, 3, height, width, 8, 3)
    sections = struct.pack(">III", 0, 0, 0) + struct.pack(">H", 0)  # raw image data
    planes = bytes([200]) * (width * height) + bytes([100]) * (width * height)
    return header + sections + planes + bytes([50]) * (width * height)


def _frames(fmt: str) -> bytes:
    frames = [Image.new("RGB", (16, 16), c) for c in ("red", "blue", "green")]
    return _encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100)


SMALL = Image.new("RGB", (16, 12), (10, 200, 30))
OTHER_FORMATS = {
    "PSD": _psd(),
    "TIFF": _encode(SMALL, "TIFF"),
    "WEBP": _encode(SMALL, "WEBP"),
    "GIF": _encode(SMALL, "GIF"),
    "BMP": _encode(SMALL, "BMP"),
    "ICO": _encode(SMALL, "ICO"),
}
TALL_PNG = _encode(Image.new("L", (1, 4000)), "PNG")  # 1 px wide, 4000 px high
WIDE_PNG = _encode(Image.new("L", (4000, 1)), "PNG")


@pytest.mark.parametrize("fmt", sorted(OTHER_FORMATS))
def test_another_format_is_unsupported_naming_its_real_format(fmt: str) -> None:
    content = OTHER_FORMATS[fmt]
    with Image.open(io.BytesIO(content)) as img:  # Pillow left to itself reads it
        assert img.format == fmt
    assert sniff_format(content) == fmt
    with pytest.raises(ImageRejected) as err:
        normalize_image(content, short_side=64)
    assert err.value.code == "unsupported_format"
    assert f"a {fmt} file" in err.value.message and "data.image_formats" in err.value.message


def test_a_png_is_unsupported_when_only_jpeg_is_allowed() -> None:
    limits = ImageLimits(formats=("JPEG",))
    with pytest.raises(ImageRejected) as err:
        open_rgb(_encode(SMALL, "PNG"), limits=limits)
    assert err.value.code == "unsupported_format" and "a PNG file" in err.value.message


def test_image_formats_accept_only_what_the_job_supports() -> None:
    assert DataConfig(image_formats=["png", "jpeg"]).image_formats == ("PNG", "JPEG")
    for bad in (["PSD"], [], ["JPEG", "TIFF"]):
        with pytest.raises(ValueError, match="image_formats"):
            DataConfig(image_formats=bad)


def _decoded_rows(root: Path, files: dict[str, bytes], limits: ImageLimits) -> dict[str, dict]:
    """``files`` written under ``root/daisy/`` and run through ingest's decode function
    (what each Spark task runs), without Spark: ``{name: row}``."""
    (root / "daisy").mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (root / "daisy" / name).write_bytes(content)
    listing = pd.DataFrame(
        {
            "relative_path": [f"daisy/{n}" for n in files],
            "label": "daisy",
            "num_bytes": [len(c) for c in files.values()],
            "reason_code": None,
            "reason": None,
        }
    )
    decode = decode_partitions(str(root), 64, 90, limits.max_pixels, ("jpg", "png"), limits=limits)
    out = pd.concat(list(decode(iter([listing]))))
    return {r["relative_path"].split("/", 1)[1]: r for r in out.to_dict("records")}


def test_ingest_quarantines_other_formats_extreme_shapes_and_animations(tmp_path: Path) -> None:
    real = next((PHOTOS / "daisy").glob("*.jpg")).read_bytes()
    files = {
        "psd.jpg": OTHER_FORMATS["PSD"],
        "tiff.jpg": OTHER_FORMATS["TIFF"],
        "webp.jpg": OTHER_FORMATS["WEBP"],
        "tall.png": TALL_PNG,
        "wide.png": WIDE_PNG,
        "long.png": _encode(Image.new("L", (20_000, 2_000)), "PNG"),
        "animated.png": _frames("PNG"),
        "real.jpg": real,
    }
    rows = _decoded_rows(tmp_path / "photos", files, ImageLimits())
    codes = {name: row["reason_code"] for name, row in rows.items()}
    assert codes == {
        "psd.jpg": "unsupported_format",
        "tiff.jpg": "unsupported_format",
        "webp.jpg": "unsupported_format",
        "tall.png": "extreme_aspect",
        "wide.png": "extreme_aspect",
        "long.png": "long_side_too_large",
        "animated.png": "animated_image",
        "real.jpg": None,
    }
    assert "a PSD file" in rows["psd.jpg"]["reason"]
    assert "a TIFF file" in rows["tiff.jpg"]["reason"]
    assert "a WEBP file" in rows["webp.jpg"]["reason"]
    assert (
        "1x4000" in rows["tall.png"]["reason"]
        and "data.max_aspect_ratio" in rows["tall.png"]["reason"]
    )
    assert "data.max_long_side_pixels" in rows["long.png"]["reason"]
    assert "3 frames" in rows["animated.png"]["reason"]
    assert rows["real.jpg"]["image"] is not None


def test_a_file_over_max_file_bytes_is_quarantined_unread(tmp_path: Path) -> None:
    """The listed size decides: the file is not there, so reading it would say
    ``unreadable``."""
    root = tmp_path / "photos"
    (root / "daisy").mkdir(parents=True)
    listing = pd.DataFrame(
        {
            "relative_path": ["daisy/huge.jpg", "daisy/small.jpg"],
            "label": "daisy",
            "num_bytes": [5_000, 900],
            "reason_code": None,
            "reason": None,
        }
    )
    limits = ImageLimits(max_file_bytes=1_000)
    decode = decode_partitions(str(root), 64, 90, limits.max_pixels, ("jpg",), limits=limits)
    rows = pd.concat(list(decode(iter([listing])))).set_index("relative_path")
    assert rows.loc["daisy/huge.jpg", "reason_code"] == "file_too_large"
    assert "data.max_file_bytes=1000" in rows.loc["daisy/huge.jpg", "reason"]
    assert rows.loc["daisy/small.jpg", "reason_code"] == "unreadable"  # this one was read


def test_a_gif_is_unsupported_and_an_animated_png_is_refused() -> None:
    with pytest.raises(ImageRejected) as err:
        open_rgb(_frames("GIF"))
    assert err.value.code == "unsupported_format" and "a GIF file" in err.value.message
    with pytest.raises(ImageRejected) as err:
        open_rgb(_frames("PNG"))
    assert err.value.code == "animated_image"
    img, _, _ = open_rgb(_encode(SMALL, "PNG"))  # one frame: an image
    assert img.size == (16, 12)


def test_long_side_and_aspect_limits_are_settings() -> None:
    check_size(20_000, 2_000, ImageLimits(max_long_side=20_000))
    check_size(4000, 1, ImageLimits(max_aspect_ratio=4000))
    with pytest.raises(ImageRejected, match="extreme_aspect"):
        check_size(4000, 1, ImageLimits(max_aspect_ratio=3999))


def test_the_defaults_keep_every_real_photo() -> None:
    limits = ImageLimits.from_data(DataConfig())
    assert limits == ImageLimits()
    count = 0
    for path in PHOTOS.glob("*/*.jpg"):
        with Image.open(path, formats=limits.formats) as img:
            check_size(*img.size, limits)
        count += 1
    assert count == 3670


def test_float_images_are_scaled_by_their_real_range() -> None:
    ramp = np.linspace(0.0, 1.0, 64, dtype=np.float32)
    for scale in (1.0, 1000.0):
        img = Image.fromarray(np.tile(ramp * scale, (8, 1)), "F")
        notes: list[str] = []
        out = np.asarray(to_rgb(img, notes))
        assert out[..., 0].min() == 0 and out[..., 0].max() == 255  # not nearly black
        assert np.abs(out[0, :, 0].astype(int) - np.round(ramp * 255)).max() <= 1
        assert any("float range" in n for n in notes)


def test_the_pixel_limit_setting_raises_pillows_own(tmp_path: Path) -> None:
    """A 100-megapixel JPEG (solid grey: 0.5 MB) is refused with the default limit, naming
    the setting, and accepted with the setting at 200M; Pillow's process-wide limit is
    what it was afterwards."""
    content = _encode(Image.new("L", (10_000, 10_000), 128), "JPEG", quality=50)
    before = Image.MAX_IMAGE_PIXELS
    with pytest.raises(ImageRejected) as err:
        normalize_image(content, short_side=64)
    assert err.value.code == "too_many_pixels" and "data.max_image_pixels" in err.value.message
    out = normalize_image(content, short_side=64, limits=ImageLimits(max_pixels=200_000_000))
    assert (out.width, out.height) == (10_000, 10_000)
    assert before == Image.MAX_IMAGE_PIXELS


def _in_fresh_process(code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT_DIR,
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


_PEAK = (
    "import resource; peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
)


def test_a_16bit_6000x6000_png_costs_its_pixels_not_a_float64_copy(tmp_path: Path) -> None:
    """36 megapixels: 2 bytes each decoded, 1 in grey, 3 in RGB, so at most 6 bytes per
    pixel (216 MB) at the peak, where the float64 path took about 900 MB; the 16-bit values
    are scaled to 8 bits, not clipped."""
    ramp = np.tile((np.arange(6000, dtype=np.uint32) * 65535 // 5999).astype(np.uint16), (6000, 1))
    path = tmp_path / "deep.png"
    Image.fromarray(ramp).save(path, compress_level=1)
    del ramp
    result = _in_fresh_process(
        _PEAK
        + "import json, numpy as np\n"
        + "from flowers_job.vision.images import open_rgb\n"
        + f"content = open({str(path)!r}, 'rb').read()\n"
        + "start = peak()\n"
        + "img, notes, size = open_rgb(content)\n"
        + "grown = peak() - start\n"
        + "row = np.asarray(img.crop((0, 0, 6000, 1)))[0, :, 0]\n"
        + "print(json.dumps({'grown': grown, 'mode': img.mode, 'size': size, 'notes': notes,"
        + " 'ends': [int(row[0]), int(row[2999]), int(row[-1])]}))\n"
    )
    assert result["mode"] == "RGB" and result["size"] == [6000, 6000]
    assert result["ends"][0] == 0 and result["ends"][2] == 255 and 125 <= result["ends"][1] <= 130
    assert result["grown"] < 6 * 6000 * 6000, f"{result['grown'] / MB:.0f} MB"


SCORER_CONFIG = {
    "architecture": "efficientnet_lite0",
    "label_names": ["a", "b"],
    "image_size": 96,
    "resize_size": 110,
    "mean": [0.5] * 3,
    "std": [0.5] * 3,
    "dropout": 0.2,
    "max_pixels": 89_478_485,
    "batch_size": 8,
}
"""A served model's ``model_config`` from before the image limits: they take their defaults."""


@pytest.fixture
def state_dict(tmp_path: Path) -> Path:
    """Random weights for :data:`SCORER_CONFIG` (what is scored does not matter here)."""
    import torch

    from flowers_job.vision.backbones import build_model

    torch.manual_seed(0)
    path = tmp_path / "state.pt"
    torch.save(
        build_model("efficientnet_lite0", 2, "none", freeze_backbone=False).state_dict(), path
    )
    return path


def test_extreme_aspect_is_refused_before_any_resize_at_ingest_and_in_the_scorer(
    tmp_path: Path, state_dict: Path
) -> None:
    """A 4000x1 and a 1x4000 PNG (about 90 bytes each) are refused from their headers at
    ingest and by both scorer paths. Resizing their short side to 110 px would make a
    440,000x110 RGB image (145 MB) of each, so a peak under 40 MB shows none was resized."""
    (tmp_path / "tall.png").write_bytes(TALL_PNG)
    (tmp_path / "wide.png").write_bytes(WIDE_PNG)
    script = f"""
import json, os
os.environ["FLOWERS_SERVING_DEVICE"] = "cpu"
from flowers_job.serving.scorer import Scorer
from flowers_job.vision.images import normalize_image
from flowers_job.vision.limits import ImageRejected
raws = [open({str(tmp_path / "tall.png")!r}, "rb").read(), open({str(tmp_path / "wide.png")!r}, "rb").read()]
scorers = [Scorer({SCORER_CONFIG!r}, {str(state_dict)!r}, batch_decode=b) for b in (False, True)]
start = peak()
codes = []
for raw in raws:
    try:
        normalize_image(raw, short_side=110)
    except ImageRejected as exc:
        codes.append(exc.code)
for scorer in scorers:
    scores = scorer.score(raws)
    codes += [r.code for r in scores.rejections]
print(json.dumps({{"grown": peak() - start, "codes": codes, "reason": scores.rejections[1].message}}))
"""
    result = _in_fresh_process(_PEAK + script)
    assert result["codes"] == ["extreme_aspect"] * 6
    assert "4000x1" in result["reason"] and "data.max_aspect_ratio" in result["reason"]
    assert result["grown"] < 40 * MB, f"{result['grown'] / MB:.0f} MB"


def test_the_scorer_names_the_real_format_of_a_row(
    state_dict: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Serving and predict (which scores through the same :class:`Scorer`) reject a PSD,
    TIFF or WebP row naming its format, an animated PNG as such, and score the real photo,
    on the Pillow path and on the batched (GPU) path."""
    from flowers_job.serving.scorer import Scorer

    monkeypatch.setenv("FLOWERS_SERVING_DEVICE", "cpu")
    real = next((PHOTOS / "roses").glob("*.jpg")).read_bytes()
    contents = [
        OTHER_FORMATS["PSD"],
        OTHER_FORMATS["TIFF"],
        OTHER_FORMATS["WEBP"],
        _frames("PNG"),
        real,
    ]
    for batch_decode in (False, True):
        scorer = Scorer(SCORER_CONFIG, state_dict, batch_decode=batch_decode)
        scores = scorer.score(contents)
        codes = [r.code if r else None for r in scores.rejections]
        assert codes == ["unsupported_format"] * 3 + ["animated_image", None]
        for fmt, rejection in zip(("PSD", "TIFF", "WEBP"), scores.rejections, strict=False):
            assert rejection is not None and f"a {fmt} file" in rejection.message
        assert np.isnan(scores.probabilities[:4]).all()
        assert abs(scores.probabilities[4].sum() - 1) < 1e-6


@pytest.fixture(autouse=True)
def _pillow_limit_untouched() -> Iterator[None]:
    before = Image.MAX_IMAGE_PIXELS
    yield
    assert before == Image.MAX_IMAGE_PIXELS
