"""One photo decoded and normalised: the bytes of a file to an upright 8-bit sRGB image, and
that image to the JPEG the images table stores.

Pure Python (Pillow), no Spark and no torch: ingest's decode workers on the executors, batch
scoring and the served model all open photos here, so all three see exactly the same
pixels. The checks are :mod:`flowers_job.vision.limits`', the colour conversion
:mod:`flowers_job.vision.colour`'s.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass, replace

from PIL import Image, ImageOps, UnidentifiedImageError

from flowers_job.vision.colour import HIGH_DEPTH, high_depth_to_l, to_rgb, to_srgb
from flowers_job.vision.limits import (
    ImageLimits,
    ImageRejected,
    check_size,
    pillow_pixel_limit,
    refuse_unidentified,
)

__all__ = ["NormalizedImage", "normalize_image", "open_rgb"]


@dataclass(frozen=True)
class NormalizedImage:
    """A photo ready for the images table.

    Attributes:
        jpeg: 8-bit sRGB JPEG bytes, EXIF orientation applied, shorter side at most the
            requested size (pixels).
        width: width in pixels of the original photo, as displayed (after EXIF rotation).
        height: height in pixels of the original photo, as displayed.
        notes: what was done to it, e.g. ``"mode CMYK->RGB; icc->sRGB"`` ('' if nothing).
    """

    jpeg: bytes
    width: int
    height: int
    notes: str


def open_rgb(
    content: bytes,
    *,
    max_pixels: int | None = None,
    limits: ImageLimits | None = None,
    draft_short_side: int | None = None,
) -> tuple[Image.Image, list[str], tuple[int, int]]:
    """Decode ``content`` into an 8-bit sRGB Pillow image, upright per its EXIF tag.

    Only ``limits.formats`` are opened (Pillow's ``formats=``: no other plugin reads the
    file), and the size in the header is checked against ``limits`` before any pixel is
    decoded. Decoding costs the image's own pixels (a 16-bit image 2 bytes per pixel and
    the 8-bit result, :func:`~flowers_job.vision.colour.high_depth_to_l`).

    Args:
        content: the file's bytes.
        max_pixels: the pixel limit (decompression-bomb guard); replaces
            ``limits.max_pixels`` when given.
        limits: what is decoded and how large (:class:`ImageLimits`); None: the defaults.
        draft_short_side: if given, let the JPEG decoder downscale by 1/2, 1/4 or 1/8 while
            keeping both sides >= this many pixels (much faster for large photos).

    Returns:
        ``(image, notes, (width, height))``: a fully loaded RGB image, what was done to it,
        and the original size in pixels as displayed (after EXIF rotation, before any draft).

    Raises:
        ImageRejected: ``empty_file``, ``file_too_large``, ``unsupported_format`` (naming
            the format its signature shows), ``not_an_image``, ``too_many_pixels``,
            ``long_side_too_large``, ``extreme_aspect``, ``animated_image`` or ``corrupt``.
    """
    limits = limits or ImageLimits()
    if max_pixels is not None:
        limits = replace(limits, max_pixels=max_pixels)
    if not content:
        raise ImageRejected("empty_file", "file has 0 bytes")
    if len(content) > limits.max_file_bytes:
        raise ImageRejected(
            "file_too_large",
            f"{len(content)} bytes, more than data.max_file_bytes={limits.max_file_bytes}",
        )
    notes: list[str] = []
    try:
        with pillow_pixel_limit(limits.max_pixels), warnings.catch_warnings():
            # Pillow warns past its limit in Image.open; check_size then decides, naming
            # the setting. Past twice its limit Pillow raises (below).
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img: Image.Image = Image.open(io.BytesIO(content), formats=limits.formats)
            w, h = img.size
            check_size(w, h, limits)
            frames = int(getattr(img, "n_frames", 1))
            if img.format != "MPO" and frames > 1:
                # MPO: a camera's JPEG with extra pictures (a preview, a depth map); its
                # first frame is the photo. An APNG's frames are an animation.
                raise ImageRejected(
                    "animated_image",
                    f"an animated {img.format} of {frames} frames: which frame is the "
                    "photo is not known",
                )
            if draft_short_side and img.format in ("JPEG", "MPO"):
                img.draft(None, (draft_short_side, draft_short_side))
            img.load()
    except ImageRejected:
        raise
    except UnidentifiedImageError:
        raise refuse_unidentified(content, limits.formats) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageRejected(
            "too_many_pixels", f"{exc} (data.max_image_pixels={limits.max_pixels})"
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageRejected("corrupt", f"{type(exc).__name__}: {exc}") from None
    orientation = img.getexif().get(0x0112, 1)
    if orientation != 1:
        notes.append(f"exif orientation {orientation} applied")
        img = ImageOps.exif_transpose(img)
        if orientation in (5, 6, 7, 8):  # 90 or 270 degree rotations swap the sides
            w, h = h, w
    source_mode = img.mode
    if source_mode in HIGH_DEPTH:  # to 8 bits first: the wide pixels are freed here
        img = high_depth_to_l(img, notes)
    img = to_srgb(img, notes)
    img = to_rgb(img, notes, source_mode)
    return img, notes, (w, h)


def normalize_image(
    content: bytes,
    *,
    short_side: int,
    quality: int = 90,
    max_pixels: int | None = None,
    limits: ImageLimits | None = None,
) -> NormalizedImage:
    """Decode a photo, normalise it to 8-bit sRGB, downscale, and re-encode as JPEG.

    Args:
        content: the file's bytes.
        short_side: the stored image's shorter side is at most this (pixels); smaller
            photos are kept at their size (the loader resizes).
        quality: JPEG quality of the re-encoded image.
        max_pixels: decompression-bomb guard; replaces ``limits.max_pixels`` when given.
        limits: formats and sizes decoded (:class:`ImageLimits`; None: the defaults).

    Returns:
        A :class:`NormalizedImage`.

    Raises:
        ImageRejected: the file is empty, too large, of another format, not an image, too
            large or too elongated in pixels, animated, or corrupt (:func:`open_rgb`).
    """
    img, notes, (width, height) = open_rgb(
        content, max_pixels=max_pixels, limits=limits, draft_short_side=short_side
    )
    if min(img.size) > short_side:
        scale = short_side / min(img.size)
        size = (max(1, round(img.width * scale)), max(1, round(img.height * scale)))
        img = img.resize(size, Image.Resampling.BICUBIC, reducing_gap=3.0)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return NormalizedImage(buf.getvalue(), width, height, "; ".join(notes))
