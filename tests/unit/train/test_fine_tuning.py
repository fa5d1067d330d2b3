"""The fine-tuning recipe: parameter groups (layer-wise decay, no decay on norms and
biases), warm-up then cosine, EMA and its checkpoint, EfficientNet-Lite1/2 weights, and the
settings' checks. Unit tests only: no job runs here."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from flowers_job.config import JobConfig, load_config
from flowers_job.config.load import ConfigError
from flowers_job.train.checkpoint import load_checkpoint, save_checkpoint
from flowers_job.train.fine_tuning import attach_ema, layer_ids, make_ema, param_groups
from flowers_job.train.state import make_scheduler
from flowers_job.train.step import make_optimizer
from flowers_job.vision.backbones import (
    LITE_MEAN,
    build_model,
    native_image_size,
    preprocessing_for,
)
from tests.support import ROOT_DIR

pytestmark = pytest.mark.tier("gate")


def _cfg(tmp_path: Path, *overrides: str) -> JobConfig:
    return load_config(None, list(overrides), **{"paths.output_dir": tmp_path})


@pytest.fixture(scope="module")
def lite0() -> nn.Module:
    """EfficientNet-Lite0 with a trained backbone, random weights (the groups depend on the
    structure only)."""
    return build_model("efficientnet_lite0", 5, "none", freeze_backbone=False)


def test_the_defaults_make_one_group_of_every_trainable_parameter(
    tmp_path: Path, lite0: nn.Module
) -> None:
    train = _cfg(tmp_path).train
    (group,) = param_groups(lite0, train, 0.01)
    trainable = [p for p in lite0.parameters() if p.requires_grad]
    assert [id(p) for p in group["params"]] == [id(p) for p in trainable]
    assert (group["lr"], group["weight_decay"], group["lr_scale"]) == (0.01, 1e-4, 1.0)


def test_layer_decay_and_no_decay_on_norms_and_biases(tmp_path: Path, lite0: nn.Module) -> None:
    train = _cfg(
        tmp_path,
        "model.freeze_backbone=false",
        "train.layer_decay=0.5",
        "train.decay_norm_and_bias=false",
        "train.optimizer=sgd",  # AdamW's first construction imports torch._dynamo (seconds)
    ).train
    groups = param_groups(lite0, train, 0.01)
    ids, num_layers = layer_ids(lite0)
    # stem conv, stem norm, 16 blocks, head conv, head norm; then the new head
    assert num_layers == 20
    assert ids["backbone.net._conv_stem.weight"] == 0
    assert ids["backbone.net._blocks.0._depthwise_conv.weight"] == 2
    assert ids["backbone.net._blocks.15._bn2.bias"] == 17
    assert ids["head.1.weight"] == ids["head.1.bias"] == 20
    name = {id(p): n for n, p in lite0.named_parameters()}
    seen = [id(p) for g in groups for p in g["params"]]
    trainable = [id(p) for p in lite0.parameters() if p.requires_grad]
    assert sorted(seen) == sorted(trainable) and len(seen) == len(set(seen))
    for g in groups:
        layers = {ids[name[id(p)]] for p in g["params"]}
        assert len(layers) == 1
        assert g["lr"] == pytest.approx(0.01 * 0.5 ** (20 - layers.pop()))
        dims = {p.ndim for p in g["params"]}
        assert (g["weight_decay"] == 0.0) == (max(dims) < 2)
        assert g["weight_decay"] in (0.0, 1e-4)
    head = [g for g in groups if any(name[id(p)] == "head.1.weight" for p in g["params"])]
    assert head[0]["lr"] == 0.01 and head[0]["weight_decay"] == 1e-4
    bias = [g for g in groups if any(name[id(p)] == "head.1.bias" for p in g["params"])]
    assert bias[0]["weight_decay"] == 0.0
    optimizer = make_optimizer(train, groups, 0.01)
    assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in groups]


def _lrs(cfg: JobConfig, steps_per_epoch: int, lr: float) -> list[float]:
    weight = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([{"params": [weight], "lr": lr}], lr=lr)
    scheduler = make_scheduler(cfg, optimizer, lr, steps_per_epoch)
    out = []
    for _ in range(cfg.train.epochs * steps_per_epoch):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def test_warmup_then_cosine_values(tmp_path: Path) -> None:
    cfg = _cfg(
        tmp_path,
        "train.epochs=5",
        "train.warmup_epochs=1",
        "train.lr_schedule=cosine",
        "train.lr_min_ratio=0.1",
        "train.base_learning_rate=0.001",
    )
    lrs = _lrs(cfg, 10, 0.002)  # 2 ranks: warm-up from 0.001 to 0.002 over 10 steps
    assert lrs[0] == pytest.approx(0.001)
    assert lrs[5] == pytest.approx(0.0015)
    assert lrs[10] == pytest.approx(0.002)  # peak, then the cosine over 40 steps
    assert lrs[30] == pytest.approx(0.002 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2))))
    assert lrs[-1] == pytest.approx(0.002 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 39 / 40))))
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:]))
    constant = _lrs(_cfg(tmp_path, "train.epochs=5", "train.warmup_epochs=1"), 10, 0.002)
    assert constant[:11] == pytest.approx(lrs[:11]) and constant[-1] == pytest.approx(0.002)


def test_ema_updates_after_each_step_and_round_trips_through_a_checkpoint(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    linear, norm = nn.Linear(4, 3), nn.BatchNorm1d(3)
    model = nn.Sequential(linear, norm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = make_ema(model, 0.9)
    assert ema is not None and make_ema(model, None) is None
    attach_ema(optimizer, ema, model)

    def step() -> None:
        optimizer.zero_grad()
        model(torch.randn(8, 4)).pow(2).sum().backward()
        optimizer.step()

    def average(key: str) -> torch.Tensor:
        return ema.module.state_dict()[key]

    step()  # the first update copies the weights
    assert torch.equal(average("0.weight"), linear.weight)
    before = average("0.weight").clone()
    step()
    assert torch.allclose(average("0.weight"), 0.9 * before + 0.1 * linear.weight.detach())
    assert not torch.equal(average("0.weight"), linear.weight)
    # BatchNorm statistics are averaged too (use_buffers)
    assert norm.running_mean is not None
    assert not torch.equal(average("1.running_mean"), norm.running_mean)
    save_checkpoint({"ema": ema.state_dict()}, tmp_path)  # loaded with weights_only=True
    saved = load_checkpoint(tmp_path)
    assert saved is not None
    again = AveragedModel(model, use_buffers=True)
    again.load_state_dict(saved["ema"])
    assert int(again.n_averaged) == 2
    for a, b in zip(again.state_dict().values(), ema.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_the_cosine_schedule_state_round_trips_through_a_weights_only_checkpoint(
    tmp_path: Path,
) -> None:
    cfg = _cfg(tmp_path, "train.epochs=3", "train.lr_schedule=cosine")
    weight = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.01)
    scheduler = make_scheduler(cfg, optimizer, 0.01, 4)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    save_checkpoint({"scheduler": scheduler.state_dict()}, tmp_path)
    saved = load_checkpoint(tmp_path)
    assert saved is not None
    optimizer2 = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.01)
    scheduler2 = make_scheduler(cfg, optimizer2, 0.01, 4)
    scheduler2.load_state_dict(saved["scheduler"])
    optimizer2.step()
    scheduler2.step()
    optimizer.step()
    scheduler.step()
    assert optimizer2.param_groups[0]["lr"] == pytest.approx(optimizer.param_groups[0]["lr"])


@pytest.mark.parametrize(
    ("architecture", "size"), [("efficientnet_lite1", 240), ("efficientnet_lite2", 260)]
)
def test_efficientnet_lite1_and_lite2_load_their_offline_weights(
    tmp_path: Path, architecture: str, size: int
) -> None:
    model = build_model(architecture, 5, "package")
    scratch = build_model(architecture, 5, "none", freeze_backbone=False)
    a, b = model.backbone.state_dict(), scratch.backbone.state_dict()
    assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)
    assert model.eval()(torch.randn(1, 3, 64, 64)).shape == (1, 5)
    assert preprocessing_for(architecture).mean == LITE_MEAN
    assert native_image_size(architecture) == size
    cfg = _cfg(tmp_path, f"model.architecture={architecture}")
    assert (cfg.data.image_size, cfg.model.resolved_weights) == (size, "package")


def test_an_explicit_image_size_wins_over_the_native_one(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "model.architecture=efficientnet_lite2", "data.image_size=192")
    assert cfg.data.image_size == 192
    assert _cfg(tmp_path, "model.architecture=resnet18").data.image_size == 224
    again = JobConfig.model_validate(cfg.model_dump(mode="json"))  # what the workers rebuild
    assert again == cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.layer_decay=0.8"], "train.layer_decay"),
        (["model.freeze_backbone=false", "train.layer_decay=0"], "train.layer_decay"),
        (["train.ema_decay=1"], "train.ema_decay"),
        (["train.lr_schedule=step"], "train.lr_schedule"),
        (["train.lr_min_ratio=2"], "train.lr_min_ratio"),
        (["model.architecture=efficientnet_lite9"], "model.architecture"),
        (["model.frozen_layers=4"], "model.frozen_layers"),  # with the frozen default
        (["model.frozen_layers=-1", "model.freeze_backbone=false"], "model.frozen_layers"),
    ],
)
def test_bad_recipe_settings_are_refused_by_name(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        _cfg(tmp_path, *overrides)


def test_the_gpu_preset_is_lite2_at_260_px_with_the_whole_recipe(tmp_path: Path) -> None:
    preset = ROOT_DIR / "configs" / "gpu.yaml"
    cfg = load_config(preset, None, **{"paths.output_dir": tmp_path})
    assert (cfg.model.architecture, cfg.data.image_size) == ("efficientnet_lite2", 260)
    assert (cfg.train.lr_schedule, cfg.train.ema_decay, cfg.world_size) == ("cosine", 0.995, 1)


def test_frozen_layers_stop_backpropagation_and_keep_their_statistics(tmp_path: Path) -> None:
    """``model.frozen_layers=10`` on EfficientNet-Lite0: the stem, its norm and blocks 0-7
    get no gradient, keep their weights and BatchNorm statistics through a training step
    (inference mode inside ``train()``), and are outside the optimizer; block 8 on trains;
    layer-wise decay numbers the trained layers only; a checkpoint of another split is
    refused on resume."""
    cfg = _cfg(tmp_path, "model.freeze_backbone=false", "model.frozen_layers=10")
    model = build_model("efficientnet_lite0", 5, "none", freeze_backbone=False, frozen_layers=10)
    net = model.backbone.get_submodule("net")
    blocks8 = net.get_submodule("_blocks")
    frozen = [net.get_submodule("_conv_stem"), net.get_submodule("_bn0")]
    frozen += [blocks8.get_submodule(str(i)) for i in range(8)]
    before = {n: t.clone() for n, t in model.state_dict().items()}
    optimizer = make_optimizer(cfg.train, param_groups(model, cfg.train, 0.1), 0.1)
    model.train()
    assert not any(m.training for f in frozen for m in f.modules())
    assert blocks8.get_submodule("8").training
    loss = model(torch.randn(4, 3, 64, 64)).logsumexp(1).mean()
    loss.backward()
    optimizer.step()
    after = model.state_dict()
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    blocks = [f"backbone.net._blocks.{i}." for i in range(8)]
    frozen_names = ("backbone.net._conv_stem.", "backbone.net._bn0.", *blocks)
    assert not [n for n in changed if n.startswith(frozen_names)]
    assert "backbone.net._blocks.8._bn2.running_mean" in changed
    assert "backbone.net._blocks.8._project_conv.weight" in changed
    assert all(p.grad is None for f in frozen for p in f.parameters())
    assert layer_ids(model)[0]["backbone.net._blocks.8._project_conv.weight"] == 0
    with pytest.raises(ValueError, match="every one of the backbone's 20 layers"):
        build_model("efficientnet_lite0", 5, "none", freeze_backbone=False, frozen_layers=20)

    from flowers_job.train.resume import check_resumable

    saved = {"config": cfg.model_dump(mode="json"), "label_names": ["a"]}
    check_resumable(saved, cfg, ["a"])
    other = _cfg(tmp_path, "model.freeze_backbone=false")
    with pytest.raises(ValueError, match=r"model\.frozen_layers=10, not 0"):
        check_resumable(saved, other, ["a"])
