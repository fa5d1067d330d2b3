"""What else a frozen backbone allows: train the head on features computed once, no augmentation.

With the backbone frozen, the job still runs it on every training image every epoch, because
each epoch augments the images afresh (random resized crop, flip). Dropping the augmentation
would let the training features, too, be computed once per run, as the job already does
for validation (``train.cache_val_features``): every epoch after that costs a linear layer
on ``[N, 1280]`` floats. This measures both sides of that trade on the job's own tables and
split:

- ``features``: the backbone run once over the train and validation images with the
  evaluation transform (resize, centre crop; no augmentation), 2 threads, batch 64;
- ``head``: the job's head (dropout 0.2 + linear), optimizer (AdamW, the job's learning
  rate for its world size and global batch), loss (cross-entropy, label smoothing 0.1) and
  early-stopping rule (keep the epoch of the lowest validation loss) trained on those
  features for ``--epochs`` epochs at the job's global batch size, in one process;

and reports the validation accuracy at the best epoch next to the job's own (from the
job's ``summary.json``, which is read for its tables and settings).

    .venv/bin/python benchmarks/feature_cache.py --job-output /tmp/bench-docs/job \\
        --report output/benchmarks/feature_cache.json

About 1 minute on 2 cores.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import write_report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--job-output", type=Path, required=True, help="a job's --output-dir")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--report", type=Path)
    args = p.parse_args(argv)

    from flowers_job.runtime.allocator import tune_this_process

    tune_this_process()  # this process runs torch itself: glibc's defaults would thrash
    import torch
    from PIL import Image
    from torch import nn

    from flowers_job.cluster.session import get_spark
    from flowers_job.config import DataConfig
    from flowers_job.vision.backbones import build_model, preprocessing_for
    from flowers_job.vision.precision import DeviceNormalize
    from flowers_job.vision.transforms import eval_pixels

    summary: dict[str, Any] = json.loads((args.job_output / "summary.json").read_text())
    history = summary["history"]
    data_cfg = DataConfig()  # the job's defaults (its summary has no image size)
    size = data_cfg.image_size
    spark = get_spark("feature_cache", master="local[2]")
    tables: dict[str, Any] = {
        split: spark.read.format("delta")
        .load(summary["tables"][split])
        .select("image", "label_index")
        .toPandas()
        for split in ("train", "val")
    }
    spark.stop()

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = build_model("efficientnet_lite0", len(summary["label_names"]), "package").eval()
    model.to(memory_format=torch.channels_last)
    pre = preprocessing_for("efficientnet_lite0")
    normalize = DeviceNormalize(pre.mean, pre.std, torch.device("cpu"))
    tf = eval_pixels(size, data_cfg.stored_short_side)

    t0 = time.perf_counter()
    feats: dict[str, torch.Tensor] = {}
    labels: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for split, pdf in tables.items():
            out = []
            contents = list(pdf["image"])
            for i in range(0, len(contents), 64):
                batch = []
                for content in contents[i : i + 64]:
                    with Image.open(io.BytesIO(content)) as img:
                        batch.append(tf(img.convert("RGB")))
                out.append(model.backbone(normalize(torch.stack(batch))))
            feats[split] = torch.cat(out)
            labels[split] = torch.tensor(pdf["label_index"].to_numpy(), dtype=torch.int64)
    feature_seconds = time.perf_counter() - t0

    world_size = int(summary["world_size"])
    global_batch = int(summary["global_batch_size"])
    lr = float(summary["learning_rate"])
    head = model.head
    head.train()
    for param in head.parameters():
        param.requires_grad_(True)
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=1e-4)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    best = (float("inf"), 0.0, 0)
    t1 = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        head.train()
        order = torch.randperm(len(feats["train"]))
        for i in range(0, len(order), global_batch):
            idx = order[i : i + global_batch]
            loss = criterion(head(feats["train"][idx]), labels["train"][idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        head.eval()
        with torch.inference_mode():
            logits = head(feats["val"])
            val_loss = float(criterion(logits, labels["val"]))
            val_acc = float((logits.argmax(1) == labels["val"]).float().mean())
        if val_loss < best[0]:
            best = (val_loss, val_acc, epoch)
    head_seconds = time.perf_counter() - t1

    result = {
        "date": time.strftime("%Y-%m-%d"),
        "image_size": size,
        "train_rows": len(feats["train"]),
        "val_rows": len(feats["val"]),
        "world_size_of_the_job": world_size,
        "global_batch_size": global_batch,
        "learning_rate": lr,
        "feature_seconds": feature_seconds,
        "head_seconds_per_epoch": head_seconds / args.epochs,
        "epochs": args.epochs,
        "best_epoch": best[2],
        "val_loss": best[0],
        "val_accuracy": best[1],
        "job_val_accuracy": summary["val_accuracy"],
        "job_best_epoch": summary["best_epoch"],
        "job_seconds_per_epoch": sum(h["epoch_seconds"] for h in history) / len(history),
    }
    print(
        f"features once (train + val, no augmentation): {feature_seconds:.1f} s; head: "
        f"{result['head_seconds_per_epoch'] * 1000:.0f} ms per epoch; best epoch {best[2]}: "
        f"val accuracy {best[1]:.4f} (the job, with augmentation: "
        f"{summary['val_accuracy']:.4f}, {result['job_seconds_per_epoch']:.1f} s per epoch)"
    )
    write_report(result, args.report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
