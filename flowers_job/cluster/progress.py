"""A progress bar of the Spark tasks a block of driver code runs, on classic Spark and Connect."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from pyspark.sql import SparkSession

from flowers_job.cluster.connect import is_connect_session

__all__ = ["task_progress"]


PROGRESS_POLL_SECONDS = 0.5
"""How often :func:`task_progress` reads Spark's StatusTracker, seconds."""
PROGRESS_JOIN_SECONDS = 5.0
"""Longest wait for the progress thread to stop once the block is done, seconds."""


@contextmanager
def task_progress(spark: SparkSession, description: str) -> Iterator[None]:
    """A tqdm bar of the Spark tasks of the jobs run in the block by this thread.

    Classic Spark: StatusTracker, polled every :data:`PROGRESS_POLL_SECONDS` for the jobs of
    a job group; the thread is stopped within :data:`PROGRESS_JOIN_SECONDS` when the block
    ends. Spark Connect has no StatusTracker (no SparkContext): a progress handler
    (``SparkSession.registerProgressHandler``, removed after) gets each operation's stages
    with their task counts as the server reports them (every
    ``spark.connect.progress.reportInterval``, 2 s by default, and at the end), and counts
    only the operations this thread runs, as a job group would."""
    from tqdm import tqdm

    with tqdm(desc=description, unit="task", total=1, dynamic_ncols=True) as bar:
        if is_connect_session(spark):
            with _connect_progress(spark, bar):
                yield
            return
        with _classic_progress(spark, bar, description):
            yield


def _show(bar: Any, total: int, completed: int) -> None:
    bar.total = max(total, 1)
    bar.update(completed - bar.n)


@contextmanager
def _connect_progress(spark: SparkSession, bar: Any) -> Iterator[None]:
    """:func:`task_progress` on Connect: a progress handler drives ``bar``."""
    owner = threading.get_ident()
    lock = threading.Lock()
    seen: dict[tuple[str | None, int], tuple[int, int]] = {}

    def handler(
        stages: Iterable[Any] | None, inflight_tasks: int, operation_id: str | None, done: bool
    ) -> None:  # pyspark calls it with these keywords (pyspark.sql.connect.shell.progress)
        if threading.get_ident() != owner:  # another thread's operation
            return
        with lock:
            for stage in stages or []:
                # a stage skipped (its shuffle output reused) never completes a task
                finished = done or stage.done
                completed = stage.num_tasks if finished else stage.num_completed_tasks
                seen[(operation_id, stage.stage_id)] = (stage.num_tasks, completed)
            _show(bar, sum(t for t, _ in seen.values()), sum(c for _, c in seen.values()))

    # pyspark 4.2 types the handler as its ProgressHandler ABC; it calls any callable
    spark.registerProgressHandler(handler)  # type: ignore[arg-type]
    try:
        yield
    finally:
        spark.removeProgressHandler(handler)  # type: ignore[arg-type]


@contextmanager
def _classic_progress(spark: SparkSession, bar: Any, description: str) -> Iterator[None]:
    """:func:`task_progress` on classic Spark: the StatusTracker of a job group, polled."""
    sc = spark.sparkContext
    group = f"flowers-predict-{uuid.uuid4().hex[:8]}"
    properties = ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel")
    before = {key: sc.getLocalProperty(key) for key in properties}
    sc.setJobGroup(group, description)
    tracker = sc.statusTracker()
    done = threading.Event()

    def counts() -> tuple[int, int]:
        total = completed = 0
        for job_id in tracker.getJobIdsForGroup(group):
            job = tracker.getJobInfo(job_id)
            for stage_id in job.stageIds if job else []:
                stage = tracker.getStageInfo(stage_id)
                if stage is not None:
                    total += stage.numTasks
                    # a stage skipped (its shuffle output reused) never completes a task
                    done_job = job is not None and job.status == "SUCCEEDED"
                    completed += stage.numTasks if done_job else stage.numCompletedTasks
        return total, completed

    def poll() -> None:
        while not done.wait(PROGRESS_POLL_SECONDS):
            _show(bar, *counts())

    thread = threading.Thread(target=poll, name=group, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(PROGRESS_JOIN_SECONDS)
        for key, value in before.items():  # None removes the property
            sc.setLocalProperty(key, value)  # type: ignore[arg-type]
        _show(bar, *counts())
