"""The Delta loader's plan: a split of the table at one version, as the ranks read it."""

from __future__ import annotations

from dataclasses import dataclass

from flowers_job.loaders.base import ShardPlan

__all__ = ["DeltaPlan"]


@dataclass(frozen=True)
class DeltaPlan(ShardPlan):
    """A :class:`ShardPlan` of the table itself: ``cache_dir_url`` is the table's location,
    read at ``version``, its ``split`` partition; ``padding_per_shard`` counts the padding
    rows (``valid = 0``) in ``rows_per_shard``: only where a rank holds fewer real rows than
    steps (a split smaller than the world size's batches), so that no batch is empty.

    With ``model_key`` the table is the ``embeddings`` table (the frozen backbone's
    features of each photo): that key's rows of ``views`` in ``split``, read as features,
    not images."""

    version: int = -1
    split: str = ""
    padding_per_shard: list[int] | None = None
    model_key: str | None = None
    views: list[str] | None = None
