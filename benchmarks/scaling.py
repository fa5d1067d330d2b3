"""2-rank scaling: two DDP ranks of one thread each against one rank of two threads.

On a 2-core machine there are two ways to put both cores to work on the job's training step:
two processes (DDP ranks, gloo, one intra-op thread each, gradients all-reduced every step)
or one process whose operators use two intra-op threads. This measures which gives more
training images per second, on the same data, model, optimizer and per_device_batch_size.

Both configurations run the hand-written in-memory loop of ``inmemory.py``
(:func:`inmemory.run`: ``torchrun`` ranks, the job's model, AdamW, cross-entropy, no
loader and no decode in the loop) on the same decoded tensors (``--count`` photos decoded
once by :func:`inmemory.decode_to_file`), and train on the same number of images:

- ``2x1``: 2 ranks x 1 thread, ``--steps`` timed steps per rank;
- ``1x2``: 1 rank x 2 threads, ``2 * --steps`` timed steps;

each after ``--warmup`` untimed steps per rank. They alternate (``2x1``, ``1x2``, ``2x1``,
``1x2``, ...) ``--repeats`` times so that drift in the machine's load falls on both; the
median images/s of each is reported (images/s: all ranks' timed images / the slowest rank's
seconds, as :func:`inmemory.run` computes it), with the efficiency ratio
``images/s(2x1) / images/s(1x2)`` (above 1: the ranks use the cores better than the
threads) and the CPU user/system seconds of each run (``getrusage`` of torchrun's
children: the whole run, start-up, model build and warm-up included). ``--unfrozen`` also
measures both with the backbone trained (``freeze_backbone=False``), after the frozen
backbone (the job's default). Run from the repository root:

    .venv/bin/python benchmarks/scaling.py --output /tmp/bench-scaling.json
    # smaller: --count 64 --steps 3 --warmup 1 --repeats 1; the backbone trained too: --unfrozen

Exit status: 0, or 1 when a backbone setting could not be run (its error is printed and
kept under ``failed`` in the JSON; the other setting is still measured).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from report import machine_facts  # noqa: E402

CORES = 2  # the cores both configurations share: 2 ranks x 1 thread, 1 rank x 2 threads
CONFIGS = {"2x1": (2, 1), "1x2": (1, 2)}  # name: (ranks, intra-op threads per rank)


def _import_inmemory() -> Any:
    """``benchmarks/inmemory.py`` as a module (it is a script beside this one, not a package)."""
    for path in (str(HERE), str(REPO)):
        if path not in sys.path:
            sys.path.insert(0, path)
    import inmemory

    return inmemory


def measure(
    data: Path,
    *,
    steps: int,
    warmup: int,
    batch_size: int,
    repeats: int,
    freeze_backbone: bool,
    timeout: float,
) -> dict[str, Any]:
    """Both configurations on ``data``, alternating, ``repeats`` times each.

    The ``1x2`` rank runs ``CORES * steps`` timed steps, so both train on
    ``CORES * steps * batch_size`` images per run.

    Returns:
        ``runs``: per configuration, the :func:`inmemory.run` result of every repeat;
        ``images_per_second``, ``cpu_user_seconds``, ``cpu_system_seconds``: per
        configuration, the median over the repeats (images/s; CPU seconds of the whole run);
        ``efficiency``: median images/s of ``2x1`` / median images/s of ``1x2``;
        ``pair_efficiency``: the same ratio for each repeat's pair.

    Raises:
        RuntimeError or subprocess.CalledProcessError: a rank failed (which of the two
        depends on the version of :func:`inmemory.run`); subprocess.TimeoutExpired: a run
        took longer than ``timeout`` seconds.
    """
    inmemory = _import_inmemory()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    for repeat in range(repeats):
        for name, (ranks, threads) in CONFIGS.items():
            result = inmemory.run(
                data,
                ranks=ranks,
                threads=threads,
                steps=steps * CORES // ranks,
                warmup=warmup,
                batch_size=batch_size,
                freeze_backbone=freeze_backbone,
                timeout=timeout,
            )
            runs[name].append(result)
            print(
                f"  repeat {repeat + 1}/{repeats} {name}: {result['images_per_second']:.1f} img/s "
                f"({result['images']} images in {result['seconds']:.1f} s; CPU user "
                f"{result['cpu_user_seconds']:.1f} s, system {result['cpu_system_seconds']:.1f} s)",
                flush=True,
            )

    def median(name: str, key: str) -> float:
        return float(statistics.median(float(r[key]) for r in runs[name]))

    rate = {name: median(name, "images_per_second") for name in CONFIGS}
    pairs = zip(runs["2x1"], runs["1x2"], strict=True)
    return {
        "freeze_backbone": freeze_backbone,
        "images_per_run": CORES * steps * batch_size,
        "images_per_second": {k: round(v, 2) for k, v in rate.items()},
        "cpu_user_seconds": {k: round(median(k, "cpu_user_seconds"), 2) for k in CONFIGS},
        "cpu_system_seconds": {k: round(median(k, "cpu_system_seconds"), 2) for k in CONFIGS},
        "efficiency": round(rate["2x1"] / rate["1x2"], 3),
        "pair_efficiency": [
            round(a["images_per_second"] / b["images_per_second"], 3) for a, b in pairs
        ],
        "runs": runs,
    }


def format_table(results: list[dict[str, Any]]) -> str:
    """The medians as a Markdown table: one row per configuration and backbone setting."""
    head = ["backbone", "ranks x threads", "images/s (median)", "vs 1x2", "CPU user s", "CPU sys s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        backbone = "frozen" if r["freeze_backbone"] else "trained"
        for name in CONFIGS:
            ratio = r["images_per_second"][name] / r["images_per_second"]["1x2"]
            cells = [
                backbone,
                name,
                f"{r['images_per_second'][name]:.1f}",
                f"{ratio:.2f}x",
                f"{r['cpu_user_seconds'][name]:.1f}",
                f"{r['cpu_system_seconds'][name]:.1f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (0; 1 when a backbone setting failed)."""
    inmemory = _import_inmemory()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--photos", type=Path, default=inmemory.DEFAULT_PHOTOS, help="photo folders")
    p.add_argument("--count", type=int, default=256, help="photos decoded (default 256)")
    p.add_argument("--image-size", type=int, default=224, help="crop side, px")
    p.add_argument("--steps", type=int, default=20, help="timed steps per rank of 2x1")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per rank first")
    p.add_argument("--batch-size", type=int, default=32, help="per_device_batch_size")
    p.add_argument("--repeats", type=int, default=2, help="runs of each configuration")
    p.add_argument("--unfrozen", action="store_true", help="also with the backbone trained")
    p.add_argument("--timeout", type=float, default=900.0, help="limit per run, seconds")
    p.add_argument("--output", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.count < CORES * args.batch_size:
        p.error(f"--count must be at least {CORES} x --batch-size ({CORES * args.batch_size})")
    if min(args.steps, args.repeats) < 1 or args.warmup < 0:
        p.error("--steps and --repeats must be at least 1, --warmup at least 0")

    facts = machine_facts("torch")
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    print(
        f"{args.count} photos at {args.image_size} px, per_device_batch_size "
        f"{args.batch_size}, {CORES * args.steps * args.batch_size} timed images per run "
        f"(2x1: {args.steps} steps per rank, 1x2: {CORES * args.steps}), {args.warmup} "
        f"warm-up steps, {args.repeats} repeats; {facts['nproc']} cores, load "
        f"{facts['loadavg_at_start']}",
        flush=True,
    )
    results: list[dict[str, Any]] = []
    failed: dict[str, str] = {}  # backbone setting: the end of the error
    with tempfile.TemporaryDirectory() as tmp:
        data = inmemory.decode_to_file(
            args.photos, args.count, args.image_size, Path(tmp) / "data.pt"
        )
        for freeze in (True, False) if args.unfrozen else (True,):
            backbone = "frozen" if freeze else "trained"
            print(f"backbone {backbone}:", flush=True)
            try:
                results.append(
                    measure(
                        data,
                        steps=args.steps,
                        warmup=args.warmup,
                        batch_size=args.batch_size,
                        repeats=args.repeats,
                        freeze_backbone=freeze,
                        timeout=args.timeout,
                    )
                )
            except (RuntimeError, subprocess.CalledProcessError) as exc:
                # A failed setting is reported, not measured; the others still are.
                failed[backbone] = str(exc)[-4000:]
                print(f"backbone {backbone}: FAILED: {str(exc)[-1500:]}", flush=True)
    facts["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    table = format_table(results)
    report = {
        "settings": settings,
        "machine": facts,
        "results": results,
        "failed": failed,
        "table": table,
    }
    print()
    print(table)
    print()
    for r in results:
        backbone = "frozen" if r["freeze_backbone"] else "trained"
        print(
            f"efficiency ({backbone} backbone) = img/s 2x1 / img/s 1x2 = {r['efficiency']:.3f} "
            f"(per pair: {r['pair_efficiency']})"
        )
    summary = {
        ("frozen" if r["freeze_backbone"] else "trained"): {
            k: r[k]
            for k in ("images_per_second", "efficiency", "cpu_user_seconds", "cpu_system_seconds")
        }
        for r in results
    }
    print(json.dumps(summary))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
        print(f"JSON: {args.output}")
    if failed:
        print(f"FAILED (not measured): {', '.join(failed)} backbone")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
