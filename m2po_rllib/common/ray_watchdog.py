"""A local Ray ends with the job that started it, a `kill -9` included.

`ray.init()` starts the GCS and the raylet as children that die with the driver, but the
raylet's own children (the dashboard and runtime-env agents, idle workers) then try to
report to the dead GCS and linger for seconds to minutes. `watch(pids)` starts a small
child process that waits on a pipe from this process: the pipe closes when this process
ends, however it ends, and the child then kills exactly the processes it was given and
their descendants, by PID, each checked against its start time so that a PID the system
has since reused is left alone. Linux only (it reads /proc); elsewhere it does nothing.
Run as `python -m m2po_rllib.common.ray_watchdog PID:START ...` with the pipe on stdin.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

_PROC = "/proc"
REFRESH_S = 2.0


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        with open(f"{_PROC}/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def descendants(roots: list[int]) -> list[int]:
    """`roots` and every process below them, from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir(_PROC):
        if entry.isdigit():
            try:
                with open(f"{_PROC}/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def watch(pids: list[int]) -> subprocess.Popen | None:
    """Start the watchdog over `pids` and their descendants now; None where /proc is absent."""
    if not os.path.isdir(_PROC):
        return None
    marked = [f"{pid}:{t}" for pid in descendants(pids) if (t := start_time(pid))]
    return subprocess.Popen(
        [sys.executable, "-m", "m2po_rllib.common.ray_watchdog", *marked],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
    )


_WATCHDOG = []  # the watchdog's Popen: its pipe stays open for as long as this process lives


def started_here() -> bool:
    """This process started the Ray it is connected to (a local head), rather than joining one."""
    import ray

    return bool(getattr(ray._private.worker, "_global_node", None) and ray._private.worker._global_node.head)


def end_with_this_process() -> None:
    """The local Ray this process started ends with it, a kill -9 included: a watchdog over
    the Ray processes (GCS, raylet and what they start). Used by `m2po train` and the lab
    (`jobs/local_ray.py`) and by a script's `build_algo()` that started Ray (`resources.py`)."""
    import logging

    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    try:
        pids = [info.process.pid for infos in node.all_processes.values() for info in infos if info.process]
    except Exception as e:  # a Ray whose internals changed: without the watchdog
        logging.getLogger(__name__).debug("no watchdog for the local Ray: %s", e)
        return
    watchdog = watch(pids)
    if watchdog is not None:
        _WATCHDOG.append(watchdog)


def _main(marked: list[str]) -> None:
    import select

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is the job's to handle
    roots = {int(p): t for p, t in (m.split(":") for m in marked)}
    targets = dict(roots)
    # Until the job's end of the pipe closes (EOF), refresh the list every REFRESH_S: the
    # processes the roots start later (agents, workers) are reparented when a root dies,
    # so they must be known before that.
    while not select.select([sys.stdin], [], [], REFRESH_S)[0]:
        alive = [pid for pid, t in roots.items() if start_time(pid) == t]
        targets.update({pid: t for pid in descendants(alive) if (t := start_time(pid))})
    if sys.stdin.buffer.read1(1):
        return  # not the job's pipe: nothing of ours to end
    for pid, t in targets.items():
        if pid != os.getpid() and start_time(pid) == t:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


if __name__ == "__main__":
    _main(sys.argv[1:])
