"""Backbones: the offline EfficientNet-Lite0 weights, torchvision architectures, local files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowers_job.vision.backbones import build_model

pytestmark = pytest.mark.tier("gate")


def test_efficientnet_lite0_loads_pretrained_weights_offline_and_freezes() -> None:
    model = build_model("efficientnet_lite0", 5, "package", freeze_backbone=True)
    scratch = build_model("efficientnet_lite0", 5, "none", freeze_backbone=False)
    a = dict(model.backbone.named_parameters())
    b = dict(scratch.backbone.named_parameters())
    assert any(not torch.equal(a[k], b[k]) for k in a)  # real weights, not the init
    assert not any(p.requires_grad for p in model.backbone.parameters())
    assert all(p.requires_grad for p in model.head.parameters())
    model.train()
    assert not model.backbone.training  # frozen BatchNorm statistics
    out = model(torch.randn(2, 3, 64, 64))
    assert out.shape == (2, 5) and out.dtype == torch.float32


def test_torchvision_architecture_from_a_local_weights_file(tmp_path: Path) -> None:
    from torchvision import models

    source = models.get_model("resnet18", weights=None, num_classes=1000)
    path = tmp_path / "resnet18.pt"
    torch.save(source.state_dict(), path)  # as a user would save ImageNet weights
    model = build_model("resnet18", 3, "file", weights_path=path, freeze_backbone=False)
    loaded = model.backbone.state_dict()["conv1.weight"]
    assert torch.equal(loaded, source.conv1.weight)
    assert model.head[-1].in_features == 512
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 3)


def test_a_trained_backbone_gives_every_trainable_parameter_a_gradient() -> None:
    """DDP fails on the second step ("Expected to have finished reduction in the prior
    iteration") when a trainable parameter gets no gradient: the package's own ImageNet
    classifier, which the features never pass through, must not be trainable."""
    model = build_model("efficientnet_lite0", 5, "package", freeze_backbone=False)
    model.train()
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert "backbone.net._conv_stem.weight" in trainable
    assert [n for n, p in trainable.items() if p.grad is None] == []
