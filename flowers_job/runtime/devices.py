"""Which device a process computes on: a training rank's own GPU, the served model's device.

A rank on a GPU host must have a GPU of its own. Spark gives each barrier task the GPUs of
its ``spark.task.resource.gpu.amount`` (TorchDistributor turns them into
``CUDA_VISIBLE_DEVICES``); in local mode every process sees the driver's
``spark.driver.resource.gpu.amount`` GPUs and takes the one of its ``LOCAL_RANK``. A
misconfigured cluster (no GPU resources, or fewer GPUs than ranks) used to put two ranks on
one GPU silently (``local_rank % device_count()``): twice the memory, half the speed, and
NCCL refuses two ranks on one device only at its first collective, if at all. Here each rank
checks before any work (:func:`rank_device`), and once the ranks have gathered, no two on a
host may name the same GPU (:func:`check_own_gpus`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "GPU_RESOURCE_HINT",
    "check_own_gpus",
    "gpu_identity",
    "rank_device",
    "serving_device",
]

GPU_RESOURCE_HINT = (
    "give every rank a GPU of its own: on a cluster spark.task.resource.gpu.amount=1 with "
    "spark.executor.resource.gpu.amount and spark.executor.resource.gpu.discoveryScript "
    "(Spark's examples/src/main/scripts/getGpusResources.sh); in local mode "
    "spark.driver.resource.gpu.amount=<distributed.num_processes> with "
    "spark.driver.resource.gpu.discoveryScript; or run fewer distributed.num_processes"
)


def rank_device(rank: int, local_rank: int, use_gpu: bool) -> torch.device:
    """The device of rank ``rank``: ``cuda:<local_rank>`` with ``use_gpu``, else the CPU.

    Raises:
        RuntimeError: ``use_gpu`` and CUDA is unavailable, or this process sees no GPU for
            its ``local_rank`` (naming the GPUs it sees and the Spark settings to fix).
    """
    if not use_gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"rank {rank}: use_gpu is set but CUDA is not available")
    count = torch.cuda.device_count()
    if local_rank >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        raise RuntimeError(
            f"rank {rank}: LOCAL_RANK {local_rank} has no GPU of its own; this process sees "
            f"{count} GPU(s) (CUDA_VISIBLE_DEVICES={visible}): {GPU_RESOURCE_HINT}"
        )
    return torch.device("cuda", local_rank)


def gpu_identity(device: torch.device) -> str | None:
    """The GPU's UUID (the same in every process whatever ``CUDA_VISIBLE_DEVICES`` says),
    or its PCI bus id where torch has no UUID; None on a CPU."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid)
    return str(getattr(props, "pci_bus_id", device))


def check_own_gpus(ranks: Sequence[dict[str, Any]]) -> None:
    """No two ranks on one host share a GPU. Every rank runs it on the same gathered list
    (:func:`~flowers_job.runtime.process_group.gather_ranks`), so all refuse together.

    Args:
        ranks: per rank ``{"rank", "host", "gpu"}`` (``gpu``: :func:`gpu_identity`).

    Raises:
        RuntimeError: naming the host, the GPU and the ranks that share it.
    """
    seen: dict[tuple[str, str], list[int]] = {}
    for r in ranks:
        if r.get("gpu"):
            seen.setdefault((str(r["host"]), str(r["gpu"])), []).append(int(r["rank"]))
    shared = {key: ids for key, ids in seen.items() if len(ids) > 1}
    if shared:
        what = "; ".join(
            f"ranks {', '.join(map(str, ids))} on {host} share GPU {gpu}"
            for (host, gpu), ids in shared.items()
        )
        raise RuntimeError(f"{what}: {GPU_RESOURCE_HINT}")


def serving_device(choice: str | None = None) -> torch.device:
    """The served model's device: ``choice``, else ``FLOWERS_SERVING_DEVICE``, else 'auto'.

    'auto': the first GPU when CUDA is available (Databricks GPU Model Serving, ``predict``
    on GPU executors), else the CPU; 'cpu'; 'cuda' (or 'cuda:N').

    Raises:
        ValueError: an unknown choice, or 'cuda' without CUDA.
    """
    choice = (choice or os.environ.get("FLOWERS_SERVING_DEVICE") or "auto").strip().lower()
    if choice == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if choice == "cpu":
        return torch.device("cpu")
    if choice.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"FLOWERS_SERVING_DEVICE={choice}: CUDA is not available here")
        return torch.device(choice if ":" in choice else "cuda:0")
    raise ValueError(f"FLOWERS_SERVING_DEVICE={choice!r}: expected auto, cpu or cuda[:N]")
