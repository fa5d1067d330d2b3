"""Decode and augment a batch of stored JPEGs on the training device in one batched call.

The loaders can deliver a batch's images undecoded (``data.decode_device``): ``jpeg``, uint8
``[B, L]`` (each row one stored JPEG, zero-padded to the widest of the split) and
``jpeg_length``, int64 ``[B]`` (bytes of each). :class:`BatchDecoder` decodes them in one call
(:func:`~flowers_job.vision.jpeg_decode.decode_jpegs`: TorchCodec, nvJPEG's batched decoder on
CUDA) and crops, resizes and flips the whole batch with one
``torchvision.ops.roi_align`` on that device: the training images' random resized crop and
flip, or the evaluation resize and centre crop, as :mod:`flowers_job.vision.images` does on
the CPU with Pillow.

**The same draws on every device.** The crop boxes and flips are drawn on the host from a
``torch.Generator`` seeded by ``(seed, epoch, shard, step)`` (:func:`step_seed`): one batch's
augmentation depends on nothing else, so the same module gives the same crops on the CPU
and on a GPU, and a run resumed inside an epoch draws what the uninterrupted one drew. The
pixels then differ only by the decoder: nvJPEG's chroma upsampling against libjpeg-turbo's,
a mean absolute difference of 0.72-0.94 grey levels on an H200 (a few pixels at sharp
colour edges up to 90; benchmarks/gpu.py reports it). Against the loaders' Pillow path on
the CPU the decoded pixels are identical and the resize differs (roi_align's bin averages
against an antialiased bilinear filter): 0.9 grey levels on average at 224 px, which
tests/unit/train/test_gpu_path.py bounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = [
    "CROP_RATIO",
    "CROP_SCALE",
    "JPEG_KEY",
    "LENGTH_KEY",
    "BatchDecoder",
    "crop_boxes",
    "pad_jpegs",
    "padding_groups",
    "step_seed",
]

JPEG_KEY = "jpeg"
"""A batch's undecoded images: uint8 ``[B, L]``, one stored JPEG per row, zero-padded."""
LENGTH_KEY = "jpeg_length"
"""int64 ``[B]``: the bytes of each row of :data:`JPEG_KEY`."""

CROP_SCALE = (0.35, 1.0)
"""RandomResizedCrop's area fraction (:func:`flowers_job.vision.transforms.train_pixels`)."""
CROP_RATIO = (3.0 / 4.0, 4.0 / 3.0)
"""RandomResizedCrop's aspect ratios, torchvision's default."""

_TRIES = 10
_DRAWS = 2 * _TRIES + 3  # per image: (area, log-ratio) per try, top, left, flip


