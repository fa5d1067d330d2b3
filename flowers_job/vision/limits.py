"""What the job decodes, and how large: every photo is judged by its signature and header
before any pixel is decoded.

Ingest, batch scoring and the served model share these checks: a file's real format (its
first bytes, never a decoder's guess), the formats allowed, its size in bytes, its pixels,
long side and aspect ratio, and Pillow's process-wide decompression-bomb limit held at the
job's own for the decode.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from PIL import Image

if TYPE_CHECKING:
    from flowers_job.config.data import DataConfig

__all__ = [
    "STORED_FORMATS",
    "ImageLimits",
    "ImageRejected",
    "check_size",
    "pillow_pixel_limit",
    "refuse_unidentified",
    "sniff_format",
]


class ImageRejected(ValueError):
    """A file that cannot become a training image. ``code`` is a stable reason key."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


STORED_FORMATS = ("JPEG",)
"""What the images table holds: ingest re-encodes every photo as a JPEG, so the loaders
open stored images as JPEG only."""


@dataclass(frozen=True)
class ImageLimits:
    """What the job decodes, and how large: ingest, predict and the served model check every
    file against these before its pixels are decoded (the defaults are ``data``'s).

    Attributes:
        formats: Pillow format names opened (``data.image_formats``); a file of any other
            format is ``unsupported_format`` and no other Pillow plugin ever reads it (the
            workaround of CVE-2026-25990's advisory, a crafted PSD).
        max_pixels: width x height at most (``data.max_image_pixels``), ``too_many_pixels``.
        max_aspect_ratio: long side / short side at most (``data.max_aspect_ratio``),
            ``extreme_aspect``: resizing the short side to 256 px makes a 4000x1 image
            1,024,000x256 (about 1 GB).
        max_long_side: pixels of the longer side at most (``data.max_long_side_pixels``),
            ``long_side_too_large``.
        max_file_bytes: bytes of the file at most (``data.max_file_bytes``),
            ``file_too_large``.
    """

    formats: tuple[str, ...] = ("JPEG", "PNG")
    max_pixels: int = 89_478_485
    max_aspect_ratio: float = 20.0
    max_long_side: int = 16_384
    max_file_bytes: int = 128 * 2**20

    @classmethod
    def from_data(cls, data: DataConfig) -> ImageLimits:
        """The limits a ``data`` section sets."""
        return cls(
            formats=tuple(data.image_formats),
            max_pixels=data.max_image_pixels,
            max_aspect_ratio=data.max_aspect_ratio,
            max_long_side=data.max_long_side_pixels,
            max_file_bytes=data.max_file_bytes,
        )

    def model_config(self) -> dict[str, Any]:
        """The limits as the served model's ``model_config`` entries (plain JSON values;
        ``max_pixels`` is the key models registered before already have)."""
        return {
            "image_formats": list(self.formats),
            "max_pixels": self.max_pixels,
            "max_aspect_ratio": self.max_aspect_ratio,
            "max_long_side": self.max_long_side,
            "max_file_bytes": self.max_file_bytes,
        }

    @classmethod
    def from_model_config(cls, config: Mapping[str, Any]) -> ImageLimits:
        """The limits of a served model's ``model_config``; a key that a model registered
        before this setting existed lacks takes its default."""
        default = cls()
        return cls(
            formats=tuple(config.get("image_formats", default.formats)),
            max_pixels=int(config.get("max_pixels", default.max_pixels)),
            max_aspect_ratio=float(config.get("max_aspect_ratio", default.max_aspect_ratio)),
            max_long_side=int(config.get("max_long_side", default.max_long_side)),
            max_file_bytes=int(config.get("max_file_bytes", default.max_file_bytes)),
        )


_SIGNATURES: tuple[tuple[int, bytes, str], ...] = (
    (0, b"\xff\xd8\xff", "JPEG"),
    (0, b"\x89PNG\r\n\x1a\n", "PNG"),
    (0, b"8BPS", "PSD"),
    (0, b"II*\x00", "TIFF"),
    (0, b"MM\x00*", "TIFF"),
    (0, b"II+\x00", "TIFF"),  # BigTIFF
    (0, b"MM\x00+", "TIFF"),
    (0, b"GIF87a", "GIF"),
    (0, b"GIF89a", "GIF"),
    (8, b"WEBP", "WEBP"),  # after b"RIFF" and the chunk's length
    (0, b"BM", "BMP"),
    (0, b"\x00\x00\x01\x00", "ICO"),
    (0, b"\x00\x00\x02\x00", "CUR"),
    (0, b"icns", "ICNS"),
    (0, b"\x00\x00\x00\x0cjP  \r\n\x87\n", "JPEG2000"),
    (0, b"\xffO\xffQ", "JPEG2000"),
    (0, b"qoif", "QOI"),
    (0, b"DDS ", "DDS"),
    (0, b"v/1\x01", "OpenEXR"),
    (0, b"%PDF", "PDF"),
    (0, b"%!PS", "EPS"),
    (0, b"\xc5\xd0\xd3\xc6", "EPS"),
)
"""File signatures ("magic numbers") of the image formats a file named ``.jpg`` may really
hold, from each format's specification (Gary Kessler's table of file signatures collects
them); matched on the file's first bytes, never by a decoder."""
_HEIF_BRANDS = {
    b"heic": "HEIC",
    b"heix": "HEIC",
    b"mif1": "HEIF",
    b"msf1": "HEIF",
    b"avif": "AVIF",
    b"avis": "AVIF",
}


