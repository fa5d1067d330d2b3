"""The batched decoder's padding: one tall and one wide image in a batch cost their own
pixels, not a canvas of the batch's largest height by its largest width each."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from flowers_job.vision.batch_decode import BatchDecoder, padding_groups

pytestmark = pytest.mark.tier("gate")

TALL, WIDE = (2000, 100), (100, 2000)  # (height, width): aspect 20, data.max_aspect_ratio


def _image(height: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=g)


def test_padding_groups_keep_each_slot_under_four_times_its_image() -> None:
    sizes = [TALL, WIDE, (256, 341), (256, 384), (341, 256), (187, 1024)]
    groups = padding_groups(sizes)
    assert sorted(i for idx, _ in groups for i in idx) == list(range(len(sizes)))
    for idx, (height, width) in groups:
        for i in idx:
            h, w = sizes[i]
            assert h <= height < 2 * h and w <= width < 2 * w
    tall_group = next(canvas for idx, canvas in groups if 0 in idx)
    assert tall_group == TALL  # not (2000, 2000)


@pytest.mark.parametrize("train", [False, True])
def test_a_tall_and_a_wide_image_allocate_their_own_pixels_and_match_alone(train: bool) -> None:
    """The largest allocation of the transform is one image's float32 canvas (2.4 MB), not
    the batch padded to 2000x2000 (96 MB); and each image comes out as it does alone."""
    decoder = BatchDecoder(train, 64, 72, torch.device("cpu"))
    images = [_image(*TALL, seed=1), _image(*WIDE, seed=2), _image(*TALL, seed=3)]

    def run(batch: list[torch.Tensor]) -> torch.Tensor:
        generator = torch.Generator().manual_seed(7) if train else None
        return decoder.transform(batch, generator)

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = run(images)
    largest = max(e.cpu_memory_usage for e in prof.events())
    one_canvas = 2 * 3 * TALL[0] * TALL[1] * 4  # the two tall images share a canvas
    assert largest <= one_canvas < 2000 * 2000 * 3 * 4
    assert out.shape == (3, 3, 64, 64) and out.dtype == torch.uint8
    if not train:  # the evaluation boxes depend on the image alone
        for i, img in enumerate(images):
            torch.testing.assert_close(out[i], run([img])[0], atol=1, rtol=0)
