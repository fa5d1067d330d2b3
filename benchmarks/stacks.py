"""The default environment against the legacy Petastorm one: the same job, side by side.

    .venv/bin/python benchmarks/stacks.py --images ../shared/data/flower_photos \\
        --work /tmp/bench-stacks --report FILE [--seed 0] [--set KEY=VALUE ...]

Runs ``flowers-job run`` on the same photos and settings, one after the other, in each
environment as ``make run`` and ``make run LOADER=petastorm`` do: ``.venv`` (Spark 4.2, Mosaic
Streaming, TorchCodec) and ``.venv-petastorm`` (Spark 4.0, pyarrow 14, NumPy 1.26, Petastorm).
Each run ingests into its own output folder. Prints and writes each run's test accuracy,
images/s (training and validation, the summary's ``images_per_second``; training alone,
``train_images_per_second``: the mean over epochs of each epoch's training images / its
training seconds) and job seconds (from its ``summary.json``), the Python packages of each
environment, and the ratios of the default environment to the legacy one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import machine_facts, write_report

REPO = Path(__file__).resolve().parents[1]
RUNS = {
    "default": (REPO / ".venv", "streaming"),
    "petastorm": (REPO / ".venv-petastorm", "petastorm"),
}
"""Each run: its environment and its ``data.loader``."""
KEYS = ("test_accuracy", "val_accuracy", "images_per_second", "seconds_per_epoch", "job_seconds")
PACKAGES = ("pyspark", "delta-spark", "pyarrow", "numpy", "torch", "torchvision", "mlflow")


def _versions(venv: Path) -> dict[str, str]:
    code = (
        "import json, importlib.metadata as m; "
        f"print(json.dumps({{p: m.version(p) for p in {list(PACKAGES)!r}}}))"
    )
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return dict(json.loads(out.stdout))


def _run(name: str, images: Path, work: Path, seed: int, sets: list[str]) -> dict[str, Any]:
    venv, loader = RUNS[name]
    out = work / name
    argv = [
        str(venv / "bin" / "flowers-job"),
        "run",
        "--images",
        str(images),
        "--output-dir",
        str(out),
        "--set",
        f"data.loader={loader}",
        "--set",
        f"train.seed={seed}",
        *[x for s in sets for x in ("--set", s)],
    ]
    t0 = time.perf_counter()
    with (work / f"{name}.log").open("w") as log:
        subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=3600, check=True)
    wall = time.perf_counter() - t0
    summary = json.loads((out / "summary.json").read_text())
    train_rates = [h["train_images_per_second"] for h in summary["history"]]
    return {
        "loader": loader,
        "wall_seconds": round(wall, 1),
        **{k: summary[k] for k in KEYS},
        "train_images_per_second": round(sum(train_rates) / len(train_rates), 2),
        "versions": _versions(venv),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True, help="a folder for both runs")
    parser.add_argument("--report", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", dest="sets", action="append", default=[])
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    runs = {name: _run(name, args.images, args.work, args.seed, args.sets) for name in RUNS}
    new, old = runs["default"], runs["petastorm"]
    report = {
        "machine": machine_facts(),
        "seed": args.seed,
        "sets": args.sets,
        "runs": runs,
        "ratios_default_to_petastorm": {
            "images_per_second": round(new["images_per_second"] / old["images_per_second"], 3),
            "train_images_per_second": round(
                new["train_images_per_second"] / old["train_images_per_second"], 3
            ),
            "job_seconds": round(new["job_seconds"] / old["job_seconds"], 3),
            "test_accuracy_difference": round(new["test_accuracy"] - old["test_accuracy"], 4),
        },
    }
    write_report(report, args.report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
