"""Ingest a 10x photo set with the driver capped at 1 GiB: wall time, peak memory, row counts.

Builds ``--factor`` copies of the real photos in a temporary folder, by hard links where the
file system allows it (copies otherwise; never symbolic links, which ingest would refuse or
follow), each under its own name ``r<copy>_<name>`` in its label folder. Then runs
:func:`flowers_job.data.ingest.ingest` in this process on a local SparkSession started with
``spark.driver.memory`` (default 1g: in local mode the driver JVM is also the executor) and
measures:

- ``ingest_seconds``: wall time of ``ingest`` (the session start is reported separately);
- ``jvm_peak_rss_mib``: ``VmHWM`` of the driver JVM (``/proc/<pid>/status``; the pid is the
  Py4J gateway's process, checked to be ``java`` with psutil);
- ``python_peak_rss_mib``: ``VmHWM`` of this driver Python process;
- ``workers_peak_rss_mib``: the largest sum of RSS of Spark's Python workers, sampled every
  0.5 s (they are not the driver, but they do the decoding);

and checks that ``images + quarantine == files on disk`` and that the report agrees.
Writes a JSON report (``--report``) and prints a summary. Run from the repository root:

    python benchmarks/ingest_scale.py --factor 10 --report output/benchmarks/ingest_scale.json

Exit status: 0 when the counts check out, 1 when they do not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PHOTOS = Path(os.environ.get("FLOWERS_PHOTOS", REPO.parent / "shared/data/flower_photos"))
MIB = 2**20


def build_photo_set(photos: Path, dest: Path, factor: int, per_label: int | None) -> int:
    """``factor`` copies of every photo of every label folder of ``photos``, hard-linked into
    ``dest/<label>/r<copy>_<name>``; returns the number of files made."""
    made = 0
    for label_dir in sorted(p for p in photos.iterdir() if p.is_dir()):
        out = dest / label_dir.name
        out.mkdir(parents=True)
        sources = sorted(p for p in label_dir.iterdir() if p.is_file())[:per_label]
        for copy in range(factor):
            for src in sources:
                target = out / f"r{copy:02d}_{src.name}"
                try:
                    os.link(src, target)
                except OSError:  # another file system, or links not allowed
                    shutil.copyfile(src, target)
                made += 1
    return made


def files_on_disk(root: Path) -> int:
    """Every file and link under ``root``, counted independently of ingest."""
    return sum(len(files) for _, _, files in os.walk(root))


def vm_hwm_mib(pid: int | str) -> float:
    """Peak resident set size (``VmHWM``) of a process, MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


def driver_jvm(spark: Any) -> psutil.Process:
    """The driver JVM of a local session: the Py4J gateway's process (``java``)."""
    proc = psutil.Process(spark.sparkContext._gateway.proc.pid)
    if proc.name() != "java":  # launched through a shell: take its java child
        proc = next(p for p in proc.children(recursive=True) if p.name() == "java")
    return proc


class WorkerSampler(threading.Thread):
    """Samples the summed RSS of the JVM's Python children (Spark's Python workers)."""

    def __init__(self, jvm: psutil.Process, every_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.jvm, self.every_s = jvm, every_s
        self.peak_bytes = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            total = 0
            for child in self.jvm.children(recursive=True):
                try:
                    if child.name().startswith("python"):
                        total += child.memory_info().rss
                except psutil.Error:
                    continue
            self.peak_bytes = max(self.peak_bytes, total)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--photos", type=Path, default=DEFAULT_PHOTOS, help="the real photos")
    parser.add_argument("--factor", type=int, default=10, help="copies of each photo")
    parser.add_argument("--per-label", type=int, default=None, help="photos per label (all)")
    parser.add_argument("--driver-memory", default="1g", help="spark.driver.memory")
    parser.add_argument("--master", default="local[*]", help="Spark master")
    parser.add_argument("--image-size", type=int, default=224, help="data.image_size")
    parser.add_argument("--workdir", type=Path, help="where to build the set (a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the set and the tables")
    parser.add_argument(
        "--report",
        type=Path,
        default=REPO / "output/benchmarks/ingest_scale.json",
        help="JSON report path",
    )
    args = parser.parse_args(argv)

    from flowers_job.config import load_config
    from flowers_job.data.ingest import ingest
    from flowers_job.spark import get_spark

    work = Path(tempfile.mkdtemp(prefix="ingest_scale_", dir=args.workdir))
    try:
        t0 = time.perf_counter()
        files = build_photo_set(args.photos, work / "images", args.factor, args.per_label)
        build_s = time.perf_counter() - t0
        print(f"built {files} files in {work / 'images'} in {build_s:.0f} s", flush=True)
        cfg = load_config(
            None,
            [f"data.image_size={args.image_size}"],
            **{"data.images": work / "images", "paths.output_dir": work / "out"},
        )
        t0 = time.perf_counter()
        spark = get_spark(
            "ingest_scale", master=args.master, conf={"spark.driver.memory": args.driver_memory}
        )
        session_s = time.perf_counter() - t0
        jvm = driver_jvm(spark)
        sampler = WorkerSampler(jvm)
        sampler.start()
        t0 = time.perf_counter()
        report = ingest(spark, cfg)
        ingest_s = time.perf_counter() - t0
        sampler.stop.set()
        sampler.join()
        on_disk = files_on_disk(work / "images")
        counts_ok = report.images_rows + report.quarantined_rows == report.files == on_disk
        result = {
            "files_on_disk": on_disk,
            "ingest_report": report.to_dict(),
            "counts_ok": counts_ok,
            "ingest_seconds": round(ingest_s, 1),
            "session_start_seconds": round(session_s, 1),
            "build_seconds": round(build_s, 1),
            "jvm_peak_rss_mib": round(vm_hwm_mib(jvm.pid), 1),
            "python_peak_rss_mib": round(vm_hwm_mib("self"), 1),
            "workers_peak_rss_mib": round(sampler.peak_bytes / MIB, 1),
            "spark": {
                key: spark.conf.get(key)
                for key in (
                    "spark.master",
                    "spark.driver.memory",
                    "spark.sql.execution.arrow.maxRecordsPerBatch",
                )
            },
            "settings": {
                "factor": args.factor,
                "per_label": args.per_label,
                "image_size": args.image_size,
            },
            "machine": {
                "cpus": os.cpu_count(),
                "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
                "python": platform.python_version(),
            },
        }
        spark.stop()
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"ingest of {on_disk} files: {report.images_rows} images + {report.quarantined_rows} "
        f"quarantined ({'ok' if counts_ok else 'MISMATCH'}) in {ingest_s:.0f} s; peak RSS: "
        f"driver JVM {result['jvm_peak_rss_mib']:.0f} MiB (spark.driver.memory="
        f"{args.driver_memory}), driver Python {result['python_peak_rss_mib']:.0f} MiB, "
        f"Python workers {result['workers_peak_rss_mib']:.0f} MiB; report: {args.report}"
    )
    return 0 if counts_ok else 1


if __name__ == "__main__":
    sys.exit(main())
