"""The embeddings table's update on a day's change, checkouts side by side, and where its
seconds go.

For ``--factor N`` (the corpus of :mod:`corpus`, ``<work>/corpus-x<N>``, built or reused) it

1. hard-links the corpus into ``<work>/update-x<N>/images``, ingests it (``flowers-job
   ingest``'s library call, :func:`flowers_job.ingest.job.ingest`) and embeds every photo
   (:func:`~flowers_job.ingest.embeddings.update_embeddings`, the first update: a write);
2. makes a day's change of the photos: 1 % added (the corpus's spare variants), 0.1 %
   deleted, and ingests it: the base output dir;
3. for each ``--checkout`` (a folder holding ``flowers_job/``: this one, or a ``git worktree``
   of another commit), ``--repeat`` times, alternating: hard-links the base output dir (Delta
   writes new files, never changes one) and runs the day's update on it in a fresh Python
   process with that checkout first on ``PYTHONPATH``, its Spark event log on; records the
   update's wall seconds, its counts, and its SQL executions (description, seconds, from
   the event log).

Every update sees the same tables and the same change. ``data.image_size`` is 32 by default
(``--set`` to change it): the forward passes are a small, equal part of each update; the
comparisons with the tables and the ``MERGE`` are what differ.

Writes ``<results>/embeddings_update_x<N>.json`` and prints a table: per checkout, each
run's seconds and the mean, and the ratio of each checkout's mean to the first's::

    git worktree add /tmp/old <commit>
    python benchmarks/embeddings_update.py --factor 30 --checkout /tmp/old . --repeat 2
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import build_corpus, select_photos
from report import machine_facts

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PHOTOS = Path(os.environ.get("FLOWERS_PHOTOS", REPO.parent / "shared/data/flower_photos"))
DEFAULT_WORK = Path("/var/tmp/flowers-scale")
UPDATE_SECONDS = 3600
"""Bound on one process (the preparation, or one update), seconds."""

_PREPARE = """
import json, os, sys
from pathlib import Path
from flowers_job.cluster.session import get_spark
from flowers_job.config import load_config
from flowers_job.driver.embedding_data import embedding_spec
from flowers_job.ingest.embeddings import update_embeddings
from flowers_job.ingest.job import ingest
from flowers_job.tables.table_ref import table_ref