def sniff_format(content: bytes) -> str | None:
    """The image format ``content`` starts like (``"PSD"``, ``"TIFF"``, ``"WEBP"``, ...), from
    its signature alone: no decoder reads the file. None when no signature matches.

    ISO base media files (HEIC, HEIF, AVIF) are told by their ``ftyp`` box's major brand.
    """
    head = content[:32]
    if head[4:8] == b"ftyp":
        brand = head[8:12]
        return _HEIF_BRANDS.get(brand, f"ISO media (ftyp {brand.decode('latin-1')!r})")
    for offset, magic, name in _SIGNATURES:
        if head[offset : offset + len(magic)] == magic:
            if name == "WEBP" and head[:4] != b"RIFF":
                continue
            return name
    return None


_LIMIT_LOCK = threading.Lock()
_limit_users: list[int] = []
_pillow_default: list[int | None] = []


@contextmanager
def pillow_pixel_limit(max_pixels: int) -> Iterator[None]:
    """Raise Pillow's process-wide decompression-bomb limit (``Image.MAX_IMAGE_PIXELS``) to at
    least ``max_pixels`` for the ``with`` block, so that ``data.max_image_pixels`` above
    Pillow's 89,478,485 is what decides (Pillow refuses more than twice its limit in
    ``Image.open``). Never lowers it; nested and concurrent blocks (threads of a REST
    server) hold the largest limit in use, and the value found before the first block comes
    back when the last one ends. The job's own check (:func:`check_size`) then applies each
    decode's limit."""
    with _LIMIT_LOCK:
        if not _limit_users:
            _pillow_default[:] = [Image.MAX_IMAGE_PIXELS]
        _limit_users.append(max_pixels)
        base = _pillow_default[0]
        if base is not None:
            Image.MAX_IMAGE_PIXELS = max(base, *_limit_users)
    try:
        yield
    finally:
        with _LIMIT_LOCK:
            _limit_users.remove(max_pixels)
            base = _pillow_default[0]
            if base is not None:
                Image.MAX_IMAGE_PIXELS = max(base, *_limit_users) if _limit_users else base


def check_size(width: int, height: int, limits: ImageLimits) -> None:
    """Refuse an image by its size (read from its header, before any pixel is decoded).

    Raises:
        ImageRejected: ``too_many_pixels`` (width x height over ``limits.max_pixels``),
            ``long_side_too_large`` or ``extreme_aspect``, naming the size and the setting.
    """
    w, h = width, height
    if w * h > limits.max_pixels:
        raise ImageRejected(
            "too_many_pixels",
            f"{w}x{h} = {w * h} pixels exceeds the limit of {limits.max_pixels} "
            "(data.max_image_pixels)",
        )
    if max(w, h) > limits.max_long_side:
        raise ImageRejected(
            "long_side_too_large",
            f"{w}x{h}: a side of {max(w, h)} pixels exceeds the limit of "
            f"{limits.max_long_side} (data.max_long_side_pixels)",
        )
    aspect = max(w, h) / max(1, min(w, h))
    if aspect > limits.max_aspect_ratio:
        raise ImageRejected(
            "extreme_aspect",
            f"{w}x{h}: an aspect ratio of {aspect:.4g} exceeds the limit of "
            f"{limits.max_aspect_ratio:g} (data.max_aspect_ratio); resizing its short side "
            "would make it very large",
        )


def refuse_unidentified(content: bytes, formats: tuple[str, ...]) -> ImageRejected:
    """Why a file that no allowed decoder identifies is refused: ``unsupported_format``
    naming its real format when its signature tells it, else ``not_an_image``."""
    found = sniff_format(content)
    if found is None:
        # Pillow's own message names the BytesIO object's address: not reproducible.
        return ImageRejected(
            "not_an_image",
            f"not a {' or '.join(formats)} file (no known image signature in its first bytes)",
        )
    if found in formats:
        return ImageRejected("corrupt", f"starts like a {found} file, but its header is damaged")
    return ImageRejected(
        "unsupported_format",
        f"a {found} file (told by its signature), not one of data.image_formats "
        f"{list(formats)}; not decoded",
    )
