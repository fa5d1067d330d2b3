"""Pixels: decode and normalise one photo, and the tensors the model sees.

Pure Python (Pillow, torchvision), no Spark: used by the ingest UDF on executors,
by the loaders on the ranks (:class:`DecodeTransform`), and by the served MLflow model, so
all three see exactly the same pixels. torch and torchvision are imported by the
transforms only: ingest's driver and decode workers never load them (about 600 MB of
resident memory per process).
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image, ImageCms, ImageOps, UnidentifiedImageError

if TYPE_CHECKING:
    import pandas as pd
    import torch

__all__ = [
    "DecodeTransform",
    "ImageRejected",
    "NormalizedImage",
    "eval_pixels",
    "eval_transform",
    "normalize_image",
    "open_rgb",
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


def _to_rgb(img: Image.Image, notes: list[str]) -> Image.Image:
    """8-bit RGB from any Pillow mode; transparency is composited on white."""
    mode = img.mode
    if mode == "RGB":
        return img
    if mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        # 16/32-bit grayscale: scale to 0..255 rather than clip (convert('L') clips).
        arr = np.asarray(img, dtype=np.float64)
        hi = 65535.0 if mode.startswith("I;16") or arr.max() > 255 else 255.0
        arr = np.clip(arr / hi * 255.0 + 0.5, 0, 255).astype(np.uint8)
        img = Image.fromarray(arr, mode="L")
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
    content: bytes, *, max_pixels: int, draft_short_side: int | None = None
) -> tuple[Image.Image, list[str], tuple[int, int]]:
    """Decode ``content`` into an 8-bit sRGB Pillow image, upright per its EXIF tag.

    Args:
        content: the file's bytes (JPEG, PNG, or anything Pillow reads).
        max_pixels: decompression-bomb guard; larger images are rejected before decoding.
        draft_short_side: if given, let the JPEG decoder downscale by 1/2, 1/4 or 1/8 while
            keeping both sides >= this many pixels (much faster for large photos).

    Returns:
        ``(image, notes, (width, height))``: a fully loaded RGB image, what was done to it,
        and the original size in pixels as displayed (after EXIF rotation, before any draft).

    Raises:
        ImageRejected: ``empty_file``, ``not_an_image``, ``too_many_pixels`` or ``corrupt``.
    """
    if not content:
        raise ImageRejected("empty_file", "file has 0 bytes")
    notes: list[str] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img: Image.Image = Image.open(io.BytesIO(content))
            w, h = img.size
            if w * h > max_pixels:
                raise ImageRejected(
                    "too_many_pixels",
                    f"{w}x{h} = {w * h} pixels exceeds the limit of {max_pixels} (data.max_image_pixels)",
                )
            if draft_short_side and img.format == "JPEG":
                img.draft(None, (draft_short_side, draft_short_side))
            img.load()
    except ImageRejected:
        raise
    except UnidentifiedImageError:
        # Pillow's own message names the BytesIO object's address: not reproducible.
        raise ImageRejected(
            "not_an_image", "Pillow cannot identify the file as an image (JPEG, PNG, ...)"
        ) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageRejected("too_many_pixels", str(exc)) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageRejected("corrupt", f"{type(exc).__name__}: {exc}") from None
    orientation = img.getexif().get(0x0112, 1)
    if orientation != 1:
        notes.append(f"exif orientation {orientation} applied")
        img = ImageOps.exif_transpose(img)
        if orientation in (5, 6, 7, 8):  # 90 or 270 degree rotations swap the sides
            w, h = h, w
    img = _to_srgb(img, notes)
    img = _to_rgb(img, notes)
    return img, notes, (w, h)


def normalize_image(
    content: bytes, *, short_side: int, quality: int = 90, max_pixels: int = 89_478_485
) -> NormalizedImage:
    """Decode a photo, normalise it to 8-bit sRGB, downscale, and re-encode as JPEG.

    Args:
        content: the file's bytes.
        short_side: the stored image's shorter side is at most this (pixels); smaller
            photos are kept at their size (the loader resizes).
        quality: JPEG quality of the re-encoded image.
        max_pixels: decompression-bomb guard (see :func:`open_rgb`).

    Returns:
        A :class:`NormalizedImage`.

    Raises:
        ImageRejected: the file is empty, not an image, too large, or corrupt.
    """
    img, notes, (width, height) = open_rgb(
        content, max_pixels=max_pixels, draft_short_side=short_side
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


def train_pixels(image_size: int) -> Callable[[Image.Image], torch.Tensor]:
    """Training augmentation: PIL RGB -> uint8 ``[3, image_size, image_size]`` (not normalised:
    the training loop normalises on the device, :class:`flowers_job.vision.precision.DeviceNormalize`).

    RandomResizedCrop (scale 0.35-1) and horizontal flip, as in torchvision's reference
    classification recipe, with a milder crop scale suited to a frozen backbone.
    """
    from torchvision.transforms import v2 as T

    return T.Compose(_train_steps(image_size))


def eval_pixels(image_size: int, resize_size: int) -> Callable[[Image.Image], torch.Tensor]:
    """Evaluation: resize the shorter side to ``resize_size``, centre-crop ``image_size``.

    PIL RGB -> uint8 ``[3, image_size, image_size]`` (not normalised).
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
        self._tf: Callable[[Image.Image], torch.Tensor] | None = None

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
        the JPEG's bytes as uint8 ``[length]``."""
        import torch

        if self.undecoded:
            return torch.frombuffer(bytearray(content), dtype=torch.uint8)
        tf = self.warm_up()._tf
        assert tf is not None
        with Image.open(io.BytesIO(content)) as img:
            return tf(img.convert("RGB")).contiguous()

    def __call__(self, pdf: pd.DataFrame) -> pd.DataFrame:
        """A pandas batch with an ``image`` column of stored JPEGs -> the same batch with
        uint8 ``[3, S, S]`` C-contiguous arrays (STACK.md trap 10) in ``image``; undecoded:
        ``jpeg`` (uint8 ``[jpeg_width]`` rows) and ``jpeg_length`` instead of ``image``."""
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
