"""Ranks, devices and collectives. The only module that reads RANK, LOCAL_RANK, WORLD_SIZE.

TorchDistributor starts the training function under ``torchrun``, which sets
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR``/``MASTER_PORT``.
Every collective here runs on *all* ranks; none may be called from a rank-0-only branch.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from flowers_job.runtime.devices import check_own_gpus, gpu_identity, rank_device

if TYPE_CHECKING:  # placement is the driver's: it imports pyspark
    from flowers_job.runtime.layout import HostLayout

__all__ = [
    "DistContext",
    "all_gather_object",
    "all_reduce_sum",
    "all_reduce_sum_int64",
    "broadcast_flag",
    "broadcast_object",
    "describe_hosts",
    "env_rank",
    "gather_ranks",
    "init_distributed",
    "rank_address",
    "set_socket_interface",
    "shard_environment",
    "shutdown_distributed",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job.

    Attributes:
        rank: global rank, 0..world_size-1.
        local_rank: rank on this node; selects the GPU.
        world_size: number of training processes.
        device: ``cuda:<local_rank>`` or ``cpu``.
        backend: 'nccl' or 'gloo'.
    """

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """Rank 0: the only rank that logs, checkpoints and talks to MLflow."""
        return self.rank == 0


def init_distributed(
    *,
    use_gpu: bool,
    backend: Literal["auto", "nccl", "gloo"] = "auto",
    timeout_seconds: float = 600.0,
    threads_per_process: int | None = None,
) -> DistContext:
    """Join the process group described by the torchrun environment.

    Args:
        use_gpu: put this rank on ``cuda:<LOCAL_RANK>``.
        backend: 'auto' = nccl on GPU, gloo on CPU.
        timeout_seconds: process-group timeout; a collective waiting longer raises.
        threads_per_process: intra-op CPU threads for torch (None = leave as is).

    Returns:
        The :class:`DistContext` of this process.

    Raises:
        KeyError: RANK/WORLD_SIZE are not set (not started by torchrun).
        RuntimeError: no GPU of its own although ``use_gpu``
            (:func:`~flowers_job.runtime.devices.rank_device`), or the rendezvous fails or times out.
    """
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = rank_device(rank, local_rank, use_gpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if threads_per_process:
        torch.set_num_threads(threads_per_process)
    chosen = ("nccl" if use_gpu else "gloo") if backend == "auto" else backend
    set_socket_interface()
    if not dist.is_initialized():
        dist.init_process_group(
            backend=chosen,
            timeout=timedelta(seconds=timeout_seconds),
            rank=rank,
            world_size=world_size,
            device_id=device if chosen == "nccl" else None,
        )
    return DistContext(rank, local_rank, world_size, device, chosen)


def shutdown_distributed() -> None:
    """Leave the process group (no-op if not initialised)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: Sequence[float], ctx: DistContext) -> list[float]:
    """Element-wise sum of ``values`` over all ranks, in float64 (losses, not counts: use
    :func:`all_reduce_sum_int64` for those)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [float(x) for x in t.cpu().tolist()]


def all_reduce_sum_int64(values: Sequence[int], ctx: DistContext) -> list[int]:
    """Element-wise sum of ``values`` (each a signed int64) over all ranks, as int64: exact,
    and wrapping modulo 2**64 like any int64 addition (row checksums rely on it).

    Raises:
        RuntimeError: a value outside int64 (torch refuses to build the tensor), or the
            collective fails or times out.
    """
    t = torch.tensor(list(values), dtype=torch.int64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [int(x) for x in t.cpu().tolist()]


def broadcast_flag(value: bool, ctx: DistContext, src: int = 0) -> bool:
    """``src``'s ``value`` on every rank: one broadcast of a one-element int32 tensor on the
    rank's device (a host sync on a GPU: call it every few steps, not every step).

    Raises:
        RuntimeError: the collective fails or times out (``distributed.timeout_seconds``).
    """
    t = torch.tensor([int(value)], dtype=torch.int32, device=ctx.device)
    _settle(dist.broadcast(t, src=src, async_op=True), t)
    return bool(t.item())


def broadcast_tensor(tensor: torch.Tensor, ctx: DistContext, src: int = 0) -> None:
    """Overwrite ``tensor`` (on the rank's device, any shape and dtype) with ``src``'s, in
    place, on every rank; returns once the process group has released it (:func:`_settle`).

    Raises:
        RuntimeError: the collective fails or times out (``distributed.timeout_seconds``).
    """
    _settle(dist.broadcast(tensor, src=src, async_op=True), tensor)


def broadcast_object(obj: Any, ctx: DistContext, src: int = 0) -> Any:
    """Return ``src``'s ``obj`` on every rank (pickled; keep it small).

    Two broadcasts, the pickle's size (int64, shape ``(1,)``) then its bytes (uint8, shape
    ``(size,)``), as ``torch.distributed.broadcast_object_list`` does, with one difference:
    this returns only once the process group's threads have released both tensors
    (:func:`_settle`). ``train_worker`` ends with this collective, and the process exits
    right after it; a gloo worker thread that drops the last reference to a tensor created
    in Python must take the GIL, and if the interpreter has begun finalizing by then the
    thread exits inside C++ and the rank dies of SIGABRT ("terminate called without an
    active exception"; core dumps here show ``ProcessGroupGloo::runLoop`` destroying an
    ``AsyncBroadcastWork``). DDP keeps the process group, and so its threads, alive past
    ``destroy_process_group`` (torch 2.13), so leaving the group does not join them.
    pytorch/pytorch#179291 describes the same teardown race.

    Raises:
        RuntimeError: the collective fails or times out (``distributed.timeout_seconds``).
    """
    payload = pickle.dumps(obj) if ctx.rank == src else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=ctx.device)
    _settle(dist.broadcast(size, src=src, async_op=True), size)
    if ctx.rank == src:
        # Memory torch owns (a copy): a tensor over a Python buffer frees it through a deleter
        # that takes the GIL, which a gloo thread releasing the tensor last at exit cannot.
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(ctx.device, copy=True)
    else:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=ctx.device)
    _settle(dist.broadcast(data, src=src, async_op=True), data)
    return obj if ctx.rank == src else pickle.loads(data.cpu().numpy().tobytes())


