"""The GPU data path: the model's limit, the real loader with device decode, and CPU decode.

One run measures, side by side on one device, the training step of the job
(:func:`flowers_job.train.step.train_one_epoch`: normalise on the device, autocast in the
precision :func:`~flowers_job.vision.precision.amp_dtype` picks, DDP-free forward/backward,
AdamW, the device-side sums) fed three ways:

- **synthetic**: random uint8 batches already on the device (the model's limit);
- **device decode**: the real Mosaic Streaming reader (:class:`~flowers_job.loaders.
  streaming.StreamingReader`) over MDS shards of the stored JPEGs, undecoded, through the
  rank's input stage (:class:`~flowers_job.train.device_prefetch.DeviceReader`: a background thread
  pins, copies and decodes each batch on the device with
  :class:`~flowers_job.vision.batch_decode.BatchDecoder`, two batches ahead);
- **loader decode**: the same reader decoding with Pillow in ``--loader-workers`` DataLoader
  workers, then the same input stage (pinned, asynchronous copy).

each for a frozen and a trained backbone, and prints images/s and the ratios to the limit.
It also reports the batched decoder alone (images/s), whether the step's loop body makes a
host sync (``torch.cuda.set_sync_debug_mode('error')`` over the synthetic step), how far the
decoder's pixels on the device are from the same module's on the CPU (same draws), and the
served model's latency (:class:`~flowers_job.serving.scorer.Scorer`, the pyfunc's core, without
the HTTP server) for 1 and 32 images: p50 and p99 in milliseconds.

The MDS shards are written here with Streaming's own ``MDSWriter`` (the job writes them from
Delta with Spark: same columns, :data:`~flowers_job.loaders.streaming.streaming_loader.MDS_COLUMNS`), so the
benchmark needs neither Spark nor MLflow: it runs on a bare GPU machine with torch,
torchvision, pydantic and Mosaic Streaming. The photos are the real ones, normalised as
ingest stores them (or already stored JPEGs with ``--stored``). Weights are random: the
speed of a network does not depend on them.

    .venv/bin/python benchmarks/gpu.py --photos ../shared/data/flower_photos --limit 2000
    .venv/bin/python benchmarks/gpu.py --smoke      # CPU, seconds: CI checks that it runs

On a CPU it runs the same stages (slowly); ``--smoke`` shrinks everything to a few batches.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import machine_facts, write_report

from flowers_job.loaders.base import wrap_int64
from flowers_job.loaders.streaming.streaming_loader import (
    MDS_COLUMNS,
    StreamingPlan,
    StreamingReader,
)
from flowers_job.train.device_prefetch import DeviceReader
from flowers_job.train.metrics import Sums
from flowers_job.train.step import make_optimizer, train_one_epoch
from flowers_job.vision.backbones import build_model, preprocessing_for
from flowers_job.vision.batch_decode import BatchDecoder, pad_jpegs, step_seed
from flowers_job.vision.decode_transform import DecodeTransform
from flowers_job.vision.images import normalize_image
from flowers_job.vision.precision import DeviceNormalize, amp_dtype

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PHOTOS = REPO.parent / "shared/data/flower_photos"


def stored_images(args: argparse.Namespace) -> tuple[list[bytes], list[int]]:
    """The stored JPEGs and label indices: ``--stored`` as they are, else ``--photos``
    normalised as ingest stores them (shorter side ``stored_short_side``, quality 90)."""
    root = Path(args.stored or args.photos)
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    files = sorted(
        (f, i)
        for i, c in enumerate(classes)
        for f in (root / c).iterdir()
        if f.suffix.lower() in (".jpg", ".jpeg")
    )
    step = max(1, len(files) // args.limit) if args.limit else 1
    files = files[::step][: args.limit or None]
    short = round(args.image_size * 256 / 224)
    jpegs = [
        f.read_bytes() if args.stored else normalize_image(f.read_bytes(), short_side=short).jpeg
        for f, _ in files
    ]
    return jpegs, [i for _, i in files]


def write_shards(
    jpegs: list[bytes], labels: list[int], out: Path, batch: int, repeat: int = 1
) -> StreamingPlan:
    """MDS shards of the images (the job's columns), each written ``repeat`` times as
    distinct rows, and the plan of one rank reading them."""
    from streaming import MDSWriter

    jpegs, labels = jpegs * repeat, labels * repeat
    ids = [hash((i, len(j))) & (2**62 - 1) for i, j in enumerate(jpegs)]
    with MDSWriter(out=str(out), columns=MDS_COLUMNS, compression=None) as writer:
        for row_id, jpeg, label in zip(ids, jpegs, labels, strict=True):
            writer.write(
                {"row_id": row_id, "image": jpeg, "label_index": label, "valid": 1, "segment": 0}
            )
    n = len(jpegs)
    return StreamingPlan(
        loader="streaming",
        cache_dir_url=out.as_uri(),
        dataset_size=n,
        checksum=wrap_int64(sum(ids)),
        rows_per_shard=[n],
        checksum_per_shard=None,
        steps_per_epoch=math.ceil(n / batch),
        per_device_batch_size=batch,
    )


class Step:
    """The job's training step for one backbone setting, on ``device``."""

    def __init__(
        self, args: argparse.Namespace, device: torch.device, frozen: bool, ddp: bool = False
    ) -> None:
        torch.manual_seed(0)
        self.device = device
        net = build_model(args.architecture, 5, "none", freeze_backbone=frozen).to(device)
        net.to(memory_format=torch.channels_last)
        params = [p for p in net.parameters() if p.requires_grad]
        self.model: nn.Module = net
        if ddp:  # as the job wraps it (flowers_job.train.state)
            from torch.nn.parallel import DistributedDataParallel

            ids = [device.index] if device.type == "cuda" else None
            self.model = DistributedDataParallel(net, device_ids=ids)
        from flowers_job.config import TrainConfig

        self.optimizer = make_optimizer(TrainConfig(), params, 1e-4)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda _: 1.0)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=0.1, reduction="none")
        pre = preprocessing_for(args.architecture)
        self.normalize = DeviceNormalize(pre.mean, pre.std, device)
        self.dtype = amp_dtype("auto", device)
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.dtype == torch.float16)

    def run(self, batches: Any) -> int:
        """Train over ``batches``; returns the rows read (one host read, at the end)."""
        return train_one_epoch(
            self.model,
            batches,
            self.optimizer,
            self.scheduler,
            self.criterion,
            self.normalize,
            self.dtype,
            self.scaler,
        ).read


