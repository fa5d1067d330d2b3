"""The fixed views a frozen backbone embeds once per photo, and the key of its embeddings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from flowers_job.config import EmbeddingsConfig
from flowers_job.vision.transforms import eval_pixels
from flowers_job.vision.views import (
    VIEWS,
    EmbeddingSpec,
    view_pixels,
    weights_file,
    weights_id,
)
from tests.support import PHOTOS

pytestmark = pytest.mark.tier("gate")


def _photo() -> Image.Image:
    path = sorted((PHOTOS / "daisy").glob("*.jpg"))[0]
    with Image.open(path) as img:
        return img.convert("RGB")


def test_the_centre_view_is_the_evaluation_crop_and_the_others_differ() -> None:
    """View 0 is what the served model sees (``eval_pixels``); the mirror is its flip; the
    closer crop is another image of the same size."""
    img = _photo()
    centre = view_pixels("centre", 224, 256)(img)
    assert torch.equal(centre, eval_pixels(224, 256)(img))
    assert torch.equal(view_pixels("mirror", 224, 256)(img), centre.flip(-1))
    zoom = view_pixels("zoom", 224, 256)(img)
    assert zoom.shape == centre.shape == (3, 224, 224) and zoom.dtype == torch.uint8
    assert not torch.equal(zoom, centre)
    assert torch.equal(view_pixels("zoom_mirror", 224, 256)(img), zoom.flip(-1))
    with pytest.raises(ValueError, match="unknown view 'tilt'"):
        view_pixels("tilt", 224, 256)


def test_the_config_names_the_views_in_their_order() -> None:
    for k in range(1, len(VIEWS) + 1):
        assert EmbeddingsConfig(views=k).view_names == VIEWS[:k]


def test_the_model_key_changes_with_the_weights_and_the_transform(tmp_path: Path) -> None:
    """Another weights file or another size is another key: never mixed in the table."""
    package = weights_file("efficientnet_lite0", "package", None)
    own = tmp_path / "own.pt"
    own.write_bytes(package.read_bytes() + b"\0")
    base = EmbeddingSpec(
        "efficientnet_lite0", "package", None, weights_id(package), 224, 256, VIEWS
    )
    keys = {
        base.model_key,
        EmbeddingSpec(
            "efficientnet_lite0", "file", str(own), weights_id(own), 224, 256, VIEWS
        ).model_key,
        EmbeddingSpec(
            "efficientnet_lite0", "package", None, weights_id(package), 240, 274, VIEWS
        ).model_key,
    }
    assert len(keys) == 3
    assert weights_id(package) == weights_id(package).lower() and len(weights_id(package)) == 23
    with pytest.raises(ValueError, match="from a file or the package"):
        weights_file("resnet50", "torchvision", None)