SETTLE_SECONDS = 30.0
"""Upper bound of :func:`_settle`'s wait (seconds) for the process group to release a tensor."""


def _settle(work: dist.Work | None, tensor: torch.Tensor) -> None:
    """Wait for ``work``; then, for a CPU tensor (gloo), until the process group's threads
    hold no reference to ``tensor`` (its use count is back to this frame's one), polling
    every millisecond with the GIL released, for at most :data:`SETTLE_SECONDS`; past that,
    log and go on.

    Why: gloo's worker threads can still hold the finished work, and its tensor, after
    ``wait()`` returns; a rank that exits then aborts (SIGABRT) in interpreter teardown
    (docs/known-issues.md, "torch"; pytorch/pytorch#179291). torch offers no public count
    of a tensor's holders, so this reads the private ``Tensor._use_count``; a torch without
    it skips the wait."""
    if work is not None:
        work.wait()
        del work  # the Work object holds the tensor too
    if tensor.device.type != "cpu":
        return  # NCCL's watchdog retires its work items on its own schedule (untested here)
    use_count = getattr(tensor, "_use_count", None)
    if use_count is None:
        return
    deadline = time.monotonic() + SETTLE_SECONDS
    while use_count() > 1:
        if time.monotonic() > deadline:
            log.warning(
                "the process group still holds a tensor %.0f s after its collective",
                SETTLE_SECONDS,
            )
            return
        time.sleep(0.001)


def all_gather_object(obj: Any, ctx: DistContext) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (pickled; a collective)."""
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def env_rank() -> int | None:
    """This process's global rank from the torchrun environment, or None outside torchrun."""
    value = os.environ.get("RANK")
    return int(value) if value is not None else None


