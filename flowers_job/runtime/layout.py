"""Where the ranks of a job sit on its hosts, and which shard each reads: plain data that the
driver computes (:func:`flowers_job.cluster.placement.check_placement`) and every rank uses
(the loaders, the process group). Stdlib only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["HostLayout", "rank_hosts", "ranks_by_host"]


@dataclass(frozen=True)
class HostLayout:
    """How the ranks of a job sit on its hosts, and which shard of the data each reads.

    Spark places the tasks of a barrier stage on its executors in its own order (it
    round-robins over the executors' offers), so global ranks 0 and 2 may share a host
    while rank 1 is on another. A loader that needs consecutive ranks per host (Mosaic
    Streaming derives a rank's node from ``RANK // LOCAL_WORLD_SIZE``) reads shard
    :attr:`shard` instead of the global rank: the ranks' position when they are grouped by
    host (hosts in the order of their lowest rank, ranks ascending within a host). Rank 0
    always reads shard 0, and where the ranks already are consecutive per host, every
    rank's shard is its rank. DDP's process group keeps the global ranks.

    One barrier task may run several ranks, one per GPU of the task (pyspark 4.2+, where
    ``spark.task.resource.gpu.amount`` is above 1): they are consecutive ranks on the task's
    host (:func:`rank_hosts`), and grouping by host keeps them together.

    Attributes:
        hosts: the host of each global rank (index = rank).
        rank: this process's global rank.
        shard: the shard this rank reads, 0..world_size-1 (a permutation of the ranks).
        local_rank: this rank's index among the ranks of its host, 0-based.
        local_world_size: ranks on this rank's host.
        num_nodes: number of hosts.
    """

    hosts: tuple[str, ...]
    rank: int
    shard: int
    local_rank: int
    local_world_size: int
    num_nodes: int

    @classmethod
    def of(cls, hosts: Sequence[str], rank: int) -> HostLayout:
        """The layout of ranks whose hosts are ``hosts`` (index = global rank), seen from
        ``rank``.

        Raises:
            ValueError: ``rank`` is not an index of ``hosts``.
        """
        if not 0 <= rank < len(hosts):
            raise ValueError(f"rank {rank} is not one of the {len(hosts)} ranks")
        groups = ranks_by_host(hosts)
        shard = 0
        for host, ranks in groups.items():
            if host == hosts[rank]:
                return cls(
                    tuple(hosts),
                    rank,
                    shard + ranks.index(rank),
                    ranks.index(rank),
                    len(ranks),
                    len(groups),
                )
            shard += len(ranks)
        raise AssertionError("unreachable: every rank's host is a group")

    @property
    def equal(self) -> bool:
        """Every host runs the same number of ranks (what Mosaic Streaming can serve)."""
        return len({len(r) for r in ranks_by_host(self.hosts).values()}) == 1

    def describe(self) -> str:
        """``"fl-w1: ranks 0, 2; fl-w2: ranks 1, 3"``: the ranks on each host."""
        return "; ".join(
            f"{host}: rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
            for host, ranks in ranks_by_host(self.hosts).items()
        )


def rank_hosts(task_hosts: Sequence[str], processes_per_task: int = 1) -> list[str]:
    """The host of each global rank (index = ``RANK``) of a barrier stage whose tasks
    (index = partition id) ran on ``task_hosts``, each running ``processes_per_task`` ranks.

    TorchDistributor starts one ``torchrun`` per task with ``--node_rank`` = the task's
    partition id and ``--nproc_per_node`` = ``processes_per_task`` (pyspark 4.2+: the GPUs in
    the task's ``CUDA_VISIBLE_DEVICES``; before, 1), and torchrun's static rendezvous numbers
    a node's workers from ``node_rank * nproc_per_node`` (``RANK = node_rank * nproc_per_node
    + LOCAL_RANK``), so task ``i`` runs ranks ``i * processes_per_task`` to
    ``(i + 1) * processes_per_task - 1``, all on its host. Rule: SPARK-41916,
    https://github.com/apache/spark/pull/53501.

    Raises:
        ValueError: ``processes_per_task`` is below 1.
    """
    if processes_per_task < 1:
        raise ValueError(f"processes_per_task must be at least 1, not {processes_per_task}")
    return [host for host in task_hosts for _ in range(processes_per_task)]


def ranks_by_host(hosts: Sequence[str]) -> dict[str, list[int]]:
    """``{host: its global ranks, ascending}``, hosts in the order of their lowest rank."""
    groups: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        groups.setdefault(host, []).append(rank)
    return groups
