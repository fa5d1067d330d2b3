"""``train.benchmark_test_each_epoch``, for benchmarks only: the test split scored after
every epoch, so that a benchmark can report the time to reach a test accuracy (MLPerf
Training's time-to-quality, benchmarks/sweep.py).

The score is logged with the epoch's metrics (``benchmark_test_accuracy``) and read by
nothing in the job: early stopping and the best epoch are decided on validation, and the
summary's test score is still the one scored once after training
(:func:`~flowers_job.train.evaluate.evaluate_test`). Its pass runs after the epoch's clock
has stopped, so ``epoch_seconds`` leaves it out.
"""

from __future__ import annotations

from flowers_job.train.evaluate import evaluate
from flowers_job.train.metrics import check_shard, check_totals, reduce_sums
from flowers_job.train.state import TrainState, open_reader

__all__ = ["benchmark_test_accuracy"]


def benchmark_test_accuracy(state: TrainState, epoch: int) -> float:
    """The test split's accuracy (a fraction in [0, 1], all ranks) of the weights that
    validation scores (:attr:`~flowers_job.train.state.TrainState.eval_model`), after
    ``epoch``. A collective: every rank calls it.

    Raises:
        ShardError: a rank read other rows than planned, or a row was dropped or read twice.
    """
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
