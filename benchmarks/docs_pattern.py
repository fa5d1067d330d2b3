"""Baseline: the Databricks documentation's flowers pattern, written plainly.

What the Databricks docs show for distributed training of an image classifier from Spark:
"Distributed training with TorchDistributor" (a training function run by
``TorchDistributor``, ``init_process_group``, DDP) fed the way the notebook "Simplify data
conversion from Spark to PyTorch" feeds it (flowers photos -> Spark DataFrame -> Petastorm
``make_spark_converter`` -> ``make_torch_dataloader`` with a pandas ``TransformSpec``). It is
the yardstick for the project's job: wall time and accuracy on the same photos, the same
validation split (``--val-paths``) and the same machine.

The pattern, step by step:

1. ``spark.read.format("binaryFile")`` over the photo folders (``*.jpg``, recursive); the
   label is the parent folder's name (``regexp_extract`` on ``path``), ``label_index`` its
   position among the sorted label names; the columns kept are ``content`` and
   ``label_index``.
2. Train/val: with ``--val-paths`` (a text file, one absolute photo path per line: the job's
   validation photos) the rows whose path is listed are val, all others train (a join on the
   path, ``file:`` URIs normalised to plain paths). Without it,
   ``df.randomSplit([0.9, 0.1], seed=12345)``, the notebook's split. Both DataFrames are
   then ``repartition(num_processes)``-ed, as the notebook does ("make sure the number of
   partitions is at least the number of workers", with ``repartition(2)`` for its two
   workers; Petastorm shards by row group and fails with fewer row groups than shards).
3. ``make_spark_converter`` for each, cached under a temporary ``file://`` directory
   (``SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF``): the ORIGINAL full-size JPEG bytes
   go to Parquet.
4. ``TorchDistributor(num_processes, local_mode=True, use_gpu=False).run(...)`` of
   :func:`train_and_evaluate`: gloo, ``torch.set_num_threads(cpu_count // world_size)``,
   the frozen ImageNet EfficientNet-Lite0 and a new Linear head (the project's
   :func:`flowers_job.vision.backbones.build_model`, the backbone standing in for the notebook's
   MobileNetV2) wrapped in DDP, ``SGD(head, lr=0.001 * world_size, momentum=0.9)`` (the
   notebook's distributed version scales the learning rate by the number of workers;
   ``--no-scale-lr`` keeps 0.001), ``StepLR(step_size=7, gamma=0.1)``,
   ``CrossEntropyLoss``. Each rank reads its shard (``cur_shard=rank``) with
   ``num_epochs=None`` (an endless reader: every rank runs the same number of steps) and
   Petastorm's default thread reader pool; the ``TransformSpec`` decodes each JPEG with PIL
   and applies torchvision's ``RandomResizedCrop(S), RandomHorizontalFlip()`` (train) or
   ``Resize(round(S * 256 / 224)), CenterCrop(S)`` (val), ``ToTensor()``, ``Normalize`` with
   the weights' own mean/std (:func:`flowers_job.vision.backbones.preprocessing_for`), giving float32
   ``(3, S, S)`` arrays. ``steps_per_epoch = len(converter_train) // (batch * world_size)``
   and ``validation_steps = max(1, len(converter_val) // (batch * world_size))``: the docs
   drop the remainder (and, for a val set smaller than one global batch, the endless reader
   repeats rows), so ``val_rows_evaluated`` says how many rows the reported accuracy is over.
   Loss and accuracy are summed over the ranks with ``all_reduce`` after every epoch.

Left out of the docs' pattern: MLflow (autologging, model logging and registry) and
Horovod (TorchDistributor replaces HorovodRunner, as the TorchDistributor page does).
The session is a plain local one (``local[2]``, 4 GiB driver, UI off), and the processes
run with glibc's allocator defaults, as the docs' do (``--allocator glibc``, the default);
``--allocator tuned`` takes the session from :func:`flowers_job.cluster.session.get_spark` instead,
so that the ranks and Python workers get the project's malloc tuning
(``flowers_job.runtime.allocator``) as the job's do. The JSON records the variables in effect.

Prints one line per epoch and the results as JSON, also written to ``--output``:
``wall_seconds`` (from before the SparkSession start to the converters' deletion: the whole
pattern), ``convert_seconds`` (both ``make_spark_converter`` calls), ``train_seconds`` (the
``TorchDistributor.run``), ``val_accuracy``, ``val_loss`` (mean cross-entropy per row) and
the sizes and settings. Run from the repository root:

    .venv/bin/python benchmarks/docs_pattern.py --val-paths /tmp/job-val-paths.txt \\
        --output /tmp/docs-pattern.json

and for a small trial (12 photos per label, 64 px, one epoch):

    .venv/bin/python benchmarks/docs_pattern.py --limit 12 --epochs 1 --image-size 64 \\
        --batch-size 4 --output /tmp/docs-small.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pandas as pd
    import torch
    from petastorm import TransformSpec
    from petastorm.spark import SparkDatasetConverter
    from pyspark.sql import DataFrame, SparkSession

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PHOTOS = Path(os.environ.get("FLOWERS_PHOTOS", REPO.parent / "shared/data/flower_photos"))
ARCHITECTURE = "efficientnet_lite0"  # the project's backbone (the notebook's: MobileNetV2)
BASE_LR = 0.001  # the notebook's SGD learning rate, per worker
MOMENTUM = 0.9  # the notebook's SGD momentum
STEP_LR = (7, 0.1)  # the notebook's StepLR: x0.1 every 7 epochs
SPLIT_WEIGHTS = [0.9, 0.1]  # the notebook's randomSplit, train/val
ALLOCATOR_VARS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def _quiet_petastorm() -> None:
    """Silence the pyarrow deprecation warnings petastorm 0.13.1 raises on every read."""
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"petastorm(\.|$)")


# --- driver side: Spark -------------------------------------------------------------------


def _plain_path(column: Any) -> Any:
    """A ``file:/...`` or ``file:///...`` URI column (as binaryFile gives) -> a plain path."""
    from pyspark.sql import functions as F

    return F.regexp_replace(column, r"^file:(//)?", "")


