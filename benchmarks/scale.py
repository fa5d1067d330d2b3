"""Data that grows: the whole job on N times the photos, as a user runs it, against 1x.

For ``--factor N`` (and ``--fraction F`` of each label's photos, 1 by default) it

1. builds, or reuses, a corpus of N distinct variants of every photo in its true label
   folder (:mod:`corpus`; ``<work>/corpus-x<N>``, or ``--corpus DIR``), and hard-links it
   into a fresh images folder for this run (the corpus itself is never changed);
2. runs the job's own CLI in subprocesses (``python -m flowers_job ...``, this checkout on
   ``PYTHONPATH``), each with its process tree sampled every 0.5 s (RSS and ``VmHWM`` of the
   driver Python, the driver JVM, Spark's Python workers and each training rank):

   - ``ingest`` of all the files: files/s (files / the ingest's own seconds, from its log
     line), the driver's peak RSS (JVM + Python);
   - ``ingest`` again with nothing changed (it lists and compares, writes nothing);
   - ``ingest`` again after 1 % new photos (spare variants) were added and 0.1 % deleted: its
     seconds against the full ingest's, the same above the unchanged run's (what the change
     itself cost), and the counts of an incremental ingest when the CLI prints them
     (``files_listed``, ``files_decoded``, ``rows_*``); ``--only-ingest`` stops here
     (``ingest_x<N>.json``);
   - ``train`` twice with ``train.epochs=1``: the first run writes the loader cache, the
     second reuses it; each run's preparation time (from its start to its first training
     step: the first progress line of epoch 1); of the first, its training images/s
     (``train_images_per_second`` of the epoch), ``loader_cache`` and the rows per shard of
     ``summary.json``, and the peak RSS of each rank. The second is stopped at its first
     step (``--second-train full`` runs it to its end): its preparation is what it measures;
   - ``predict --table`` over the test split of the stored images table (``--predict-split``):
     images/s (the report's);
   - with ``--memory-limit SIZE``: a third ``train`` in a memory cgroup of that size
     (``--limited-set`` overrides; ``--limited-driver-memory M``: ``run`` under
     ``spark-submit --driver-memory M`` instead), with the train split's stored size beside
     it (a run on data larger than its memory when the limit is below it);
     ``--only-limited`` runs the full ingest and this train only (``limited_x<N>.json``).

``--set KEY=VALUE`` goes to every ingest and train (the data settings must match).

Writes ``<results>/scale_x<N>[_f<F>].json``, then a Markdown table of every factor in that
folder against the 1x run of the same fraction (``scale.md``, also printed). Run from the
repository root:

    python benchmarks/scale.py --factor 1 --fraction 0.1      # a few minutes
    python benchmarks/scale.py --factor 30 --corpus /work/scale-corpus/x30
    python benchmarks/scale.py --factor 30 --corpus /work/scale-corpus/x30 --only-limited \
        --set data.image_size=128 --set data.resize_ratio=2 --set data.jpeg_quality=100 \
        --set data.val_fraction=0.05 --set data.test_fraction=0.05 --memory-limit 4.5G \
        --limited-driver-memory 1g --limited-set distributed.num_processes=1
    python benchmarks/scale.py --table                        # the table only, from the JSONs

Exit status: 0 when every command succeeded (an out-of-memory kill under ``--memory-limit``
is a result, not a failure), 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpus import build_corpus, select_photos
from report import machine_facts

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PHOTOS = Path(os.environ.get("FLOWERS_PHOTOS", REPO.parent / "shared/data/flower_photos"))
DEFAULT_WORK = Path(tempfile.gettempdir()) / "flowers-scale"
MIB = 2**20
INCREMENTAL_KEYS = (
    "files_listed",
    "files_decoded",
    "rows_inserted",
    "rows_updated",
    "rows_deleted",
    "rows_quarantined",
)
"""Counts an incremental ingest reports (recorded when the CLI prints them)."""
INGEST_LINE = re.compile(r"ingest: (\d+) files -> .* in ([\d.]+) s")
CACHE_LINE = re.compile(
    r"\b(train|val|test): loader cache (reused|written:) \S+ \(([\d.]+) MiB written, ([\d.]+) s\)"
)
"""The job's log line of each split's loader cache entry (flowers_job.loaders.cache_dir)."""
MARKERS = {
    "split_prepared": re.compile(r"\b(train|val|test): \d+ rows"),
    "ranks_banner": re.compile(r"world_size \d+ \("),
    "first_step": re.compile(r"epoch 1(/\d+)?:\s+0%"),
}
"""Log lines whose last (``split_prepared``) or first arrival time is recorded, seconds
after the command started: the loader plans of the splits (driver), the ranks' banner
(model built, readers open), and the first progress line of epoch 1 (tqdm prints it as the
first batch is asked for: the start of the first training step)."""
TARGETS = {
    "ingest_files_per_second": (">=", 0.9),
    "driver_peak_rss_mib": ("<=", 1.25),
    "train_images_per_second": (">=", 0.95),
    "incremental_vs_full_ingest": ("<=", 0.1),
    "second_vs_first_preparation": ("<=", 0.05),
    "second_vs_first_start_to_first_step": ("", None),
}


# --- the process tree ------------------------------------------------------------------


def _vm_hwm_bytes(proc: psutil.Process) -> int:
    try:
        with open(f"/proc/{proc.pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class TreeSampler(threading.Thread):
    """Samples the memory of a process and its descendants every ``every_s`` seconds.

    Each process gets a role the first time it is seen: ``driver_python`` (the root),
    ``driver_jvm`` (``java``), ``rank<r>`` (a process with ``RANK`` in its environment that
    is not torchrun itself), ``spark_python_workers`` (other Python processes under the
    JVM) or ``other:<name>``. Per process the peak is the larger of its sampled RSS and its last
    ``VmHWM`` (the kernel's own peak, which catches spikes between samples).
    """

    def __init__(self, root: psutil.Process, every_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.root, self.every_s = root, every_s
        self.roles: dict[int, str] = {}
        self.peak_bytes: dict[int, int] = {}
        self.group_peak_bytes: dict[str, int] = {}
        self.tree_peak_bytes = 0
        self.stop = threading.Event()

    def _role(self, proc: psutil.Process) -> str:
        if proc.pid == self.root.pid:
            return "driver_python"
        name = proc.name()
        if name == "java":
            return "driver_jvm"
        cmdline = " ".join(proc.cmdline())
        rank = proc.environ().get("RANK")
        if (
            rank is not None
            and "torch.distributed.run" not in cmdline
            and "torchrun" not in cmdline
        ):
            return f"rank{rank}"
        if name.startswith("python") and any(p.name() == "java" for p in proc.parents()):
            return "spark_python_workers"
        return f"other:{name}"

    def sample(self) -> None:
        """One sample of every process of the tree."""
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return
        groups: dict[str, int] = {}
        for proc in procs:
            try:
                # "other" again until it execs: a rank is first seen as a fork of torchrun
                if self.roles.get(proc.pid, "other").startswith("other"):
                    self.roles[proc.pid] = self._role(proc)
                rss = proc.memory_info().rss
            except psutil.Error:
                continue
            peak = max(rss, _vm_hwm_bytes(proc))
            self.peak_bytes[proc.pid] = max(self.peak_bytes.get(proc.pid, 0), peak)
            role = self.roles[proc.pid]
            groups[role] = groups.get(role, 0) + rss
        for role, total in groups.items():
            self.group_peak_bytes[role] = max(self.group_peak_bytes.get(role, 0), total)
        self.tree_peak_bytes = max(self.tree_peak_bytes, sum(groups.values()))

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            self.sample()

    def peaks_mib(self) -> dict[str, Any]:
        """Peak RSS, MiB: per role the largest single process (ranks: each rank's own), the
        Spark workers' and the whole tree's as the largest sampled sum."""
        out: dict[str, Any] = {}
        for pid, role in self.roles.items():
            mib = round(self.peak_bytes.get(pid, 0) / MIB, 1)
            if role == "spark_python_workers":
                continue
            out[role] = max(out.get(role, 0.0), mib)
        out["spark_python_workers_sum"] = round(
            self.group_peak_bytes.get("spark_python_workers", 0) / MIB, 1
        )
        out["tree_sum"] = round(self.tree_peak_bytes / MIB, 1)
        if "driver_jvm" in out and "driver_python" in out:
            out["driver_jvm_plus_python"] = round(out["driver_jvm"] + out["driver_python"], 1)
        return out


# --- a memory cgroup -------------------------------------------------------------------


class MemoryCgroup:
    """A memory cgroup of ``limit_bytes`` for one command, v2 or v1 (we are root).

    v2 (``/sys/fs/cgroup/cgroup.controllers`` lists ``memory``): a child of the root
    cgroup with ``memory.max``; v1: a child of this process's own memory cgroup
    (``/sys/fs/cgroup/memory/<ours>/``) with ``memory.limit_in_bytes``. The command is
    started by ``sh``, which writes its own pid to ``cgroup.procs`` and then ``exec``s the
    command, so every process it starts is in the group from the first instruction.
    Without swap the limit caps RSS plus the page cache the kernel cannot reclaim.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        name = f"flowers-scale-{os.getpid()}"
        unified = Path("/sys/fs/cgroup")
        controllers = unified / "cgroup.controllers"
        if controllers.exists() and "memory" in controllers.read_text().split():
            self.version = 2
            self.path = unified / name
            self.path.mkdir()
            (self.path / "memory.max").write_text(str(limit_bytes))
            if (self.path / "memory.swap.max").exists():
                (self.path / "memory.swap.max").write_text("0")
        else:
            ours = next(
                line.split(":", 2)[2]
                for line in Path("/proc/self/cgroup").read_text().splitlines()
                if line.split(":", 2)[1] == "memory"
            )
            self.version = 1
            self.path = Path("/sys/fs/cgroup/memory") / ours.lstrip("/") / name
            self.path.mkdir()
            (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))

    def wrap(self, command: list[str]) -> list[str]:
        """``command`` started inside the group."""
        procs = self.path / "cgroup.procs"
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *command]

    def stats(self) -> dict[str, Any]:
        """The group's peak usage (MiB), limit hits and out-of-memory kills."""
        read = lambda name: (self.path / name).read_text()  # noqa: E731
        out: dict[str, Any] = {
            "cgroup": str(self.path),
            "version": self.version,
            "limit_mib": round(self.limit_bytes / MIB, 1),
        }
        if self.version == 2:
            events = dict(line.split() for line in read("memory.events").splitlines())
            out["oom_kills"] = int(events.get("oom_kill", 0))
            out["limit_hits"] = int(events.get("max", 0))
            if (self.path / "memory.peak").exists():
                out["peak_mib"] = round(int(read("memory.peak")) / MIB, 1)
        else:
            out["peak_mib"] = round(int(read("memory.max_usage_in_bytes")) / MIB, 1)
            out["limit_hits"] = int(read("memory.failcnt"))
            control = dict(line.split() for line in read("memory.oom_control").splitlines())
            out["oom_kills"] = int(control.get("oom_kill", 0))
        return out

    def remove(self) -> None:
        """Remove the group (empty once its command has exited)."""
        for _ in range(20):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.5)


