"""The loaders' decode: stored JPEG bytes to the uint8 tensors a rank trains on, one image
or a pandas batch at a time, picklable for reader and DataLoader worker processes."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from flowers_job.vision.limits import STORED_FORMATS
from flowers_job.vision.transforms import eval_pixels, train_pixels

if TYPE_CHECKING:
    import pandas as pd
    import torch

__all__ = ["DecodeTransform"]


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
