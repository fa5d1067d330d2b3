"""Data that grows: the whole job on N times the photos, as a user runs it, against 1x.

For ``--factor N`` (and ``--fraction F`` of each label's photos, 1 by default; several
factors, ``--factor 100 30 10 1``: each in turn, largest first so that the smaller corpora
are links to its files) it

1. builds, or reuses, a corpus of N distinct variants of every photo in its true label
   folder (:mod:`corpus`; ``<work>/corpus-x<N>``, or ``--corpus DIR``; the variants that
   the other corpora in ``<work>`` hold are linked from them), and hard-links it into a
   fresh images folder for this run (the corpus itself is never changed);
2. runs the job's own CLI in subprocesses (``python -m flowers_job ...``, this checkout on
   ``PYTHONPATH``), each with its process tree sampled every 0.5 s (RSS and ``VmHWM`` of the
   driver Python, the driver JVM, Spark's Python workers and each training rank), in this
   order, on one output dir:

   - ``ingest`` of all the files: files/s (files / the ingest's own seconds, from its log
     line), the driver's peak RSS (JVM + Python);
   - ``train`` twice with ``train.epochs=1``, on the tables of that full ingest: the first
     run writes the loader cache from scratch (no cache at all), the second reuses it; each
     run's preparation time (from its start to its first training step: the first progress
     line of epoch 1); of the first, its training images/s (``train_images_per_second`` of
     the epoch), ``loader_cache`` and the rows per shard of ``summary.json``, and the peak
     RSS of each rank. The second is stopped at its first step (``--second-train full``
     runs it to its end): its preparation is what it measures. With ``--train-steps N``
     the first (and the day's) train is stopped once epoch 1 has done N steps, its
     images/s taken from the progress lines (:func:`progress_rate`), and predict skipped;
   - ``ingest`` again with nothing changed (it lists and compares, writes nothing);
   - ``ingest`` again after 1 % new photos (spare variants) were added and 0.1 % deleted: its
     seconds against the full ingest's, the same above the unchanged run's (what the change
     itself cost), and the counts of an incremental ingest when the CLI prints them
     (``files_listed``, ``files_decoded``, ``rows_*``); ``--only-ingest`` stops here
     (``ingest_x<N>.json``; no train runs then, the ingests keep this order);
   - **a day's cycle** (``day`` in the JSON): that incremental ingest is the day's ingest,
     then ``train`` with ``train.epochs=1`` on the new tables version, whose loader cache
     does not exist yet (the first train's, of the previous version, does): a new version's
     first train. Recorded: ``day_seconds`` (the wall seconds of the incremental ingest and
     of this train), its ``preparation_seconds``, ``cache_bytes_written`` per split and
     ``cache_bytes_written_total`` (``bytes_written`` of its ``summary.json``'s
     ``loader_cache``), ``full_cache_bytes`` (what the first train wrote from scratch) and
     ``cache_bytes_vs_full`` (the day's / the full; 1.0 while a new version rewrites the
     whole cache), and the day train's own record (``day.train``). (Before the day step
     existed, the two trains ran after the incremental ingest, on the changed tables: they
     now run before the change, so that the day train is the first on a new version while a
     cache of the previous one exists; they still measure a cache written from scratch and
     then reused, on about 1 % fewer rows.)
   - ``predict --table`` over the test split of the stored images table (``--predict-split``;
     the changed tables, as before): images/s (the report's);
   - with ``--memory-limit SIZE``: a third ``train`` in a memory cgroup of that size
     (``--limited-set`` overrides; ``--limited-driver-memory M``: ``run`` under
     ``spark-submit --driver-memory M`` instead), with the train split's stored size beside
     it (a run on data larger than its memory when the limit is below it);
     ``--only-limited`` runs the full ingest and this train only (``limited_x<N>.json``).

Every step records ``store_bytes_growth`` (the growth of the output dir's ``tables`` and
``loader_cache`` during it) and ``bytes_written``: for an ingest the tables' growth, for a
train the loader cache bytes of its summary (its log's for a train stopped early).

``--store s3`` puts the output dir (the tables, the loader cache, summary.json) in a bucket
of an S3 API server started for the run (``python -m moto.server`` on 127.0.0.1, stopped
at the end whatever happens): every command gets ``--output-dir s3a://<bucket>/out``, the
``AWS_*`` of ``tools/cluster.py``'s ``s3_env`` and ``PYSPARK_SUBMIT_ARGS`` with hadoop-aws
and the ``fs.s3a.*`` settings (as ``tests/support/s3.py``'s ``S3Store.cli_env``), and
``tracking.tracking_uri=sqlite:///<run>/mlflow.db`` (the job refuses its default store under
an object-store output dir). The images stay on the local disk; summary.json and the
sizes are read with boto3. moto keeps the objects in its own process's memory.

``--set KEY=VALUE`` goes to every ingest and train (the data settings must match).

Writes ``<results>/scale_x<N>[_f<F>][_s3].json``, then a Markdown table of every run in that
folder (a column per factor and store) against the 1x run of the same fraction and store
(``scale.md``, also printed). Run from the repository root:

    python benchmarks/scale.py --factor 1 --fraction 0.1      # a few minutes
    python benchmarks/scale.py --factor 1 --fraction 0.1 --store s3
    python benchmarks/scale.py --factor 30 --corpus /work/scale-corpus/x30
    python benchmarks/scale.py --factor 30 --corpus /work/scale-corpus/x30 --store s3
    python benchmarks/scale.py --factor 30 --corpus /work/scale-corpus/x30 --only-limited \
        --set data.image_size=128 --set data.resize_ratio=2 --set data.jpeg_quality=100 \
        --set data.val_fraction=0.05 --set data.test_fraction=0.05 --memory-limit 4.5G \
        --limited-driver-memory 1g --limited-set distributed.num_processes=1
    python benchmarks/scale.py --table                        # the table only, from the JSONs
    python benchmarks/scale.py --factor 100 30 10 1 --train-steps 60  # a day at 4 sizes
    python benchmarks/day_model.py benchmarks/results/<date>  # its fit (day_model.md)

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
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, Protocol

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tools"))

from cluster import (
    DELTA_PACKAGE,
    S3_CREDENTIALS,
    S3_PACKAGES,
    ivy_dir,
    local_s3_server,
    resolve_packages,
    s3_env,
    s3a_conf,
)
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
    r"\b(train|val|test): loader cache (reused|written:) \S+ \(([\d.]+) MiB written, "
    r"(?:appended to \S+, )?([\d.]+) s\)"
)
"""The job's log line of each split's loader cache entry (flowers_job.loaders.cache_dir),
written whole, grown by appending (``appended to <entry>``) or reused."""
TABLE_LINE = re.compile(
    r"\b(train|val|test): \d+ rows read from the table at version \d+ \(no loader cache, "
    r"0 bytes written, ([\d.]+) s\)"
)
"""The job's log line of each split's plan where the loader reads the table itself
(``data.loader=delta``, flowers_job.driver.prepare): the log read, nothing written."""
MARKERS = {
    "split_prepared": re.compile(r"\b(train|val|test): \d+ rows"),
    "ranks_banner": re.compile(r"world_size \d+ \("),
    "first_step": re.compile(r"epoch 1(/\d+)?:\s+0%"),
}
"""Log lines whose last (``split_prepared``) or first arrival time is recorded, seconds
after the command started: the loader plans of the splits (driver), the ranks' banner
(model built, readers open), and the first progress line of epoch 1 (tqdm prints it as the
first batch is asked for: the start of the first training step)."""
PROGRESS_LINE = re.compile(r"epoch 1(?:/\d+)?:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)")
"""A progress line of epoch 1 (rank 0's tqdm, one every 15 s): its steps done and the
epoch's steps."""
GLOBAL_BATCH = re.compile(r"global_batch_size (\d+)")
"""The ranks' banner: images per step."""
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
    stop_when: Callable[[str], bool] | None = None,
    seen: threading.Event | None = None,
) -> None:
    for line in stream:
        with lock:
            sink.append((time.perf_counter() - t0, line.rstrip("\n")))
        if stop_when is not None and seen is not None and stop_when(line):
            seen.set()


