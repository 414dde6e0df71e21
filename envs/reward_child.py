"""The parent's handle on one math-verify child process (`MathVerifier`'s pool, reward.py)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

_CHILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_verify_child.py")


class VerifierChild:
    """One math-verify process (`envs/_verify_child.py`), used by one thread at a time: started
    with sympy's pure-Python ground types, an address-space cap and its own session; asked
    one answer at a time with a deadline; its RSS read; killed."""

    def __init__(self, timeout_s: int, memory_limit_mb: int):
        env = dict(os.environ, SYMPY_GROUND_TYPES="python")
        self.proc = subprocess.Popen(
            [sys.executable, _CHILD_SCRIPT, str(timeout_s), str(memory_limit_mb)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            close_fds=True,
            start_new_session=True,  # a Ctrl-C in the parent's terminal does not hit it
        )
        self.ready = False
        self.tasks = 0
        self._buffer = b""

    def _read_line(self, deadline: float) -> dict | None:
        """The next JSON line, None if `deadline` passes; raises EOFError if the child died."""
        poller = select.poll()  # not select.select: Ray workers can have fds >= 1024
        poller.register(self.proc.stdout.fileno(), select.POLLIN)
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if poller.poll(remaining * 1000):
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    raise EOFError("math-verify child exited")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def wait_ready(self, startup_s: float) -> None:
        if self.ready:
            return
        message = self._read_line(time.monotonic() + startup_s)
        if message is None:
            raise TimeoutError(f"math-verify child not ready after {startup_s:.0f} s")
        if not message.get("ready"):
            raise RuntimeError(
                f"math-verify child failed to start: {message.get('error')}; "
                "install the project's dependencies (`pip install math-verify`)"
            )
        self.ready = True

    def request(self, pred: str, gold: str, deadline_s: float) -> dict | None:
        payload = json.dumps({"pred": pred, "gold": gold}) + "\n"
        self.proc.stdin.write(payload.encode())
        self.proc.stdin.flush()
        self.tasks += 1
        return self._read_line(time.monotonic() + deadline_s)

    def rss_mb(self) -> float:
        try:
            with open(f"/proc/{self.proc.pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        except (OSError, ValueError, IndexError):
            return 0.0

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
