"""What the driver hands every rank: one frozen, typed value, pickled once by TorchDistributor
(``TorchDistributor.run(train_worker, job)``) and read by attribute on the ranks.

Each value has one source: the driver sets it once (:func:`flowers_job.driver.pipeline.
training_job`), and the ranks derive everything else from it. It holds no secret: the
configuration is ``JobConfig.model_dump(mode="json")``, which leaves the secret fields out, and
the ranks get credentials from their environment only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flowers_job.config import JobConfig
    from flowers_job.loaders.base import Loader

__all__ = ["SPLITS", "TrainingJob"]

SPLITS = ("train", "val", "test")
"""The splits a job carries a shard plan for, in this order."""


@dataclass(frozen=True)
class TrainingJob:
    """The job of every rank of one TorchDistributor run.

    Attributes:
        config: the validated configuration, ``JobConfig.model_dump(mode="json")`` (no
            secret field); :meth:`job_config` validates it again on the rank.
        plans: split name (:data:`SPLITS`) -> its shard plan, ``ShardPlan.to_dict()``.
        loader: the loader class the driver resolved (pickled by reference: each rank
            imports its module), whose ``plan_type`` rebuilds the plans.
        report_dir: the run's report dir (a path or an object-store URL), where ranks
            write ``rank-<r>.json``, ``ranks.json`` and ``model.json``.
        label_names: class names, in ``label_index`` order.
        lineage: the Delta versions and digests the model was trained from (MLflow params).
        example_images: a few stored JPEGs, bytes, the registered model's input example.
        use_gpu: whether ranks train on CUDA (NCCL) or on the CPU (gloo).
        threads_per_process: intra-op threads of each rank; None: from the executor's
            cores (:func:`flowers_job.train.rank.threads_for_rank`).
        executor_cores: executor host (address or name) -> its cores; empty in local mode.
        task_cpus: ``spark.task.cpus``, the fewest threads a barrier-mode rank gets.
        memory_settings: the settings that decide a rank's memory, by dotted name, with
            their values (the batch, the decoding workers and the loader's own), for the
            watchdog's out-of-memory report.
        driver: the driver's identity
            (:func:`~flowers_job.runtime.parent_watch.driver_identity`): a rank exits if
            that process dies; None: not watched.
        attempt: 0, or the automatic restart's number (:mod:`flowers_job.driver.restarts`).
    """

    config: dict[str, Any]
    plans: dict[str, dict[str, Any]]
    loader: type[Loader]
    report_dir: str
    label_names: tuple[str, ...] = ()
    lineage: dict[str, Any] = field(default_factory=dict)
    example_images: tuple[bytes, ...] = ()
    use_gpu: bool = False
    threads_per_process: int | None = None
    executor_cores: dict[str, int] = field(default_factory=dict)
    task_cpus: int = 1
    memory_settings: dict[str, str] = field(default_factory=dict)
    driver: dict[str, Any] | None = None
    attempt: int = 0

    def job_config(self) -> JobConfig:
        """The configuration, validated again on this rank.

        Raises:
            pydantic.ValidationError: the configuration is not valid here (a rank's
                package differs from the driver's).
        """
        from flowers_job.config import JobConfig

        return JobConfig.model_validate(self.config)

    @property
    def timeout_seconds(self) -> Any:
        """``distributed.timeout_seconds`` as the configuration holds it (None if absent), for
        messages written before the configuration is validated."""
        return self.config.get("distributed", {}).get("timeout_seconds")
