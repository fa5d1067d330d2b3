"""JPEG bytes -> uint8 RGB tensors, through TorchCodec where it is installed.

torchvision 0.29 deprecates its image I/O (``torchvision.io.decode_jpeg`` and the rest) for
TorchCodec (pytorch/vision#9609), which decodes JPEG on the CPU and, a batch per call, with
nvJPEG on CUDA. Where TorchCodec is not installed (the Databricks runtimes ship torchvision
0.22 and 0.24, whose decoders are current, and no TorchCodec), ``torchvision.io`` decodes.
TorchCodec always applies the EXIF orientation and decodes to RGB (meta-pytorch/torchcodec#1560);
``torchvision.io``'s batched decode cannot apply the orientation on CUDA, so callers pass
upright images only: the stored images (ingest applied the orientation) and the plain JPEGs
of serving. On those both decoders give the pixels Pillow gives (docs/known-issues.md#decoders).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["decode_jpeg", "decode_jpegs", "decoder_name"]


@functools.cache
def _torchcodec() -> Callable[..., Any] | None:
    """TorchCodec's ``decode_jpeg``, or None where TorchCodec (or its native library) is
    missing."""
    try:
        from torchcodec.decoders import decode_jpeg as torchcodec_decode
    except (ImportError, OSError, RuntimeError):
        return None
    return torchcodec_decode


def decoder_name() -> str:
    """``"torchcodec"`` or ``"torchvision"``: the library that decodes here."""
    return "torchcodec" if _torchcodec() is not None else "torchvision"


def decode_jpegs(rows: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Decode B JPEGs in one call: nvJPEG's batched decoder on CUDA, libjpeg-turbo on a CPU.

    Args:
        rows: B 1-D uint8 tensors on the host, each one whole JPEG file.
        device: where the pixels go (and, on CUDA, where they are decoded).

    Returns:
        B uint8 ``[3, H, W]`` RGB tensors on ``device`` (TorchCodec applies an EXIF
        orientation, ``torchvision.io`` does not: pass upright images).

    Raises:
        RuntimeError: a row is not a JPEG the decoder reads (the decoder's message).
    """
    if not rows:
        return []
    torchcodec_decode = _torchcodec()
    if torchcodec_decode is not None:
        out = torchcodec_decode(list(rows), mode="RGB", device=device)
    else:
        from torchvision.io import ImageReadMode
        from torchvision.io import decode_jpeg as torchvision_decode

        out = torchvision_decode(list(rows), mode=ImageReadMode.RGB, device=device)
    return list(out) if isinstance(out, list) else [out]


def decode_jpeg(content: bytes) -> torch.Tensor:
    """One JPEG file's bytes -> uint8 ``[3, H, W]`` RGB on the CPU (:func:`decode_jpegs`).

    Raises:
        RuntimeError: ``content`` is not a JPEG the decoder reads.
    """
    import torch

    (image,) = decode_jpegs(
        [torch.frombuffer(bytearray(content), dtype=torch.uint8)], torch.device("cpu")
    )
    return image
