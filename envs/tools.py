"""Sandboxed tools for multi-turn episodes: a calculator and a restricted Python expression
evaluator, run with the verifier's isolation.

`ToolSandbox.run(tool, text)` sends one call to a child process (`envs/_tool_child.py`,
a fresh `python -I` interpreter in an empty directory, address-space, file-size and CPU
limits) that evaluates the expression by walking its AST against a whitelist (numbers and
exact arithmetic; in "python" mode also comparisons, boolean logic, conditional
expressions, tuples / lists and abs / min / max / round / sum / len / int / float): no
names, attributes, imports or files are reachable, and numbers past ~6000 digits are
refused before they are computed. The parent waits at most `time_limit_s`, then kills and
replaces the child. Every outcome is a `ToolResult` (ok, error or timeout) whose
`observation` is what the env shows the policy; nothing raises into the caller or blocks
past the deadline. Thread-safe: one child serves one call at a time, so concurrent callers
wait for each other (each call's own time limit starts when it is sent).

    sandbox = ToolSandbox()
    sandbox.run("calculator", "12345 * 6789").observation   # '<result>83810205</result>'
    sandbox.run("python", "__import__('os')").observation    # '<error>Call is not allowed</error>'
"""

from __future__ import annotations

import atexit
import json
import math
import os
import selectors
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

TOOLS = ("calculator", "python")
_CHILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_tool_child.py")
METRIC_KEYS = ("tool/calls", "tool/errors", "tool/timeouts", "tool/child_restarts")
MAX_INPUT_CHARS = 1000


@dataclass(frozen=True)
class ToolResult:
    status: str  # "ok", "error" or "timeout"
    output: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def observation(self) -> str:
        """What the env appends to the episode for the policy to read."""
        return f"<result>{self.output}</result>" if self.ok else f"<error>{self.output}</error>"


class ToolSandbox:
    """One child process serving tool calls; see the module docstring.

    Args:
        time_limit_s: the longest a call may take; the child is then killed and replaced.
        memory_limit_mb: the child's address-space limit (0: none).
        max_calls_per_child: calls before a child is replaced by a fresh one.
    """

    def __init__(self, time_limit_s: float = 2.0, memory_limit_mb: int = 512, max_calls_per_child: int = 2000):
        if not time_limit_s > 0:
            raise ValueError(f"time_limit_s ({time_limit_s}) must be > 0")
        if not isinstance(memory_limit_mb, int) or memory_limit_mb < 0:
            raise ValueError(f"memory_limit_mb ({memory_limit_mb!r}) must be an int >= 0 (0: no limit)")
        if not isinstance(max_calls_per_child, int) or max_calls_per_child < 1:
            raise ValueError(f"max_calls_per_child ({max_calls_per_child!r}) must be an int >= 1")
        self.time_limit_s = float(time_limit_s)
        self.memory_limit_mb = memory_limit_mb
        self.max_calls_per_child = max_calls_per_child
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None
        self._served = 0
        self._dir = tempfile.mkdtemp(prefix="m2po-tool-")
        self.metrics = dict.fromkeys(METRIC_KEYS, 0)
        atexit.register(self.close)

    # -- the child ---------------------------------------------------------------------------
    def _start(self) -> subprocess.Popen:
        os.makedirs(self._dir, exist_ok=True)
        # The child's own CPU backstop: every call it may serve, at the time limit each.
        cpu_s = math.ceil(self.time_limit_s * self.max_calls_per_child) + 30
        child = subprocess.Popen(
            [sys.executable, "-I", _CHILD_SCRIPT, str(self.memory_limit_mb), str(cpu_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=self._dir,
            env={"PATH": os.environ.get("PATH", ""), "LC_ALL": "C.UTF-8"},
        )
        try:
            hello = self._read(child, deadline=time.monotonic() + 15.0)
        except ValueError:  # not JSON
            hello = None
        if not (hello or {}).get("ready"):
            self._kill(child)
            raise RuntimeError(f"the child did not start ({hello!r})")
        return child

    @staticmethod
    def _read(child: subprocess.Popen, deadline: float) -> dict | None:
        """One JSON line from the child, or None at the deadline or if it died."""
        line = b""
        with selectors.DefaultSelector() as sel:  # not select(): file descriptors past 1024 are common
            sel.register(child.stdout, selectors.EVENT_READ)
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return None
                chunk = os.read(child.stdout.fileno(), 1 << 16)
                if not chunk:
                    return None
                line += chunk
        return json.loads(line)

    def _kill(self, child: subprocess.Popen | None) -> None:
        if child is None:
            return
        if child.poll() is None:
            child.kill()
        child.wait()
        for stream in (child.stdin, child.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def _replace(self) -> None:
        self._kill(self._child)
        self._child, self._served = None, 0
        self.metrics["tool/child_restarts"] += 1

    # -- calls -------------------------------------------------------------------------------
    def run(self, tool: str, text: str) -> ToolResult:
        """Evaluates `text` with `tool` ("calculator" or "python")."""
        with self._lock:
            self.metrics["tool/calls"] += 1
            if tool not in TOOLS:
                return self._error(f"unknown tool {tool!r}; the tools are {', '.join(TOOLS)}")
            if not isinstance(text, str):
                return self._error(f"the tool input must be text, got {type(text).__name__}")
            if len(text) > MAX_INPUT_CHARS:
                return self._error(f"input longer than {MAX_INPUT_CHARS} characters")
            return self._call(tool, text)

    def _call(self, tool: str, text: str) -> ToolResult:
        if self._child is not None and self._child.poll() is not None:
            self._replace()  # died since the last call
        if self._child is None:
            try:
                self._child = self._start()
            except (OSError, RuntimeError) as e:
                return self._error(f"the tool sandbox could not start: {e}")
        try:
            self._child.stdin.write(json.dumps({"tool": tool, "input": text}).encode() + b"\n")
            self._child.stdin.flush()
            reply = self._read(self._child, time.monotonic() + self.time_limit_s)
        except (OSError, ValueError):  # a broken pipe, or a reply that is not JSON
            reply = None
        if reply is None:
            # Killed either way, so that a late answer is never read as the next call's.
            timed_out = self._child.poll() is None
            self._replace()
            if timed_out:
                self.metrics["tool/timeouts"] += 1
                self.metrics["tool/errors"] += 1
                return ToolResult("timeout", f"the tool took longer than {self.time_limit_s:g} s")
            return self._error("the tool crashed (memory limit?)")
        self._served += 1
        if self._served >= self.max_calls_per_child:
            self._replace()
        if reply.get("status") != "ok":
            return self._error(str(reply.get("output", "error")))
        return ToolResult("ok", str(reply.get("output", "")))

    def _error(self, message: str) -> ToolResult:
        self.metrics["tool/errors"] += 1  # callers hold the lock
        return ToolResult("error", message)

    def close(self) -> None:
        with self._lock:
            self._kill(self._child)
            self._child = None
        try:
            os.rmdir(self._dir)
        except OSError:
            pass