def parse_size(text: str) -> int:
    """``6G``, ``512M``, ``1.5g`` or bytes -> bytes (powers of 1024)."""
    match = re.fullmatch(r"([\d.]+)\s*([kmgt]?)i?b?", text.strip().lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 6G, 512M)")
    power = " kmgt".index(match.group(2) or " ")
    return int(float(match.group(1)) * 1024**power)


# --- one command -----------------------------------------------------------------------


def _pump(
    stream: IO[str],
    sink: list[tuple[float, str]],
    t0: float,
    lock: threading.Lock,
    stop_at: re.Pattern[str] | None = None,
    seen: threading.Event | None = None,
) -> None:
    for line in stream:
        with lock:
            sink.append((time.perf_counter() - t0, line.rstrip("\n")))
        if stop_at is not None and seen is not None and stop_at.search(line):
            seen.set()


def run_cli(
    args: list[str],
    log_path: Path,
    cgroup: MemoryCgroup | None = None,
    stop_at: str | None = None,
    launcher: list[str] | None = None,
) -> dict[str, Any]:
    """``python -m flowers_job <args>`` as a user runs it, its tree sampled.

    ``launcher`` replaces ``python -m flowers_job`` (a ``spark-submit ... jobs/train_flowers.py``).

    With ``stop_at`` (a name of :data:`MARKERS`), the command's process group is stopped
    (SIGTERM, then SIGKILL after 30 s) once that line arrives: a run measured up to its first
    training step only. ``stopped_at`` then says so, and its exit status is the signal's.

    Returns:
        ``command``, ``returncode``, ``wall_seconds``, ``peak_rss_mib``
        (:meth:`TreeSampler.peaks_mib`), ``markers`` (seconds after the start, see
        :data:`MARKERS`), ``ingest_seconds`` (from ingest's log line, when there is one) and
        ``printed`` (the last JSON object the command printed on stdout, or None). The whole
        output, each line with its time, goes to ``log_path``.
    """
    command = [*(launcher or [sys.executable, "-m", "flowers_job"]), *args]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
        # spark-submit runs the script with $PYSPARK_PYTHON (else `python3`): this interpreter
        "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable),
    }
    lines: list[tuple[float, str]] = []
    out_lines: list[tuple[float, str]] = []
    lock = threading.Lock()
    started_at = time.time()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cgroup.wrap(command) if cgroup else command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: stopped with it below
    )
    sampler = TreeSampler(psutil.Process(proc.pid))
    sampler.start()
    assert proc.stdout is not None and proc.stderr is not None
    seen = threading.Event()
    pattern = MARKERS[stop_at] if stop_at else None
    pumps = [
        threading.Thread(target=_pump, args=(stream, sink, t0, lock, pattern, seen), daemon=True)
        for stream, sink in ((proc.stdout, out_lines), (proc.stderr, lines))
    ]
    for pump in pumps:
        pump.start()
    stopped_at = None
    try:
        while (returncode := proc.poll()) is None:
            if stopped_at is not None:
                time.sleep(0.2)
            elif seen.wait(0.5):
                stopped_at = round(time.perf_counter() - t0, 2)
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
        if stopped_at is not None:  # the JVM and the ranks too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    except BaseException:  # Ctrl-C, or SIGTERM (main): leave no JVM or rank behind
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    wall = time.perf_counter() - t0
    for pump in pumps:
        pump.join(timeout=10)
    sampler.stop.set()
    sampler.join()
    every = sorted(lines + out_lines)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text(
        f"$ {' '.join(command)}\n" + "".join(f"+{t:8.2f} {text}\n" for t, text in every)
    )
    markers: dict[str, float] = {}
    ingest_seconds = None
    cache_log: dict[str, dict[str, Any]] = {}
    for t, text in every:
        for name, pattern in MARKERS.items():
            if pattern.search(text) and (name == "split_prepared" or name not in markers):
                markers[name] = round(t, 2)
        if match := INGEST_LINE.search(text):
            ingest_seconds = float(match.group(2))
        if match := CACHE_LINE.search(text):
            cache_log[match.group(1)] = {
                "reused": match.group(2) == "reused",
                "bytes_written": round(float(match.group(3)) * MIB),
                "seconds": float(match.group(4)),
            }
    result = {
        "command": [*(launcher or ["python", "-m", "flowers_job"]), *args],
        "returncode": returncode,
        "started_at": started_at,
        "wall_seconds": round(wall, 1),
        "peak_rss_mib": sampler.peaks_mib(),
        "markers": markers,
        "ingest_seconds": ingest_seconds,
        "loader_cache_log": cache_log,
        "printed": _last_json([text for _, text in out_lines]),
        "log": str(log_path),
        "stopped_at": stopped_at,
    }
    if returncode != 0 and stopped_at is None:
        tail = "\n".join(text for _, text in every[-15:])
        print(f"  {' '.join(args[:1])} exited {returncode}; last lines:\n{tail}", flush=True)
    return result


