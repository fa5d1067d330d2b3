"""How far a trained model's test accuracy moves with the evaluation view alone: the spread
of one score on the 390 held-out photos, beside the validation split's verdict.

Reads a finished run's output directory: the best weights of its last checkpoint
(``checkpoints/last.pt``, ``best_model``) and the ``images`` Delta table at the version the
run read (``summary.json``'s lineage), through a local Spark session. Then scores the
validation and the test split once per view, on the CPU, with the job's own pipeline (the
loaders' evaluation decode, ``DecodeTransform``, and the training loop's normalisation):

- ``resize R, crop C``: the shorter side resized to R px, the centre C x C crop (the job's
  own view is ``resize stored_short_side, crop image_size``: 256 and 224 for Lite0; the
  others test at a higher resolution than training, Touvron et al. 2019, "Fixing the
  train-test resolution discrepancy");
- ``+ flip``: the mean of the softmax of the view and of its mirror image (test-time
  augmentation).

Nothing here changes the job: it measures how much of a test score's difference between two
recipes one could get from choices the validation split does not prefer, the noise floor of
a 0.95 target on 390 photos (one photo is 0.0026). Run from the repository root, after a
``make run`` (about 4 minutes on 2 cores):

    .venv/bin/python benchmarks/eval_views.py --output /tmp/ft6 \\
        --report benchmarks/results/2026-11-26/eval_views_finetune_seed0.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))

from report import machine_facts, write_report  # noqa: E402

from flowers_job.cluster.session import get_spark  # noqa: E402
from flowers_job.config import JobConfig  # noqa: E402
from flowers_job.tables.delta_tables import split_frame  # noqa: E402
from flowers_job.tables.table_ref import TableRef  # noqa: E402
from flowers_job.vision.backbones import build_model, preprocessing_for  # noqa: E402
from flowers_job.vision.decode_transform import DecodeTransform  # noqa: E402
from flowers_job.vision.precision import DeviceNormalize  # noqa: E402

VIEWS: list[tuple[int | None, int | None, bool]] = [
    (None, None, False),  # the job's own view
    (None, None, True),
    (256, 256, False),
    (292, 256, False),
    (274, 240, False),
    (256, 240, False),
]
"""(resize px, crop px, flip) per view; None: the run's own (stored short side, image size)."""


def _rows(summary: dict[str, Any], split: str) -> list[tuple[bytes, int]]:
    """(JPEG bytes, label index) of every row of ``split`` at the version the run read
    (``summary``: the run's ``summary.json``)."""
    entry = summary["lineage"]["splits"][split]
    spark = get_spark("eval_views", conf={"spark.driver.memory": "2g"})
    frame = split_frame(spark, TableRef.from_lineage(entry), int(entry["version"]), split)
    return [(bytes(r["image"]), int(r["label_index"])) for r in frame.collect()]


def score(
    model: torch.nn.Module,
    rows: list[tuple[bytes, int]],
    view: DecodeTransform,
    normalize: DeviceNormalize,
    flip: bool,
    batch: int = 64,
) -> int:
    """How many of ``rows`` the model classifies right under ``view`` (the loaders' evaluation
    decode: JPEG -> uint8 ``[3, S, S]``) and ``normalize`` (the training loop's), with the
    mirror image's softmax averaged in when ``flip``."""
    right = 0
    for i in range(0, len(rows), batch):
        chunk = rows[i : i + batch]
        x = normalize(torch.stack([view.decode(b) for b, _ in chunk]))
        with torch.no_grad():
            p = model(x).softmax(1)
            if flip:
                p = p + model(x.flip(3)).softmax(1)
        right += int((p.argmax(1) == torch.tensor([y for _, y in chunk])).sum())
    return right


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--output", type=Path, required=True, help="a finished run's output dir")
    p.add_argument("--report", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    facts = machine_facts("torch")

    ckpt = torch.load(
        args.output / "checkpoints" / "last.pt", map_location="cpu", weights_only=False
    )
    cfg = JobConfig.model_validate(ckpt["config"])
    model = build_model(
        cfg.model.architecture,
        len(ckpt["label_names"]),
        "none",
        freeze_backbone=cfg.model.freeze_backbone,
        frozen_layers=cfg.model.frozen_layers,
        dropout=cfg.model.dropout,
    )
    model.load_state_dict(ckpt["best_model"])
    model.eval().to(memory_format=torch.channels_last)
    pre = preprocessing_for(cfg.model.architecture)
    normalize = DeviceNormalize(pre.mean, pre.std, torch.device("cpu"))
    summary = json.loads((args.output / "summary.json").read_text())
    splits = {s: _rows(summary, s) for s in ("val", "test")}

    results: list[dict[str, Any]] = []
    print("| view | val right (accuracy) | test right (accuracy) | seconds |")
    print("|---|---|---|---|")
    for resize, crop, flip in VIEWS:
        r = resize or cfg.data.stored_short_side
        c = crop or cfg.data.image_size
        view = DecodeTransform(False, c, r)
        start = time.perf_counter()
        row: dict[str, Any] = {"resize": r, "crop": c, "flip": flip}
        for split, rows in splits.items():
            right = score(model, rows, view, normalize, flip)
            row[split] = {"right": right, "rows": len(rows), "accuracy": right / len(rows)}
        row["seconds"] = time.perf_counter() - start
        results.append(row)
        name = f"resize {r}, crop {c}{' + flip' if flip else ''}"
        print(
            f"| {name} | {row['val']['right']} ({row['val']['accuracy']:.4f}) | "
            f"{row['test']['right']} ({row['test']['accuracy']:.4f}) | {row['seconds']:.0f} |",
            flush=True,
        )
    write_report({**facts, "output": str(args.output), "views": results}, args.report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
