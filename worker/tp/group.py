"""Joining a tensor-parallel group, and moving plans over it.

torch.distributed over a TCP store on rank 0's node: NCCL for the model's collectives on
CUDA, gloo on CPU. Plans always travel over a gloo (CPU) group: they are small int64
tensors that the receiving ranks read on the host anyway.
"""
from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from worker.model.parallel import TPContext

# A rank waits for the next plan for as long as its engine is idle, so the collective
# timeout cannot bound idleness; a dead peer closes its sockets and fails the collective.
_TIMEOUT = datetime.timedelta(days=1)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_tp_group(rank: int, size: int, host: str, port: int, device: torch.device) -> tuple[TPContext, object]:
    """Join the group (blocks until all `size` ranks have joined). Returns the model's
    TPContext and the CPU group for plans."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=_TIMEOUT)
    plan_group = dist.new_group(backend="gloo", timeout=_TIMEOUT) if backend != "gloo" else dist.group.WORLD
    return TPContext(rank, size, dist.group.WORLD), plan_group


def send_plan(payload: torch.Tensor, group: object) -> None:
    """Rank 0: two broadcasts (length, then the ints)."""
    dist.broadcast(torch.tensor([payload.numel()], dtype=torch.long), src=0, group=group)
    dist.broadcast(payload, src=0, group=group)


def recv_plan(group: object) -> torch.Tensor:
    length = torch.zeros(1, dtype=torch.long)
    dist.broadcast(length, src=0, group=group)
    payload = torch.empty(int(length.item()), dtype=torch.long)
    dist.broadcast(payload, src=0, group=group)
    return payload


def agree_num_blocks(num_blocks: int, group: object) -> int:
    """Every rank must use the same block ids: the smallest pool wins."""
    t = torch.tensor([num_blocks], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def leave_tp_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
