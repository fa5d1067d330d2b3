"""The GPU data path on a CPU: device decode, the sync-free step, the device and precision choice.

What cannot run here is CUDA itself (no GPU in CI). The choices that depend on a GPU (bf16 or
fp16 by compute capability, a GPU of each rank's own, the served model's device) are tested
with torch's CUDA queries faked by ``monkeypatch``: the mock stands for the GPU only. The
batched decoder and the step run for real on the CPU, the same module a GPU runs
(benchmarks/gpu.py runs it on a GPU: its CPU-against-GPU pixel difference is in
benchmarks/README.md).
"""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from torch.overrides import TorchFunctionMode

from flowers_job.config import load_config
from flowers_job.loaders.base import wrap_int64
from flowers_job.runtime.devices import check_own_gpus, rank_device, serving_device
from flowers_job.train.metrics import PassSums, Sums
from flowers_job.train.step import train_one_epoch
from flowers_job.vision.backbones import build_model
from flowers_job.vision.batch_decode import (
    CROP_RATIO,
    CROP_SCALE,
    BatchDecoder,
    crop_boxes,
    pad_jpegs,
    step_seed,
)
from flowers_job.vision.decode_transform import DecodeTransform
from flowers_job.vision.images import normalize_image
from flowers_job.vision.precision import DeviceNormalize, amp_dtype
from tests.support import PHOTOS, ROOT_DIR

pytestmark = [pytest.mark.timeout(300), pytest.mark.tier("gate")]

REPO = ROOT_DIR


@pytest.fixture(scope="module")
def stored() -> list[bytes]:
    """16 real photos as ingest stores them (shorter side 128 px: the decoders resize them
    to 110 before the crop)."""
    files = sorted(PHOTOS.glob("*/*.jpg"))[::200][:16]
    return [normalize_image(f.read_bytes(), short_side=128).jpeg for f in files]


