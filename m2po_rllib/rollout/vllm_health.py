"""Is a `vllm.LLM` alive: its engine-core processes and workers, read from outside, so that
`VLLMEngine` can say an engine died (and how) before a call hangs on it."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True if `pid` runs and is not a zombie (a killed worker its parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: existence only
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def engine_core_processes(llm) -> list:
    """The engine-core processes (multiprocessing.Process), if vLLM runs them out of process
    (VLLM_ENABLE_V1_MULTIPROCESSING=1, the default)."""
    resources = getattr(llm.llm_engine.engine_core, "resources", None)
    manager = getattr(resources, "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


def find_death(llm, core_processes: list, worker_pids: list[int]) -> str | None:
    """How the engine died (vLLM's own flag, an engine-core process gone, a worker gone), or None."""
    resources = getattr(llm.llm_engine.engine_core, "resources", None)
    if getattr(resources, "engine_dead", False):
        return "vLLM flagged its engine core dead"
    for proc in core_processes:
        if not proc.is_alive():
            return f"engine-core process {proc.pid} exited with code {proc.exitcode}"
    for pid in worker_pids:
        if pid != os.getpid() and not pid_alive(pid):
            return f"worker process {pid} is gone"
    return None