def load_photos(spark: SparkSession, photos: Path, limit: int | None) -> DataFrame:
    """The photos as the docs read them: ``binaryFile``, label from the parent folder.

    Args:
        spark: the session.
        photos: a folder of ``<label>/*.jpg``.
        limit: photos per label (the first ones by file name), or None for all. With a limit
            the selected files are listed here and passed to ``load``; without, the folder is.

    Returns:
        Columns ``path`` (plain local path, string), ``content`` (the JPEG bytes, binary)
        and ``label_index`` (int, the label's position among the sorted label names).
    """
    from pyspark.sql import functions as F

    sources: list[str] = [str(photos)]
    if limit is not None:
        sources = [
            str(p)
            for folder in sorted(d for d in photos.iterdir() if d.is_dir())
            for p in sorted(folder.glob("*.jpg"))[:limit]
        ]
    df = (
        spark.read.format("binaryFile")
        .option("pathGlobFilter", "*.jpg")
        .option("recursiveFileLookup", "true")
        .load(sources)
        .withColumn("label", F.regexp_extract("path", r"([^/]+)/[^/]+$", 1))
    )
    labels = sorted(row["label"] for row in df.select("label").distinct().collect())
    label_to_idx = F.create_map(*[F.lit(x) for i, name in enumerate(labels) for x in (name, i)])
    return df.select(
        _plain_path(F.col("path")).alias("path"),
        "content",
        label_to_idx[F.col("label")].cast("int").alias("label_index"),
    )


def split(
    spark: SparkSession, df: DataFrame, val_paths: Path | None, seed: int
) -> tuple[DataFrame, DataFrame, int | None]:
    """Train and val DataFrames (columns ``content``, ``label_index``).

    With ``val_paths`` (one absolute photo path per line) the listed photos are val and all
    others train; without it, ``df.randomSplit(SPLIT_WEIGHTS, seed)``.

    Returns:
        ``(train, val, listed)``: ``listed`` is the number of distinct paths in the file
        (None without one); val rows can be fewer when listed photos are not in ``df``.
    """
    from pyspark.sql import functions as F

    if val_paths is None:
        train, val = df.randomSplit(SPLIT_WEIGHTS, seed=seed)
        return train.select("content", "label_index"), val.select("content", "label_index"), None
    lines = {line.strip() for line in val_paths.read_text().splitlines() if line.strip()}
    listed = sorted(str(Path(p.removeprefix("file:")).resolve()) for p in lines)
    val_df = spark.createDataFrame([(p,) for p in listed], "path string")
    val_keys = F.broadcast(val_df)
    train = df.join(val_keys, on="path", how="left_anti")
    val = df.join(val_keys, on="path", how="left_semi")
    return train.select("content", "label_index"), val.select("content", "label_index"), len(listed)


# --- worker side: the function TorchDistributor runs --------------------------------------


