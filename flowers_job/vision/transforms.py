"""The torchvision transforms of the model's pixels: training augmentation and evaluation
crops, uint8 in and out (the training loop normalises on the device), after torchvision's
reference classification presets."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from PIL import Image

__all__ = ["eval_pixels", "train_pixels"]


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
    ``[3, image_size, image_size]`` (not normalised: the training loop normalises on the
    device, :class:`flowers_job.vision.precision.DeviceNormalize`).

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
