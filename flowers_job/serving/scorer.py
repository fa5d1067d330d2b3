"""The served model's work: decode images, run the network, return probabilities.

:class:`Scorer` is what the registered MLflow pyfunc
(:class:`~flowers_job.serving.pyfunc_model.FlowersClassifierModel`) wraps, with no MLflow in it: built from
the pyfunc's ``model_config`` and its ``state_dict`` artifact, it scores a list of image bytes
(:meth:`Scorer.score`) for the REST server, in-process pyfunc users and ``flowers-job
predict`` on the executors alike.

Images are decoded exactly as at ingest (EXIF orientation, ICC -> sRGB, 8-bit RGB) and then
resized and centre-cropped as at validation.

**On a GPU** (Databricks GPU Model Serving, ``flowers-job predict`` on GPU executors) the
network runs on the first GPU in the precision training would choose there (bf16 from
compute capability 8.0, fp16 below: :func:`~flowers_job.vision.precision.amp_dtype`), and the
request's plain JPEGs (8-bit RGB or grey, upright, no ICC profile: what cameras and the
stored images are) are decoded there in one batched call
(:class:`~flowers_job.vision.batch_decode.BatchDecoder`); every other image takes the Pillow
path and joins the batch as pixels. ``FLOWERS_SERVING_DEVICE`` (auto, cpu, cuda[:N]) chooses
the device (:func:`~flowers_job.runtime.devices.serving_device`); ``Scorer(...,
batch_decode=True)`` sends the plain JPEGs through the batched decoder on a CPU too (how
the tests run the GPU's code path).
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flowers_job.vision.limits import ImageLimits, ImageRejected, check_size, pillow_pixel_limit

__all__ = ["SCORE_BATCH_SIZE", "Scorer", "Scores"]


@dataclass(frozen=True)
class Scores:
    """What :meth:`FlowersClassifierModel.score` returns for N images.

    Attributes:
        probabilities: float64 ``[N, num_labels]``, columns in ``label_names`` order; each
            scored row sums to 1; a rejected row is all NaN.
        rejections: N entries: None for a scored row, else the
            :class:`~flowers_job.vision.limits.ImageRejected` that says why (``code`` is one of
            ingest's reason codes: ``empty_file``, ``file_too_large``, ``unsupported_format``
            (naming the real format), ``not_an_image``, ``too_many_pixels``,
            ``long_side_too_large``, ``extreme_aspect``, ``animated_image``, ``corrupt``, or
            ``decode_error`` for any other failure to decode).
    """

    probabilities: np.ndarray
    rejections: list[ImageRejected | None]


SCORE_BATCH_SIZE = 32
"""Images per forward pass of :meth:`FlowersClassifierModel.score` (``model_config``'s
``batch_size``): the training ranks' per-device batch on CPU. Batch scoring on 2 cores ran
faster with 32 than with 64 or 16 (docs/performance.md): at 224 px a batch of 64 makes every
activation map about 100 MB, and the element-wise layers (batch norm, ReLU6, padding) of
two concurrent workers then wait on memory. A model registered before keeps its own
``batch_size``."""


class Scorer:
    """The network and its preprocessing, rebuilt from a pyfunc's ``model_config``.

    ``config`` keys: architecture, label_names, image_size, resize_size, mean, std, dropout,
    max_pixels, batch_size (:func:`flowers_job.serving.pyfunc_model.model_config`), and the
    limits of :meth:`ImageLimits.model_config <flowers_job.vision.limits.ImageLimits.model_config>`
    (image_formats, max_aspect_ratio, max_long_side, max_file_bytes: each defaults to
    ``data``'s default when absent, as in a model registered before them); ``state_dict``: the
    classifier's weights (a ``torch.save`` file, loaded with ``weights_only``).
    ``device``: None = :func:`~flowers_job.runtime.devices.serving_device`.
    ``batch_decode``: decode the plain JPEGs in one batched call on a CPU device too (on a
    GPU they always are); False: Pillow, one image at a time, on a CPU.
    """

    def __init__(
        self,
        config: dict[str, Any],
        state_dict: str | Path,
        device: torch.device | None = None,
        *,
        batch_decode: bool = False,
    ) -> None:
        from flowers_job.runtime.devices import serving_device
        from flowers_job.vision.backbones import build_model
        from flowers_job.vision.batch_decode import BatchDecoder
        from flowers_job.vision.precision import DeviceNormalize, amp_dtype
        from flowers_job.vision.transforms import eval_pixels

        cfg = config
        self.label_names = list(cfg["label_names"])
        self.limits = ImageLimits.from_model_config(cfg)
        self.batch_size = int(cfg.get("batch_size", SCORE_BATCH_SIZE))
        self.model = build_model(
            cfg["architecture"],
            len(self.label_names),
            "none",
            freeze_backbone=False,
            dropout=float(cfg["dropout"]),
        )
        state = torch.load(state_dict, map_location="cpu", weights_only=True)
        self.model.load_state_dict(state)
        # Channels-last, as training runs it: on CPU it scored faster than contiguous, at 1
        # and at 2 threads (docs/performance.md).
        self.device = device = device if device is not None else serving_device()
        self.model.to(device, memory_format=torch.channels_last)  # type: ignore[call-overload]
        self.model.eval()
        self.dtype = amp_dtype("auto", device)
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = True
        # The evaluation path's: uint8 pixels per image, normalised once per batch
        # (DeviceNormalize), not a float32 copy per image.
        size, resize = int(cfg["image_size"]), int(cfg["resize_size"])
        self.pixels = eval_pixels(size, resize)
        self.normalize = DeviceNormalize(tuple(cfg["mean"]), tuple(cfg["std"]), device)
        self.decoder = (
            BatchDecoder(False, size, resize, device)
            if device.type == "cuda" or batch_decode
            else None
        )

    def score(self, contents: Sequence[bytes | bytearray | memoryview | None]) -> Scores:
        """Decode and score N images; a row that does not decode is rejected, not raised.

        Each image is checked by its header against the model's
        :class:`~flowers_job.vision.limits.ImageLimits` (format, pixels, long side, aspect
        ratio) before it is decoded or resized: a refused row costs no pixel memory.

        Args:
            contents: N file bytes (any format Pillow reads); None (or NaN) counts as an
                empty file, any other non-bytes value is ``not_an_image``.

        Returns:
            :class:`Scores`: float64 ``[N, num_labels]`` probabilities (NaN rows where
            rejected) and N rejections (None where scored). The decodable rows go through the
            model in batches of ``batch_size``; with a batched decoder (a GPU), the plain
            JPEGs of each batch are decoded in one call on the device.
        """
        n = len(contents)
        probabilities = np.full((n, len(self.label_names)), np.nan)
        rejections: list[ImageRejected | None] = [None] * n
        raws = [b""] * n
        plain: list[int] = []
        others: list[int] = []
        for i, content in enumerate(contents):
            try:
                raws[i] = _as_bytes(content)
            except ImageRejected as exc:
                rejections[i] = exc
                continue
            is_plain = self.decoder is not None and _plain_jpeg(raws[i], self.limits)
            (plain if is_plain else others).append(i)
        for group, batched in ((plain, True), (others, False)):
            for k in range(0, len(group), self.batch_size):
                rows = group[k : k + self.batch_size]
                images, rows = self._pixels(rows, raws, rejections, batched)
                if rows:
                    probabilities[rows] = self._forward(images)
        return Scores(probabilities, rejections)

    def _pixels(
        self,
        rows: list[int],
        raws: list[bytes],
        rejections: list[ImageRejected | None],
        batched: bool,
    ) -> tuple[torch.Tensor, list[int]]:
        """uint8 ``[b, 3, S, S]`` on the device for ``rows`` and the rows it holds: one batched
        decode (``batched``; a batch the decoder refuses goes the Pillow way), else Pillow one
        by one, recording each image that does not decode in ``rejections``."""
        from flowers_job.vision.batch_decode import pad_jpegs
        from flowers_job.vision.images import open_rgb

        if batched and self.decoder is not None:
            jpeg, length = pad_jpegs([raws[i] for i in rows])
            try:
                return self.decoder(torch.from_numpy(jpeg), torch.from_numpy(length)), rows
            except RuntimeError:
                pass  # a damaged JPEG among them: find it the Pillow way
        tensors, kept = [], []
        for i in rows:
            try:
                img, _, _ = open_rgb(raws[i], limits=self.limits)
                tensors.append(self.pixels(img))
                kept.append(i)
            except ImageRejected as exc:
                rejections[i] = _explain(exc, raws[i])
            except Exception as exc:  # any other decoder failure: a row, not a crash
                rejections[i] = ImageRejected("decode_error", f"{type(exc).__name__}: {exc}")
        if not tensors:
            return torch.empty(0), []
        return torch.stack(tensors).to(self.device, non_blocking=True), kept

    def _forward(self, images: torch.Tensor) -> np.ndarray:
        """uint8 ``[b, 3, S, S]`` -> float64 ``[b, num_labels]`` probabilities (host), in the
        device's precision."""
        from flowers_job.vision.precision import autocast

        with torch.inference_mode(), autocast(self.device, self.dtype):
            logits = self.model(self.normalize(images))
        return torch.softmax(logits.float(), dim=1).double().cpu().numpy()


def _plain_jpeg(raw: bytes, limits: ImageLimits) -> bool:
    """True for a JPEG the batched decoder reads as Pillow would: 8-bit RGB (YCbCr) or
    grey, upright (no EXIF rotation), without an ICC profile, within ``limits`` (JPEG among
    its formats, pixels, long side, aspect ratio: :func:`~flowers_job.vision.limits.check_size`).
    Reads the header only (Pillow opens lazily, and as a JPEG only); anything else takes
    the Pillow path, which names why it refuses a file."""
    from PIL import Image

    if "JPEG" not in limits.formats or len(raw) > limits.max_file_bytes:
        return False
    try:
        with (
            pillow_pixel_limit(limits.max_pixels),
            Image.open(io.BytesIO(raw), formats=("JPEG",)) as img,
        ):
            check_size(*img.size, limits)
            return (
                img.format == "JPEG"
                and img.mode in ("RGB", "L")
                and not img.info.get("icc_profile")
                and img.getexif().get(0x0112, 1) == 1
            )
    except Exception:
        return False


def _as_bytes(content: object) -> bytes:
    """One input cell as bytes: None/NaN -> ``b""`` (then ``empty_file``).

    Raises:
        ImageRejected: ``not_an_image`` for a value that is not bytes (a string, a number).
    """
    if isinstance(content, bytes | bytearray | memoryview):
        return bytes(content)
    if content is None or (isinstance(content, float) and np.isnan(content)):
        return b""
    raise ImageRejected(
        "not_an_image", f"expected the image file's bytes, got a {type(content).__name__}"
    )


def _explain(exc: ImageRejected, raw: bytes) -> ImageRejected:
    """``exc``, with a hint when the bytes are base64 text rather than an image (a client that
    sent the ``inputs`` JSON format, which MLflow does not base64-decode for binary columns)."""
    if exc.code != "not_an_image" or not raw:
        return exc
    try:
        base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        return exc
    return ImageRejected(
        exc.code,
        f"{exc.message}; the bytes are base64 text: send images in a dataframe_split or "
        "dataframe_records payload, where MLflow base64-decodes the binary 'image' column",
    )
