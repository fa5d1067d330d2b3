"""The container image's cost: its build times, its size and what makes it large, and the
job's time in it against the same job outside it, side by side in one run.

    .venv/bin/python benchmarks/image_cost.py --work /var/tmp/bench-container \\
        --report benchmarks/results/<date>/<commit>/image_cost.json [--per-label 40] [--repeat 2]

Needs what tools/container.py needs (root, podman, mmdebstrap, runc). Measured, in order:

1. The Debian-made base (mmdebstrap, then ``podman import``), made again.
2. The image on it with no layer cache and a warm package cache (the uv cache of this
   machine, which ``make setup`` filled): what CI's first build costs.
3. The image again after a change to the project's code only (a line added to a module in
   a copy of the build context): the layers of Java and the locked stack are reused.
4. The image again with nothing changed (every layer reused).
5. Its size, per layer and per part: the CUDA libraries (``nvidia-*`` wheels), triton,
   torch's own CUDA libraries, the rest of torch, pyspark, Java, the jars; the CPU-only torch
   build (``download.pytorch.org/whl/cpu``) ships none of the CUDA parts, so their sum is what
   a ``-cpu`` tag would save (that index is not reachable here: the saving is measured on this
   image, not on a built second one). ``--sizes-only`` also measures their gzip size (what a
   registry stores and a node pulls), on the image already built.
6. ``flowers-job run`` on the same photo sample with the same settings, ``--repeat`` times
   each, alternating: in the image with ``--network none``, and in ``.venv`` outside it.
   Wall seconds of the whole command (container start included) and the job's own
   ``job_seconds`` and ``images_per_second`` from its summary.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from container import (
    REPO,
    build_image,
    check,
    image_size,
    make_base,
    run,
    run_args,
    unavailable_reason,
)
from report import machine_facts, write_report

sys.path.insert(0, str(REPO))
from tests.support import LABELS
from tests.support.data import sample_photos

TAG = "localhost/flowers-job:bench"
CONTEXT = ("requirements/lock.txt", "pyproject.toml", "README.md", "flowers_job", "jobs",
           "docker", ".dockerignore")  # fmt: skip
SITE = "/opt/venv/lib/python3.11/site-packages"
PARTS = {
    "nvidia_cuda_libraries": [f"{SITE}/nvidia"],
    "triton": [f"{SITE}/triton"],
    "torch_cuda_libraries": [f"{SITE}/torch/lib/libtorch_cuda*.so", f"{SITE}/torch/lib/*nvshmem*",
                             f"{SITE}/torch/lib/libc10_cuda.so"],
    "torch_all": [f"{SITE}/torch"],
    "pyspark": [f"{SITE}/pyspark"],
    "venv_all": ["/opt/venv"],
    "java": ["/usr/lib/jvm"],
    "ivy_jars": ["/opt/ivy"],
}  # fmt: skip
"""Parts of the image, as paths (shell globs) inside it; ``du`` counts a hard link once."""
CUDA_ONLY = ("nvidia_cuda_libraries", "triton", "torch_cuda_libraries")


def part_bytes(tag: str) -> dict[str, int]:
    """Bytes on disk of each of :data:`PARTS` in the image (``du -sbc``), and of the
    CUDA-only ones together (``cuda_only``)."""
    script = "; ".join(
        f"echo {name} $(du -sbc {' '.join(paths)} 2>/dev/null | tail -1 | cut -f1)"
        for name, paths in PARTS.items()
    )
    out = check(run_args(tag, ["-c", script], entrypoint="sh"), 300)
    parts = {line.split()[0]: int(line.split()[1]) for line in out.splitlines() if line.strip()}
    return {**parts, "cuda_only": sum(parts[k] for k in CUDA_ONLY)}


def compressed_bytes(tag: str) -> dict[str, int]:
    """gzip -1 bytes (what ``docker push`` sends, at its fastest level) of the whole image's
    file tree and of its CUDA-only parts, from ``podman image mount`` (root)."""
    root = check(["podman", "image", "mount", tag], 120).strip()
    try:
        out: dict[str, int] = {}
        trees = {"image": ["."], **{k: PARTS[k] for k in CUDA_ONLY}}
        for name, paths in trees.items():
            rel = " ".join(p.lstrip("/") for p in paths)
            script = f"cd {root} && tar -c --hard-dereference {rel} 2>/dev/null | gzip -1 | wc -c"
            out[name] = int(check(["sh", "-c", script], 1800).split()[0])
        out["cuda_only"] = sum(out[k] for k in CUDA_ONLY)
        return out
    finally:
        subprocess.run(["podman", "image", "unmount", tag], capture_output=True, check=False)


def layer_sizes(tag: str) -> list[dict[str, Any]]:
    out = check(["podman", "history", "--format", "json", tag], 60)
    rows = json.loads(out)
    return [
        {"bytes": int(r.get("size", 0)), "step": str(r.get("CreatedBy", ""))[:120]}
        for r in reversed(rows)
        if int(r.get("size", 0)) > 0
    ]


def changed_context(work: Path) -> Path:
    """A copy of the build context with one line added to the project's code."""
    ctx = work / "context"
    shutil.rmtree(ctx, ignore_errors=True)
    for name in CONTEXT:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, ctx / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (ctx / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, ctx / name)
    init = ctx / "flowers_job" / "__init__.py"
    init.write_text(init.read_text() + f"\n# changed for benchmarks/image_cost.py {time.time()}\n")
    return ctx