def _last_json(lines: list[str]) -> dict[str, Any] | None:
    """The last ``{`` ... ``}`` block printed at the start of lines, parsed."""
    starts = [i for i, text in enumerate(lines) if text == "{"]
    for start in reversed(starts):
        for end in range(start, len(lines)):
            if lines[end] == "}":
                try:
                    parsed: dict[str, Any] = json.loads("\n".join(lines[start : end + 1]))
                    return parsed
                except json.JSONDecodeError:
                    break
    return None


# --- the data --------------------------------------------------------------------------


def link_tree(src: Path, dest: Path) -> int:
    """Hard-link every file under ``src`` to the same place under ``dest`` (copies where
    links are refused); returns the number of files."""
    made = 0
    for folder, _, files in os.walk(src):
        out = dest / Path(folder).relative_to(src)
        out.mkdir(parents=True, exist_ok=True)
        for name in files:
            try:
                os.link(Path(folder) / name, out / name)
            except OSError:
                shutil.copyfile(Path(folder) / name, out / name)
            made += 1
    return made


def change_images(
    images: Path, extra: Path, delete_fraction: float, seed: int = 0
) -> dict[str, int]:
    """Add the spare variants under ``extra`` to ``images`` (hard links) and delete
    ``delete_fraction`` of the files that were there (a seeded sample)."""
    before = sorted(
        str(Path(folder, name).relative_to(images))
        for folder, _, files in os.walk(images)
        for name in files
    )
    deleted = random.Random(seed).sample(before, round(delete_fraction * len(before)))
    for relative in deleted:
        (images / relative).unlink()
    added = link_tree(extra, images) if extra.exists() else 0
    return {"files_before": len(before), "added": added, "deleted": len(deleted)}