def fake_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], count: int = 1) -> None:
    """torch's CUDA queries answer as a host with ``count`` GPUs of ``capability``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    names = {(7, 5): "Tesla T4", (8, 0): "NVIDIA A100", (9, 0): "NVIDIA H100"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: names[capability])


@pytest.mark.parametrize(
    ("capability", "expected"),
    [((9, 0), torch.bfloat16), ((8, 0), torch.bfloat16), ((7, 5), torch.float16)],
)
def test_auto_precision_is_bf16_from_ampere_and_fp16_below(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], expected: torch.dtype
) -> None:
    """A T4 (7.5) answers True to torch.cuda.is_bf16_supported() but emulates bf16: 'auto'
    picks fp16 there (with a gradient scaler), bf16 from compute capability 8.0."""
    fake_gpu(monkeypatch, capability)
    cuda = torch.device("cuda", 0)
    assert amp_dtype("auto", cuda) is expected
    assert amp_dtype("off", cuda) is None
    assert amp_dtype("fp16", cuda) is torch.float16
    assert amp_dtype("auto", torch.device("cpu")) is None


def test_bf16_on_a_t4_is_refused_naming_the_setting_and_the_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_gpu(monkeypatch, (7, 5))
    with pytest.raises(ValueError, match=r"train.amp=bf16: cuda:0 is a Tesla T4 .* 7\.5"):
        amp_dtype("bf16", torch.device("cuda", 0))


def test_amp_false_in_yaml_means_float32(tmp_path: Path) -> None:
    cfg = load_config(None, [], **{"train.amp": False, "paths.output_dir": tmp_path})
    assert cfg.train.amp == "off"


def test_a_rank_without_a_gpu_of_its_own_fails_naming_the_spark_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two ranks on a host that exposes one GPU: rank 1 refuses instead of sharing cuda:0
    (what ``local_rank % device_count()`` did)."""
    fake_gpu(monkeypatch, (9, 0), count=1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert rank_device(0, 0, use_gpu=True) == torch.device("cuda", 0)
    with pytest.raises(RuntimeError) as err:
        rank_device(1, 1, use_gpu=True)
    message = str(err.value)
    assert "rank 1: LOCAL_RANK 1 has no GPU of its own" in message
    assert "CUDA_VISIBLE_DEVICES=0" in message
    assert "spark.task.resource.gpu.amount=1" in message and "discoveryScript" in message
    assert rank_device(1, 1, use_gpu=False) == torch.device("cpu")


def test_two_ranks_on_one_gpu_are_refused_by_every_rank() -> None:
    ranks = [
        {"rank": 0, "host": "fl-w1", "gpu": "GPU-aaa"},
        {"rank": 1, "host": "fl-w2", "gpu": "GPU-aaa"},  # another host's GPU 0: fine
        {"rank": 2, "host": "fl-w1", "gpu": "GPU-bbb"},
    ]
    check_own_gpus(ranks)
    check_own_gpus([{"rank": 0, "host": "h", "gpu": None}, {"rank": 1, "host": "h", "gpu": None}])
    ranks.append({"rank": 3, "host": "fl-w1", "gpu": "GPU-aaa"})
    with pytest.raises(RuntimeError, match="ranks 0, 3 on fl-w1 share GPU GPU-aaa"):
        check_own_gpus(ranks)


def test_the_served_model_takes_the_gpu_when_there_is_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Faked CUDA: 'auto' picks cuda:0 and the precision of its capability (fp16 on a T4,
    bf16 on an A100); FLOWERS_SERVING_DEVICE=cpu keeps the CPU; without CUDA, the CPU."""
    monkeypatch.delenv("FLOWERS_SERVING_DEVICE", raising=False)
    fake_gpu(monkeypatch, (7, 5))
    device = serving_device()
    assert device == torch.device("cuda", 0)
    assert amp_dtype("auto", device) is torch.float16
    fake_gpu(monkeypatch, (8, 0))
    assert amp_dtype("auto", serving_device()) is torch.bfloat16
    monkeypatch.setenv("FLOWERS_SERVING_DEVICE", "cpu")
    assert serving_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("FLOWERS_SERVING_DEVICE")
    assert serving_device() == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA is not available"):
        serving_device("cuda")
    with pytest.raises(ValueError, match="expected auto, cpu or cuda"):
        serving_device("tpu")


def test_device_decode_matches_pillow_within_a_grey_level_on_average(stored: list[bytes]) -> None:
    """The evaluation pixels of the batched decoder (run on the CPU here) against the
    loaders' Pillow path: the same JPEG decoder (libjpeg-turbo: identical pixels), then
    torchvision's antialiased bilinear resize against roi_align's bin averages. Tolerance:
    a mean absolute difference under 4 grey levels and under 10% of the values more than 10
    apart (measured: 2.2 and 4.0% here, 128 -> 110 px; 0.9 and 1.6% for 256 -> 224 px; a box
    3 px off gives 29 and 63%, a flip 50 and 76%)."""
    jpeg, length = (torch.from_numpy(a) for a in pad_jpegs(stored))
    out = BatchDecoder(False, 96, 110, torch.device("cpu"))(jpeg, length)
    ref = torch.stack([DecodeTransform(False, 96, 110).decode(c) for c in stored])
    assert out.shape == ref.shape == (16, 3, 96, 96) and out.dtype == torch.uint8
    diff = (out.int() - ref.int()).abs().float()
    assert float(diff.mean()) < 4.0
    assert float((diff > 10).float().mean()) < 0.10


def test_training_draws_are_the_steps_own(stored: list[bytes]) -> None:
    """The same (seed, epoch, shard, step) gives the same crops and flips, another step
    others; every box keeps RandomResizedCrop's area and ratio limits."""
    jpeg, length = (torch.from_numpy(a) for a in pad_jpegs(stored))
    dec = BatchDecoder(True, 64, 110, torch.device("cpu"))

    def run(step: int) -> torch.Tensor:
        return dec(jpeg, length, torch.Generator().manual_seed(step_seed(3, 2, 1, step)))

    assert torch.equal(run(5), run(5))
    assert not torch.equal(run(5), run(6))
    sizes = [(110, 165), (110, 110), (300, 110), (110, 400)] * 50
    boxes, flips = crop_boxes(sizes, torch.Generator().manual_seed(0))
    for (h, w), (top, left, bh, bw) in zip(sizes, boxes, strict=True):
        assert 0 <= top <= h - bh and 0 <= left <= w - bw
        assert CROP_SCALE[0] * h * w * 0.9 <= bh * bw <= h * w
        assert CROP_RATIO[0] * 0.95 <= bw / bh <= CROP_RATIO[1] * 1.05
    assert 0.3 < sum(flips) / len(flips) < 0.7


def test_pad_jpegs_refuses_an_image_wider_than_the_plan() -> None:
    jpeg, length = pad_jpegs([b"\xff\xd8ab", b"\xff\xd8abcdef"], width=8)
    assert jpeg.shape == (2, 8) and length.tolist() == [4, 8]
    assert bytes(jpeg[0, :4]) == b"\xff\xd8ab" and not jpeg[0, 4:].any()
    with pytest.raises(ValueError, match="longer than the split's widest"):
        pad_jpegs([b"x" * 9], width=8)


class _Syncs(TorchFunctionMode):
    """Records the calls that make the host wait for a GPU (``.item()``, ``.cpu()``,
    ``int(t)``, a boolean-mask index...) made from flowers_job's own code while on."""

    FORBIDDEN: ClassVar[set[str]] = {
        "item",
        "cpu",
        "tolist",
        "numpy",
        "__int__",
        "__float__",
        "__bool__",
        "nonzero",
    }

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.calls: list[str] = []
        self.tensors: list[Any] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", str(func))
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if self.on and caller.startswith("flowers_job") and name in self.FORBIDDEN:
            self.calls.append(f"{caller}: {name}")
            self.tensors.append(args[0] if args else None)
        if self.on and name == "__getitem__" and caller.startswith("flowers_job"):
            index = args[1] if len(args) > 1 else None
            if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
                self.calls.append(f"{caller}: boolean mask index")
        return func(*args, **(kwargs or {}))


def test_the_step_loop_body_waits_for_no_device() -> None:
    """The training loop's body (forward, loss, backward, optimizer, the running sums) calls
    none of the host-syncing tensor methods; the sums are read once, after the loop. On a
    GPU, benchmarks/gpu.py runs the same loop under torch.cuda.set_sync_debug_mode('error')."""
    torch.manual_seed(0)
    model = build_model("efficientnet_lite0", 5, "none", freeze_backbone=False)
    g = torch.Generator().manual_seed(0)
    batches = [
        {
            "image": torch.randint(0, 256, (4, 3, 32, 32), generator=g, dtype=torch.uint8),
            "label_index": torch.randint(0, 5, (4,), generator=g),
            "row_id": torch.tensor([2**62, 2**62, 7, -9]) + i,
            "valid": torch.tensor([True, True, True, i != 2]),
        }
        for i in range(3)
    ]
    mode = _Syncs()

    def guarded() -> Iterator[dict[str, torch.Tensor]]:
        mode.on = True
        try:
            yield from batches
        finally:
            mode.on = False

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with mode:
        sums = train_one_epoch(
            model,
            guarded(),
            optimizer,
            torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
            nn.CrossEntropyLoss(reduction="none"),
            DeviceNormalize((0.5,) * 3, (0.5,) * 3, torch.device("cpu")),
            None,
            torch.amp.GradScaler("cpu", enabled=False),
        )
    assert mode.calls == []
    assert (sums.rows, sums.read) == (11, 12)
    ids = [int(r) for b in batches for r, v in zip(b["row_id"], b["valid"], strict=True) if v]
    assert sums.checksum == wrap_int64(sum(ids))  # int64 wraps, as the driver's checksum does


def test_the_ema_update_reads_only_its_host_count_and_averages_as_torch_does() -> None:
    """With ``train.ema_decay``, the update after each step reads nothing but its update
    count, a host tensor (``AveragedModel``'s own update reads it on the device, twice a
    step), and the average equals ``AveragedModel.update_parameters``' on the same steps."""
    import copy

    from flowers_job.train.fine_tuning import attach_ema, make_ema

    torch.manual_seed(0)
    model = build_model("efficientnet_lite0", 5, "none", freeze_backbone=False)
    ema = make_ema(model, 0.9)
    assert ema is not None and ema.n_averaged.device.type == "cpu"
    reference = copy.deepcopy(ema)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    attach_ema(optimizer, ema, model)
    mode = _Syncs()
    x = torch.randn(2, 3, 32, 32)
    with mode:
        mode.on = True
        for _ in range(3):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
            reference.update_parameters(model)
        mode.on = False
    assert mode.calls and all(t is ema.n_averaged for t in mode.tensors), mode.calls
    assert int(ema.n_averaged) == int(reference.n_averaged) == 3
    for a, b in zip(
        ema.module.state_dict().values(), reference.module.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b)


def test_a_sync_in_the_loop_body_is_caught() -> None:
    """The probe itself can fail: a ``.item()`` from flowers_job code is recorded."""
    mode = _Syncs()
    with mode:
        mode.on = True
        Sums(torch.device("cpu")).values()
    assert any("tolist" in c for c in mode.calls)


def test_sums_resume_from_a_mid_epoch_position() -> None:
    sums = Sums(torch.device("cpu"), PassSums(1.5, 3, 4, -5, 6))
    sums.add(
        torch.tensor([0, 1]),
        torch.tensor([[2.0, 0.0], [2.0, 0.0]]),
        torch.tensor(0.25),
        torch.tensor([True, False]),
        torch.tensor([10, 20]),
    )
    assert sums.values() == PassSums(1.75, 4, 5, 5, 8)


def test_served_plain_jpegs_take_the_batched_decoder_and_score_like_pillow(
    stored: list[bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``batch_decode=True`` runs the GPU's serving path on the CPU: the plain JPEGs
    go through the batched decoder, a PNG and an EXIF-rotated JPEG through Pillow, and the
    probabilities match the Pillow-only scorer's to 0.05."""
    from flowers_job.serving.scorer import Scorer

    torch.manual_seed(0)
    model = build_model("efficientnet_lite0", 5, "none", freeze_backbone=False)
    torch.save(model.state_dict(), tmp_path / "state.pt")
    config = {
        "architecture": "efficientnet_lite0",
        "label_names": ["a", "b", "c", "d", "e"],
        "image_size": 96,
        "resize_size": 110,
        "mean": [0.5] * 3,
        "std": [0.5] * 3,
        "dropout": 0.2,
        "max_pixels": 10**8,
        "batch_size": 8,
    }
    img = Image.open(io.BytesIO(stored[0]))
    png, rotated = io.BytesIO(), io.BytesIO()
    img.save(png, format="PNG")
    exif = Image.Exif()
    exif[0x0112] = 6
    img.save(rotated, format="JPEG", exif=exif)
    contents = [*stored[:10], png.getvalue(), rotated.getvalue(), b"not a jpeg"]
    monkeypatch.setenv("FLOWERS_SERVING_DEVICE", "cpu")
    pillow = Scorer(config, tmp_path / "state.pt").score(contents)
    batched = Scorer(config, tmp_path / "state.pt", batch_decode=True)
    assert batched.decoder is not None
    scores = batched.score(contents)
    assert [r.code if r else None for r in scores.rejections] == [None] * 12 + ["not_an_image"]
    np.testing.assert_allclose(scores.probabilities[:12], pillow.probabilities[:12], atol=0.05)
    np.testing.assert_array_equal(scores.probabilities[10:12], pillow.probabilities[10:12])


@pytest.mark.slow
@pytest.mark.tier("full")
@pytest.mark.timeout(600)
def test_the_gpu_benchmark_runs_on_a_cpu(tmp_path: Path) -> None:
    """benchmarks/gpu.py --smoke: every stage runs (the CUDA-only checks say so) and the
    report holds the feeds' images/s and the served model's latencies."""
    import json

    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--smoke", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=560,
        check=False,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["step_host_sync"] == "not checked (CPU)"
    for feed in ("synthetic", "device_decode", "loader_decode"):
        assert report["steps"][f"trained_{feed}"] > 0
    assert report["serving"]["p50_ms_1"] > 0 and report["ddp"]["backend"] == "gloo"
