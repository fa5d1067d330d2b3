"""Colour: any decoded Pillow image to 8-bit sRGB RGB (ICC profiles applied, 16/32-bit and
float images scaled, transparency composited on white), at a bounded cost in memory."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageCms

__all__ = ["HIGH_DEPTH", "high_depth_to_l", "to_rgb", "to_srgb"]

_SRGB = ImageCms.createProfile("sRGB")
_PROFILE_MODES = {"RGB": "RGB", "GRAY": "L", "CMYK": "CMYK"}


def to_srgb(img: Image.Image, notes: list[str]) -> Image.Image:
    """Apply an embedded ICC profile, when it matches the pixel mode, to get sRGB; what was
    done, or why not, is appended to ``notes``."""
    icc = img.info.get("icc_profile")
    if not icc:
        return img
    try:
        src = ImageCms.ImageCmsProfile(io.BytesIO(icc))
        space = src.profile.xcolor_space.strip()
    except (OSError, ImageCms.PyCMSError) as exc:
        notes.append(f"icc ignored (unreadable: {exc})")
        return img
    if _PROFILE_MODES.get(space) != img.mode:
        # e.g. a GRAY 'Dot Gain 20%' profile on an RGB JPEG (see EDGE_CASES.tsv): no transform.
        notes.append(f"icc ignored ({space} profile on {img.mode} pixels)")
        return img
    if space == "RGB" and "srgb" in (src.profile.profile_description or "").lower():
        return img  # already sRGB: nothing to do
    try:
        out = ImageCms.profileToProfile(img, src, _SRGB, outputMode="RGB")
    except ImageCms.PyCMSError as exc:
        notes.append(f"icc ignored ({exc})")
        return img
    notes.append(f"icc {space}->sRGB")
    assert out is not None
    return out


_STRIP_PIXELS = 1 << 20
"""Pixels converted at a time from a 16/32-bit or float image to 8 bits: the float32 copy
of one strip is 4 MiB, whatever the image's size."""


def _gray8(img: Image.Image, scale: float, offset: float) -> Image.Image:
    """A one-channel 16/32-bit or float image -> mode ``L``: ``clip(round(v * scale +
    offset), 0, 255)`` per pixel (NaN -> 0), a strip of rows at a time, so that the image
    costs its own pixels, one byte per pixel out, and a float32 copy of one strip (never a
    float64 copy of the whole image: 8 bytes per pixel, 288 MB at 6000x6000)."""
    out = Image.new("L", img.size)
    rows = max(1, _STRIP_PIXELS // max(1, img.width))
    for top in range(0, img.height, rows):
        box = (0, top, img.width, min(img.height, top + rows))
        strip = np.asarray(img.crop(box), dtype=np.float32)
        strip = np.nan_to_num(strip * np.float32(scale) + np.float32(offset + 0.5), nan=0.0)
        np.clip(strip, 0, 255, out=strip)
        out.paste(Image.fromarray(strip.astype(np.uint8), "L"), box[:2])
    return out


def high_depth_to_l(img: Image.Image, notes: list[str]) -> Image.Image:
    """16-bit and 32-bit integer and float grey images -> 8-bit ``L``, scaled, not clipped
    (``convert('L')`` clips at 255).

    ``I;16*``: 0..65535 -> 0..255 (v / 257). ``I``: the same when a value is over 255, else
    as it is. ``F``: its real range (min..max) -> 0..255, as image viewers show a float
    image: float images come in 0..1 as often as in 0..255, and the range is the one
    scale that shows both; a constant image keeps its value, clipped to 0..255.
    """
    mode = img.mode
    if mode.startswith("I;16"):
        return _gray8(img, 255.0 / 65535.0, 0.0)
    extrema = img.getextrema()  # (min, max) of a one-channel image
    lo, hi = float(extrema[0]), float(extrema[1])  # type: ignore[arg-type]
    if mode == "I":
        return _gray8(img, 255.0 / 65535.0 if hi > 255 else 1.0, 0.0)
    if not (np.isfinite(lo) and np.isfinite(hi)) or hi <= lo:
        return _gray8(img, 1.0 if np.isfinite(lo) else 0.0, 0.0)
    notes.append(f"float range {lo:.6g}..{hi:.6g} scaled to 0..255")
    return _gray8(img, 255.0 / (hi - lo), -lo * 255.0 / (hi - lo))


HIGH_DEPTH = ("I;16", "I;16B", "I;16L", "I", "F")


def to_rgb(img: Image.Image, notes: list[str], source_mode: str | None = None) -> Image.Image:
    """8-bit RGB from any Pillow mode; transparency is composited on white. ``source_mode``:
    the mode the file was decoded in, when ``img`` is already converted from it (named in
    the note)."""
    mode = source_mode or img.mode
    if img.mode == "RGB":
        if source_mode and source_mode != "RGB":
            notes.append(f"mode {mode}->RGB")
        return img
    if img.mode in HIGH_DEPTH:
        img = high_depth_to_l(img, notes)
    if img.mode == "P":
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(background, rgba)
    out = img.convert("RGB")
    notes.append(f"mode {mode}->RGB")
    return out