def delta_table_bytes(table: Path, split: str | None = None) -> int:
    """Bytes of the data files of a Delta table's latest version, or of its partition
    ``split=<split>`` (its JSON log replayed; all Parquet files under it, or under the
    partition's folder, when the log has been checkpointed away)."""
    log = table / "_delta_log"
    commits = sorted(log.glob("*.json"))
    if not commits or not commits[0].name.startswith("0" * 20):
        root = table / f"split={split}" if split else table
        return sum(p.stat().st_size for p in root.rglob("*.parquet"))
    live: dict[str, int] = {}
    for commit in commits:
        for line in commit.read_text().splitlines():
            action = json.loads(line)
            if "add" in action:
                add = action["add"]
                if split is None or add.get("partitionValues", {}).get("split") == split:
                    live[add["path"]] = int(add["size"])
            elif "remove" in action:
                live.pop(action["remove"]["path"], None)
    return sum(live.values())


def dir_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


# --- the runs --------------------------------------------------------------------------


def train_result(run: dict[str, Any], summary_path: Path) -> dict[str, Any]:
    """A ``train`` run's numbers: its command's, plus the summary's."""
    fresh = summary_path.exists() and summary_path.stat().st_mtime > run["started_at"]
    summary = json.loads(summary_path.read_text()) if fresh else {}  # not a previous run's
    history = summary.get("history") or [{}]
    first_step = run["markers"].get("first_step", run["markers"].get("ranks_banner"))
    ranks = {k: v for k, v in run["peak_rss_mib"].items() if k.startswith("rank")}
    return {
        **run,
        "preparation_seconds": first_step,
        "preparation_from": "first_step" if "first_step" in run["markers"] else "ranks_banner",
        "train_images_per_second": history[0].get("train_images_per_second"),
        "epoch_seconds": history[0].get("epoch_seconds"),
        "train_seconds": summary.get("train_seconds"),
        "steps_per_epoch": summary.get("steps_per_epoch"),
        "train_rows": summary.get("train_rows"),
        "rows_per_shard": summary.get("rows_per_shard"),
        "loader": summary.get("loader"),
        # a run stopped at its first step wrote no summary: its log says the same
        "loader_cache": summary.get("loader_cache") or run["loader_cache_log"] or None,
        "rank_peak_rss_mib": dict(sorted(ranks.items())),
    }