def transform_row(
    is_train: bool,
    image_size: int,
    mean: list[float],
    std: list[float],
    pd_batch: pd.DataFrame,
) -> pd.DataFrame:
    """The notebook's ``transform_row``: JPEG bytes -> normalised float32 ``(3, S, S)``.

    Input columns ``content`` (bytes) and ``label_index``; output ``label_index`` and
    ``features`` (``np.float32``, C-contiguous, ``(3, image_size, image_size)``). Train:
    ``RandomResizedCrop(S)``, ``RandomHorizontalFlip()``; val: ``Resize(round(S*256/224))``,
    ``CenterCrop(S)`` (the notebook's 256/224 at S=224); both ``ToTensor()``,
    ``Normalize(mean, std)``.
    """
    from PIL import Image
    from torchvision import transforms

    steps: list[Any] = [transforms.Lambda(lambda x: Image.open(io.BytesIO(x)).convert("RGB"))]
    if is_train:
        steps += [transforms.RandomResizedCrop(image_size), transforms.RandomHorizontalFlip()]
    else:
        steps += [
            transforms.Resize(round(image_size * 256 / 224)),
            transforms.CenterCrop(image_size),
        ]
    steps += [transforms.ToTensor(), transforms.Normalize(mean, std)]
    trans = transforms.Compose(steps)
    pd_batch["features"] = pd_batch["content"].map(
        lambda x: np.ascontiguousarray(trans(x).numpy())  # docs/known-issues.md, "Petastorm"
    )
    return pd_batch.drop(labels=["content"], axis=1)


def get_transform_spec(
    is_train: bool, image_size: int, mean: list[float], std: list[float]
) -> TransformSpec:
    """The notebook's ``TransformSpec``: the new ``features`` field's dtype and shape, and
    the output columns in order."""
    from petastorm import TransformSpec

    return TransformSpec(
        partial(transform_row, is_train, image_size, mean, std),
        edit_fields=[("features", np.float32, (3, image_size, image_size), False)],
        selected_fields=["features", "label_index"],
    )


def run_steps(
    model: torch.nn.Module,
    criterion: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    batches: Any,
    steps: int,
) -> torch.Tensor:
    """``steps`` batches from the iterator ``batches``: a training pass with ``optimizer``,
    an evaluation pass (``no_grad``) without.

    Returns:
        float64 ``[loss_sum, correct, rows]`` of this rank (loss summed over rows).
    """
    import torch

    model.train(optimizer is not None)
    totals = torch.zeros(3, dtype=torch.float64)
    for _ in range(steps):
        batch = next(batches)
        inputs, labels = batch["features"], batch["label_index"].long()
        with torch.set_grad_enabled(optimizer is not None):
            outputs = model(inputs)
            loss = criterion(outputs, labels)
        if optimizer is not None:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        totals += torch.tensor(
            [
                loss.item() * len(labels),
                (outputs.argmax(1) == labels).sum().item(),
                len(labels),
            ],
            dtype=torch.float64,
        )
    return totals