def timed(fn: Callable[[], int], device: torch.device) -> tuple[int, float]:
    """``(rows, seconds)`` of ``fn()``, the device drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    rows = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return rows, time.perf_counter() - t0


def synthetic(
    args: argparse.Namespace, device: torch.device, n_batches: int
) -> list[dict[str, Any]]:
    """Random batches on the device, as the input stage hands them to the step."""
    size, b = args.image_size, args.batch
    g = torch.Generator().manual_seed(1)
    return [
        {
            "image": torch.randint(0, 256, (b, 3, size, size), generator=g, dtype=torch.uint8).to(
                device
            ),
            "label_index": torch.randint(0, 5, (b,), generator=g).to(device),
            "row_id": torch.arange(b, dtype=torch.int64).to(device),
            "valid": torch.ones(b, dtype=torch.bool, device=device),
        }
        for _ in range(n_batches)
    ]


def reader(
    args: argparse.Namespace, plan: StreamingPlan, device: torch.device, on_device: bool
) -> DeviceReader:
    """The job's input stage over the Streaming reader: undecoded + device decode, or
    Pillow in the loader's workers."""
    size, resize = args.image_size, round(args.image_size * 256 / 224)
    inner = StreamingReader(
        plan,
        DecodeTransform(True, size, resize, undecoded=on_device),
        shuffle=True,
        seed=0,
        num_nodes=1,
        num_workers=args.loader_workers,  # reading (and Pillow's decode) off the GIL
    )
    decoder = BatchDecoder(True, size, resize, device) if on_device else None
    return DeviceReader(inner, device, decoder, prefetch=2)