def job(
    where: str, tag: str, photos: Path, out: Path, sets: list[str], log: Path
) -> dict[str, Any]:
    """One ``flowers-job run``, in the image or in .venv; its wall and summary times."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shutil.chown(out, 1000, 1000)
    args = [a for s in sets for a in ("--set", s)]
    if where == "container":
        rc, text, wall = run(
            tag, ["run", "--images", "/data", "--output-dir", "/out", *args], timeout=1800,
            log=log, mounts={photos: "/data:ro", out: "/out"},
        )  # fmt: skip
    else:
        start = time.monotonic()
        with log.open("w") as f:
            rc = subprocess.run(
                [str(REPO / ".venv" / "bin" / "flowers-job"), "run", "--images", str(photos),
                 "--output-dir", str(out), *args],
                stdout=f, stderr=subprocess.STDOUT, timeout=1800, check=False, cwd=out,
            ).returncode  # fmt: skip
        wall, text = time.monotonic() - start, log.read_text()
    if rc != 0:
        raise RuntimeError(f"{where} run exited {rc}: {text[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "where": where,
        "wall_seconds": round(wall, 1),
        "job_seconds": round(summary["job_seconds"], 1),
        "train_seconds": round(summary.get("train_seconds", 0.0), 1),
        "images_per_second": round(summary["images_per_second"], 1),
        "test_accuracy": summary["test_accuracy"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/bench-container"))
    parser.add_argument("--report", type=Path)
    parser.add_argument("--per-label", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument(
        "--sizes-only", action="store_true", help="the size measures of the image already built"
    )
    parser.add_argument("--set", dest="sets", action="append", default=[
        "data.image_size=128", "train.per_device_batch_size=16", "train.epochs=3"])  # fmt: skip
    ns = parser.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        print(f"cannot: {reason}", file=sys.stderr)
        return 2
    ns.work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"machine": machine_facts(), "sets": ns.sets}
    if ns.sizes_only:
        report["image_bytes"] = image_size(TAG)
        report["parts_bytes"] = part_bytes(TAG)
        report["gzip_bytes"] = compressed_bytes(TAG)
        write_report(report, ns.report)
        return 0
    base, report["base_seconds"] = make_base(ns.work / "base", force=True)
    report["base_bytes"] = image_size(base)
    report["build_no_layer_cache_seconds"] = round(
        build_image(base, TAG, log=ns.work / "build-cold.log", no_cache=True), 1
    )
    report["build_after_code_change_seconds"] = round(
        build_image(base, TAG, log=ns.work / "build-code.log", context=changed_context(ns.work)), 1
    )
    report["build_nothing_changed_seconds"] = round(
        build_image(base, TAG, log=ns.work / "build-same.log", context=ns.work / "context"), 1
    )
    print(json.dumps({k: v for k, v in report.items() if k.endswith("seconds")}), flush=True)
    report["image_bytes"] = image_size(TAG)
    report["layers"] = layer_sizes(TAG)
    report["parts_bytes"] = part_bytes(TAG)
    report["cuda_only_share"] = round(report["parts_bytes"]["cuda_only"] / report["image_bytes"], 3)
    shutil.rmtree(ns.work / "photos", ignore_errors=True)
    photos = sample_photos(ns.work / "photos", ns.per_label)
    runs = []
    for i in range(ns.repeat):
        for where in ("container", "outside"):
            result = job(where, TAG, photos, ns.work / f"out-{where}", ns.sets,
                         ns.work / f"{where}-{i}.log")  # fmt: skip
            print(json.dumps(result), flush=True)
            runs.append(result)
    report["runs"] = runs
    for key in ("wall_seconds", "job_seconds", "images_per_second"):
        inside = statistics.median(r[key] for r in runs if r["where"] == "container")
        outside = statistics.median(r[key] for r in runs if r["where"] == "outside")
        report[f"container_over_outside_{key}"] = round(inside / outside, 3)
    report["photos"] = len(LABELS) * ns.per_label
    write_report(report, ns.report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
