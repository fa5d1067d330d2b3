"""Batch scoring against the model's speed: ``flowers-job predict`` beside the training job's
test pass, on the same rows and cores, in one run.

On a fresh output directory it ingests the photos (``flowers_job.ingest.job.ingest``,
in-process, default settings; ingest's own log line gives its decode rate: listing done, the
decode job's files / seconds) and registers a model of the job's architecture without
training (``tests/support/model_registry.py``: EfficientNet-Lite0 with its offline weights and a
seeded new head; any model of the architecture scores at the same speed). Then, one after
the other:

1. ``test pass`` (before): the training job's test pass on every row of the stored
   ``images`` table, as the ranks run it: ``--world-size`` processes (spawned, glibc tuned as
   the ranks are, ``cores // world_size`` torch threads each), each reading its share of the
   table's Parquet files' rows (row ``i`` to rank ``i % world_size``) with pyarrow, decoding
   them with the loaders' own ``DecodeTransform(train=False)`` in batches of
   ``--batch`` rows, and scoring them with :func:`flowers_job.train.evaluate.score_shard`
   (the test pass's function: ``DeviceNormalize``, the model, the loss and the per-row
   predictions). The model is loaded before the clock starts, as in training;
   images/s = rows of all ranks / the slowest rank's seconds.
2. ``predict --table``: ``flowers-job predict --table <output>/tables/images`` in a
   subprocess, as a user runs it (default model from ``summary.json``); its report's
   ``images_per_second`` (the scoring job: Python workers started, model loaded, scored,
   Delta write) and the command's wall time.
3. ``predict --images``: the same over the original photos (listing, decode as ingest,
   scoring, write), next to ingest's decode rate.
4. ``test pass`` (after) again: the mean of the two brackets the predict runs, so a drift of
   the machine shows as a difference between them.

The ratio reported is ``predict --table`` images/s / the test pass's mean images/s (the goal:
0.8 or more). Run from the repository root (about 4 minutes on 2 cores with all photos):

    .venv/bin/python benchmarks/predict_speed.py \\
        --report benchmarks/results/2026-11-24/predict_speed.json
    # quicker: --photos DIR with a sample; --work-dir DIR --keep to look at the tables
    # a larger batch: --repeat 4 --no-images (the table's rows 4 times, for both passes)
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))

from report import machine_facts, write_report  # noqa: E402

PHOTOS = REPO.parent / "shared" / "data" / "flower_photos"
PREDICT_SECONDS = 1800  # limit on one flowers-job predict command, seconds
TEST_PASS_SECONDS = 900  # limit on one test pass (all ranks), seconds


class _DecodeLog(logging.Handler):
    """Keeps ingest's ``decoded %d files in %.1f s`` record: (files, seconds)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.decoded: tuple[int, float] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("decoded %d files"):
            files, seconds = cast(tuple[int, float], record.args)
            self.decoded = (int(files), float(seconds))


def prepare(photos: Path, output_dir: Path, repeat: int = 1) -> dict[str, Any]:
    """Register a model and ingest ``photos`` into ``output_dir`` (fresh); the Spark session is
    stopped afterwards.

    Returns:
        ``summary`` (what ``predict`` reads from summary.json), ``ingest`` (its report),
        ``ingest_decode`` (files, seconds, files/s of ingest's decode job), ``files`` (the
        images table's current Parquet files) and ``model`` (its ``model_config``).
    """
    from flowers_job.cluster.session import get_spark
    from flowers_job.config import load_config
    from flowers_job.ingest.job import ingest
    from tests.support.model_registry import register_model

    shutil.rmtree(output_dir, ignore_errors=True)
    output_dir.mkdir(parents=True)
    first_label = sorted(p for p in photos.iterdir() if p.is_dir())[0]
    example = sorted(first_label.glob("*.jpg"))[0]
    summary = register_model(output_dir, [example.read_bytes()], seed=0)
    (output_dir / "summary.json").write_text(json.dumps(summary))
    cfg = load_config(None, [], **{"paths.output_dir": output_dir, "data.images": photos})
    handler = _DecodeLog()
    logger = logging.getLogger("flowers_job.ingest")  # ingest.job and ingest.write
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    spark = get_spark("predict_speed")
    try:
        report = ingest(spark, cfg)
        table = spark.read.format("delta").load(str(cfg.paths.table("images")))
        if repeat > 1:
            table = _repeated(spark, table, repeat, output_dir / "repeated")
        files = sorted(table.inputFiles())
        rows = table.count()
    finally:
        logger.removeHandler(handler)
        spark.stop()
    assert handler.decoded is not None, "ingest logged no decode time"
    files_n, seconds = handler.decoded
    from flowers_job.serving.pyfunc_model import model_config

    return {
        "summary": summary,
        "ingest": report.to_dict(),
        "ingest_decode": {
            "files": files_n,
            "seconds": round(seconds, 2),
            "images_per_second": round(files_n / seconds, 1),
        },
        "files": [f.removeprefix("file://") for f in files],
        "table": str(output_dir / "repeated") if repeat > 1 else str(cfg.paths.table("images")),
        "rows": rows,
        "model": model_config(cfg, report.label_names),
    }


