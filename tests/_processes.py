"""The processes a job under test started, and the check that they end with it."""

from __future__ import annotations

import psutil


def ray_processes_of(pid: int) -> list[psutil.Process]:
    """Every process below `pid` (its local Ray: GCS, raylet, agents, workers), less the
    watchdog that ends them (`m2po_rllib/common/ray_watchdog.py`)."""
    return [p for p in psutil.Process(pid).children(recursive=True) if "ray_watchdog" not in " ".join(p.cmdline())]


def assert_all_end(processes: list[psutil.Process], after: str, timeout_s: float = 30) -> None:
    """Each of `processes` is gone within `timeout_s` (`after`: what happened, for the message)."""
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    assert not alive, f"left running {after}: {[p.cmdline()[:2] for p in alive]}"
