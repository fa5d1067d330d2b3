"""Pixels: decode and normalise one photo, and the tensors the model sees.

Pure Python (Pillow, torchvision), no Spark: used by the ingest UDF on executors,
by the loaders on the ranks (:class:`DecodeTransform`), and by the served MLflow model, so
all three see exactly the same pixels. torch and torchvision are imported by the
transforms only: ingest's driver and decode workers never load them (about 600 MB of
resident memory per process).
"""

from __future__ import annotations

import io
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image, ImageCms, ImageOps, UnidentifiedImageError

if TYPE_CHECKING:
    import pandas as pd
    import torch

    from flowers_job.config.data import DataConfig

__all__ = [
    "STORED_FORMATS",
    "DecodeTransform",
    "ImageLimits",
    "ImageRejected",
    "NormalizedImage",
    "check_size",
    "eval_pixels",
    "eval_transform",
    "normalize_image",
    "open_rgb",
    "pillow_pixel_limit",
    "sniff_format",
    "train_pixels",
]

_SRGB = ImageCms.createProfile("sRGB")
_PROFILE_MODES = {"RGB": "RGB", "GRAY": "L", "CMYK": "CMYK"}


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


def _unsupported(content: bytes, formats: tuple[str, ...]) -> ImageRejected:
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


def _to_srgb(img: Image.Image, notes: list[str]) -> Image.Image:
    """Apply an embedded ICC profile, when it matches the pixel mode, to get sRGB."""
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


def _high_depth_to_l(img: Image.Image, notes: list[str]) -> Image.Image:
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


_HIGH_DEPTH = ("I;16", "I;16B", "I;16L", "I", "F")


def _to_rgb(img: Image.Image, notes: list[str], source_mode: str | None = None) -> Image.Image:
    """8-bit RGB from any Pillow mode; transparency is composited on white. ``source_mode``:
    the mode the file was decoded in, when ``img`` is already converted from it (named in
    the note)."""
    mode = source_mode or img.mode
    if img.mode == "RGB":
        if source_mode and source_mode != "RGB":
            notes.append(f"mode {mode}->RGB")
        return img
    if img.mode in _HIGH_DEPTH:
        img = _high_depth_to_l(img, notes)
    if img.mode == "P":
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(background, rgba)
    out = img.convert("RGB")
    notes.append(f"mode {mode}->RGB")
    return out


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
    the 8-bit result, :func:`_gray8`).

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
        raise _unsupported(content, limits.formats) from None
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
    if source_mode in _HIGH_DEPTH:  # to 8 bits first: the wide pixels are freed here
        img = _high_depth_to_l(img, notes)
    img = _to_srgb(img, notes)
    img = _to_rgb(img, notes, source_mode)
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


def _normalize(mean: tuple[float, ...], std: tuple[float, ...]) -> list[Callable[..., object]]:
    import torch
    from torchvision.transforms import v2 as T

    return [T.ToDtype(torch.float32, scale=True), T.Normalize(mean, std)]


def _train_steps(image_size: int) -> list[Callable[..., object]]:
    from torchvision.transforms import v2 as T

    return [
        T.RandomResizedCrop(image_size, scale=(0.35, 1.0), antialias=True),
        T.RandomHorizontalFlip(),
        T.PILToTensor(),
    ]


def _eval_steps(image_size: int, resize_size: int) -> list[Callable[..., object]]:
    from torchvision.transforms import v2 as T

    return [T.Resize(resize_size, antialias=True), T.CenterCrop(image_size), T.PILToTensor()]


def train_pixels(image_size: int) -> Callable[[Image.Image | torch.Tensor], torch.Tensor]:
    """Training augmentation: PIL RGB (or uint8 ``[3, H, W]``) -> uint8
    ``[3, image_size, image_size]`` (not normalised:
    the training loop normalises on the device, :class:`flowers_job.vision.precision.DeviceNormalize`).

    RandomResizedCrop (scale 0.35-1) and horizontal flip, as in torchvision's reference
    classification recipe, with a milder crop scale suited to a frozen backbone.
    """
    from torchvision.transforms import v2 as T

    return T.Compose(_train_steps(image_size))


def eval_pixels(
    image_size: int, resize_size: int
) -> Callable[[Image.Image | torch.Tensor], torch.Tensor]:
    """Evaluation: resize the shorter side to ``resize_size``, centre-crop ``image_size``.

    PIL RGB (or uint8 ``[3, H, W]``) -> uint8 ``[3, image_size, image_size]`` (not normalised).
    """
    from torchvision.transforms import v2 as T

    return T.Compose(_eval_steps(image_size, resize_size))


