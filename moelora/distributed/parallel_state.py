"""Tensor- and expert-parallel process groups over torch.distributed (NCCL on GPUs, gloo on the CPU).

Rank layout: world = tp_size * ep_size, rank = ep_rank * tp_size + tp_rank, so the ranks of one tensor-parallel
group are neighbours (on one host they share NVLink). Attention and the dense layers are split over the tp
group and replicated over ep; the MoE layers (routed and shared experts) are split over the whole world: the
routed experts by expert over ep and by intermediate width over tp, the shared experts by width over all ranks.
So one all-reduce over the world combines an MoE layer, and one over the tp group an attention or dense layer.

No module-level state: `init_parallel` returns the ParallelState that the sharding functions take.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    """This process's place in the tp x ep grid and its process groups (None where the group has one rank)."""

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    tp_group: dist.ProcessGroup | None = None  # the tp_size ranks that share this process's ep_rank
    world_group: dist.ProcessGroup | None = None  # every rank: the MoE layers' all-reduce
    control_group: dist.ProcessGroup | None = None  # every rank, gloo: step metadata broadcast from rank 0 (CPU objects)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.ep_size

    @property
    def rank(self) -> int:
        return self.ep_rank * self.tp_size + self.tp_rank

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1


def init_parallel(tp_size: int = 1, ep_size: int = 1, backend: str | None = None, init_method: str | None = None,
                  rank: int | None = None, world_size: int | None = None,
                  timeout: timedelta | None = None) -> ParallelState:
    """Join (or reuse) the default process group and make the tp groups.

    backend: "nccl" | "gloo" | None (NCCL when CUDA is available, else gloo). init_method/rank/world_size: as
    torch.distributed.init_process_group takes them (None: from the environment, e.g. under torchrun);
    timeout: of the rendezvous and of every collective of this process (None: torch's default).
    Every rank must call this with the same tp_size and ep_size (new_group is collective)."""
    if tp_size < 1 or ep_size < 1:
        raise ValueError(f"tensor_parallel_size={tp_size} and expert_parallel_size={ep_size} must be >= 1")
    if tp_size * ep_size == 1:
        return ParallelState()
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        kw = {} if rank is None else {"rank": rank, "world_size": world_size}
        if timeout is not None:
            kw["timeout"] = timeout
        dist.init_process_group(backend, init_method=init_method, **kw)
    world = dist.get_world_size()
    if world != tp_size * ep_size:
        raise ValueError(f"the process group has {world} ranks, but tensor_parallel_size={tp_size} x "
                         f"expert_parallel_size={ep_size} = {tp_size * ep_size}")
    me = dist.get_rank()
    tp_group = None
    for e in range(ep_size):  # every rank creates every group, in the same order
        g = dist.new_group([e * tp_size + t for t in range(tp_size)], timeout=timeout) if tp_size > 1 else None
        if e == me // tp_size:
            tp_group = g
    control = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return ParallelState(tp_size, me % tp_size, ep_size, me // tp_size, tp_group, dist.group.WORLD, control)


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in a launch by torchrun (or any launcher that sets torchrun's variables)."""

    rank: int
    local_rank: int
    world_size: int


def torchrun_env() -> LaunchEnv | None:
    """RANK / LOCAL_RANK / WORLD_SIZE when RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are all set (as torchrun
    sets them for every process it starts), else None."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    return LaunchEnv(int(env["RANK"]), int(env.get("LOCAL_RANK", "0")), int(env["WORLD_SIZE"]))


def check_launch(tp_size: int, ep_size: int) -> LaunchEnv | None:
    """Under torchrun with more than one process: the launch, after checking that WORLD_SIZE = tp_size x ep_size
    (ValueError naming both otherwise). None without torchrun, or for a torchrun launch of one process that
    asks for one rank."""
    env = torchrun_env()
    if env is None or (env.world_size == 1 and tp_size * ep_size == 1):
        return None
    if env.world_size != tp_size * ep_size:
        raise ValueError(f"torchrun started WORLD_SIZE={env.world_size} processes, but tensor_parallel_size (--tp) "
                         f"{tp_size} x expert_parallel_size (--ep) {ep_size} = {tp_size * ep_size} ranks: launch tp x "
                         "ep processes in all (--nnodes x --nproc-per-node), or change --tp/--ep")
    return env


def all_reduce_(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum t over the group, in place (nothing when the group is None: one rank)."""
    if group is not None:
        dist.all_reduce(t, group=group)
    return t


def free_port() -> int:
    """A TCP port free on this host now (for a single-host launch's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