def train_and_evaluate(
    converter_train: SparkDatasetConverter,
    converter_val: SparkDatasetConverter,
    settings: dict[str, Any],
) -> dict[str, Any]:
    """The training function TorchDistributor runs on every rank (gloo, CPU).

    Args:
        converter_train: Petastorm converter of the train rows (``content``, ``label_index``).
        converter_val: the same for val.
        settings: ``epochs``, ``image_size`` (px), ``batch_size`` (per rank), ``lr`` (the SGD
            learning rate, already scaled), ``mean``, ``std``, ``num_classes``,
            ``reader_pool_type``.

    Returns:
        Rank 0's ``val_accuracy``, ``val_loss`` (last epoch, over ``val_rows_evaluated`` rows,
        all ranks), ``val_rows_evaluated``, ``val_steps``, ``steps_per_epoch``,
        ``epoch_seconds`` (rank 0, per epoch, train + val), ``train_rows_seen`` (all ranks,
        all epochs), ``train_loss``, ``train_accuracy``; broadcast so that every rank returns
        the same (docs/known-issues.md, "Spark").
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from flowers_job.vision.backbones import build_model

    _quiet_petastorm()
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    batch_size = int(settings["batch_size"])
    size, mean, std = int(settings["image_size"]), settings["mean"], settings["std"]

    model = build_model(
        ARCHITECTURE, int(settings["num_classes"]), "package", freeze_backbone=True, dropout=0.2
    )
    ddp_model = DDP(model)
    criterion = torch.nn.CrossEntropyLoss()
    # Only the new head is optimised; the frozen backbone has no gradients.
    optimizer = torch.optim.SGD(
        model.head.parameters(), lr=float(settings["lr"]), momentum=MOMENTUM
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=STEP_LR[0], gamma=STEP_LR[1])

    steps_per_epoch = len(converter_train) // (batch_size * world_size)
    validation_steps = max(1, len(converter_val) // (batch_size * world_size))
    reader = {"num_epochs": None, "reader_pool_type": settings["reader_pool_type"]}
    if rank == 0:
        print(
            f"world_size {world_size}, per_device_batch_size {batch_size}, "
            f"global_batch_size {batch_size * world_size}, {size} px, "
            f"train {len(converter_train)} rows ({steps_per_epoch} steps/epoch), "
            f"val {len(converter_val)} rows ({validation_steps} steps), lr {settings['lr']}",
            flush=True,
        )
    epoch_seconds: list[float] = []
    train_totals = val_totals = torch.zeros(3, dtype=torch.float64)
    with (
        converter_train.make_torch_dataloader(
            transform_spec=get_transform_spec(True, size, mean, std),
            cur_shard=rank,
            shard_count=world_size,
            batch_size=batch_size,
            **reader,
        ) as train_loader,
        converter_val.make_torch_dataloader(
            transform_spec=get_transform_spec(False, size, mean, std),
            cur_shard=rank,
            shard_count=world_size,
            batch_size=batch_size,
            **reader,
        ) as val_loader,
    ):
        train_iter, val_iter = iter(train_loader), iter(val_loader)
        for epoch in range(int(settings["epochs"])):
            t0 = time.perf_counter()
            train_totals = run_steps(ddp_model, criterion, optimizer, train_iter, steps_per_epoch)
            scheduler.step()
            val_totals = run_steps(ddp_model, criterion, None, val_iter, validation_steps)
            dist.all_reduce(train_totals)
            dist.all_reduce(val_totals)
            epoch_seconds.append(round(time.perf_counter() - t0, 2))
            if rank == 0:
                tl, tc, tn = train_totals.tolist()
                vl, vc, vn = val_totals.tolist()
                print(
                    f"epoch {epoch + 1}: train loss {tl / max(tn, 1):.4f} "
                    f"acc {tc / max(tn, 1):.4f} | val loss {vl / vn:.4f} acc {vc / vn:.4f} "
                    f"({int(vn)} rows) | {tn / epoch_seconds[-1]:.1f} train img/s over the epoch, "
                    f"{epoch_seconds[-1]:.1f} s",
                    flush=True,
                )
    tl, tc, tn = train_totals.tolist()
    vl, vc, vn = val_totals.tolist()
    result: dict[str, Any] = {
        "val_accuracy": vc / vn,
        "val_loss": vl / vn,
        "val_rows_evaluated": int(vn),
        "val_steps": validation_steps,
        "steps_per_epoch": steps_per_epoch,
        "epoch_seconds": epoch_seconds,
        "train_rows_seen": steps_per_epoch * batch_size * world_size * int(settings["epochs"]),
        "train_loss": tl / tn if tn else None,
        "train_accuracy": tc / tn if tn else None,
    }
    box: list[Any] = [result]
    dist.broadcast_object_list(box, src=0)
    dist.destroy_process_group()
    return dict(box[0])


# --- driver -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run the pattern end to end, print and write the JSON; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--photos", type=Path, default=DEFAULT_PHOTOS, help="<label>/*.jpg")
    parser.add_argument(
        "--val-paths", type=Path, default=None, help="file: one val photo path per line"
    )
    parser.add_argument("--limit", type=int, default=None, help="photos per label (default all)")
    parser.add_argument("--epochs", type=int, default=2, help="training epochs")
    parser.add_argument("--image-size", type=int, default=224, help="model input side, px")
    parser.add_argument("--batch-size", type=int, default=32, help="per-process batch size")
    parser.add_argument("--num-processes", type=int, default=2, help="TorchDistributor ranks")
    parser.add_argument(
        "--scale-lr",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"SGD lr = {BASE_LR} x num_processes, as the notebook's distributed version",
    )
    parser.add_argument("--seed", type=int, default=12345, help="randomSplit seed (no val file)")
    parser.add_argument(
        "--reader-pool",
        choices=["thread", "process", "dummy"],
        default="thread",
        help="Petastorm reader_pool_type (the docs: the default, thread)",
    )
    parser.add_argument(
        "--allocator",
        choices=("glibc", "tuned"),
        default="glibc",
        help="glibc: the docs' plain session and glibc's defaults; tuned: the project's",
    )
    parser.add_argument("--output", type=Path, default=None, help="JSON results file")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")
    if min(args.epochs, args.image_size, args.batch_size, args.num_processes) < 1:
        parser.error("--epochs, --image-size, --batch-size and --num-processes must be >= 1")
    if args.val_paths is not None and not args.val_paths.is_file():
        parser.error(f"--val-paths {args.val_paths}: no such file")

    _quiet_petastorm()
    from petastorm.spark import SparkDatasetConverter, make_spark_converter
    from pyspark.ml.torch.distributor import TorchDistributor
    from pyspark.sql import SparkSession

    from flowers_job.cluster.session import get_spark
    from flowers_job.vision.backbones import preprocessing_for

    photos = args.photos.resolve()
    lr = BASE_LR * (args.num_processes if args.scale_lr else 1)
    cache_dir = Path(tempfile.mkdtemp(prefix="docs-pattern-petastorm-"))
    wall_t0 = time.perf_counter()
    if args.allocator == "tuned":
        spark = get_spark("docs_pattern", master="local[2]")
    else:
        for name in ALLOCATOR_VARS:
            os.environ.pop(name, None)
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        spark = (
            SparkSession.builder.appName("docs_pattern")
            .master("local[2]")
            .config("spark.driver.memory", "4g")
            .config("spark.ui.enabled", "false")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("WARN")
    converters: list[SparkDatasetConverter] = []
    try:
        df = load_photos(spark, photos, args.limit)
        num_classes = df.select("label_index").distinct().count()
        df_train, df_val, listed = split(spark, df, args.val_paths, args.seed)
        # The notebook: "make sure the number of partitions is at least the number of workers".
        df_train = df_train.repartition(args.num_processes)
        df_val = df_val.repartition(args.num_processes)

        spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, cache_dir.as_uri())
        t0 = time.perf_counter()
        converter_train = make_spark_converter(df_train)
        converters.append(converter_train)
        converter_val = make_spark_converter(df_val)
        converters.append(converter_val)
        convert_s = time.perf_counter() - t0
        print(
            f"converted: train {len(converter_train)}, val {len(converter_val)} rows "
            f"({num_classes} labels) in {convert_s:.1f} s",
            flush=True,
        )
        if min(len(converter_train), len(converter_val)) < args.num_processes:
            # Petastorm shards by row group: a shard without one raises NoDataAvailableError.
            raise SystemExit(
                f"train {len(converter_train)} / val {len(converter_val)} rows: each needs at "
                f"least --num-processes ({args.num_processes}) rows, one row group per shard"
            )
        if listed is not None and len(converter_val) != listed:
            print(
                f"warning: {listed} val paths listed, {len(converter_val)} found among the photos",
                flush=True,
            )

        pre = preprocessing_for(ARCHITECTURE)
        settings = {
            "epochs": args.epochs,
            "image_size": args.image_size,
            "batch_size": args.batch_size,
            "lr": lr,
            "mean": list(pre.mean),
            "std": list(pre.std),
            "num_classes": num_classes,
            "reader_pool_type": args.reader_pool,
        }
        distributor = TorchDistributor(
            num_processes=args.num_processes, local_mode=True, use_gpu=False
        )
        t0 = time.perf_counter()
        out = distributor.run(train_and_evaluate, converter_train, converter_val, settings)
        train_s = time.perf_counter() - t0
        if not isinstance(out, dict):
            raise RuntimeError(f"TorchDistributor returned {out!r}, not the result dict")
        train_rows, val_rows = len(converter_train), len(converter_val)
    finally:
        for converter in converters:
            converter.delete()
        shutil.rmtree(cache_dir, ignore_errors=True)
    wall_s = time.perf_counter() - wall_t0
    spark.stop()

    results: dict[str, Any] = {
        "wall_seconds": round(wall_s, 1),
        "convert_seconds": round(convert_s, 1),
        "train_seconds": round(train_s, 1),
        "val_accuracy": round(out["val_accuracy"], 4),
        "val_loss": round(out["val_loss"], 4),
        "val_rows": val_rows,
        "val_rows_evaluated": out["val_rows_evaluated"],
        "train_rows": train_rows,
        "train_rows_seen": out["train_rows_seen"],
        "epochs": args.epochs,
        "image_size": args.image_size,
        "per_device_batch_size": args.batch_size,
        "num_processes": args.num_processes,
        "epoch_seconds": out["epoch_seconds"],
        "steps_per_epoch": out["steps_per_epoch"],
        "val_steps": out["val_steps"],
        "learning_rate": lr,
        "reader_pool_type": args.reader_pool,
        "split": "val-paths" if listed is not None else f"randomSplit seed {args.seed}",
        "val_paths_listed": listed,
        "photos": str(photos),
        "limit_per_label": args.limit,
        "allocator_env": {k: os.environ.get(k) for k in ALLOCATOR_VARS},
    }
    text = json.dumps(results, indent=2)
    print(text)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