def eval_transform(
    image_size: int, resize_size: int, mean: tuple[float, ...], std: tuple[float, ...]
) -> Callable[[Image.Image], torch.Tensor]:
    """:func:`eval_pixels`, then normalised: float32 ``[3, image_size, image_size]``, the
    served model's input (the same pixels the training loop normalises on the device)."""
    from torchvision.transforms import v2 as T

    return T.Compose([*_eval_steps(image_size, resize_size), *_normalize(mean, std)])


class DecodeTransform:
    """Stored JPEG bytes -> uint8 ``[3, S, S]`` tensors: :meth:`decode` for one image (a
    loader's per-sample path), ``__call__`` for a pandas batch (a loader's batch path, e.g.
    Petastorm's ``TransformSpec``).

    Training: random resized crop and flip (:func:`train_pixels`); evaluation: resize and
    centre crop (:func:`eval_pixels`). Not normalised: the training loop normalises on the
    device. A picklable class (not a closure) so that reader processes and DataLoader worker
    processes can ship it.

    ``undecoded`` (``data.decode_device`` on the device): nothing is decoded here; the
    batch carries the stored JPEGs (:data:`~flowers_job.vision.batch_decode.JPEG_KEY`, rows
    zero-padded to ``jpeg_width`` bytes or to the batch's longest, and their lengths) for
    :class:`~flowers_job.vision.batch_decode.BatchDecoder` to decode on the device.
    """

    def __init__(
        self,
        train: bool,
        image_size: int,
        resize_size: int,
        *,
        undecoded: bool = False,
        jpeg_width: int | None = None,
    ) -> None:
        self.train = train
        self.image_size = image_size
        self.resize_size = resize_size
        self.undecoded = undecoded
        self.jpeg_width = jpeg_width
        self._tf: Callable[[Image.Image | torch.Tensor], torch.Tensor] | None = None

    def warm_up(self) -> DecodeTransform:
        """Build the torchvision transform now (its first use imports torchvision, ~2 s),
        so that the first timed epoch does not pay for it. Returns ``self``."""
        if self._tf is None and not self.undecoded:
            self._tf = (
                train_pixels(self.image_size)
                if self.train
                else eval_pixels(self.image_size, self.resize_size)
            )
        return self

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tf": None}  # rebuilt where it is used

    def decode(self, content: bytes) -> torch.Tensor:
        """One stored JPEG -> uint8 ``[3, S, S]``, augmented (train), contiguous; undecoded:
        the JPEG's bytes as uint8 ``[length]``. Decoded by TorchCodec and transformed as a
        tensor where TorchCodec is installed, else by Pillow and transformed as an image
        (the same transforms; the resize's pixels differ by rounding)."""
        import torch

        if self.undecoded:
            return torch.frombuffer(bytearray(content), dtype=torch.uint8)
        from flowers_job.vision.jpeg_decode import decode_jpeg, decoder_name

        tf = self.warm_up()._tf
        assert tf is not None
        if decoder_name() == "torchcodec":  # a JPEG only, as STORED_FORMATS
            return tf(decode_jpeg(content)).contiguous()
        with Image.open(io.BytesIO(content), formats=STORED_FORMATS) as img:
            return tf(img.convert("RGB")).contiguous()

    def __call__(self, pdf: pd.DataFrame) -> pd.DataFrame:
        """A pandas batch with an ``image`` column of stored JPEGs -> the same batch with
        uint8 ``[3, S, S]`` C-contiguous arrays (docs/known-issues.md, "Petastorm") in
        ``image``; undecoded: ``jpeg`` (uint8 ``[jpeg_width]`` rows) and ``jpeg_length``
        instead of ``image``."""
        from flowers_job.vision.batch_decode import JPEG_KEY, LENGTH_KEY, pad_jpegs

        pdf = pdf.copy()
        if self.undecoded:
            jpeg, length = pad_jpegs(list(pdf.pop("image")), self.jpeg_width)
            pdf[JPEG_KEY] = list(jpeg)
            pdf[LENGTH_KEY] = length
            return pdf
        pdf["image"] = [
            np.ascontiguousarray(self.decode(content).numpy()) for content in pdf["image"]
        ]
        return pdf