def _repeated(spark: Any, table: Any, repeat: int, path: Path) -> Any:
    """``table``'s rows ``repeat`` times, as a new Delta table at ``path`` (copy ``k`` gets
    ``row_id + k * 2**40`` and ``relative_path`` suffixed ``#k``): a batch of realistic size
    from the real photos, for both passes. Returns the table read back."""
    from pyspark.sql import functions as F

    copies = [
        table.withColumn("row_id", F.col("row_id") + F.lit(k * 2**40)).withColumn(
            "relative_path", F.concat(F.col("relative_path"), F.lit(f"#{k}"))
        )
        for k in range(repeat)
    ]
    out = copies[0]
    for c in copies[1:]:
        out = out.unionByName(c)
    out.write.format("delta").partitionBy("split").save(str(path))
    return spark.read.format("delta").load(str(path))


def _rank_pass(
    rank: int,
    world_size: int,
    threads: int,
    batch: int,
    files: list[str],
    model_uri: str,
    tracking_uri: str,
    conf: dict[str, Any],
    barrier: Any,
    results: Any,
) -> None:
    """One rank of the test pass (module level: spawned processes import it)."""
    import mlflow
    import pyarrow.parquet as pq
    import torch
    from torch import nn

    from flowers_job.runtime.allocator import tune_this_process
    from flowers_job.train.evaluate import score_shard
    from flowers_job.vision.decode_transform import DecodeTransform
    from flowers_job.vision.precision import DeviceNormalize

    tune_this_process()
    torch.set_num_threads(threads)
    mlflow.set_tracking_uri(tracking_uri)
    model = mlflow.pyfunc.load_model(model_uri).unwrap_python_model().model
    normalize = DeviceNormalize(tuple(conf["mean"]), tuple(conf["std"]), torch.device("cpu"))
    criterion = nn.CrossEntropyLoss(reduction="none")
    decode = DecodeTransform(False, int(conf["image_size"]), int(conf["resize_size"])).warm_up()
    barrier.wait(TEST_PASS_SECONDS)
    t0 = time.perf_counter()
    rows = 0

    def batches() -> Any:
        nonlocal rows
        i = 0
        pending: list[tuple[bytes, int, int]] = []
        for path in files:
            for record in pq.ParquetFile(path).iter_batches(
                batch_size=512, columns=["image", "label_index", "row_id"]
            ):
                for image, label, row_id in zip(
                    *(record.column(c).to_pylist() for c in ("image", "label_index", "row_id")),
                    strict=True,
                ):
                    if i % world_size == rank:
                        pending.append((image, label, row_id))
                    i += 1
                    if len(pending) == batch:
                        yield _batch(pending, decode)
                        rows += len(pending)
                        pending = []
        if pending:
            yield _batch(pending, decode)
            rows += len(pending)

    scores = score_shard(model, batches(), criterion, normalize, None)
    results.put((rank, rows, time.perf_counter() - t0, float(scores.sums.loss_sum)))


def _batch(pending: list[tuple[bytes, int, int]], decode: Any) -> dict[str, Any]:
    import torch

    return {
        "image": torch.stack([decode.decode(p[0]) for p in pending]),
        "label_index": torch.tensor([p[1] for p in pending], dtype=torch.int64),
        "valid": torch.ones(len(pending), dtype=torch.bool),
        "row_id": torch.tensor([p[2] for p in pending], dtype=torch.int64),
    }


