"""Which frozen-backbone feature recipe reaches a test accuracy of 0.93: fixed views embedded
once per photo, a linear head trained on them.

With the backbone frozen, a photo's features depend only on its pixels: a fixed set of views
(:data:`flowers_job.vision.views.VIEWS`: the evaluation crop, its mirror image, a closer crop
and its mirror) embedded once per photo replaces the job's random augmentation, and every
epoch after that costs a linear layer on ``[N, features]`` floats. This sweeps, on the job's
own tables and split of the real photos:

- ``tables``: the job's ``images`` Delta table per backbone and input size
  (``--backbones``, ``<architecture>@<size>``), from ``flowers-job ingest`` (skipped when
  present): stored for that size (shorter side ``round(size * 256 / 224)``: 256 for 224 px,
  297 for 260, 329 for 288; ingest never enlarges, so most photos, about 320 x 240, keep
  theirs); all must hold the same photos in the same splits (the split hashes the photo's
  content, not its size), which is asserted;
- ``features``: the backbone run once per view over all three splits (Pillow decode, the
  view's transform, batches of 32, the job's normalisation, 2 threads, float32), timed per
  backbone and view, cached under ``--work`` so that a rerun skips them;
- ``heads``: for K = 1, 2, 4 (the first K views), label smoothing 0 and 0.1 and each seed, the
  job's head (dropout 0.2 + linear; AdamW, the job's learning rate for its world size 2 and its
  global batch 64) trained on every (train photo, view) pair once per epoch in a seeded
  order, stopped early on the validation loss of the centre view as the job stops (Keras
  semantics: ``min_delta`` 0.001, ``--patience``, the best epoch's weights restored); then
  the test split scored on the centre view (what the served model sees) and on the softmax
  averaged over the K views (test-time augmentation).

Reports the test accuracy per seed both ways, its mean, min and max per (backbone, K, label
smoothing), next to the best epochs and the validation accuracy, and prints a markdown table
sorted by the mean centre-view test accuracy. Run from the repository root:

    nice -n 5 .venv/bin/python benchmarks/embedding_sweep.py \\
        --images ../shared/data/flower_photos --work /var/tmp/sweep \\
        --report benchmarks/results/2026-11-30/embeddings/sweep.json

About 30-45 s per ingest; the features took 71-76 s per view for Lite0 at 288 px on the quiet
2-core machine (2026-11-30, AMD EPYC), 44-335 s per view for Lite0 at 224 and Lite2 at 260
while it was shared (load average 2-5); the 54 heads about 1.5 minutes in all; a rerun with
the features cached takes the heads' time only.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import machine_facts, write_report

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd
    import torch

    from flowers_job.vision.backbones import Classifier

BACKBONES = ("efficientnet_lite0@224", "efficientnet_lite0@288", "efficientnet_lite2@260")
"""``<architecture>@<image size>``: the backbones swept by default, each at an input size (the
stored shorter side ``round(size * 256 / 224)``, the job's ``data.resize_ratio``)."""


def parse_backbone(text: str) -> tuple[str, int]:
    """``efficientnet_lite0@288`` -> ``("efficientnet_lite0", 288)``; without ``@``, the
    architecture's native size."""
    from flowers_job.vision.backbones import native_image_size

    arch, _, size = text.partition("@")
    return arch, int(size) if size else native_image_size(arch)


COLUMNS = ["image", "label_index", "split", "row_id"]
SPLITS = ("train", "val", "test")


def table_dir(work: Path, backbone: str) -> Path:
    """The ``--output-dir`` of ``backbone``'s ingest: ``efficientnet_lite2@260`` ->
    ``WORK/lite2-260``."""
    arch, size = parse_backbone(backbone)
    return work / f"{arch.removeprefix('efficientnet_')}-{size}"


def ingest(images: Path, work: Path, backbone: str) -> float | None:
    """Run ``flowers-job ingest`` for ``backbone`` (its image size) unless its ``images``
    table exists.

    Returns:
        The ingest's seconds, or None when the table was already there.

    Raises:
        subprocess.CalledProcessError: the ingest failed.
    """
    out = table_dir(work, backbone)
    arch, size = parse_backbone(backbone)
    if (out / "tables" / "images" / "_delta_log").is_dir():
        return None
    cli = Path(sys.executable).parent / "flowers-job"
    cmd = [str(cli), "ingest", "--images", str(images), "--output-dir", str(out)]
    cmd += ["--set", f"model.architecture={arch}", "--set", f"data.image_size={size}"]
    print("+", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t0


def read_tables(work: Path, archs: list[str]) -> dict[str, pd.DataFrame]:
    """Each backbone's ``images`` table (:data:`COLUMNS`), sorted by ``row_id``, through one
    local Spark session."""
    from flowers_job.cluster.session import get_spark

    spark = get_spark("sweep", master="local[2]")
    try:
        frames = {
            arch: spark.read.format("delta")
            .load(str(table_dir(work, arch) / "tables" / "images"))
            .select(*COLUMNS)
            .toPandas()
            for arch in archs
        }
    finally:
        spark.stop()
    return {
        arch: cast("pd.DataFrame", pdf).sort_values("row_id", kind="stable").reset_index(drop=True)
        for arch, pdf in frames.items()
    }


def check_tables(
    frames: dict[str, pd.DataFrame], stored: dict[str, int]
) -> tuple[dict[str, int], dict[str, int]]:
    """Assert that every table holds the same photos, labels and splits, and that the stored
    images' shorter side is at most the expected one (ingest does not enlarge); returns the
    split sizes and, per table, how many stored images are smaller than that."""
    from PIL import Image

    archs = list(frames)
    first = frames[archs[0]]
    assert first["row_id"].is_unique, "duplicate row_id"
    for arch in archs[1:]:
        other = frames[arch]
        for split in SPLITS:
            a = set(first.loc[first["split"] == split, "row_id"])
            b = set(other.loc[other["split"] == split, "row_id"])
            assert a == b, (
                f"split {split!r} differs between {archs[0]} and {arch}: "
                f"{len(a - b)} rows only in the first, {len(b - a)} only in the second"
            )
        assert list(first["row_id"]) == list(other["row_id"]), "row ids differ"
        assert (first["label_index"].to_numpy() == other["label_index"].to_numpy()).all(), (
            "labels differ"
        )
    smaller: dict[str, int] = {}
    for arch, pdf in frames.items():
        sides = []
        for content in pdf["image"]:
            with Image.open(io.BytesIO(content)) as img:  # the header only
                sides.append(min(img.size))
        # ingest never enlarges: a photo smaller than the stored side keeps its size
        assert max(sides) == stored[arch], f"{arch}: stored shorter sides up to {max(sides)}"
        smaller[arch] = sum(side < stored[arch] for side in sides)
    return {split: int((first["split"] == split).sum()) for split in SPLITS}, smaller


def features(
    arch: str,
    pdf: pd.DataFrame,
    view: str,
    model: Classifier,
    size: int,
    resize: int,
    batch: int,
) -> np.ndarray:
    """``model.backbone`` on ``view`` of every row of ``pdf``: float32 ``[rows, features]``."""
    import numpy as np
    import torch
    from PIL import Image

    from flowers_job.vision.backbones import preprocessing_for
    from flowers_job.vision.precision import DeviceNormalize
    from flowers_job.vision.views import view_pixels

    pre = preprocessing_for(parse_backbone(arch)[0])
    normalize = DeviceNormalize(pre.mean, pre.std, torch.device("cpu"))
    tf = view_pixels(view, size, resize)
    contents = list(pdf["image"])
    out = []
    with torch.inference_mode():
        for i in range(0, len(contents), batch):
            pixels = []
            for content in contents[i : i + batch]:
                with Image.open(io.BytesIO(content)) as img:
                    pixels.append(tf(img.convert("RGB")))
            out.append(model.backbone(normalize(torch.stack(pixels))).float().numpy())
    return np.concatenate(out).astype(np.float32, copy=False)


def cached_features(
    cache: Path,
    arch: str,
    pdf: pd.DataFrame,
    views: tuple[str, ...],
    size: int,
    resize: int,
    batch: int,
) -> tuple[dict[str, np.ndarray], dict[str, dict[str, Any]]]:
    """Every view's features for ``arch``, from ``cache`` when computed before for the same rows
    in the same order, else computed (and cached, with their time)."""
    import numpy as np
    import torch

    from flowers_job.vision.backbones import build_model

    cache.mkdir(parents=True, exist_ok=True)
    rows = np.array(pdf["row_id"].astype(str).tolist(), dtype=str)  # unicode, not pickled
    stem = arch.replace("@", "-")
    rows_file = cache / f"{stem}_rows.npy"
    try:
        same_rows = np.array_equal(np.load(rows_file), rows)
    except (OSError, ValueError):  # none yet, or not a plain array
        same_rows = False
    model: Classifier | None = None
    feats: dict[str, np.ndarray] = {}
    timing: dict[str, dict[str, Any]] = {}
    for view in views:
        npy, meta = cache / f"{stem}_{view}.npy", cache / f"{stem}_{view}.json"
        if same_rows and npy.exists() and meta.exists():
            feats[view] = np.load(npy)
            timing[view] = {**json.loads(meta.read_text()), "cached": True}
            print(f"{arch} {view}: cached ({timing[view]['seconds']:.1f} s when computed)")
            continue
        if model is None:
            torch.manual_seed(0)
            model = build_model(parse_backbone(arch)[0], 5, "package").eval()
            model.to(memory_format=torch.channels_last)
        t0 = time.perf_counter()
        feats[view] = features(arch, pdf, view, model, size, resize, batch)
        seconds = time.perf_counter() - t0
        timing[view] = {
            "seconds": round(seconds, 2),
            "images": len(pdf),
            "images_per_second": round(len(pdf) / seconds, 1),
            "image_size": size,
            "resize": resize,
            "batch": batch,
            "computed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        np.save(npy, feats[view])
        meta.write_text(json.dumps(timing[view]) + "\n")
        timing[view]["cached"] = False
        print(
            f"{arch} {view}: {seconds:.1f} s, {len(pdf) / seconds:.1f} images/s, "
            f"features {feats[view].shape}",
            flush=True,
        )
    if not same_rows:
        np.save(rows_file, rows)
    return feats, timing


def train_head(
    train: torch.Tensor,
    train_y: torch.Tensor,
    val: torch.Tensor,
    val_y: torch.Tensor,
    test: torch.Tensor,
    test_y: torch.Tensor,
    *,
    seed: int,
    label_smoothing: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The job's head on ``train`` (``[K, N, F]``: every photo's K views), early-stopped on the
    validation loss of ``val`` (``[N, F]``, the centre view), scored on ``test`` (``[K, N, F]``)
    on the centre view and on the softmax averaged over the K views."""
    import torch
    from torch import nn

    from flowers_job.train.early_stopping import EarlyStopping

    k, n, dim = train.shape
    pairs = train.reshape(k * n, dim)  # row j: view j // n of photo j % n
    pair_y = train_y.repeat(k)
    torch.manual_seed(seed)
    head = nn.Sequential(nn.Dropout(args.dropout), nn.Linear(dim, int(train_y.max()) + 1))
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
    order_rng = torch.Generator().manual_seed(seed)
    stopper = EarlyStopping(mode="min", min_delta=args.min_delta, patience=args.patience)
    best_state = {name: t.clone() for name, t in head.state_dict().items()}
    best_val_acc = 0.0
    epochs = 0
    t0 = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        epochs = epoch
        head.train()
        order = torch.randperm(len(pairs), generator=order_rng)
        for i in range(0, len(order), args.batch):
            idx = order[i : i + args.batch]
            loss = criterion(head(pairs[idx]), pair_y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        head.eval()
        with torch.inference_mode():
            logits = head(val)
            val_loss = float(criterion(logits, val_y))
            val_acc = float((logits.argmax(1) == val_y).float().mean())
        decision = stopper.step(val_loss, epoch)
        if decision.improved:
            best_state = {name: t.clone() for name, t in head.state_dict().items()}
            best_val_acc = val_acc
        if decision.stop:
            break
    head.load_state_dict(best_state)
    head.eval()
    with torch.inference_mode():
        logits = torch.stack([head(test[v]) for v in range(k)])
        view0 = float((logits[0].argmax(1) == test_y).float().mean())
        tta = float((logits.softmax(-1).mean(0).argmax(1) == test_y).float().mean())
    return {
        "seed": seed,
        "test_accuracy_view0": view0,
        "test_accuracy_tta": tta,
        "best_epoch": stopper.best_epoch,
        "epochs_run": epochs,
        "val_loss": stopper.best,
        "val_accuracy": best_val_acc,
        "head_seconds": round(time.perf_counter() - t0, 3),
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-seed lists with mean, min and max of both test accuracies."""
    out: dict[str, Any] = {"seeds": [r["seed"] for r in runs]}
    for key in ("test_accuracy_view0", "test_accuracy_tta"):
        values = [r[key] for r in runs]
        out[key] = {
            "per_seed": values,
            "mean": statistics.fmean(values),
            "min": min(values),
            "max": max(values),
        }
    for key in ("best_epoch", "epochs_run", "val_accuracy", "val_loss", "head_seconds"):
        out[key] = [r[key] for r in runs]
    out["mean_best_epoch"] = statistics.fmean(r["best_epoch"] for r in runs)
    return out


def markdown(rows: list[dict[str, Any]], target: float) -> str:
    """The sweep as a markdown table, the best mean centre-view test accuracy first."""
    lines = [
        "| arch | K | label smoothing | test view 0 mean (min-max) | test TTA mean (min-max) "
        f"| mean best epoch | val acc mean | mean >= {target} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: -r["test_accuracy_view0"]["mean"]):
        v0, tta = r["test_accuracy_view0"], r["test_accuracy_tta"]
        lines.append(
            f"| {r['arch'].removeprefix('efficientnet_')} | {r['k']} | {r['label_smoothing']} "
            f"| {v0['mean']:.4f} ({v0['min']:.4f}-{v0['max']:.4f}) "
            f"| {tta['mean']:.4f} ({tta['min']:.4f}-{tta['max']:.4f}) "
            f"| {r['mean_best_epoch']:.1f} | {statistics.fmean(r['val_accuracy']):.4f} "
            f"| {'yes' if v0['mean'] >= target else 'no'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--images", type=Path, default=Path("../shared/data/flower_photos"))
    p.add_argument("--work", type=Path, default=Path("/var/tmp/sweep"), help="tables, features")
    p.add_argument(
        "--backbones",
        nargs="+",
        default=list(BACKBONES),
        help="<architecture>@<image size>, e.g. efficientnet_lite0@288",
    )
    p.add_argument("--k", nargs="+", type=int, default=[1, 2, 4], help="views per photo")
    p.add_argument("--label-smoothing", nargs="+", type=float, default=[0.0, 0.1])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=40, help="at most")
    p.add_argument("--patience", type=int, default=3, help="early stopping (the job's: 2)")
    p.add_argument("--min-delta", type=float, default=0.001)
    p.add_argument("--batch", type=int, default=64, help="the job's global batch")
    p.add_argument("--lr", type=float, default=2e-3, help="the job's 1e-3 x world size 2")
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--feature-batch", type=int, default=32)
    p.add_argument("--target", type=float, default=0.93, help="mean test accuracy asked for")
    p.add_argument("--report", type=Path)
    args = p.parse_args(argv)

    from flowers_job.runtime.allocator import tune_this_process

    tune_this_process()  # this process runs torch itself: glibc's defaults would thrash
    import torch

    from flowers_job.config import DataConfig
    from flowers_job.vision.views import VIEWS

    wall0 = time.perf_counter()
    facts = machine_facts("torch", "torchvision", "pillow", "pyspark")
    torch.set_num_threads(2)
    if max(args.k) > len(VIEWS):
        p.error(f"--k: at most {len(VIEWS)} views")
    views = VIEWS[: max(args.k)]  # the views some K trains on: each costs a forward pass
    names = list(args.backbones)
    sizes = {name: parse_backbone(name)[1] for name in names}
    stored = {name: DataConfig(image_size=sizes[name]).stored_short_side for name in names}

    ingest_seconds = {name: ingest(args.images, args.work, name) for name in names}
    frames = read_tables(args.work, names)
    split_rows, smaller = check_tables(frames, stored)
    print(
        f"tables: {split_rows} rows per split, the same in {', '.join(names)}; "
        f"stored smaller than the stored side (not enlarged): {smaller}"
    )

    first = frames[names[0]]
    masks = {split: (first["split"] == split).to_numpy() for split in SPLITS}
    labels = {
        split: torch.from_numpy(first["label_index"].to_numpy()[masks[split]]).long()
        for split in SPLITS
    }
    feature_timing: dict[str, dict[str, dict[str, Any]]] = {}
    rows: list[dict[str, Any]] = []
    for arch in names:
        feats, feature_timing[arch] = cached_features(
            args.work / "features",
            arch,
            frames[arch],
            views,
            sizes[arch],
            stored[arch],
            args.feature_batch,
        )
        per_split = {
            split: torch.stack([torch.from_numpy(feats[v][masks[split]]) for v in views])
            for split in SPLITS
        }
        for k in args.k:
            for ls in args.label_smoothing:
                runs = []
                for seed in args.seeds:
                    run = train_head(
                        per_split["train"][:k],
                        labels["train"],
                        per_split["val"][0],
                        labels["val"],
                        per_split["test"][:k],
                        labels["test"],
                        seed=seed,
                        label_smoothing=ls,
                        args=args,
                    )
                    print(
                        f"{arch} K={k} ls={ls} seed={seed}: test {run['test_accuracy_view0']:.4f} "
                        f"(TTA {run['test_accuracy_tta']:.4f}), val {run['val_accuracy']:.4f}, "
                        f"best epoch {run['best_epoch']}/{run['epochs_run']}, "
                        f"{run['head_seconds']:.1f} s",
                        flush=True,
                    )
                    runs.append(run)
                rows.append({"arch": arch, "k": k, "label_smoothing": ls, **summarise(runs)})
        del feats, per_split

    table = markdown(rows, args.target)
    result = {
        **facts,
        "settings": {
            key: (str(value) if isinstance(value, Path) else value)
            for key, value in vars(args).items()
        },
        "views": list(views),
        "image_size": sizes,
        "stored_short_side": stored,
        "split_rows": split_rows,
        "stored_smaller_than_short_side": smaller,
        "ingest_seconds": ingest_seconds,
        "feature_seconds": feature_timing,
        "sweep": sorted(rows, key=lambda r: -r["test_accuracy_view0"]["mean"]),
        "reaching_target": [
            f"{r['arch']} K={r['k']} ls={r['label_smoothing']}"
            for r in rows
            if r["test_accuracy_view0"]["mean"] >= args.target
        ],
        "wall_seconds": round(time.perf_counter() - wall0, 1),
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "markdown": table,
    }
    print(table)
    write_report(result, args.report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
