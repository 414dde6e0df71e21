"""The few torch.distributed collectives the losses need, as no-ops without a process group."""

from __future__ import annotations

import torch
import torch.distributed as dist


# A `group` value meaning "this process only", even when torch.distributed is set up.
LOCAL = object()


def world_size(group=None) -> int:
    """Ranks in `group` (None: the default group); 1 for LOCAL or without torch.distributed."""
    if group is LOCAL or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def all_reduce_sum(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum `x` over the ranks of `group` in place and return it; identity on one rank."""
    if world_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def all_gather_cat(x: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate the equal-shaped 1-D `x` of every rank, in rank order."""
    n = world_size(group)
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)