def run_cli(
    args: list[str],
    log_path: Path,
    cgroup: MemoryCgroup | None = None,
    stop_at: str | None = None,
    launcher: list[str] | None = None,
    extra_env: dict[str, str] | None = None,
    stop_after_steps: int | None = None,
) -> dict[str, Any]:
    """``python -m flowers_job <args>`` as a user runs it, its tree sampled.

    ``launcher`` replaces ``python -m flowers_job`` (a ``spark-submit ... jobs/train_flowers.py``);
    ``extra_env`` goes on top of this process's environment (:meth:`OutputStore.cli_env`).

    With ``stop_at`` (a name of :data:`MARKERS`), the command's process group is stopped
    (SIGTERM, then SIGKILL after 30 s) once that line arrives: a run measured up to its first
    training step only. ``stopped_at`` then says so, and its exit status is the signal's.
    With ``stop_after_steps``, the same once a progress line of epoch 1 reports that many
    steps done (:data:`PROGRESS_LINE`): a train measured over its first steps only.

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
        **(extra_env or {}),
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
    stop_when: Callable[[str], bool] | None = None
    if stop_at:
        pattern = MARKERS[stop_at]
        stop_when = lambda line: pattern.search(line) is not None  # noqa: E731
    elif stop_after_steps:
        stop_when = lambda line: _steps_done(line) >= stop_after_steps  # noqa: E731
    pumps = [
        threading.Thread(target=_pump, args=(stream, sink, t0, lock, stop_when, seen), daemon=True)
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
        if match := TABLE_LINE.search(text):
            cache_log[match.group(1)] = {
                "reused": False,
                "bytes_written": 0,
                "seconds": float(match.group(2)),
            }
    result = {
        **progress_rate(every),
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


def _steps_done(line: str) -> int:
    """The steps done that a progress line of epoch 1 reports; -1 for another line."""
    match = PROGRESS_LINE.search(line)
    return int(match.group(1)) if match else -1


def progress_rate(lines: list[tuple[float, str]]) -> dict[str, Any]:
    """Training images/s from epoch 1's progress lines (``(seconds, text)``, in order): the
    steps between the first line past step 0 and the last, times ``global_batch_size`` (the
    ranks' banner), over the seconds between those lines. The first step (compilation,
    the readers' first row groups) is left out. None where fewer than two such lines came
    (a train shorter than 15 s)."""
    batch = next((int(m.group(1)) for _, text in lines if (m := GLOBAL_BATCH.search(text))), None)
    points = [(t, _steps_done(text)) for t, text in lines if _steps_done(text) > 0]
    rate = None
    if batch and len(points) >= 2 and points[-1][0] > points[0][0]:
        (t0, s0), (t1, s1) = points[0], points[-1]
        rate = round((s1 - s0) * batch / (t1 - t0), 1)
    return {
        "progress_images_per_second": rate,
        "progress_steps": points[-1][1] if points else 0,
        "global_batch_size": batch,
    }


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


def delta_table_bytes(store: OutputStore, table: str, split: str | None = None) -> int:
    """Bytes of the data files of a Delta table's latest version, or of its partition
    ``split=<split>`` (its JSON log replayed; all Parquet files under it, or under the
    partition's folder, when the log has been checkpointed away). ``table`` is relative to
    the output dir (``tables/images``), on either store."""
    log = f"{table}/_delta_log"
    commits = sorted(n for n in store.files(log) if n.endswith(".json") and "/" not in n)
    if not commits or not commits[0].startswith("0" * 20):
        root = f"{table}/split={split}" if split else table
        return sum(size for name, size in store.files(root).items() if name.endswith(".parquet"))
    live: dict[str, int] = {}
    for commit in commits:
        for line in (store.read_text(f"{log}/{commit}") or "").splitlines():
            action = json.loads(line)
            if "add" in action:
                add = action["add"]
                if split is None or add.get("partitionValues", {}).get("split") == split:
                    live[add["path"]] = int(add["size"])
            elif "remove" in action:
                live.pop(action["remove"]["path"], None)
    return sum(live.values())


# --- the output dir's store ------------------------------------------------------------

S3_SERVER_TIMEOUT = 30.0
"""Bound on the moto server's start (seconds; about 2 s)."""
S3_RESOLVE_TIMEOUT = 600.0
"""Bound on the resolution of the s3a jars into an empty Ivy cache (seconds; 55 to 96 s)."""
STORE_PARTS = ("tables", "loader_cache")
"""The output dir's folders whose growth every step records (``store_bytes_growth``)."""


class OutputStore(Protocol):
    """Where the run's ``--output-dir`` lives (the tables, the loader cache, summary.json);
    every ``sub`` is a path relative to it (``tables/images``, ``summary.json``)."""

    kind: str

    def url(self, sub: str = "") -> str:
        """The output dir (or ``sub`` under it) as the CLI takes it."""
        ...

    def files(self, sub: str = "") -> dict[str, int]:
        """Every file (object) under ``sub``: its path relative to ``sub`` -> bytes."""
        ...

    def read_text(self, sub: str) -> str | None:
        """The file's text, None when there is none."""
        ...

    def modified(self, sub: str) -> float | None:
        """The file's last modification (epoch seconds), None when there is none."""
        ...

    def cli_env(self) -> dict[str, str]:
        """What a CLI subprocess's environment needs on top of this process's."""
        ...

    def submit_args(self) -> list[str]:
        """``spark-submit`` options of a run on this store (``--packages``, ``--conf``)."""
        ...

    def describe(self) -> dict[str, Any]:
        """The store, for the result's JSON."""
        ...


def store_bytes(store: OutputStore, sub: str = "") -> int:
    """Bytes of every file (object) under ``sub``."""
    return sum(store.files(sub).values())


class DiskStore:
    """The output dir on the local disk (``--store disk``)."""

    kind = "disk"

    def __init__(self, root: Path) -> None:
        self.root = root

    def url(self, sub: str = "") -> str:
        return str(self.root / sub) if sub else str(self.root)

    def files(self, sub: str = "") -> dict[str, int]:
        base = self.root / sub
        if not base.is_dir():
            return {}
        out = {}
        for path in base.rglob("*"):
            with contextlib.suppress(OSError):  # removed while listed
                if path.is_file():
                    out[path.relative_to(base).as_posix()] = path.stat().st_size
        return out

    def read_text(self, sub: str) -> str | None:
        with contextlib.suppress(OSError):
            return (self.root / sub).read_text()
        return None

    def modified(self, sub: str) -> float | None:
        with contextlib.suppress(OSError):
            return (self.root / sub).stat().st_mtime
        return None

    def cli_env(self) -> dict[str, str]:
        return {}

    def submit_args(self) -> list[str]:
        return ["--packages", DELTA_PACKAGE]

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "output_dir": self.url()}


class S3OutputStore:
    """The output dir in a bucket of an S3 API server (``--store s3``: moto on 127.0.0.1),
    ``s3a://<bucket>/<prefix>``; read with boto3 (``list_objects_v2``, ``get_object``)."""

    kind = "s3"

    def __init__(self, endpoint: str, bucket: str, prefix: str = "out") -> None:
        import boto3

        self.endpoint, self.bucket, self.prefix = endpoint, bucket, prefix.strip("/")
        self.client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=S3_CREDENTIALS[0],
            aws_secret_access_key=S3_CREDENTIALS[1],
            region_name=s3_env(endpoint)["AWS_DEFAULT_REGION"],
        )

    def key(self, sub: str = "") -> str:
        return f"{self.prefix}/{sub.strip('/')}".rstrip("/")

    def url(self, sub: str = "") -> str:
        return f"s3a://{self.bucket}/{self.key(sub)}"

    def files(self, sub: str = "") -> dict[str, int]:
        prefix = self.key(sub) + "/"
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        )
        return {
            o["Key"][len(prefix) :]: int(o["Size"])
            for page in pages
            for o in page.get("Contents", [])
            if not o["Key"].endswith("/")  # s3a's directory markers
        }

    def read_text(self, sub: str) -> str | None:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.key(sub))["Body"]
        except self.client.exceptions.NoSuchKey:
            return None
        return bytes(body.read()).decode()

    def modified(self, sub: str) -> float | None:
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self.key(sub))
        except self.client.exceptions.ClientError:
            return None
        return float(head["LastModified"].timestamp())

    def spark_conf(self) -> dict[str, str]:
        return {"spark.jars.ivy": str(ivy_dir()), **s3a_conf(self.endpoint)}

    def submit_args(self) -> list[str]:
        """``--packages`` names Delta too: an explicit ``--packages`` wins over the
        ``spark.jars.packages`` of ``configure_spark_with_delta_pip``, which would otherwise
        leave hadoop-aws out (as ``tests/support/s3.py``'s ``S3Store.submit_args``)."""
        args = ["--packages", ",".join(S3_PACKAGES)]
        for key, value in self.spark_conf().items():
            args += ["--conf", f"{key}={value}"]
        return args

    def cli_env(self) -> dict[str, str]:
        """``AWS_*`` (:func:`cluster.s3_env`) and ``PYSPARK_SUBMIT_ARGS``: the local session
        the CLI builds then has hadoop-aws and the ``fs.s3a.*`` settings."""
        return {
            **s3_env(self.endpoint),
            "PYSPARK_SUBMIT_ARGS": shlex.join([*self.submit_args(), "pyspark-shell"]),
        }

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "output_dir": self.url(),
            "endpoint": self.endpoint,
            "server": "moto " + _version("moto"),
        }


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