def test_pass(prep: dict[str, Any], world_size: int, threads: int, batch: int) -> dict[str, Any]:
    """The test pass over every row of ``files`` (see the module docstring): images/s."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(world_size)
    results = ctx.Queue()
    summary = prep["summary"]
    uri = f"models:/{summary['registered_model_name']}/{summary['registered_model_version']}"
    procs = [
        ctx.Process(
            target=_rank_pass,
            args=(
                r,
                world_size,
                threads,
                batch,
                prep["files"],
                uri,
                summary["mlflow_tracking_uri"],
            ),
            kwargs={"conf": prep["model"], "barrier": barrier, "results": results},
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=TEST_PASS_SECONDS) for _ in procs]
    for p in procs:
        p.join(TEST_PASS_SECONDS)
        if p.exitcode != 0:
            raise RuntimeError(f"a test-pass rank exited with {p.exitcode}")
    rows = sum(g[1] for g in got)
    seconds = max(g[2] for g in got)
    return {
        "rows": rows,
        "seconds": round(seconds, 2),
        "images_per_second": round(rows / seconds, 1),
        "rank_seconds": [round(g[2], 2) for g in sorted(got)],
        "loadavg_after": round(os.getloadavg()[0], 2),
    }


def run_predict(output_dir: Path, source: list[str], table: Path) -> dict[str, Any]:
    """``flowers-job predict --output-dir OUTPUT_DIR SOURCE --output-table TABLE`` in a
    subprocess that imports this checkout; its report's scoring rate and the wall time.

    Raises:
        RuntimeError: the command failed (its stderr's tail attached).
    """
    shutil.rmtree(table, ignore_errors=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    t0 = time.perf_counter()
    done = subprocess.run(
        [
            *(sys.executable, "-m", "flowers_job", "predict", "--output-dir", str(output_dir)),
            *(*source, "--output-table", str(table)),
        ],
        capture_output=True,
        text=True,
        timeout=PREDICT_SECONDS,
        check=False,
        env=env,
    )
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"flowers-job predict failed ({done.returncode}): {done.stderr[-3000:]}")
    report = json.loads(done.stdout)
    return {
        "input_rows": report["input_rows"],
        "output_rows": report["output_rows"],
        "reason_counts": report["reason_counts"],
        "label_counts": report["label_counts"],
        "scoring_seconds": round(report["seconds"], 2),
        "images_per_second": round(report["images_per_second"], 1),
        "command_wall_seconds": round(wall, 1),
        "loadavg_after": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--photos", type=Path, default=PHOTOS, help="images root (<label>/<file>)")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temp dir")
    parser.add_argument("--keep", action="store_true", help="keep --work-dir's tables")
    parser.add_argument("--world-size", type=int, default=2, help="test-pass ranks (the job's 2)")
    parser.add_argument("--batch", type=int, default=32, help="per_device_batch_size")
    parser.add_argument("--report", type=Path, default=None, help="write the JSON here too")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="score the images table's rows this many times (a Delta table of copies): a "
        "batch large enough that predict's fixed costs (Spark's Python workers, the model's "
        "load in each) weigh as they do on a real batch",
    )
    parser.add_argument(
        "--no-images", action="store_true", help="skip predict --images (the originals)"
    )
    args = parser.parse_args(argv)

    facts = machine_facts("torch", "pyspark", "mlflow")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-predict-"))
    out = work / "out"
    try:
        prep = prepare(args.photos.resolve(), out, args.repeat)
        threads = max(1, facts["nproc"] // args.world_size)
        runs: dict[str, Any] = {}
        runs["test_pass_before"] = test_pass(prep, args.world_size, threads, args.batch)
        runs["predict_table"] = run_predict(out, ["--table", prep["table"]], work / "pred_table")
        if not args.no_images:
            runs["predict_images"] = run_predict(
                out, ["--images", str(args.photos.resolve())], work / "pred_images"
            )
        runs["test_pass_after"] = test_pass(prep, args.world_size, threads, args.batch)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    test_ips = (
        runs["test_pass_before"]["images_per_second"] + runs["test_pass_after"]["images_per_second"]
    ) / 2
    decode_ips = prep["ingest_decode"]["images_per_second"]
    report = {
        "benchmark": "predict_speed",
        **facts,
        "photos": str(args.photos),
        "world_size": args.world_size,
        "threads_per_rank": threads,
        "batch": args.batch,
        "repeat": args.repeat,
        "rows": prep["rows"],
        "ingest_decode": prep["ingest_decode"],
        **runs,
        "test_pass_images_per_second": round(test_ips, 1),
        "ratio_predict_table_vs_test_pass": round(
            runs["predict_table"]["images_per_second"] / test_ips, 3
        ),
    }
    if "predict_images" in runs:
        ips = runs["predict_images"]["images_per_second"]
        report["ratio_predict_images_vs_test_pass"] = round(ips / test_ips, 3)
        report["ratio_predict_images_vs_ingest_decode"] = round(ips / decode_ips, 3)
    write_report(report, args.report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
