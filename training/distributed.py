"""Process-group set-up from torchrun's (or srun's) environment, and small collectives.

One process per GPU (or CPU rank under gloo). ``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` come from
torchrun; under a bare ``srun`` they are derived from ``SLURM_NTASKS``/``SLURM_PROCID``/
``SLURM_LOCALID``. The device mesh is 1-D (``shard``) for FSDP, or 2-D (``replicate``, ``shard``)
for HSDP when ``replicate > 1``.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    mesh: DeviceMesh | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_from_slurm() -> None:
    """Fill torchrun's variables from Slurm's when a bare ``srun`` started us."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) < 2:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(device: str, replicate: int = 1, timeout_s: float = 600, shard_alone: bool = False) -> DistInfo:
    """Initialise the process group (NCCL on GPUs, gloo on CPU) and the device mesh.

    Args:
        device: ``auto``, ``cpu`` or ``cuda``.
        replicate: HSDP replica groups (e.g. the number of nodes); 1 means plain FSDP.
        timeout_s: how long a collective waits for the slowest rank before the job fails
            (``parallel.timeout_s``); it must outlast the longest step, validation or checkpoint
            save (a 1.9b save of 19 GB took about 31 s on one H200, 2026-11).
        shard_alone: also build a process group and a mesh of one in a single process, so that
            FSDP runs there too (benchmarks' like-for-like one-GPU baseline).
    """
    _env_from_slurm()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but no CUDA GPU is visible. Fix: device=cpu or device=auto.")
    if world == 1 and not shard_alone:
        return DistInfo(device=torch.device("cuda" if use_cuda else "cpu"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if world == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    if world % replicate:
        raise ValueError(f"world size {world} is not divisible by parallel.replicate={replicate}")
    if replicate > 1:
        mesh = init_device_mesh(dev.type, (replicate, world // replicate), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("shard",))
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev, mesh=mesh)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    """Mean of a scalar tensor over ranks (identity in one process)."""
    if dist.is_initialized():
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return value


def all_reduce_max(value: torch.Tensor) -> torch.Tensor:
    """Max of a scalar tensor over ranks (identity in one process); NaN wins."""
    if dist.is_initialized():
        finite_or_inf = torch.nan_to_num(value, nan=0.0, posinf=math.inf, neginf=-math.inf)
        both = torch.stack([finite_or_inf, value.isnan().to(value.dtype)])
        dist.all_reduce(both, op=dist.ReduceOp.MAX)  # NaN's order under MAX differs by backend
        value = torch.where(both[1] > 0, torch.full_like(value, float("nan")), both[0])
    return value


class AnyRankLagged:
    """Whether a flag polled once per step is true on any rank, agreed one poll late so that no
    step waits for the GPU: each poll starts the all-reduce of this step's flag (non-blocking) and
    returns the result of the previous poll's, whose copy to the host was queued behind the
    steps before. Every rank gets the same answer at the same poll. In one process the flag
    itself, at once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None

    def poll(self, flag: bool) -> bool:
        if not dist.is_initialized():
            return flag
        agreed = False
        if self._pending is not None:
            host, done = self._pending
            if done is not None:
                done.synchronize()
            agreed = bool(host.item())
        t = torch.full((1,), 1.0 if flag else 0.0, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True).wait()  # the stream waits, not the host
        if self.device.type == "cuda":
            host = torch.empty(1, pin_memory=True)
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host, done = t, None
        self._pending = host, done
        return agreed


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (0 and 1 without a process group)."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` in one process)."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj):
    """Rank 0's ``obj`` on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
