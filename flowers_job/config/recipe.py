"""The fine-tuning recipe's settings, part of ``train`` (:class:`~flowers_job.config.TrainConfig`
derives from :class:`RecipeConfig`), and the checks that span sections.

What each does in training: :mod:`flowers_job.train.fine_tuning`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from flowers_job.config.section import Section as _Section

if TYPE_CHECKING:
    from flowers_job.config.model import TrainConfig

__all__ = ["RecipeConfig", "check_recipe", "native_image_size_default"]


class RecipeConfig(_Section):
    """Schedule, layer-wise decay, weight-decay groups and EMA of the fine-tuning recipe. The
    defaults are the job's behaviour before them (warm-up then constant, one rate, decay on
    every parameter, no EMA)."""

    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After the warm-up: 'constant' (the scaled rate to the end) or 'cosine' (half a cosine
    from the scaled rate down to ``lr_min_ratio`` times it at the last step of
    ``train.epochs``: Loshchilov & Hutter 2017, "SGDR", without restarts; Goyal et al.'s
    warm-up before it, as in timm's and torchvision's reference recipes)."""
    lr_min_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """With ``lr_schedule: cosine``: the last step's rate as a fraction of the scaled rate."""
    layer_decay: float = Field(1.0, gt=0.0, le=1.0)
    """Layer-wise learning-rate decay of a trained backbone: the head learns at the scaled
    rate, the backbone's last stage at ``layer_decay`` times it, the one before at
    ``layer_decay**2``, ..., the stem the least (Clark et al. 2020, ELECTRA; Bao et al. 2021,
    BEiT; timm's ``param_groups_layer_decay``). 1 = one rate for all. Needs
    ``model.freeze_backbone: false``."""
    decay_norm_and_bias: bool = True
    """Apply ``weight_decay`` to every trained parameter (true, as before) or only to the
    weights of convolutions and linear layers, never to normalisation scales and shifts or
    biases (false: timm's ``param_groups_weight_decay``, the practice of Goyal et al. 2017
    section 5.1 and of torchvision's reference recipes, ``--norm-weight-decay 0``)."""
    ema_decay: float | None = Field(None, gt=0.0, lt=1.0)
    """An exponential moving average of the weights, updated after every optimizer step
    (``ema = decay * ema + (1 - decay) * weights``, BatchNorm statistics included: torch's
    ``AveragedModel`` with ``get_ema_multi_avg_fn``; Polyak & Juditsky 1992, the EMA of
    Tan & Le 2019's EfficientNet training). Validation, the best epoch, the test score and
    the registered model then use the average; checkpoints hold it. Its horizon is about
    ``1 / (1 - decay)`` steps: keep it well below the run's steps (0.99 for a few hundred).
    None: off."""
    benchmark_test_each_epoch: bool = False
    """BENCHMARKS ONLY: also score the test split after every epoch (with the weights
    validation scored) and log it as ``benchmark_test_accuracy``, for time-to-quality
    measures (benchmarks/sweep.py), and the seconds that pass took as
    ``benchmark_test_seconds``. Nothing reads it: early stopping and the best epoch stay
    on validation, and the test score of the summary is still the one after training. Costs
    one pass over the test split per epoch, outside ``epoch_seconds``."""


def check_recipe(freeze_backbone: bool, train: TrainConfig) -> None:
    """Refuse settings that cannot act together.

    Raises:
        ValueError: ``train.layer_decay`` < 1 with ``model.freeze_backbone``.
    """
    if freeze_backbone and train.layer_decay < 1.0:
        raise ValueError(
            f"train.layer_decay: {train.layer_decay:g} scales the backbone's learning "
            "rates, which a frozen backbone does not have (set model.freeze_backbone=false "
            "or train.layer_decay=1)"
        )


def native_image_size_default(data: dict[str, Any], lite: tuple[str, ...]) -> dict[str, Any]:
    """``data.image_size``, when not given, set to the native resolution of
    ``model.architecture`` (:func:`flowers_job.vision.backbones.native_image_size`)."""
    section = data.get("data")
    model = data.get("model")
    if (section is not None and not isinstance(section, dict)) or "image_size" in (section or {}):
        return data
    architecture = (
        model.get("architecture")
        if isinstance(model, dict)
        else getattr(model, "architecture", None)
    )
    if not isinstance(architecture, str) or architecture not in lite:
        return data
    from flowers_job.vision.backbones import native_image_size

    return {**data, "data": {**(section or {}), "image_size": native_image_size(architecture)}}
