"""The allocator: the in-memory training loop under each allocator setting, side by side.

Runs :mod:`inmemory` (the job's model, 2 ranks of 1 thread, 224 px, batch 32, tensors
already in memory) under each setting of :data:`inmemory.ALLOCATORS` that can run here
(the jemalloc ones need ``libjemalloc2``), in turns, ``--repeats`` times, and reports the
median images/s, the ratio to the job's setting ('tuned'), and the ranks' CPU user and
system seconds and minor page faults (``getrusage`` of torchrun's children: start-up and
model build included). This is the measurement behind ``flowers_job/runtime/allocator.py``.

    .venv/bin/python benchmarks/allocators.py --report output/benchmarks/allocators.json

About 4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import inmemory
from report import write_report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--photos", type=Path, default=inmemory.DEFAULT_PHOTOS)
    p.add_argument("--count", type=int, default=256)
    p.add_argument("--steps", type=int, default=15, help="timed steps per rank")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--report", type=Path)
    args = p.parse_args(argv)

    from flowers_job.runtime.allocator import find_jemalloc

    kinds = [k for k in inmemory.ALLOCATORS if not k.startswith("jemalloc") or find_jemalloc()]
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        data = inmemory.decode_to_file(args.photos, args.count, 224, Path(tmp) / "data.pt")
        for _ in range(args.repeats):
            for kind in kinds:
                runs[kind].append(
                    inmemory.run(
                        data,
                        ranks=2,
                        threads=1,
                        steps=args.steps,
                        warmup=3,
                        batch_size=32,
                        allocator=kind,
                    )
                )
    rows = {
        kind: {
            "images_per_second": statistics.median(r["images_per_second"] for r in rs),
            "cpu_user_seconds": statistics.median(r["cpu_user_seconds"] for r in rs),
            "cpu_system_seconds": statistics.median(r["cpu_system_seconds"] for r in rs),
            "minor_faults": statistics.median(r["minor_faults"] for r in rs),
            "runs": rs,
        }
        for kind, rs in runs.items()
    }
    tuned = rows["tuned"]["images_per_second"]
    print("| allocator | images/s | vs tuned | CPU user s | CPU system s | minor faults |")
    print("|---|---|---|---|---|---|")
    for kind, row in rows.items():
        print(
            f"| {kind} | {row['images_per_second']:.1f} | "
            f"{row['images_per_second'] / tuned:.2f}x | {row['cpu_user_seconds']:.1f} | "
            f"{row['cpu_system_seconds']:.1f} | {row['minor_faults'] / 1e6:.2f} M |"
        )
    if len(kinds) < len(inmemory.ALLOCATORS):
        print("(jemalloc not installed: apt-get install libjemalloc2 to compare it)")
    report = {"date": time.strftime("%Y-%m-%d"), "allocators": rows}
    write_report(report, args.report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