def rank_address() -> str | None:
    """The address this rank's host uses in the Spark cluster, as an IP string.

    ``SPARK_LOCAL_IP`` when set (Spark binds and advertises it); otherwise the source address
    of this host's route to ``MASTER_ADDR`` (rank 0's executor address in barrier mode, the
    local host in local mode): the interface the other ranks reach this host through. Not
    the host name's address: on many clusters (Debian's default ``/etc/hosts``) the host
    name resolves to 127.0.1.1. None when neither can be determined.
    """
    local_ip = os.environ.get("SPARK_LOCAL_IP")
    if local_ip:
        return local_ip
    master = os.environ.get("MASTER_ADDR")
    if not master:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))  # no packet sent
            return str(s.getsockname()[0])
    except OSError:
        return None


def set_socket_interface() -> str | None:
    """Point gloo and NCCL at the interface of :func:`rank_address`.

    gloo (and NCCL's bootstrap) otherwise pick their address from the host name, which on
    a host whose name resolves to loopback makes every peer dial 127.0.x.x and the
    rendezvous fail with "Gloo connectFullMesh failed ... timed out connecting".
    ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` already set (by the user, or
    ``spark.executorEnv.*``) are left as they are.

    Returns:
        The interface name now in ``GLOO_SOCKET_IFNAME``, or None when none was derived.
    """
    import psutil

    address = rank_address()
    iface = None
    if address:
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address == address for a in addrs):
                iface = name
                break
    if iface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)
    return os.environ.get("GLOO_SOCKET_IFNAME")


def gather_ranks(ctx: DistContext) -> list[dict[str, Any]]:
    """Every rank's ``{"rank", "host", "address", "pid", "interface", "allocator", "gpu"}``,
    in rank order.

    A collective (every rank calls it): host name, :func:`rank_address`, process id, the
    socket interface, the memory allocator (:func:`~flowers_job.runtime.allocator.allocator_report`)
    and the GPU's UUID (:func:`~flowers_job.runtime.devices.gpu_identity`) of each rank, for the
    summary, :func:`describe_hosts` and :func:`~flowers_job.runtime.devices.check_own_gpus`.
    """
    from flowers_job.runtime.allocator import allocator_report

    me = {
        "rank": ctx.rank,
        "host": socket.gethostname(),
        "address": rank_address(),
        "pid": os.getpid(),
        "interface": os.environ.get("GLOO_SOCKET_IFNAME"),
        "allocator": allocator_report(),
        "gpu": gpu_identity(ctx.device),
    }
    ranks: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(ranks, me)
    return ranks


def describe_hosts(ctx: DistContext, ranks: list[dict[str, Any]] | None = None) -> HostLayout:
    """The :class:`HostLayout` of the job; makes ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``
    describe the ranks that share this host.

    A collective (every rank calls it) unless ``ranks`` (:func:`gather_ranks`) is given.
    torchrun sets those variables per torchrun "node", and TorchDistributor's barrier mode
    starts one torchrun per Spark task, so two ranks on one executor host both claim
    ``LOCAL_RANK=0, LOCAL_WORLD_SIZE=1``. Mosaic Streaming reads them to decide which
    processes share its shared memory and local files; two "local leaders" on one host
    would collide. The host names are all-gathered and the variables rewritten (torch
    itself no longer reads them once the group is up). ``RANK`` keeps the global rank
    (failure reports name it); :func:`shard_environment` gives a loader the shard instead.
    """
    from flowers_job.runtime.layout import HostLayout

    ranks = ranks if ranks is not None else gather_ranks(ctx)
    check_own_gpus(ranks)
    hosts = [r["host"] for r in ranks]
    layout = HostLayout.of(hosts, ctx.rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(layout.local_world_size)
    os.environ["LOCAL_RANK"] = str(layout.local_rank)
    return layout


@contextmanager
def shard_environment(shard: int) -> Iterator[None]:
    """``RANK`` set to ``shard`` (:attr:`HostLayout.shard`) inside the block, the global
    rank again after it: for a loader that reads its rank from the environment while it is
    built (Mosaic Streaming's ``World.detect``), so that consecutive "ranks" share a host."""
    saved = os.environ.get("RANK")
    os.environ["RANK"] = str(shard)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("RANK", None)
        else:
            os.environ["RANK"] = saved
