"""The limit: the job's model trained by a hand-written DDP loop on tensors already in memory.

No Spark, no loader, no decode in the loop: the photos are decoded once (resized to the
stored short side, centre-cropped to ``--image-size``, uint8 ``[N, 3, S, S]``) into a file
that every rank maps, and each rank then runs ``--steps`` training steps of the job's own
model (:func:`flowers_job.vision.backbones.build_model`, frozen EfficientNet-Lite0 + linear head by
default), optimizer (AdamW) and loss (cross-entropy, label smoothing 0.1), channels-last,
with the normalisation done on the batch as the job does it
(:class:`flowers_job.vision.precision.DeviceNormalize`). Ranks are real processes started by
``torchrun`` (gloo, CPU), ``--threads`` intra-op threads each.

It is imported by the other benchmarks (``epoch_vs_memory.py``, ``scaling.py``) and runs on
its own, one configuration per call:

    .venv/bin/python benchmarks/inmemory.py --ranks 2 --threads 1 --steps 30
    .venv/bin/python benchmarks/inmemory.py --allocator glibc   # glibc's defaults

Prints one JSON line: ``images_per_second`` (training images of all ranks / the slowest
rank's seconds over the timed steps, after ``--warmup`` untimed steps), and the CPU
seconds (user, system) and minor page faults of the ranks, from ``getrusage`` of torchrun's
children.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PHOTOS = Path(os.environ.get("FLOWERS_PHOTOS", REPO.parent / "shared/data/flower_photos"))
LABELS = ("daisy", "dandelion", "roses", "sunflowers", "tulips")


def photo_paths(photos: Path, limit: int | None = None) -> list[tuple[Path, int]]:
    """``(path, label_index)`` of the photos, interleaved across labels, at most ``limit``."""
    per_label = [sorted((photos / label).glob("*.jpg")) for label in LABELS]
    out: list[tuple[Path, int]] = []
    for i in range(max(len(p) for p in per_label)):
        for label, paths in enumerate(per_label):
            if i < len(paths):
                out.append((paths[i], label))
    return out[:limit] if limit else out


def decode_to_file(photos: Path, count: int, image_size: int, target: Path) -> Path:
    """Decode ``count`` photos once into ``target``: ``{"image": uint8 [N, 3, S, S],
    "label": int64 [N]}`` (shorter side resized to ``S * 256 / 224``, centre crop ``S``)."""
    import torch
    from PIL import Image
    from torchvision.transforms import v2 as T

    tf = T.Compose(
        [T.Resize(round(image_size * 256 / 224)), T.CenterCrop(image_size), T.PILToTensor()]
    )
    items = photo_paths(photos, count)
    images = torch.empty((len(items), 3, image_size, image_size), dtype=torch.uint8)
    for i, (path, _) in enumerate(items):
        with Image.open(path) as img:
            images[i] = tf(img.convert("RGB"))
    labels = torch.tensor([label for _, label in items], dtype=torch.int64)
    torch.save({"image": images, "label": labels}, target)
    return target


ALLOCATORS = ("tuned", "glibc", "mmap-threshold", "jemalloc", "jemalloc-nodecay")
"""The allocator settings :func:`allocator_env` knows."""


def allocator_env(kind: str) -> dict[str, str]:
    """Environment for the ranks, from this one without any allocator variable:

    - 'tuned': the job's glibc settings (:data:`flowers_job.runtime.allocator.ALLOCATOR_ENV`);
    - 'glibc': glibc's defaults;
    - 'mmap-threshold': only ``MALLOC_MMAP_THRESHOLD_`` raised, to glibc's 32 MiB cap;
    - 'jemalloc': jemalloc preloaded (``LD_PRELOAD``), its defaults;
    - 'jemalloc-nodecay': the same, with ``MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1``
      (freed pages are never returned to the kernel).

    Raises:
        SystemExit: a jemalloc kind where jemalloc is not installed.
    """
    from flowers_job.runtime.allocator import ALLOCATOR_ENV, find_jemalloc

    dropped = {*ALLOCATOR_ENV, "LD_PRELOAD", "MALLOC_CONF", "MALLOC_MMAP_THRESHOLD_"}
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    if kind == "tuned":
        env.update(ALLOCATOR_ENV)
    elif kind == "mmap-threshold":
        env["MALLOC_MMAP_THRESHOLD_"] = str(32 * 2**20)
    elif kind.startswith("jemalloc"):
        lib = find_jemalloc()
        if lib is None:
            raise SystemExit("jemalloc is not installed (apt-get install libjemalloc2)")
        env["LD_PRELOAD"] = lib
        if kind == "jemalloc-nodecay":
            env["MALLOC_CONF"] = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
    elif kind != "glibc":
        raise ValueError(f"unknown allocator {kind!r}: one of {ALLOCATORS}")
    return env


def run(
    data: Path,
    *,
    ranks: int,
    threads: int,
    steps: int,
    warmup: int,
    batch_size: int,
    allocator: str = "tuned",
    freeze_backbone: bool = True,
    timeout: float = 1800.0,
) -> dict[str, Any]:
    """Run the loop on ``ranks`` torchrun processes of ``threads`` threads; its result dict.

    Raises:
        RuntimeError: a rank failed (with the end of torchrun's output);
        subprocess.TimeoutExpired: the run took longer than ``timeout`` seconds.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            __file__,
            "--worker",
            f"--data={data}",
            f"--result={out}",
            f"--threads={threads}",
            f"--steps={steps}",
            f"--warmup={warmup}",
            f"--batch-size={batch_size}",
            f"--freeze-backbone={int(freeze_backbone)}",
        ]
        env = {**allocator_env(allocator), "OMP_NUM_THREADS": str(threads)}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = subprocess.run(
            cmd, check=False, env=env, timeout=timeout, capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(f"the in-memory loop failed:\n{proc.stderr[-4000:]}")
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = json.loads(out.read_text())
    return {
        **result,
        "ranks": ranks,
        "threads": threads,
        "allocator": allocator,
        "cpu_user_seconds": after.ru_utime - before.ru_utime,
        "cpu_system_seconds": after.ru_stime - before.ru_stime,
        "minor_faults": after.ru_minflt - before.ru_minflt,
    }


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from flowers_job.vision.backbones import build_model, preprocessing_for
    from flowers_job.vision.precision import DeviceNormalize

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = torch.load(args.data, mmap=True)
    images, labels = data["image"], data["label"]
    torch.manual_seed(0)
    model = build_model(
        "efficientnet_lite0", len(LABELS), "package", freeze_backbone=bool(args.freeze_backbone)
    ).to(memory_format=torch.channels_last)
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=1e-4
    )
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    pre = preprocessing_for("efficientnet_lite0")
    normalize = DeviceNormalize(pre.mean, pre.std, torch.device("cpu"))
    model.train()
    b = args.batch_size
    per_rank = images.shape[0] // world_size

    def step(i: int) -> None:
        start = rank * per_rank + (i * b) % max(1, per_rank - b)
        x = normalize(images[start : start + b])
        loss = criterion(ddp(x), labels[start : start + b])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for i in range(args.warmup):
        step(i)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(args.steps):
        step(args.warmup + i)
    seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    if rank == 0:
        images_done = args.steps * b * world_size
        Path(args.result).write_text(
            json.dumps(
                {
                    "images_per_second": images_done / float(seconds),
                    "seconds": float(seconds),
                    "images": images_done,
                    "per_device_batch_size": b,
                    "freeze_backbone": bool(args.freeze_backbone),
                }
            )
        )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", type=Path, help="decoded tensors (default: decode --photos)")
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--photos", type=Path, default=DEFAULT_PHOTOS)
    p.add_argument("--count", type=int, default=512, help="photos to decode (default 512)")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--steps", type=int, default=30, help="timed steps per rank")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per rank first")
    p.add_argument("--batch-size", type=int, default=32, help="per_device_batch_size")
    p.add_argument("--freeze-backbone", type=int, default=1)
    p.add_argument("--allocator", choices=ALLOCATORS, default="tuned")
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or decode_to_file(
            args.photos, args.count, args.image_size, Path(tmp) / "data.pt"
        )
        result = run(
            data,
            ranks=args.ranks,
            threads=args.threads,
            steps=args.steps,
            warmup=args.warmup,
            batch_size=args.batch_size,
            allocator=args.allocator,
            freeze_backbone=bool(args.freeze_backbone),
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