def ingest_result(run: dict[str, Any]) -> dict[str, Any]:
    """An ``ingest`` run's numbers: files/s over its own seconds, driver peak RSS."""
    printed = run["printed"] or {}
    files = printed.get("files")
    seconds = run["ingest_seconds"]
    return {
        **run,
        "files": files,
        "files_per_second": round(files / seconds, 1) if files and seconds else None,
        "driver_peak_rss_mib": run["peak_rss_mib"].get("driver_jvm_plus_python"),
        "incremental": {k: printed[k] for k in INCREMENTAL_KEYS if k in printed},
    }


def measure(args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Every run of one factor (module docstring); returns the JSON's dict, also given to
    ``save`` after each step (a run stopped half-way leaves its steps so far)."""
    work: Path = args.work
    tag = f"x{args.factor}" + (f"_f{args.fraction:g}" if args.fraction < 1 else "")
    corpus_dir = args.corpus or work / f"corpus-{tag}"
    run_dir = work / f"run-{tag}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    facts = machine_facts("pyspark", "delta-spark", "torch", "pillow")
    facts["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    photos = len(select_photos(args.photos, args.fraction))
    extra = math.ceil(args.new_fraction * photos * args.factor)
    print(f"corpus {corpus_dir}: {args.factor} x {photos} photos + {extra} spare", flush=True)
    manifest = build_corpus(
        args.photos,
        corpus_dir,
        args.factor,
        fraction=args.fraction,
        extra=extra,
        processes=args.processes,
    )
    corpus_info = {k: v for k, v in manifest.items() if k != "files"}
    corpus_info["path"] = str(corpus_dir)
    print(
        f"  {manifest['images_files']} files, {manifest['images_bytes'] / 2**30:.2f} GiB, "
        f"{'reused' if manifest['reused'] else 'generated'} in "
        f"{manifest['generation_seconds']:.0f} s",
        flush=True,
    )
    images, out = run_dir / "images", run_dir / "out"
    t0 = time.perf_counter()
    link_tree(corpus_dir / "images", images)
    link_seconds = time.perf_counter() - t0
    logs = run_dir / "logs"
    sets = [item for override in args.overrides for item in ("--set", override)]
    train_args = ["train", "--output-dir", str(out), "--set", f"train.epochs={args.epochs}", *sets]
    result: dict[str, Any] = {
        "benchmark": "scale",
        "factor": args.factor,
        "fraction": args.fraction,
        "machine": facts,
        "corpus": corpus_info,
        "link_seconds": round(link_seconds, 1),
        "settings": {
            "new_fraction": args.new_fraction,
            "delete_fraction": args.delete_fraction,
            "overrides": args.overrides,
            "train_overrides": [f"train.epochs={args.epochs}", *args.overrides],
            "memory_limit_mib": round(args.memory_limit / MIB) if args.memory_limit else None,
            "limited_overrides": args.limited_overrides,
            "limited_driver_memory": args.limited_driver_memory,
        },
    }
    ingest_args = ["ingest", "--images", str(images), "--output-dir", str(out), *sets]

    def step(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        print(f"{name} ...", flush=True)
        value = fn()
        result[name] = value
        print(f"  {_brief(value)}", flush=True)
        save(result)
        return value

    full = step("full_ingest", lambda: ingest_result(run_cli(ingest_args, logs / "ingest.log")))
    result["train_split_bytes"] = delta_table_bytes(out / "tables" / "images", "train")
    summary = out / "summary.json"
    if not args.only_limited:
        same = step(
            "unchanged_ingest",
            lambda: ingest_result(run_cli(ingest_args, logs / "ingest_unchanged.log")),
        )
        result["change"] = change_images(images, corpus_dir / "extra", args.delete_fraction)
        incr = step(
            "incremental_ingest",
            lambda: ingest_result(run_cli(ingest_args, logs / "ingest_incremental.log")),
        )
        if full["ingest_seconds"] and incr["ingest_seconds"]:
            incr["vs_full_ingest"] = round(incr["ingest_seconds"] / full["ingest_seconds"], 3)
            if same["ingest_seconds"] is not None:
                # what the change itself cost, above listing and comparing an unchanged root
                incr["above_unchanged_vs_full_ingest"] = round(
                    (incr["ingest_seconds"] - same["ingest_seconds"]) / full["ingest_seconds"], 3
                )
            save(result)
    if not (args.only_limited or args.only_ingest):
        step("train_first", lambda: train_result(run_cli(train_args, logs / "t1.log"), summary))
        stop_second = "first_step" if args.second_train == "preparation" else None
        step(
            "train_second",
            lambda: train_result(
                run_cli(train_args, logs / "t2.log", stop_at=stop_second), summary
            ),
        )
        print(f"  second/first preparation {_ratio_of(result, 'loader_cache')}", flush=True)
        result["loader_cache_bytes_after"] = dir_bytes(out / "loader_cache")
        predict_args = [
            "predict",
            "--output-dir",
            str(out),
            "--table",
            str(out / "tables" / "images"),
            *(["--split", args.predict_split] if args.predict_split != "all" else []),
            "--output-table",
            str(run_dir / "predictions"),
        ]
        step("predict", lambda: _predict_result(run_cli(predict_args, logs / "predict.log")))
    if args.memory_limit:
        group = MemoryCgroup(args.memory_limit)
        limited_args = train_args + [
            item for override in args.limited_overrides for item in ("--set", override)
        ]
        launcher = None
        if args.limited_driver_memory:  # `run` under spark-submit, as README's local example
            launcher = spark_submit(args.limited_driver_memory)
            limited_args = ["--images", str(images), *limited_args[1:]]
        try:
            limited = step(
                "train_limited",
                lambda: train_result(
                    run_cli(limited_args, logs / "t3.log", group, launcher=launcher), summary
                ),
            )
            limited["cgroup"] = group.stats()
        finally:
            group.remove()
        limited["larger_than_memory"] = result["train_split_bytes"] > args.memory_limit
        print(f"  {_brief(limited)}", flush=True)
        save(result)
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def spark_submit(driver_memory: str) -> list[str]:
    """``spark-submit`` of this interpreter's pyspark, local mode, a driver JVM of
    ``driver_memory``, Delta's jars, running ``jobs/train_flowers.py`` (``flowers-job run``:
    the ingest finds nothing changed and writes nothing, then trains)."""
    from importlib.metadata import version

    submit = Path(sys.executable).parent / "spark-submit"
    return [
        str(submit),
        "--master",
        "local[*]",
        "--driver-memory",
        driver_memory,
        "--packages",
        f"io.delta:delta-spark_2.13:{version('delta-spark')}",
        str(REPO / "jobs" / "train_flowers.py"),
    ]


def _predict_result(run: dict[str, Any]) -> dict[str, Any]:
    printed = run["printed"] or {}
    return {
        **run,
        "rows": printed.get("input_rows"),
        "seconds": printed.get("seconds"),
        "images_per_second": printed.get("images_per_second"),
    }


def _brief(value: dict[str, Any]) -> str:
    keys = (
        "returncode",
        "wall_seconds",
        "files",
        "ingest_seconds",
        "files_per_second",
        "driver_peak_rss_mib",
        "vs_full_ingest",
        "preparation_seconds",
        "train_images_per_second",
        "rank_peak_rss_mib",
        "images_per_second",
        "loader_cache",
        "cgroup",
    )
    return ", ".join(f"{k} {value[k]}" for k in keys if value.get(k) is not None)


# --- the table -------------------------------------------------------------------------


def metrics(result: dict[str, Any]) -> dict[str, float | None]:
    """The numbers the table compares, from one factor's JSON."""
    trains = [
        result[k]["train_images_per_second"]
        for k in ("train_first", "train_second")
        if result.get(k, {}).get("train_images_per_second")
    ]
    ranks = [
        v
        for k in ("train_first", "train_second")
        for v in result.get(k, {}).get("rank_peak_rss_mib", {}).values()
    ]
    get = lambda step, key: result.get(step, {}).get(key)  # noqa: E731 (a run stopped half-way)
    return {
        "ingest_files_per_second": get("full_ingest", "files_per_second"),
        "driver_peak_rss_mib": get("full_ingest", "driver_peak_rss_mib"),
        "train_images_per_second": sum(trains) / len(trains) if trains else None,
        "rank_peak_rss_mib": max(ranks) if ranks else None,
        "predict_images_per_second": get("predict", "images_per_second"),
        "incremental_vs_full_ingest": get("incremental_ingest", "vs_full_ingest"),
        "second_vs_first_preparation": _ratio_of(result, "loader_cache"),
        "second_vs_first_start_to_first_step": _ratio_of(result, "preparation_seconds"),
    }