def pad_jpegs(contents: Sequence[bytes], width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Stored JPEGs as one uint8 matrix, for loaders that collate fixed-shape arrays.

    Args:
        contents: B JPEG byte strings.
        width: the row width in bytes (the split's largest image, so that batches from
            different row groups concatenate); None: the longest of ``contents``.

    Returns:
        ``(jpeg, jpeg_length)``: uint8 ``[B, width]`` zero-padded rows and int64 ``[B]``.

    Raises:
        ValueError: an image is longer than ``width`` (naming its length and the width).
    """
    lengths = np.fromiter((len(c) for c in contents), dtype=np.int64, count=len(contents))
    if width is None:
        width = int(lengths.max(initial=1))
    if lengths.size and int(lengths.max()) > width:
        raise ValueError(
            f"a stored image of {int(lengths.max())} bytes is longer than the split's widest "
            f"({width} bytes, the plan's max_image_bytes): the cache and its plan disagree"
        )
    out = np.zeros((len(contents), width), dtype=np.uint8)
    for i, content in enumerate(contents):
        out[i, : len(content)] = np.frombuffer(content, dtype=np.uint8)
    return out, lengths


def step_seed(seed: int, epoch: int, shard: int, step: int) -> int:
    """The seed of one step's augmentation draws: a 63-bit function of the four (the same
    on any device and after any resume)."""
    return (((seed * 1_000_003 + epoch) * 1_000_033 + shard) * 1_000_037 + step) % 2**63


def crop_boxes(
    sizes: Sequence[tuple[int, int]],
    generator: torch.Generator,
    scale: tuple[float, float] = CROP_SCALE,
    ratio: tuple[float, float] = CROP_RATIO,
) -> tuple[list[tuple[int, int, int, int]], list[bool]]:
    """RandomResizedCrop's boxes and the horizontal flips for images of ``sizes``.

    The algorithm of ``torchvision.transforms.v2.RandomResizedCrop`` (Szegedy et al. 2015,
    "Going deeper with convolutions", the Inception crop): up to 10 tries of an area
    fraction uniform in ``scale`` and a log-uniform aspect ratio in ``ratio``; the first box
    that fits is placed uniformly; else the centre crop of the clamped ratio. All draws come
    from ``generator``, a fixed number per image (23), so one image's box never shifts
    another's.

    Args:
        sizes: ``(height, width)`` in pixels of each image.
        generator: a CPU ``torch.Generator``.

    Returns:
        ``(boxes, flips)``: per image ``(top, left, height, width)`` in pixels and whether to
        flip it horizontally (probability 0.5).
    """
    import torch

    draws = torch.rand(len(sizes), _DRAWS, generator=generator, dtype=torch.float64).tolist()
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    boxes: list[tuple[int, int, int, int]] = []
    flips: list[bool] = []
    for (height, width), u in zip(sizes, draws, strict=True):
        area = height * width
        box = None
        for t in range(_TRIES):
            target = area * (scale[0] + (scale[1] - scale[0]) * u[2 * t])
            aspect = math.exp(lo + (hi - lo) * u[2 * t + 1])
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                top = min(int(u[-3] * (height - h + 1)), height - h)
                left = min(int(u[-2] * (width - w + 1)), width - w)
                box = (top, left, h, w)
                break
        if box is None:  # the centre crop, of the ratio clamped into ``ratio``
            in_ratio = width / height
            w, h = width, height
            if in_ratio < ratio[0]:
                h = round(w / ratio[0])
            elif in_ratio > ratio[1]:
                w = round(h * ratio[1])
            box = ((height - h) // 2, (width - w) // 2, h, w)
        boxes.append(box)
        flips.append(u[-1] < 0.5)
    return boxes, flips


def padding_groups(
    sizes: Sequence[tuple[int, int]],
) -> list[tuple[list[int], tuple[int, int]]]:
    """The images of a batch in groups that share one zero-padded canvas, and its size.

    An image of ``h x w`` pixels joins the group of ``(ceil(log2 h), ceil(log2 w))``, so in
    its group's canvas ``H x W`` both ``H < 2h`` and ``W < 2w``: its slot is under 4 times
    its own pixels, whatever the rest of the batch (one canvas of the batch's largest height
    by its largest width would give a 256x5120 and a 5120x256 image a 5120x5120 slot each,
    20 times their pixels). Photos of one batch mostly share one or two groups (landscape
    and portrait).

    Args:
        sizes: ``(height, width)`` in pixels of each image of the batch.

    Returns:
        ``[(indices, (height, width))]``: the indices into ``sizes`` of each group, in the
        order of ``sizes``, and its canvas (the group's largest height and width); groups
        in the order of their first image.
    """
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (h, w) in enumerate(sizes):
        groups.setdefault(((h - 1).bit_length(), (w - 1).bit_length()), []).append(i)
    return [
        (idx, (max(sizes[i][0] for i in idx), max(sizes[i][1] for i in idx)))
        for idx in groups.values()
    ]


class BatchDecoder:
    """Stored JPEGs -> uint8 ``[B, 3, S, S]`` on ``device``: decoded in one batched call,
    then cropped, resized (bilinear, antialiased) and flipped there.

    Training (``train=True``): a random resized crop to ``image_size`` and a random
    horizontal flip (:func:`crop_boxes`), as :func:`~flowers_job.vision.transforms.train_pixels`;
    evaluation: the shorter side resized to ``resize_size``, then the centre
    ``image_size`` crop, as :func:`~flowers_job.vision.transforms.eval_pixels`. Not normalised:
    :class:`~flowers_job.vision.precision.DeviceNormalize` does that.
    """

    def __init__(
        self, train: bool, image_size: int, resize_size: int, device: torch.device
    ) -> None:
        self.train = train
        self.image_size = image_size
        self.resize_size = resize_size
        self.device = device

    def decode(self, jpeg: torch.Tensor, length: torch.Tensor) -> list[torch.Tensor]:
        """One batched decode: ``jpeg`` uint8 ``[B, L]`` and ``length`` int64 ``[B]`` (both
        on the host) -> B uint8 ``[3, H, W]`` RGB images on the device.

        Raises:
            RuntimeError: a row is not a JPEG the decoder reads (the stored images are
                baseline sRGB JPEGs written by ingest, so this means a damaged cache).
        """
        from flowers_job.vision.jpeg_decode import decode_jpegs

        return decode_jpegs([jpeg[i, :n] for i, n in enumerate(length.tolist())], self.device)

    def boxes(
        self, sizes: Sequence[tuple[int, int]], generator: torch.Generator | None
    ) -> tuple[list[tuple[float, float, float, float]], list[bool]]:
        """The source box ``(top, left, height, width)`` in pixels that becomes each
        ``image_size`` square, and the flips: training's random resized crop
        (:func:`crop_boxes`), or evaluation's resize of the shorter side to
        ``resize_size`` and centre crop, as a box in the original image."""
        if self.train:
            assert generator is not None, "training draws need the step's generator"
            crops, flips = crop_boxes(sizes, generator)
            return [tuple(map(float, c)) for c in crops], flips  # type: ignore[misc]
        out = []
        for h, w in sizes:
            scale = self.resize_size / min(h, w)  # torchvision's Resize: the shorter side
            rh, rw = (
                (self.resize_size, int(self.resize_size * w / h))
                if h <= w
                else (int(self.resize_size * h / w), self.resize_size)
            )
            top = round((rh - self.image_size) / 2) / scale  # CenterCrop's offsets
            left = round((rw - self.image_size) / 2) / scale
            out.append((top, left, self.image_size / scale, self.image_size / scale))
        return out, [False] * len(sizes)

    def transform(
        self, images: list[torch.Tensor], generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Decoded uint8 ``[3, H, W]`` images (on the device) -> uint8 ``[B, 3, S, S]``.

        The crops and resizes in one ``torchvision.ops.roi_align`` call per group of
        similar sizes (:func:`padding_groups`; most batches are one or two groups), each
        group zero-padded to its own largest image: each output pixel averages a grid of
        bilinear samples over its bin (``sampling_ratio=-1``: ``ceil(box / S)`` per side),
        an antialiased downscale like torchvision's ``antialias=True`` bilinear resize, in a
        few launches per batch instead of several per image (measured on an H200:
        benchmarks/README.md).

        Memory: the float32 canvases hold under 4 slots of an image's own pixels each, so
        they take less than 48 bytes per decoded pixel of the batch (3 channels x 4 bytes x
        4), whatever mix of tall and wide images it holds.

        Args:
            generator: the step's draws (:func:`step_seed`); required when training.
        """
        import torch
        from torchvision.ops import roi_align

        size = self.image_size
        if not images:
            return torch.empty(0, 3, size, size, dtype=torch.uint8, device=self.device)
        sizes = [(int(i.shape[-2]), int(i.shape[-1])) for i in images]
        boxes, flips = self.boxes(sizes, generator)
        groups = padding_groups(sizes)
        order = [i for idx, _ in groups for i in idx]
        slot = {i: k for idx, _ in groups for k, i in enumerate(idx)}  # index in its canvas
        rois = torch.tensor(
            [
                [slot[i], left, top, left + w, top + h]
                for i in order
                for top, left, h, w in [boxes[i]]
            ],
            dtype=torch.float32,
        )
        flip = torch.tensor([flips[i] for i in order], dtype=torch.bool)
        if self.device.type == "cuda":  # a pageable copy would wait for the device
            rois, flip = rois.pin_memory(), flip.pin_memory()
        rois = rois.to(self.device, non_blocking=True)
        flip = flip.to(self.device, non_blocking=True)
        parts, start = [], 0
        for idx, (height, width) in groups:
            canvas = torch.zeros(len(idx), 3, height, width, device=self.device)
            for k, i in enumerate(idx):
                h, w = sizes[i]
                canvas[k, :, :h, :w] = images[i]
            part = rois[start : start + len(idx)]
            parts.append(
                roi_align(
                    canvas, part, (size, size), spatial_scale=1.0, sampling_ratio=-1, aligned=True
                )
            )
            start += len(idx)
            del canvas
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        out = torch.where(flip.view(-1, 1, 1, 1), out.flip(-1), out)
        out = out.round_().clamp_(0, 255).to(torch.uint8)
        if order != list(range(len(order))):  # back to the batch's order
            inverse = torch.empty(len(order), dtype=torch.long)
            inverse[torch.tensor(order)] = torch.arange(len(order))
            out = out[inverse.to(self.device, non_blocking=True)]
        return out

    def __call__(
        self, jpeg: torch.Tensor, length: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """:meth:`decode`, then :meth:`transform`: uint8 ``[B, 3, S, S]`` on the device."""
        return self.transform(self.decode(jpeg, length), generator)