images, out, extra, delete_every, sets = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
spark = get_spark("embeddings_update_prepare", master="local[2]")
cfg = load_config(None, sets, **{"data.images": images, "paths.output_dir": out})
ingest(spark, cfg)
images_t = table_ref(cfg, "images")
version = int(images_t.history(spark, 1).select("version").first()["version"])
first = update_embeddings(spark, images_t, version, table_ref(cfg, "embeddings"), embedding_spec(cfg), "first")
files = sorted(images.rglob("*.jpg"))
added = 0
for f in sorted(extra.rglob("*.jpg"))[: len(files) // 100]:
    os.link(f, images / f.parent.name / f.name)
    added += 1
gone = files[::delete_every][: len(files) // 1000]
for f in gone:
    f.unlink()
ingest(spark, cfg)
print("PREPARED " + json.dumps({"photos": len(files), "added": added, "deleted": len(gone), "first_update_seconds": first.seconds}))
"""

_UPDATE = """
import json, sys, time
from pathlib import Path
from flowers_job.cluster.session import get_spark
from flowers_job.config import load_config
from flowers_job.driver.embedding_data import embedding_spec
from flowers_job.ingest.embeddings import update_embeddings
from flowers_job.tables.table_ref import table_ref

images, out, events, sets = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
spark = get_spark("embeddings_update", master="local[2]", conf={"spark.eventLog.enabled": "true", "spark.eventLog.dir": events, "spark.eventLog.compress": "false", "spark.eventLog.rolling.enabled": "false"})
cfg = load_config(None, sets, **{"data.images": images, "paths.output_dir": out})
images_t = table_ref(cfg, "images")
version = int(images_t.history(spark, 1).select("version").first()["version"])
spark.sparkContext.setJobGroup("update", "update")
t0 = time.perf_counter()
c = update_embeddings(spark, images_t, version, table_ref(cfg, "embeddings"), embedding_spec(cfg), "day")
seconds = time.perf_counter() - t0
print("UPDATED " + json.dumps({"seconds": seconds, "embedded": c.embedded, "copied": c.copied, "updated": c.updated, "deleted": c.deleted, "method": getattr(c, "method", "tables")}))
"""


def _run(code: str, args: list[str], checkout: Path, tag: str) -> dict[str, Any]:
    """``code`` in a fresh interpreter with ``checkout`` first on ``PYTHONPATH``; the JSON of
    its ``<tag> `` line.

    Raises:
        RuntimeError: it failed, or printed no such line (its output's tail named).
    """
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve())}
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=checkout,  # `python -c` puts its working directory first on sys.path
        env=env,
        capture_output=True,
        text=True,
        timeout=UPDATE_SECONDS,
        check=False,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith(tag + " ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{tag} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1].removeprefix(tag + " "))
    return result


def sql_executions(events: Path) -> list[dict[str, Any]]:
    """The SQL executions of the event log in ``events`` whose description names the job
    group ``update`` (Delta's own carry it as a prefix): ``{"description", "call_site",
    "start", "seconds"}`` in order, ``call_site`` the first line of the event's details (for
    PySpark, the Python line that ran it), ``start`` in seconds from the first."""
    starts: dict[int, tuple[float, str, str]] = {}
    ends: dict[int, float] = {}
    for path in sorted(events.iterdir()):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            kind = event.get("Event", "")
            if kind.endswith("SQLExecutionStart"):
                site = (event.get("details") or "").strip().splitlines()
                starts[event["executionId"]] = (
                    event["time"] / 1000,
                    event.get("description") or "",
                    site[0] if site else "",
                )
            elif kind.endswith("SQLExecutionEnd"):
                ends[event["executionId"]] = event["time"] / 1000
    rows = [
        (start, ends.get(i, start) - start, text, site)
        for i, (start, text, site) in sorted(starts.items())
        if "update" in text
    ]
    t0 = rows[0][0] if rows else 0.0
    return [
        {
            "description": re.sub(r"\s+", " ", text)[:100],
            "call_site": site[:160],
            "start": round(s - t0, 2),
            "seconds": round(d, 2),
        }
        for s, d, text, site in rows
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--factor", type=int, default=10, help="variants per photo (10)")
    parser.add_argument("--checkout", type=Path, nargs="+", default=[REPO], help="checkouts")
    parser.add_argument("--repeat", type=int, default=2, help="updates per checkout (2)")
    parser.add_argument("--photos", type=Path, default=DEFAULT_PHOTOS)
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK)
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override (default data.image_size=32, embeddings.enabled=true)",
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=REPO / "benchmarks/results" / dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"),
    )
    args = parser.parse_args(argv)
    sets = ["data.image_size=32", "embeddings.enabled=true", *args.overrides]
    facts = machine_facts("pyspark", "delta-spark", "torch")
    corpus = args.work / f"corpus-x{args.factor}"
    extra = math.ceil(0.01 * len(select_photos(args.photos)) * args.factor)  # as scale.py's
    donors = sorted(p for p in args.work.glob("corpus-*") if p.is_dir() and p != corpus)
    build_corpus(args.photos, corpus, args.factor, extra=extra, donors=donors)
    base = args.work / f"update-x{args.factor}"
    shutil.rmtree(base, ignore_errors=True)
    images, out = base / "images", base / "base"
    shutil.copytree(corpus / "images", images, copy_function=os.link)
    t0 = time.perf_counter()
    prepared = _run(
        _PREPARE, [str(images), str(out), str(corpus / "extra"), "1000", *sets], REPO, "PREPARED"
    )
    prepared["seconds"] = round(time.perf_counter() - t0, 1)
    print("prepared", prepared, flush=True)
    runs: list[dict[str, Any]] = []
    for i in range(args.repeat):
        for checkout in args.checkout:
            copy, events = base / f"run-{len(runs)}", base / f"events-{len(runs)}"
            shutil.copytree(out, copy, copy_function=os.link)
            events.mkdir()
            result = _run(
                _UPDATE, [str(images), str(copy), str(events), *sets], checkout, "UPDATED"
            )
            result.update(checkout=str(checkout), repeat=i, sql=sql_executions(events))
            runs.append(result)
            print(f"{checkout}: {result['seconds']:.1f} s", flush=True)
            shutil.rmtree(copy)
    means = {
        str(c): sum(r["seconds"] for r in runs if r["checkout"] == str(c)) / args.repeat
        for c in args.checkout
    }
    first = means[str(args.checkout[0])]
    report = {
        "benchmark": "embeddings_update",
        "machine": facts,
        "factor": args.factor,
        "settings": sets,
        "prepared": prepared,
        "runs": runs,
        "mean_seconds": means,
        "ratio_to_first": {c: round(m / first, 3) for c, m in means.items()},
    }
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / f"embeddings_update_x{args.factor}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print("| checkout | updates (s) | mean (s) | / first |\n|---|---|---|---|")
    for c, m in means.items():
        each = ", ".join(f"{r['seconds']:.1f}" for r in runs if r["checkout"] == c)
        print(f"| {c} | {each} | {m:.1f} | {report['ratio_to_first'][c]} |")
    print(f"wrote {path}")
    shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