def feeds(
    args: argparse.Namespace, plan: StreamingPlan, device: torch.device
) -> dict[str, Callable[[int], Iterator[dict[str, Any]]]]:
    """Each feed: epoch -> batches on the device."""
    fake = synthetic(args, device, 4)
    steps = plan.steps_per_epoch
    readers = {"device_decode": reader(args, plan, device, True)}
    readers["loader_decode"] = reader(args, plan, device, False)
    OPEN.extend(readers.values())
    out: dict[str, Callable[[int], Iterator[dict[str, Any]]]] = {
        "synthetic": lambda _e: (fake[i % len(fake)] for i in range(steps)),
    }
    for name, r in readers.items():
        out[name] = r.epoch
    return out


OPEN: list[DeviceReader] = []
"""The readers opened, closed when the stage ends (Streaming's shared memory)."""


def step_speeds(
    args: argparse.Namespace, plan: StreamingPlan, device: torch.device
) -> dict[str, Any]:
    """images/s of the step per feed and backbone: the median of ``--epochs`` timed epochs
    after ``--warmup-epochs`` untimed."""
    try:
        return _step_speeds(args, plan, device)
    finally:
        while OPEN:
            OPEN.pop().close()


def _step_speeds(
    args: argparse.Namespace, plan: StreamingPlan, device: torch.device
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    sources = feeds(args, plan, device)
    for frozen in (True, False):
        step = Step(args, device, frozen)
        for name, source in sources.items():
            rates = []
            for epoch in range(args.warmup_epochs + args.epochs):
                rows, seconds = timed(functools.partial(step.run, source(epoch + 1)), device)
                if epoch >= args.warmup_epochs:
                    rates.append(rows / seconds)
            key = f"{'frozen' if frozen else 'trained'}_{name}"
            out[key] = round(statistics.median(rates), 1)
            print(f"{key}: {out[key]} images/s", flush=True)
        for name in ("device_decode", "loader_decode"):
            base = out[f"{'frozen' if frozen else 'trained'}_synthetic"]
            out[f"{'frozen' if frozen else 'trained'}_{name}_vs_synthetic"] = round(
                out[f"{'frozen' if frozen else 'trained'}_{name}"] / base, 3
            )
    return out


def compiled_speed(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The synthetic step of the trained backbone with ``torch.compile`` (default mode):
    compile seconds (the first epoch) and images/s after it, against eager in this run."""
    step = Step(args, device, frozen=False)
    batches = synthetic(args, device, 4)
    steps = max(4, args.epochs * 4)
    eager = [
        timed(lambda: step.run(batches[i % 4] for i in range(steps)), device) for _ in range(2)
    ]
    step.model = torch.compile(step.model)  # type: ignore[assignment]
    first = timed(lambda: step.run(batches[i % 4] for i in range(steps)), device)
    rows, seconds = timed(lambda: step.run(batches[i % 4] for i in range(steps)), device)
    eager_rate = eager[1][0] / eager[1][1]
    return {
        "compile_seconds": round(first[1], 1),
        "eager_images_per_second": round(eager_rate, 1),
        "compiled_images_per_second": round(rows / seconds, 1),
        "compiled_vs_eager": round(rows / seconds / eager_rate, 3),
    }


def ddp_speed(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The synthetic trained step wrapped in DDP, in a process group of one joined as the job
    joins it (:func:`flowers_job.runtime.process_group.init_distributed`: NCCL on a GPU, gloo on CPU),
    against the unwrapped step in this run."""
    import os

    from flowers_job.runtime.process_group import init_distributed, shutdown_distributed

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    ctx = init_distributed(use_gpu=device.type == "cuda", timeout_seconds=120)
    try:
        batches = synthetic(args, device, 4)
        steps = max(4, args.epochs * 4)
        rates = {}
        for ddp in (False, True):
            step = Step(args, device, frozen=False, ddp=ddp)
            step.run(batches[i % 4] for i in range(steps))
            rows, seconds = timed(
                functools.partial(step.run, (batches[i % 4] for i in range(steps))), device
            )
            rates["ddp" if ddp else "plain"] = rows / seconds
        return {
            "backend": ctx.backend,
            "plain_images_per_second": round(rates["plain"], 1),
            "ddp_images_per_second": round(rates["ddp"], 1),
        }
    finally:
        shutdown_distributed()


def decoder_speed(jpegs: list[bytes], args: argparse.Namespace, device: torch.device) -> float:
    """images/s of the batched decode + train augmentation alone (host bytes in)."""
    dec = BatchDecoder(True, args.image_size, round(args.image_size * 256 / 224), device)
    batches = [pad_jpegs(jpegs[i : i + args.batch]) for i in range(0, len(jpegs), args.batch)]
    tensors = [(torch.from_numpy(j), torch.from_numpy(n)) for j, n in batches]

    def run() -> int:
        for k, (j, n) in enumerate(tensors):
            dec(j, n, torch.Generator().manual_seed(step_seed(0, 1, 0, k)))
        return len(jpegs)

    run()
    rows, seconds = timed(run, device)
    return round(rows / seconds, 1)


def sync_check(args: argparse.Namespace, device: torch.device) -> str:
    """'none': the step loop's body ran under torch's sync debug mode 'error' (CUDA only):
    the mode is on from the first batch to the last step's end, so the sums' one read
    after the loop (``Sums.values``, once per epoch) is outside it."""
    if device.type != "cuda":
        return "not checked (CPU)"
    step = Step(args, device, frozen=False)
    batches = synthetic(args, device, 3)
    step.run(iter(batches))  # warm-up: cuDNN autotuning, allocator
    torch.cuda.synchronize(device)

    def guarded() -> Iterator[dict[str, Any]]:
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield from batches
        finally:
            torch.cuda.set_sync_debug_mode("default")

    try:
        train_one_epoch(
            step.model,
            guarded(),
            step.optimizer,
            step.scheduler,
            step.criterion,
            step.normalize,
            step.dtype,
            step.scaler,
            Sums(device),
        )
        return "none"
    except RuntimeError as exc:
        import traceback

        traceback.print_exc()
        return f"sync: {exc}"
    finally:
        torch.cuda.set_sync_debug_mode("default")


def decoder_agreement(
    jpegs: list[bytes], args: argparse.Namespace, device: torch.device
) -> dict[str, float]:
    """Mean and max |device - CPU| grey levels of the same module with the same draws."""
    if device.type != "cuda":
        return {}
    j, n = (torch.from_numpy(a) for a in pad_jpegs(jpegs[: args.batch]))
    out: dict[str, float] = {}
    for train in (False, True):
        res = []
        for dev in (torch.device("cpu"), device):
            dec = BatchDecoder(train, args.image_size, round(args.image_size * 256 / 224), dev)
            res.append(dec(j, n, torch.Generator().manual_seed(7)).cpu().int())
        diff = (res[0] - res[1]).abs().float()
        name = "train" if train else "eval"
        out[f"{name}_mean_abs"] = round(float(diff.mean()), 4)
        out[f"{name}_max_abs"] = float(diff.max())
    return out


def serving_latency(
    jpegs: list[bytes], args: argparse.Namespace, device: torch.device, work: Path
) -> dict[str, Any]:
    """p50/p99 milliseconds of :meth:`Scorer.score` for 1 and 32 images."""
    from flowers_job.serving.scorer import Scorer

    model = build_model(args.architecture, 5, "none", freeze_backbone=False)
    torch.save(model.state_dict(), work / "state.pt")
    pre = preprocessing_for(args.architecture)
    config = {
        "architecture": args.architecture,
        "label_names": ["daisy", "dandelion", "roses", "sunflowers", "tulips"],
        "image_size": args.image_size,
        "resize_size": round(args.image_size * 256 / 224),
        "mean": list(pre.mean),
        "std": list(pre.std),
        "dropout": 0.2,
        "max_pixels": 89_478_485,
        "batch_size": 32,
    }
    scorer = Scorer(config, work / "state.pt", device)
    out: dict[str, Any] = {"dtype": str(scorer.dtype), "batched_decode": scorer.decoder is not None}
    for size in (1, 32):
        request = [jpegs[i % len(jpegs)] for i in range(size)]
        for _ in range(args.warmup_requests):
            scorer.score(request)
        times = []
        for _ in range(args.requests):
            t0 = time.perf_counter()
            scorer.score(request)  # returns host numpy: the device is drained
            times.append((time.perf_counter() - t0) * 1000)
        q = np.percentile(times, [50, 99])
        out[f"p50_ms_{size}"], out[f"p99_ms_{size}"] = round(float(q[0]), 2), round(float(q[1]), 2)
        print(f"serving {size}: p50 {q[0]:.2f} ms, p99 {q[1]:.2f} ms", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--photos", type=Path, default=DEFAULT_PHOTOS)
    parser.add_argument(
        "--stored", type=Path, default=None, help="already stored JPEGs, a folder per class"
    )
    parser.add_argument("--limit", type=int, default=2000, help="photos used (0: all)")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rows per photo in the shards: longer epochs, so that the loader's start per "
        "epoch (its worker processes) weighs as little as in a large data set",
    )
    parser.add_argument("--architecture", default="efficientnet_lite0")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=128, help="per_device_batch_size")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per feed")
    parser.add_argument("--warmup-epochs", type=int, default=1, help="untimed, before them")
    parser.add_argument("--loader-workers", type=int, default=8)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--warmup-requests", type=int, default=10)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile")
    parser.add_argument("--smoke", action="store_true", help="a few small batches (CI)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.limit, args.image_size, args.batch, args.epochs = 16, 64, 8, 1
        args.warmup_epochs, args.loader_workers, args.requests, args.warmup_requests = 0, 0, 2, 0
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    facts = machine_facts("torch", "torchvision", "mosaicml-streaming")
    facts["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    jpegs, labels = stored_images(args)
    report: dict[str, Any] = {
        **facts,
        "images": len(jpegs),
        "mean_jpeg_bytes": round(sum(map(len, jpegs)) / len(jpegs)),
        "architecture": args.architecture,
        "image_size": args.image_size,
        "per_device_batch_size": args.batch,
        "amp_dtype": str(amp_dtype("auto", device)),
    }
    print(f"{len(jpegs)} stored JPEGs on {facts['device']}", flush=True)
    failed = []
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        work = Path(tmp)
        plan = write_shards(jpegs, labels, work / "mds", args.batch, args.repeat)
        report["rows_per_epoch"] = plan.dataset_size
        stages: dict[str, Callable[[], Any]] = {
            "decode_only_images_per_second": lambda: decoder_speed(jpegs, args, device),
            "decoder_vs_cpu": lambda: decoder_agreement(jpegs, args, device),
            "step_host_sync": lambda: sync_check(args, device),
            "steps": lambda: step_speeds(args, plan, device),
            "serving": lambda: serving_latency(jpegs, args, device, work),
            "ddp": lambda: ddp_speed(args, device),
        }
        if args.compile:
            stages["compile"] = lambda: compiled_speed(args, device)
        for name, stage in stages.items():
            try:  # one stage's failure is reported; the others still run (a lent GPU's minutes)
                report[name] = stage()
            except Exception as exc:
                import traceback

                traceback.print_exc()
                report[name] = f"failed: {type(exc).__name__}: {exc}"
                failed.append(name)
            if args.output is not None:  # what a stage measured survives a later one's kill
                args.output.write_text(json.dumps(report, indent=2) + "\n")
    write_report(report, args.output)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
