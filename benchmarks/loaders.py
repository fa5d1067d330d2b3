"""Loader throughput: Petastorm and Mosaic Streaming against a plain pyarrow loop, same run.

Ingests the photos into ``<output-dir>`` (a second run on the same photos and settings
writes nothing), then for the train split measures, on ``--world-size`` real
TorchDistributor processes (local mode, gloo, CPU):

- ``plain``: the baseline. Each rank reads its share of the train Delta table's current
  Parquet files with pyarrow only (row group ``i`` of all files, in file order, goes to rank
  ``i % world_size``), decodes every image with the very same
  :meth:`flowers_job.vision.decode_transform.DecodeTransform.decode` (the TRAIN transform: decode,
  RandomResizedCrop, flip; uint8 as the loaders deliver it) and stacks each batch with ``torch.stack``. The same
  work minus the loader library (and minus its shuffling: the plain loop reads in file order).
- every loader of :data:`flowers_job.loaders.LOADERS` that runs on this stack
  (:func:`~flowers_job.loaders.loader_problem`; the others are skipped with the reason):
  the train split prepared exactly as training prepares it
  (:func:`flowers_job.driver.prepare.prepare_data`, timed), then read for ``--epochs`` epochs
  with :func:`flowers_job.train.shard_read.read_shards` (the training loader boundary,
  ``shuffle=True``, no model).

For each: rows per epoch (summed over the ranks; checked to be every train row exactly
once), the shuffle's quality (:func:`same_label_next`, against a uniform shuffle's), rows/s per epoch (rows / the slowest rank's seconds for that epoch) and their mean,
the ratio to the plain loop's mean rows/s, and each rank's peak RSS. Prints a table and
writes the numbers, with the machine's facts, to ``<output-dir>/loaders.json``. Run from the
repository root:

    .venv/bin/python benchmarks/loaders.py --images ../shared/data/flower_photos \\
        --output-dir /tmp/bench-loaders

``--store s3`` puts the tables and the loader caches in a bucket of a moto S3 server on
this machine (``s3a://``; the ranks read it over HTTP on loopback), the photos and the JSON
staying on the disk.

Exit status: 0 when every reader read every train row exactly once per epoch, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import itertools
import json
import os
import platform
import resource
import shlex
import sys
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PHOTOS = Path(os.environ.get("FLOWERS_PHOTOS", REPO.parent / "shared/data/flower_photos"))
MIB = 2**20
COLUMNS = ["row_id", "image", "label_index"]
VERSIONED = (
    "pyarrow",
    "petastorm",
    "mosaicml-streaming",
    "deltalake",
    "torch",
    "torchvision",
    "pillow",
    "numpy",
    "pyspark",
    "delta-spark",
)


def _local_path(url: str) -> str:
    """A ``file:`` URI (as Spark's ``inputFiles`` gives) or a plain path -> a local path."""
    parsed = urlparse(url)
    return unquote(parsed.path) if parsed.scheme in ("file", "") else url


def _open(url: str) -> Any:
    """A local path or an ``s3a://`` URL opened for reading (``pyarrow.NativeFile``)."""
    from flowers_job.location import filesystem

    fs, path = filesystem(url)
    return fs.open_input_file(path)


def _vm_hwm_bytes() -> int:
    """This process's own peak RSS (``VmHWM``, reset at exec, unlike ``ru_maxrss``), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    return 0


def read_plain(job: dict[str, Any]) -> dict[str, Any]:
    """The baseline, as a TorchDistributor training function: pyarrow + decode, no loader.

    Rank ``r`` of ``w`` reads the row groups ``i % w == r`` (numbered across ``job["files"]``
    in order) with ``ParquetFile.iter_batches(columns=COLUMNS, batch_size=job["batch"])``,
    decodes each image with ``DecodeTransform(...).decode`` and stacks the batch with
    ``torch.stack``.

    Args:
        job: ``files`` (the train table's Parquet files), ``epochs`` (how many), ``batch``
            (rows per batch), ``image_size``, ``resize_size`` and
            ``timeout_seconds`` (process-group timeout, seconds).

    Returns:
        The same keys as :func:`flowers_job.train.shard_read.read_shards` (``row_ids``,
        ``padding``, ``steps``, ``seconds``, ``rows_read``: ``[rank][epoch_index]``;
        ``peak_rss_bytes``: ``[rank]``, ``ru_maxrss`` in bytes) plus ``threads``: ``[rank]``
        torch intra-op threads and ``vm_hwm_bytes``: ``[rank]`` ``VmHWM``, bytes; identical
        on every rank.
    """
    import pyarrow.parquet as pq
    import torch
    import torch.distributed as dist

    from flowers_job.runtime.process_group import (
        broadcast_object,
        init_distributed,
        shutdown_distributed,
    )
    from flowers_job.vision.decode_transform import DecodeTransform

    ctx = init_distributed(use_gpu=False, timeout_seconds=float(job["timeout_seconds"]))
    try:
        tf = DecodeTransform(
            True,
            int(job["image_size"]),
            int(job["resize_size"]),
        ).warm_up()  # as read_shards does: no reader's first epoch pays for torchvision
        pieces = []
        for path in job["files"]:
            with _open(path) as source:
                groups = pq.ParquetFile(source).metadata.num_row_groups
            pieces += [(path, group) for group in range(groups)]
        mine: dict[str, list[int]] = {}
        for i, (path, group) in enumerate(pieces):
            if i % ctx.world_size == ctx.rank:
                mine.setdefault(path, []).append(group)
        out: dict[str, list[Any]] = {
            "row_ids": [],
            "padding": [],
            "steps": [],
            "seconds": [],
            "rows_read": [],
        }
        for _ in range(int(job["epochs"])):
            t0 = time.perf_counter()
            ids: list[int] = []
            steps = 0
            for path, groups in mine.items():
                with _open(path) as source:
                    for rb in pq.ParquetFile(source).iter_batches(
                        batch_size=int(job["batch"]), row_groups=groups, columns=COLUMNS
                    ):
                        images = rb.column("image").to_pylist()
                        image = torch.stack([tf.decode(b) for b in images])
                        label = torch.tensor(rb.column("label_index").to_pylist())
                        row_id = torch.tensor(rb.column("row_id").to_pylist())
                        assert len(image) == len(label) == len(row_id)
                        ids.extend(row_id.tolist())
                        steps += 1
            out["seconds"].append(time.perf_counter() - t0)
            out["row_ids"].append(ids)
            out["padding"].append(0)
            out["steps"].append(steps)
            out["rows_read"].append(len(ids))
        mine_all: dict[str, Any] = {
            **out,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "threads": torch.get_num_threads(),
            "vm_hwm_bytes": _vm_hwm_bytes(),
        }
        gathered: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine_all)
        result = {key: [g[key] for g in gathered] for key in mine_all}
        return dict(broadcast_object(result, ctx))
    finally:
        shutdown_distributed()


def same_label_next(result: dict[str, Any], labels: dict[int, int]) -> float:
    """The shuffle's quality: the share of consecutive rows of a rank's epoch (padding left
    out) whose labels are equal, over every rank and epoch. A uniform shuffle gives
    ``sum(p_k ** 2)`` over the label shares ``p_k`` (:func:`uniform_same_label`); rows read
    in stored order, grouped by label, give nearly 1."""
    same = pairs = 0
    for rank_epochs in result["row_ids"]:
        for ids in rank_epochs:
            seq = [labels[i] for i in ids]
            pairs += max(0, len(seq) - 1)
            same += sum(a == b for a, b in itertools.pairwise(seq))
    return round(same / pairs, 3) if pairs else 0.0


def uniform_same_label(labels: dict[int, int]) -> float:
    """``sum(p_k ** 2)``: :func:`same_label_next` of a uniform shuffle of these rows."""
    counts: dict[int, int] = {}
    for label in labels.values():
        counts[label] = counts.get(label, 0) + 1
    n = len(labels)
    return round(sum((c / n) ** 2 for c in counts.values()), 3)


def summarize(
    result: dict[str, Any], expected_ids: list[int], epochs: int, wall_s: float
) -> dict[str, Any]:
    """Per-reader numbers from a ``read_shards``/``read_plain`` result.

    Returns:
        ``rows_per_epoch`` (valid rows summed over ranks), ``padding_per_epoch`` (rows),
        ``rows_ok`` (every expected row exactly once in every epoch), ``epoch_seconds``
        (slowest rank, seconds), ``rows_per_s`` (per epoch, rows/s), ``mean_rows_per_s``
        (mean of the epochs' rows/s), ``rank_epoch_seconds`` (``[rank][epoch]``, seconds),
        ``steps`` (``[rank][epoch]``), ``peak_rss_mib`` (per rank, MiB) and
        ``distributor_wall_seconds`` (the whole ``TorchDistributor.run``, process start
        included, seconds).
    """
    ranks = len(result["row_ids"])
    want = sorted(expected_ids)
    rows, padding, ok, slowest = [], [], True, []
    for e in range(epochs):
        ids = [i for r in range(ranks) for i in result["row_ids"][r][e]]
        rows.append(len(ids))
        padding.append(sum(int(result["padding"][r][e]) for r in range(ranks)))
        ok = ok and sorted(ids) == want
        slowest.append(max(float(result["seconds"][r][e]) for r in range(ranks)))
    rates = [n / s for n, s in zip(rows, slowest, strict=True)]
    return {
        "rows_per_epoch": rows,
        "padding_per_epoch": padding,
        "rows_ok": ok,
        "epoch_seconds": [round(s, 2) for s in slowest],
        "rows_per_s": [round(x, 1) for x in rates],
        "mean_rows_per_s": round(sum(rates) / len(rates), 1),
        "rank_epoch_seconds": [[round(float(s), 2) for s in r] for r in result["seconds"]],
        "steps": result["steps"],
        "peak_rss_mib": [round(int(b) / MIB) for b in result["peak_rss_bytes"]],
        "distributor_wall_seconds": round(wall_s, 1),
    }


def machine_facts() -> dict[str, Any]:
    """nproc, memory (GiB), load averages, date and the versions of the reading stack."""
    import psutil

    versions: dict[str, str | None] = {}
    for dist_name in VERSIONED:
        try:
            versions[dist_name] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            versions[dist_name] = None
    return {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
    }


def format_table(readers: dict[str, dict[str, Any]], epochs: int) -> str:
    """The results as a Markdown table (rows/s, seconds, MiB)."""
    head = ["reader", "prepare s", "rows/epoch"]
    head += [f"rows/s e{e + 1}" for e in range(epochs)]
    head += ["rows/s mean", "vs plain", "same label next", "peak RSS/rank MiB", "ok"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in readers.items():
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} |")
            continue
        prep = r.get("prepare_seconds")
        pad = sum(r["padding_per_epoch"])
        rows = "/".join(str(n) for n in sorted(set(r["rows_per_epoch"])))
        cells = [
            name,
            "-" if prep is None else f"{prep:.1f}",
            rows + (f" (+{r['padding_per_epoch'][0]} pad)" if pad else ""),
        ]
        cells += [f"{x:.1f}" for x in r["rows_per_s"]]
        cells += [
            f"{r['mean_rows_per_s']:.1f}",
            f"{r['vs_plain']:.2f}x",
            f"{r['same_label_next']:.3f}",
            ", ".join(str(m) for m in r["peak_rss_mib"]),
            "yes" if r["rows_ok"] else "NO",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@contextlib.contextmanager
def output_location(store: str, output_dir: Path) -> Iterator[str]:
    """Where the tables (and the loader caches) go: ``output_dir`` itself (``disk``), or
    ``s3a://<bucket>/out`` in a bucket of a moto S3 server started for the run (``s3``;
    stopped on the way out), with ``AWS_*`` and ``PYSPARK_SUBMIT_ARGS`` (hadoop-aws, the
    ``fs.s3a.*`` settings) set in this process's environment before Spark starts: its
    session, its Spark tasks, the ranks' delta-rs and pyarrow then reach the bucket."""
    if store == "disk":
        yield str(output_dir)
        return
    import boto3

    sys.path.insert(0, str(REPO / "tools"))
    from cluster import (
        S3_CREDENTIALS,
        S3_PACKAGES,
        ivy_dir,
        local_s3_server,
        resolve_packages,
        s3_env,
        s3a_conf,
    )

    resolve_packages(Path(sys.executable), S3_PACKAGES, ivy_dir(), 600.0)
    with local_s3_server(output_dir / "moto.log") as endpoint:
        env = s3_env(endpoint)
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=S3_CREDENTIALS[0],
            aws_secret_access_key=S3_CREDENTIALS[1],
            region_name=env["AWS_DEFAULT_REGION"],
        ).create_bucket(Bucket="bench-loaders")
        submit = ["--packages", ",".join(S3_PACKAGES)]
        for key, value in {"spark.jars.ivy": str(ivy_dir()), **s3a_conf(endpoint)}.items():
            submit += ["--conf", f"{key}={value}"]
        os.environ.update(env, PYSPARK_SUBMIT_ARGS=shlex.join([*submit, "pyspark-shell"]))
        print(f"S3 server {endpoint}: the tables in s3a://bench-loaders/out", flush=True)
        yield "s3a://bench-loaders/out"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (0: every reader read every row once)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=Path, default=DEFAULT_PHOTOS, help="photo folders")
    parser.add_argument(
        "--output-dir", type=Path, default=Path("/tmp/bench-loaders"), help="tables + JSON"
    )
    parser.add_argument("--world-size", type=int, default=2, help="TorchDistributor processes")
    parser.add_argument("--epochs", type=int, default=2, help="epochs read per reader")
    parser.add_argument("--image-size", type=int, default=224, help="data.image_size (px)")
    parser.add_argument("--batch", type=int, default=32, help="train.per_device_batch_size")
    parser.add_argument("--master", default="local[2]", help="Spark master")
    parser.add_argument("--timeout", type=float, default=900.0, help="process-group timeout, s")
    parser.add_argument(
        "--store",
        choices=("disk", "s3"),
        default="disk",
        help="where the tables and the loader caches are: disk (--output-dir) or s3 (a bucket "
        "of a moto S3 server started for the run; loaders.json stays in --output-dir)",
    )
    args = parser.parse_args(argv)
    out = args.output_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    with output_location(args.store, out) as tables:
        return _run(args, out, tables)