def table(results_dir: Path) -> str:
    """Every ``scale_x<N>*.json`` in ``results_dir`` against the 1x of its fraction."""
    runs = [json.loads(p.read_text()) for p in sorted(results_dir.glob("scale_x*.json"))]
    runs.sort(key=lambda r: (r["fraction"], r["factor"]))
    lines = []
    for fraction in sorted({r["fraction"] for r in runs}):
        group = [r for r in runs if r["fraction"] == fraction]
        base = next((r for r in group if r["factor"] == 1), None)
        head = " | ".join(f"{r['factor']}x" for r in group)
        ratio_head = " | ".join(f"{r['factor']}x/1x" for r in group if r["factor"] != 1)
        lines += [
            f"Fraction {fraction:g} of the photos; "
            + "; ".join(
                f"{r['factor']}x: {r.get('full_ingest', {}).get('files')} files, "
                f"{r['machine']['date']}, {r['machine']['nproc']} cores, "
                f"{r['machine']['memory_gib']} GiB"
                for r in group
            ),
            "",
            f"| metric | {head} | {ratio_head} | target |".replace("|  |", "|"),
            "|---" * (2 + len(group) + sum(r["factor"] != 1 for r in group)) + "|",
        ]
        for name in (
            "ingest_files_per_second",
            "driver_peak_rss_mib",
            "train_images_per_second",
            "rank_peak_rss_mib",
            "predict_images_per_second",
            "incremental_vs_full_ingest",
            "second_vs_first_preparation",
            "second_vs_first_start_to_first_step",
        ):
            values = [metrics(r)[name] for r in group]
            cells = [_num(v) for v in values]
            own_ratio = name.endswith("ingest") or name.startswith("second_vs_first")
            ratios = []
            for r, v in zip(group, values, strict=True):
                if r["factor"] == 1:
                    continue
                b = metrics(base)[name] if base else None
                ratios.append("-" if own_ratio else _ratio(v, b))
            op, bound = TARGETS.get(name, ("", None))
            target = f"{op} {bound}x" if bound is not None else "-"
            row = [name, *cells, *ratios, target]
            lines.append("| " + " | ".join(row) + " |")
        lines += [
            "",
            "The last three rows are ratios within one factor (incremental ingest of 1 % / the "
            "full ingest; the second train's preparation (its loader caches, found and reused) "
            "/ the first's (written); the same for the time from the command's start to its "
            "first training step, Spark's and the ranks' start included): their target holds "
            "for each factor's column.",
            "",
        ]
    return "\n".join(lines)


