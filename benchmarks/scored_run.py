"""``flowers-job`` with the test split scored after every epoch: for benchmarks only
(``sweep.py``'s time to quality, MLPerf Training's measure). Not a setting of the job.

Takes ``flowers-job``'s own arguments and runs its command line, with one change: the
function the driver hands TorchDistributor (:func:`flowers_job.train.rank.train_worker`) is
:func:`train_worker` here, which on every rank wraps
:func:`flowers_job.train.loop.run_epoch` so that after each epoch's training and validation
it also scores the test split, with the weights validation scored
(``TrainState.eval_model``), and adds two metrics to the epoch's: ``benchmark_test_accuracy``
(a fraction) and ``benchmark_test_seconds`` (that pass). They are logged and kept in the
summary's ``history`` with the others, and read by nothing in the job: early stopping and
the best epoch are decided on validation, and the summary's test score is still the one
scored once after training. The pass runs after the epoch's clock has stopped, so
``epoch_seconds`` leaves it out.

TorchDistributor pickles :func:`train_worker` with cloudpickle, by value (this module is the
script, or registered by value), so the ranks need not import this file.

    .venv/bin/python benchmarks/scored_run.py run --images DIR --output-dir OUT --set ...
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flowers_job.train.job_spec import TrainingJob
    from flowers_job.train.state import TrainState

__all__ = ["main", "score_test_split", "train_worker"]

EpochFn = Callable[["TrainState", int], dict[str, float]]


def score_test_split(state: TrainState, epoch: int) -> float:
    """The test split's accuracy (a fraction in [0, 1], all ranks) of the weights that
    validation scores (``state.eval_model``), after ``epoch``. A collective: every rank
    calls it.

    Raises:
        ShardError: a rank read other rows than planned, or a row was dropped or read twice.
    """
    from flowers_job.train.evaluate import evaluate
    from flowers_job.train.metrics import check_shard, check_totals, reduce_sums
    from flowers_job.train.state import open_reader

    plan = state.plans.test
    reader = open_reader(state, plan, train=False)
    try:
        sums = evaluate(
            state.eval_model,
            lambda: reader.epoch(epoch),
            state.criterion,
            state.normalize,
            state.amp_dtype,
        )
    finally:
        reader.close()
    check_shard("test", plan, state.shard, sums)
    (totals,) = reduce_sums([sums], state.ctx)
    check_totals("test", plan, totals)
    return totals.correct / totals.rows


def scoring_test(run_epoch: EpochFn) -> EpochFn:
    """``run_epoch``, then the test split scored (:func:`score_test_split`): its metrics plus
    ``benchmark_test_accuracy`` and ``benchmark_test_seconds``."""

    def run_epoch_and_test(state: TrainState, epoch: int) -> dict[str, float]:
        metrics = run_epoch(state, epoch)
        t0 = time.perf_counter()
        metrics["benchmark_test_accuracy"] = score_test_split(state, epoch)
        metrics["benchmark_test_seconds"] = time.perf_counter() - t0
        return metrics

    run_epoch_and_test.scores_test = True  # type: ignore[attr-defined]
    return run_epoch_and_test


def train_worker(job: TrainingJob) -> dict[str, Any]:
    """On every rank: the job's :func:`~flowers_job.train.rank.train_worker`, with each
    epoch followed by a test pass (:func:`scoring_test`). The ranks are fresh processes
    (torchrun's), whose ``flowers_job.train.rank`` is the job's own."""
    from flowers_job.train import loop
    from flowers_job.train.rank import train_worker as job_worker

    if not getattr(loop.run_epoch, "scores_test", False):
        loop.run_epoch = scoring_test(loop.run_epoch)  # type: ignore[assignment]
    return job_worker(job)


def main(argv: list[str] | None = None) -> int:
    """``flowers-job`` (its arguments, its exit status), the ranks running :func:`train_worker`."""
    from pyspark import cloudpickle

    from flowers_job import cli
    from flowers_job.train import rank

    if __name__ != "__main__":  # imported: the ranks could not import this file by name
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    rank.train_worker = train_worker  # what flowers_job.driver.pipeline hands TorchDistributor
    return cli.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
