"""The confinement both sandboxed children share (the verifier, `_verify_child.py`, and the
tools, `_tool_child.py`): run as scripts, they import this before anything else.

`confine` drops the script's own folder from sys.path (envs/ holds modules, datasets.py and
tasks.py, that would shadow the libraries of those names), sets the resource limits (no core
dumps, a CPU-seconds ceiling, an address-space ceiling, optionally no file writes) and moves
the protocol to a private copy of stdout, so that whatever the untrusted code prints goes to
/dev/null instead of into the protocol.
"""

from __future__ import annotations

import os
import sys


def confine(script: str, *, cpu_limit_s: int, memory_limit_mb: int, no_files: bool = False):
    """Confine this process; returns the protocol stream (the original stdout)."""
    import resource

    folder = os.path.dirname(os.path.abspath(script))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p) != folder]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_limit_s, cpu_limit_s))
    if no_files:
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    if memory_limit_mb > 0:
        limit = memory_limit_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    sys.stdout = open(os.devnull, "w")
    return proto