def _seconds(train: dict[str, Any], key: str) -> float | None:
    """A train's ``preparation_seconds``, or for ``loader_cache`` the seconds of every
    split's entry (prepare_data: written, or found and reused), summed."""
    value = train.get(key)
    if key == "loader_cache":
        return sum(float(c.get("seconds") or 0.0) for c in value.values()) if value else None
    return None if value is None else float(value)


def _ratio_of(result: dict[str, Any], key: str) -> float | None:
    """The second train's :func:`_seconds` of ``key`` / the first's."""
    a = _seconds(result.get("train_first", {}), key)
    b = _seconds(result.get("train_second", {}), key)
    return round(b / a, 3) if a and b is not None else None


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.3f}" if value < 10 else f"{value:,.1f}"


def _ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}x"


def _stop(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--factor", type=int, default=1, help="variants per photo (1)")
    parser.add_argument("--fraction", type=float, default=1.0, help="of each label's photos")
    parser.add_argument("--photos", type=Path, default=DEFAULT_PHOTOS, help="the real photos")
    parser.add_argument(
        "--work",
        type=Path,
        default=DEFAULT_WORK,
        help=f"corpora and the run's images and tables (default {DEFAULT_WORK})",
    )
    parser.add_argument("--corpus", type=Path, help="the corpus (default <work>/corpus-x<N>)")
    parser.add_argument(
        "--results",
        type=Path,
        default=REPO / "benchmarks/results" / dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"),
        help="folder of the JSONs and scale.md (default benchmarks/results/<date>)",
    )
    parser.add_argument("--epochs", type=int, default=1, help="train.epochs of each train")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override of every ingest and train (e.g. data.resize_ratio=2)",
    )
    parser.add_argument(
        "--limited-set",
        dest="limited_overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override of the train under --memory-limit only (distributed.num_processes=1)",
    )
    parser.add_argument(
        "--limited-driver-memory",
        metavar="SIZE",
        help="run the train under --memory-limit as `spark-submit --driver-memory SIZE "
        "jobs/train_flowers.py` (the job's own local session asks for a 4g driver)",
    )
    parser.add_argument(
        "--second-train",
        choices=("preparation", "full"),
        default="preparation",
        help="the second train: stopped at its first training step (preparation, the default: "
        "what it measures), or run to its end (full)",
    )
    parser.add_argument(
        "--predict-split",
        choices=("train", "val", "test", "all"),
        default="test",
        help="the split of the images table predict scores (test, the default: 10 %% of the "
        "rows; all: the whole table)",
    )
    parser.add_argument("--new-fraction", type=float, default=0.01, help="photos added")
    parser.add_argument("--delete-fraction", type=float, default=0.001, help="photos deleted")
    parser.add_argument(
        "--memory-limit", type=parse_size, help="a third train in a memory cgroup of this size"
    )
    parser.add_argument(
        "--only-limited",
        action="store_true",
        help="the full ingest, then only the train under --memory-limit (limited_x<N>.json)",
    )
    parser.add_argument(
        "--only-ingest",
        action="store_true",
        help="the ingests only: full, unchanged, incremental (ingest_x<N>.json)",
    )
    parser.add_argument("--processes", type=int, default=2, help="corpus builder processes")
    parser.add_argument("--keep", action="store_true", help="keep the run's images and tables")
    parser.add_argument("--table", action="store_true", help="only print and save the table")
    args = parser.parse_args(argv)
    ok = True
    if not args.table:
        signal.signal(signal.SIGTERM, _stop)
        if args.only_limited and not args.memory_limit:
            parser.error("--only-limited needs --memory-limit")
        kind = "limited" if args.only_limited else "ingest" if args.only_ingest else "scale"
        name = f"{kind}_x{args.factor}" + (f"_f{args.fraction:g}" if args.fraction < 1 else "")
        path = args.results / f"{name}.json"
        args.results.mkdir(parents=True, exist_ok=True)
        result = measure(args, lambda r: path.write_text(json.dumps(r, indent=2) + "\n"))
        steps: tuple[str, ...] = ("full_ingest",)
        if not args.only_limited:
            steps += ("unchanged_ingest", "incremental_ingest")
        if not (args.only_limited or args.only_ingest):
            steps += ("train_first", "train_second", "predict")
        ok = all(
            result[k]["returncode"] == 0 or result[k].get("stopped_at") is not None for k in steps
        )
    text = table(args.results)
    (args.results / "scale.md").write_text(text + "\n")
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