def _run(args: argparse.Namespace, out: Path, tables: str) -> int:
    """The benchmark with its tables (and the loader caches) under ``tables``."""

    from pyspark.ml.torch.distributor import TorchDistributor

    from flowers_job.cluster.session import get_spark
    from flowers_job.config import load_config
    from flowers_job.driver.prepare import prepare_data
    from flowers_job.ingest.job import ingest
    from flowers_job.loaders import LOADERS, loader_problem, resolve_loader
    from flowers_job.train.shard_read import read_shards

    facts = machine_facts()
    base = [f"data.image_size={args.image_size}"]
    if args.store == "s3":  # the job's default MLflow store may not sit in an object store
        base.append(f"tracking.tracking_uri=sqlite:///{out / 'mlflow.db'}")
    flags = {"data.images": args.images.resolve(), "paths.output_dir": tables}
    cfg = load_config(None, base, **flags)
    spark = get_spark("bench_loaders", master=args.master)
    t0 = time.perf_counter()
    report = ingest(spark, cfg)
    ingest_s = time.perf_counter() - t0
    print(
        f"ingest: {report.train_rows} train / {report.val_rows} val rows "
        f"({'written' if report.written else 'unchanged, nothing written'}) in {ingest_s:.0f} s",
        flush=True,
    )
    train = spark.read.format("delta").load(str(cfg.paths.table("images"))).where("split = 'train'")
    # the train split's files: its partition folder of the images table
    files = sorted(_local_path(f) for f in train.inputFiles() if "/split=train/" in f)
    labels = {
        int(r["row_id"]): int(r["label_index"])
        for r in train.select("row_id", "label_index").collect()
    }
    expected = sorted(labels)
    common = {
        "image_size": cfg.data.image_size,
        "resize_size": cfg.data.stored_short_side,
        "timeout_seconds": args.timeout,
    }
    dist = TorchDistributor(num_processes=args.world_size, local_mode=True, use_gpu=False)
    readers: dict[str, dict[str, Any]] = {}

    print(f"plain: {len(files)} Parquet files, {len(expected)} rows", flush=True)
    t0 = time.perf_counter()
    plain = dist.run(
        read_plain, {**common, "files": files, "epochs": args.epochs, "batch": args.batch}
    )
    assert isinstance(plain, dict)
    readers["plain"] = summarize(plain, expected, args.epochs, time.perf_counter() - t0)
    readers["plain"]["same_label_next"] = same_label_next(plain, labels)
    readers["plain"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    readers["plain"]["files"] = len(files)
    readers["plain"]["torch_threads"] = plain["threads"]
    readers["plain"]["vm_hwm_mib"] = [round(int(b) / MIB) for b in plain["vm_hwm_bytes"]]

    for name in LOADERS:
        problem = loader_problem(name)
        if problem is not None:
            print(f"{name}: skipped: {problem}", flush=True)
            readers[name] = {"skipped": problem}
            continue
        lcfg = load_config(
            None,
            [
                *base,
                f"data.loader={name}",
                f"distributed.num_processes={args.world_size}",
                f"train.per_device_batch_size={args.batch}",
            ],
            **flags,
        )
        print(f"{name}: preparing the cache", flush=True)
        t0 = time.perf_counter()
        lcfg, loader = resolve_loader(lcfg)
        with prepare_data(spark, lcfg, loader) as data:
            prepare_s = time.perf_counter() - t0
            plan = data.train
            job = {
                **common,
                "plan": plan.to_dict(),
                "loader": loader,
                "epochs": list(range(1, args.epochs + 1)),
                "shuffle": True,
                "seed": lcfg.train.seed,
                "config": lcfg.model_dump(mode="json"),
            }
            print(f"{name}: reading ({plan.steps_per_epoch} steps per epoch)", flush=True)
            t0 = time.perf_counter()
            result = dist.run(read_shards, job)
            assert isinstance(result, dict)
            readers[name] = summarize(result, expected, args.epochs, time.perf_counter() - t0)
            readers[name]["same_label_next"] = same_label_next(result, labels)
        readers[name]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        readers[name]["prepare_seconds"] = round(prepare_s, 1)
        readers[name]["steps_per_epoch"] = plan.steps_per_epoch
        readers[name]["rows_per_shard"] = plan.rows_per_shard
    spark.stop()

    base_rate = readers["plain"]["mean_rows_per_s"]
    for r in readers.values():
        if "skipped" not in r:
            r["vs_plain"] = round(r["mean_rows_per_s"] / base_rate, 2)
    facts["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    table = format_table(readers, args.epochs)
    results = {
        "settings": {
            "images": str(args.images),
            "world_size": args.world_size,
            "epochs": args.epochs,
            "image_size": args.image_size,
            "batch": args.batch,
            "master": args.master,
            "store": args.store,
            "transform": "train (decode, RandomResizedCrop, flip; uint8, as the loaders deliver it)",
        },
        "ingest": {"seconds": round(ingest_s, 1), **report.to_dict()},
        "train_rows": len(expected),
        "uniform_same_label_next": uniform_same_label(labels),
        "machine": facts,
        "readers": readers,
        "table": table,
    }
    (out / "loaders.json").write_text(json.dumps(results, indent=2) + "\n")
    print(
        f"\n{len(expected)} train rows, {args.world_size} processes, batch {args.batch}, "
        f"{args.image_size} px, {args.epochs} epochs; {facts['nproc']} cores, load "
        f"{facts['loadavg_at_start']} -> {facts['loadavg_at_end']}; {facts['date']}\n"
    )
    print(table)
    print(f"\nsame label next, a uniform shuffle: {uniform_same_label(labels):.3f}")
    print(f"\nJSON: {out / 'loaders.json'}")
    ok = all(r["rows_ok"] for r in readers.values() if "skipped" not in r)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
