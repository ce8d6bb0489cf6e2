"""A trainer rank's process group: joining it, the policy's seed, and the few collectives on values
(not tensors of the model) that a step takes."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from polyrl_runtime.algorithms.advantages import AdvantageStats, merge_agent_stats
from polyrl_runtime.trainers.build import cuda_device_index
from polyrl_runtime.trainers.deepspeed_import import import_deepspeed


def join_process_group(
    master_addr: str, master_port: int, *, rank: int, world: int, local_rank: int, cuda: bool
) -> torch.device:
    """Join the trainer's process group (rendezvous at `master_addr:master_port`; a process that
    joined it already keeps it); the rank's device."""
    import torch.distributed as dist

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    device = torch.device("cpu")
    device_index = 0
    if cuda:
        device_index = cuda_device_index(local_rank, torch.cuda.device_count())
        torch.cuda.set_device(device_index)
        device = torch.device("cuda", device_index)
    if not dist.is_initialized():
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            # DeepSpeed selects the CUDA device by LOCAL_RANK: the index of this rank's own device.
            LOCAL_RANK=str(device_index),
        )
    # DeepSpeed's communication backend, over torch's group (which it starts when there is none)
    import_deepspeed().init_distributed(dist_backend="nccl" if cuda else "gloo")
    return device


def allreduce(values: list[float], *, world: int, cuda: bool, op: str = "sum") -> list[float]:
    """`values` summed (or their maximum) over the trainer's process group, in float64."""
    if world == 1:
        return values
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    if cuda:
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return [float(x) for x in t.cpu()]


def gather_agent_stats(local: Mapping[str, AdvantageStats], *, world: int) -> dict[str, AdvantageStats]:
    """Every agent's statistics merged over the trainer's process group (ranks may hold different
    agents) from this rank's `local` ones."""
    if world == 1:
        return dict(local)
    import torch.distributed as dist

    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, local)
    return merge_agent_stats(parts)
