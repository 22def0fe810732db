"""Data-parallel training under torchrun: one process per GPU, gradients averaged in one message."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def init_distributed(cfg) -> tuple[int, int, torch.device]:
    """Data parallel when started by torchrun (WORLD_SIZE > 1): one process per GPU (cuda:LOCAL_RANK),
    NCCL on CUDA and gloo on CPU. -> (rank, world size, device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if world == 1:
        return 0, 1, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():  # data generation can take hours before the first collective
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(hours=4))
    return dist.get_rank(), world, device


def average(tensors: list[torch.Tensor], world: int) -> None:
    """All-reduce and average in place (gradients, logged scalars) in one flat message."""
    if world == 1:
        return
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    dist.all_reduce(flat)
    flat /= world
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view_as(t))


def check_in_sync(params: list[torch.Tensor], world: int) -> None:
    """Every rank must hold the same weights; a missed gradient reduction shows up here."""
    if world == 1:
        return
    with torch.no_grad():
        mine = torch.stack([p.double().sum() for p in params])
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
    if any(not torch.allclose(e, everyone[0], rtol=1e-6, atol=1e-6) for e in everyone):
        raise RuntimeError("data-parallel ranks hold different drafter weights")
