"""Torch threads follow the CPUs Ray gives each process.

On a small machine a second process computing with as many intra-op threads as there are
cores slows both 10-40x (threads spin and fight for the same cores). Each process that
computes therefore sets its own thread count from its CPU allocation: an EnvRunner actor
from `num_cpus_per_env_runner`, a learner actor from `num_cpus_per_learner`, the algorithm's
own process from `num_cpus_for_main_process` (see `M2PO.setup`).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def cpus(value, default: int = 1) -> int:
    """An RLlib CPU setting as a thread count: "auto" or 0 -> `default`, fractions round up."""
    if value in (None, "auto") or not value:
        return default
    return max(1, int(-(-float(value) // 1)))


def use_cpus(value, default: int = 1) -> int:
    """Sets this process's torch intra-op threads from a CPU setting; returns the count."""
    n = cpus(value, default)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