@contextlib.contextmanager
def output_store(kind: str, run_dir: Path) -> Iterator[OutputStore]:
    """The run's output dir: ``<run>/out`` on disk, or ``s3a://<bucket>/out`` in a fresh
    bucket of a moto server started for the run (the s3a jars resolved into
    ``cluster.ivy_dir()`` first when one is missing)."""
    if kind == "disk":
        yield DiskStore(run_dir / "out")
        return
    seconds = resolve_packages(Path(sys.executable), S3_PACKAGES, ivy_dir(), S3_RESOLVE_TIMEOUT)
    if seconds:
        print(f"resolved {', '.join(S3_PACKAGES)} into {ivy_dir()} in {seconds:.0f} s")
    with local_s3_server(run_dir / "logs" / "moto.log") as endpoint:
        store = S3OutputStore(endpoint, f"flowers-scale-{os.getpid()}")
        store.client.create_bucket(Bucket=store.bucket)
        print(f"S3 server {endpoint}, output {store.url()}", flush=True)
        yield store


# --- the runs --------------------------------------------------------------------------


def train_result(run: dict[str, Any], store: OutputStore) -> dict[str, Any]:
    """A ``train`` run's numbers: its command's, plus its ``summary.json``'s (read from the
    output dir's store), ``bytes_written`` (the loader cache bytes it wrote, all splits)."""
    modified = store.modified("summary.json")
    fresh = modified is not None and modified > run["started_at"]  # not a previous run's
    summary = json.loads(store.read_text("summary.json") or "{}") if fresh else {}
    history = summary.get("history") or [{}]
    first_step = run["markers"].get("first_step", run["markers"].get("ranks_banner"))
    ranks = {k: v for k, v in run["peak_rss_mib"].items() if k.startswith("rank")}
    return {
        **run,
        "preparation_seconds": first_step,
        "preparation_from": "first_step" if "first_step" in run["markers"] else "ranks_banner",
        # a train stopped after --train-steps wrote no summary: its progress lines' rate
        "train_images_per_second": history[0].get("train_images_per_second")
        or run.get("progress_images_per_second"),
        "images_per_second_from": "summary" if history[0] else "progress",
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


def cache_bytes_written(train: dict[str, Any]) -> dict[str, int] | None:
    """Per split, the loader cache bytes a train wrote (``bytes_written`` of its
    ``loader_cache``: summary.json's, or its log's for a run stopped early); None without."""
    uses = train.get("loader_cache")
    if not uses:
        return None
    return {split: int(use.get("bytes_written") or 0) for split, use in sorted(uses.items())}


def day_result(
    ingest: dict[str, Any], train: dict[str, Any], full_cache_bytes: int | None
) -> dict[str, Any]:
    """A day's cycle: the incremental ingest (``ingest``, the day's +1 % / -0.1 % photos)
    and the first train on the new tables version after it (``train``): the day's seconds
    (both walls), the train's preparation, the cache bytes it wrote per split and in total,
    and those against ``full_cache_bytes`` (what the run's first train wrote from scratch)."""
    per_split = cache_bytes_written(train)
    total = sum(per_split.values()) if per_split is not None else None
    walls = (ingest.get("wall_seconds"), train.get("wall_seconds"))
    return {
        "returncode": train["returncode"],
        "stopped_at": train.get("stopped_at"),
        "ingest_step": "incremental_ingest",
        "ingest_wall_seconds": walls[0],
        "ingest_seconds": ingest.get("ingest_seconds"),
        "ingest_bytes_written": ingest.get("bytes_written"),
        "train_wall_seconds": walls[1],
        "preparation_seconds": train.get("preparation_seconds"),
        "cache_bytes_written": per_split,
        "cache_bytes_written_total": total,
        "bytes_written": total,
        "full_cache_bytes": full_cache_bytes,
        "cache_bytes_vs_full": (
            round(total / full_cache_bytes, 3) if total is not None and full_cache_bytes else None
        ),
        "day_seconds": (
            round(walls[0] + walls[1], 1) if walls[0] is not None and walls[1] is not None else None
        ),
        "train": train,
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
    run_dir = work / (f"run-{tag}" + ("_s3" if args.store == "s3" else ""))
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    facts = machine_facts("pyspark", "delta-spark", "torch", "pillow")
    facts["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    photos = len(select_photos(args.photos, args.fraction))
    extra = math.ceil(args.new_fraction * photos * args.factor)
    print(f"corpus {corpus_dir}: {args.factor} x {photos} photos + {extra} spare", flush=True)
    donors = sorted(p for p in work.glob("corpus-*") if p.is_dir() and p != corpus_dir)
    manifest = build_corpus(
        args.photos,
        corpus_dir,
        args.factor,
        fraction=args.fraction,
        extra=extra,
        processes=args.processes,
        donors=donors,
    )
    corpus_info = {k: v for k, v in manifest.items() if k != "files"}
    corpus_info["path"] = str(corpus_dir)
    print(
        f"  {manifest['images_files']} files, {manifest['images_bytes'] / 2**30:.2f} GiB, "
        f"{'reused' if manifest['reused'] else 'generated'} in "
        f"{manifest['generation_seconds']:.0f} s",
        flush=True,
    )
    images = run_dir / "images"
    t0 = time.perf_counter()
    link_tree(corpus_dir / "images", images)
    link_seconds = time.perf_counter() - t0
    head = {"machine": facts, "corpus": corpus_info, "link_seconds": round(link_seconds, 1)}
    with output_store(args.store, run_dir) as store:
        result = _measure_runs(args, save, store, run_dir, corpus_dir, images, head)
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def _measure_runs(
    args: argparse.Namespace,
    save: Callable[[dict[str, Any]], None],
    store: OutputStore,
    run_dir: Path,
    corpus_dir: Path,
    images: Path,
    head: dict[str, Any],
) -> dict[str, Any]:
    """The commands of :func:`measure`, on the output dir ``store``; ``head``: the machine,
    the corpus and the links' seconds, for the JSON."""
    logs = run_dir / "logs"
    env = store.cli_env()
    # the default sqlite store under --output-dir needs a disk: every command's, predict's too
    store_sets = []
    if store.kind != "disk":
        store_sets = ["--set", f"tracking.tracking_uri=sqlite:///{run_dir}/mlflow.db"]
    overrides = [*args.overrides, *store_sets[1::2]]
    sets = [item for override in overrides for item in ("--set", override)]
    out = store.url()
    train_args = ["train", "--output-dir", out, "--set", f"train.epochs={args.epochs}", *sets]
    day_args = ["train", "--output-dir", out, "--set", "train.epochs=1", *sets]
    result: dict[str, Any] = {
        "benchmark": "scale",
        "factor": args.factor,
        "fraction": args.fraction,
        "store": store.describe(),
        **head,
        "settings": {
            "new_fraction": args.new_fraction,
            "delete_fraction": args.delete_fraction,
            "overrides": overrides,
            "train_overrides": [f"train.epochs={args.epochs}", *overrides],
            "day_train_overrides": ["train.epochs=1", *overrides],
            "memory_limit_mib": round(args.memory_limit / MIB) if args.memory_limit else None,
            "limited_overrides": args.limited_overrides,
            "limited_driver_memory": args.limited_driver_memory,
            "train_steps": args.train_steps,
        },
    }
    ingest_args = ["ingest", "--images", str(images), "--output-dir", out, *sets]

    def step(name: str, kind: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run one step, record the growth of the store's tables and loader cache during
        it and its ``bytes_written`` (``kind`` ingest: the tables' growth; train: the
        loader cache bytes of its summary)."""
        print(f"{name} ...", flush=True)
        before = {part: store_bytes(store, part) for part in STORE_PARTS}
        value = fn()
        growth = {part: store_bytes(store, part) - before[part] for part in STORE_PARTS}
        value["store_bytes_growth"] = growth
        if kind == "ingest":
            value["bytes_written"] = growth["tables"]
        elif kind == "train":
            written = cache_bytes_written(value)
            value["bytes_written"] = sum(written.values()) if written is not None else None
        result[name] = value
        print(f"  {_brief(value)}", flush=True)
        save(result)
        return value

    def ingest(log: str) -> dict[str, Any]:
        return ingest_result(run_cli(ingest_args, logs / log, extra_env=env))

    trains = not (args.only_limited or args.only_ingest)
    full = step("full_ingest", "ingest", lambda: ingest("ingest.log"))
    result["train_split_bytes"] = delta_table_bytes(store, "tables/images", "train")
    if trains:  # the loader cache written from scratch, then reused: the version before the day
        step(
            "train_first",
            "train",
            lambda: train_result(
                run_cli(
                    train_args, logs / "t1.log", extra_env=env, stop_after_steps=args.train_steps
                ),
                store,
            ),
        )
        stop_second = "first_step" if args.second_train == "preparation" else None
        step(
            "train_second",
            "train",
            lambda: train_result(
                run_cli(train_args, logs / "t2.log", stop_at=stop_second, extra_env=env), store
            ),
        )
        print(f"  second/first preparation {_ratio_of(result, 'loader_cache')}", flush=True)
        result["loader_cache_bytes_after"] = store_bytes(store, "loader_cache")
    if not args.only_limited:
        same = step("unchanged_ingest", "ingest", lambda: ingest("ingest_unchanged.log"))
        result["change"] = change_images(images, corpus_dir / "extra", args.delete_fraction)
        incr = step("incremental_ingest", "ingest", lambda: ingest("ingest_incremental.log"))
        if full["ingest_seconds"] and incr["ingest_seconds"]:
            incr["vs_full_ingest"] = round(incr["ingest_seconds"] / full["ingest_seconds"], 3)
            if same["ingest_seconds"] is not None:
                # what the change itself cost, above listing and comparing an unchanged root
                incr["above_unchanged_vs_full_ingest"] = round(
                    (incr["ingest_seconds"] - same["ingest_seconds"]) / full["ingest_seconds"], 3
                )
            save(result)
    if trains:
        full_cache = result["train_first"]["bytes_written"]

        def day() -> dict[str, Any]:
            train = train_result(
                run_cli(
                    day_args, logs / "t_day.log", extra_env=env, stop_after_steps=args.train_steps
                ),
                store,
            )
            written = cache_bytes_written(train)
            train["bytes_written"] = sum(written.values()) if written is not None else None
            return day_result(incr, train, full_cache)

        step("day", "day", day)
        result["loader_cache_bytes_after_day"] = store_bytes(store, "loader_cache")
    if trains and not args.train_steps:  # a train stopped early registers no model
        predict_args = [
            "predict",
            "--output-dir",
            out,
            "--table",
            store.url("tables/images"),
            *(["--split", args.predict_split] if args.predict_split != "all" else []),
            "--output-table",
            str(run_dir / "predictions"),
            *store_sets,
        ]
        step(
            "predict",
            "other",
            lambda: _predict_result(run_cli(predict_args, logs / "predict.log", extra_env=env)),
        )
    if args.memory_limit:
        group = MemoryCgroup(args.memory_limit)
        limited_args = train_args + [
            item for override in args.limited_overrides for item in ("--set", override)
        ]
        launcher = None
        if args.limited_driver_memory:  # `run` under spark-submit, as README's local example
            launcher = spark_submit(args.limited_driver_memory, store)
            limited_args = ["--images", str(images), *limited_args[1:]]
        try:
            limited = step(
                "train_limited",
                "train",
                lambda: train_result(
                    run_cli(limited_args, logs / "t3.log", group, launcher=launcher, extra_env=env),
                    store,
                ),
            )
            limited["cgroup"] = group.stats()
        finally:
            group.remove()
        limited["larger_than_memory"] = result["train_split_bytes"] > args.memory_limit
        print(f"  {_brief(limited)}", flush=True)
        save(result)
    return result


def spark_submit(driver_memory: str, store: OutputStore) -> list[str]:
    """``spark-submit`` of this interpreter's pyspark, local mode, a driver JVM of
    ``driver_memory``, Delta's jars (and on S3 hadoop-aws and the ``fs.s3a.*`` settings:
    :meth:`OutputStore.submit_args`), running ``jobs/train_flowers.py`` (``flowers-job run``:
    the ingest finds nothing changed and writes nothing, then trains)."""
    submit = Path(sys.executable).parent / "spark-submit"
    return [
        str(submit),
        "--master",
        "local[*]",
        "--driver-memory",
        driver_memory,
        *store.submit_args(),
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
        "bytes_written",
        "cgroup",
        "day_seconds",
        "cache_bytes_written_total",
        "cache_bytes_vs_full",
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
        "day_seconds": get("day", "day_seconds"),
        "day_preparation_seconds": get("day", "preparation_seconds"),
        "full_cache_mib": _mib(get("day", "full_cache_bytes")),
        "day_cache_mib": _mib(get("day", "cache_bytes_written_total")),
        "day_vs_full_cache_bytes": get("day", "cache_bytes_vs_full"),
    }


def _mib(value: int | None) -> float | None:
    return None if value is None else round(value / MIB, 1)


def store_kind(result: dict[str, Any]) -> str:
    """A result's store (``disk`` for a JSON from before ``--store``)."""
    return str(result.get("store", {}).get("kind", "disk"))


TABLE_ROWS = (
    "ingest_files_per_second",
    "driver_peak_rss_mib",
    "train_images_per_second",
    "rank_peak_rss_mib",
    "predict_images_per_second",
    "incremental_vs_full_ingest",
    "second_vs_first_preparation",
    "second_vs_first_start_to_first_step",
    "day_seconds",
    "day_preparation_seconds",
    "full_cache_mib",
    "day_cache_mib",
    "day_vs_full_cache_bytes",
)
"""The table's rows (:func:`metrics`), in order."""
OWN_RATIOS = {
    "incremental_vs_full_ingest",
    "second_vs_first_preparation",
    "second_vs_first_start_to_first_step",
    "day_vs_full_cache_bytes",
}
"""Rows that are already ratios within one run (no ratio to the 1x)."""


def table(results_dir: Path) -> str:
    """Every ``scale_x<N>*.json`` in ``results_dir`` against the 1x of its fraction and
    store: one column per run, headed by its factor and store (``disk``, ``s3``)."""
    runs = [json.loads(p.read_text()) for p in sorted(results_dir.glob("scale_x*.json"))]
    runs.sort(key=lambda r: (r["fraction"], store_kind(r) != "disk", store_kind(r), r["factor"]))
    lines = []
    for fraction in sorted({r["fraction"] for r in runs}):
        group = [r for r in runs if r["fraction"] == fraction]
        bases = {store_kind(r): r for r in group if r["factor"] == 1}
        head = " | ".join(f"{r['factor']}x {store_kind(r)}" for r in group)
        ratio_head = " | ".join(
            f"{r['factor']}x/1x {store_kind(r)}" for r in group if r["factor"] != 1
        )
        lines += [
            f"Fraction {fraction:g} of the photos; "
            + "; ".join(
                f"{r['factor']}x {store_kind(r)}: {r.get('full_ingest', {}).get('files')} files, "
                f"{r['machine']['date']}, {r['machine']['nproc']} cores, "
                f"{r['machine']['memory_gib']} GiB"
                for r in group
            ),
            "",
            f"| metric | {head} | {ratio_head} | target |".replace("|  |", "|"),
            "|---" * (2 + len(group) + sum(r["factor"] != 1 for r in group)) + "|",
        ]
        for name in TABLE_ROWS:
            values = [metrics(r)[name] for r in group]
            cells = [_num(v) for v in values]
            ratios = []
            for r, v in zip(group, values, strict=True):
                if r["factor"] == 1:
                    continue
                base = bases.get(store_kind(r))
                b = metrics(base)[name] if base else None
                ratios.append("-" if name in OWN_RATIOS else _ratio(v, b))
            op, bound = TARGETS.get(name, ("", None))
            target = f"{op} {bound}x" if bound is not None else "-"
            row = [name, *cells, *ratios, target]
            lines.append("| " + " | ".join(row) + " |")
        lines += [
            "",
            "incremental_vs_full_ingest, second_vs_first_* and day_vs_full_cache_bytes are "
            "ratios within one run (incremental ingest of 1 % / the full ingest; the second "
            "train's preparation (its loader caches, found and reused) / the first's "
            "(written); the same for the time from the command's start to its first training "
            "step, Spark's and the ranks' start included; the loader cache bytes the day's "
            "train wrote for the new tables version / those the first train wrote from "
            "scratch): their target holds for each column. day_seconds: the day's incremental "
            "ingest and its train (train.epochs=1), wall seconds of both commands.",
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


def run_factor(args: argparse.Namespace) -> bool:
    """The runs of ``args.factor`` (:func:`measure`), saved after each step to
    ``<results>/<kind>_x<N>[_f<F>][_s3].json``; True when every command succeeded or was
    stopped on purpose."""
    kind = "limited" if args.only_limited else "ingest" if args.only_ingest else "scale"
    name = f"{kind}_x{args.factor}" + (f"_f{args.fraction:g}" if args.fraction < 1 else "")
    name += "_s3" if args.store == "s3" else ""
    path = args.results / f"{name}.json"
    result = measure(args, lambda r: path.write_text(json.dumps(r, indent=2) + "\n"))
    steps: tuple[str, ...] = ("full_ingest",)
    if not args.only_limited:
        steps += ("unchanged_ingest", "incremental_ingest")
    if not (args.only_limited or args.only_ingest):
        steps += ("train_first", "train_second", "day")
        steps += () if args.train_steps else ("predict",)
    return all(
        k in result and (result[k]["returncode"] == 0 or result[k].get("stopped_at") is not None)
        for k in steps
    )


def _stop(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--factor",
        type=int,
        nargs="+",
        default=[1],
        help="variants per photo (1); several: one run of each, in this order (largest first: "
        "the smaller corpora are then links to its files)",
    )
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
    parser.add_argument(
        "--train-steps",
        type=int,
        help="stop the first and the day's train once epoch 1 has done this many steps, and "
        "take their images/s from the progress lines (one every 15 s): a large factor "
        "measured without two whole epochs (their preparation and cache bytes are whole)",
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
    parser.add_argument(
        "--store",
        choices=("disk", "s3"),
        default="disk",
        help="where --output-dir is (the tables, the loader cache, summary.json): disk (the "
        "default, <work>/run-*/out) or s3 (s3a://<bucket>/out on a moto S3 server started "
        "for the run; the images stay on the disk); the JSON's name gets _s3",
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
        if args.corpus and len(args.factor) > 1:
            parser.error("--corpus names one factor's corpus: give one --factor with it")
        args.results.mkdir(parents=True, exist_ok=True)
        factors = args.factor
        for factor in factors:
            args.factor = factor
            ok = run_factor(args) and ok
    text = table(args.results)
    (args.results / "scale.md").write_text(text + "\n")
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
