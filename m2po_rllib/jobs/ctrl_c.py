"""Ctrl-C during `m2po train`: stop after the iteration and save, or quit at once (`CtrlC`)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading


class CtrlC:
    """SIGINT once the algorithm is built. Inside a training iteration (`step()`) the first
    Ctrl-C asks to stop after it, since a half-done step is no consistent checkpoint; a
    second one abandons the iteration. Anywhere else (held-out evaluation, between
    iterations) it raises KeyboardInterrupt at once. `abandoned` tells the two apart."""

    def __init__(self):
        self.requested = False
        self.abandoned = False
        self._in_step = False
        self._deferred: threading.Timer | None = None

    def __enter__(self):
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        if self._deferred is not None and self._deferred.is_alive():
            self._deferred.cancel()  # a Ctrl-C still to be delivered: it is a request to stop
            self.requested = True
        signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum, frame):
        if _in_finalizer(frame):
            # Python prints and drops an exception raised inside a __del__ ("Exception
            # ignored in ..."): deliver this Ctrl-C again once the finalizer is done
            self._deferred = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT))
            self._deferred.start()
            return
        if self._in_step and not self.requested:
            self.requested = True
            print("\nCtrl-C: stopping after this iteration to save a checkpoint (Ctrl-C again to quit without it)", flush=True)
            return
        self.requested = True
        self.abandoned = self._in_step
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def step(self):
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False


def _in_finalizer(frame) -> bool:
    """Whether `frame` runs inside an object's `__del__` (on its own or a caller's frame)."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False
