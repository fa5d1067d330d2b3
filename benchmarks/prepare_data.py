"""The driver's preparation of a train on tables that exist: what
:func:`flowers_job.driver.prepare.prepare_data` costs, apart from Spark's start and the ranks'.

On the output dir of an ingest (``flowers-job ingest``, or a run of ``scale.py --keep``:
``<work>/run-x<N>/out``), one ``local[2]`` session calls ``prepare_data`` ``--repeat`` times
with the loader of ``--set data.loader=...`` (default ``delta``), and records for each call:

- ``seconds``: the whole call (the tables' check, each split's plan or loader cache, the
  model's input example and the lineage), wall seconds;
- ``check_seconds``: the tables' check alone
  (:func:`flowers_job.tables.delta_tables.checked_tables`), timed once more after the call;
- ``loader_cache``: each split's record (``seconds``, ``bytes_written``, ``reused``): for a
  loader that reads the table, the plan from the Delta log; for one with a cache, the cache.

The first call runs on a cold JVM; the later ones are what a long-lived driver (a notebook,
Spark Connect) sees. Writes ``--results`` (JSON) and prints one line per call::

    python benchmarks/prepare_data.py --output-dir /var/tmp/flowers-scale/run-x100/out \\
        --images /var/tmp/flowers-scale/run-x100/images --repeat 3
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import machine_facts, write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, required=True, help="the job's tables")
    parser.add_argument("--images", type=Path, required=True, help="the photos they hold")
    parser.add_argument("--repeat", type=int, default=3, help="calls of prepare_data")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--results", type=Path, default=None, help="the JSON record")
    args = parser.parse_args(argv)

    from flowers_job.cluster.session import get_spark
    from flowers_job.config import load_config
    from flowers_job.driver.prepare import prepare_data
    from flowers_job.loaders import resolve_loader
    from flowers_job.tables.delta_tables import checked_tables
    from flowers_job.tables.table_ref import table_ref

    facts = machine_facts("pyspark", "delta-spark", "deltalake")
    sets = ["data.loader=delta", "embeddings.enabled=false", *args.set]
    flags = {"data.images": args.images.resolve(), "paths.output_dir": args.output_dir}
    cfg, loader = resolve_loader(load_config(None, sets, **flags))
    t0 = time.perf_counter()
    spark = get_spark("bench_prepare_data", master="local[2]")
    start_s = time.perf_counter() - t0
    images = table_ref(cfg, "images")
    calls: list[dict[str, Any]] = []
    for i in range(args.repeat):
        t0 = time.perf_counter()
        with prepare_data(spark, cfg, loader) as data:
            seconds = time.perf_counter() - t0
            uses = data.loader_cache
        t0 = time.perf_counter()
        checked = checked_tables(spark, cfg)
        check_s = time.perf_counter() - t0
        calls.append(
            {
                "seconds": round(seconds, 3),
                "check_seconds": round(check_s, 3),
                "loader_cache": uses,
                "plans_seconds": round(sum(u["seconds"] for u in uses.values()), 3),
            }
        )
        print(
            f"call {i + 1}: {seconds:.2f} s (the check {check_s:.2f} s, the plans "
            f"{calls[-1]['plans_seconds']:.3f} s), bytes written "
            f"{sum(u['bytes_written'] for u in uses.values())}",
            flush=True,
        )
    rows = dict(checked.split_rows)
    files = images.detail(spark)["numFiles"]
    spark.stop()
    write_report(
        {
            "benchmark": "prepare_data",
            "machine": facts,
            "loader": cfg.data.loader,
            "output_dir": str(args.output_dir),
            "images_version": checked.versions["images"],
            "split_rows": rows,
            "images_files": files,
            "spark_start_seconds": round(start_s, 1),
            "calls": calls,
        },
        args.results,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
