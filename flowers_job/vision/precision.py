"""The model's input and arithmetic on the device, shared by the training ranks and the served
model: uint8 images normalised to float32 channels-last on the device
(:class:`DeviceNormalize`), and the mixed precision a device supports (:func:`amp_dtype`,
:func:`autocast`).
"""

from __future__ import annotations

import torch

__all__ = ["BF16_MIN_CAPABILITY", "DeviceNormalize", "amp_dtype", "autocast"]

BF16_MIN_CAPABILITY = (8, 0)
"""bf16 tensor-core arithmetic starts with Ampere (compute capability 8.0: NVIDIA's CUDA C++
Programming Guide, "Compute Capabilities"). ``torch.cuda.is_bf16_supported()`` also answers
True on older GPUs, a T4 (7.5) among them, where bf16 is emulated through float32 and runs
slower than fp16 on its tensor cores."""


class DeviceNormalize:
    """uint8 images -> the model's float32 input, on the device: ``(x / 255 - mean) / std``.

    The loaders deliver uint8 ``[B, 3, S, S]`` (a quarter of float32's bytes through the
    loader, the pinned buffer and the host-to-device copy); this runs on the batch once it
    is on ``device`` (one fused multiply-add per pixel, on the GPU when there is one).

    Input: uint8 ``[B, 3, S, S]`` on any device. Output: float32 ``[B, 3, S, S]`` on
    ``device``, channels-last.
    """

    def __init__(
        self, mean: tuple[float, ...], std: tuple[float, ...], device: torch.device
    ) -> None:
        self.device = device
        scale = torch.tensor([1.0 / (255.0 * s) for s in std], dtype=torch.float32)
        shift = torch.tensor([m / s for m, s in zip(mean, std, strict=True)], dtype=torch.float32)
        self.scale = scale.view(1, -1, 1, 1).to(device)
        self.neg_shift = (-shift).view(1, -1, 1, 1).to(device)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(self.device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        return torch.addcmul(self.neg_shift, x.float(), self.scale)


def amp_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``train.amp`` on ``device``; None = float32 (no autocast).

    'auto': bf16 on a GPU of compute capability 8.0 or more (:data:`BF16_MIN_CAPABILITY`),
    fp16 on an older GPU (with a ``GradScaler``: Micikevicius et al. 2018, "Mixed Precision
    Training"), float32 on a CPU. 'bf16' and 'fp16' as asked; 'off': float32.

    Raises:
        ValueError: 'bf16' on a GPU older than compute capability 8.0, naming it.
    """
    if amp == "off":
        return None
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        modern = tuple(capability) >= BF16_MIN_CAPABILITY
        if amp == "bf16" and not modern:
            name = torch.cuda.get_device_name(device)
            raise ValueError(
                f"train.amp=bf16: {device} is a {name} of compute capability "
                f"{capability[0]}.{capability[1]}; bf16 needs 8.0 or more (Ampere and newer). "
                "Use train.amp=auto (fp16 with a gradient scaler there) or fp16"
            )
        if amp == "auto":
            return torch.bfloat16 if modern else torch.float16
    elif amp == "auto":
        return None
    return torch.bfloat16 if amp == "bf16" else torch.float16


def autocast(device: torch.device, dtype: torch.dtype | None) -> torch.autocast:
    """``torch.autocast`` on ``device`` with ``dtype``; disabled when ``dtype`` is None."""
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)
