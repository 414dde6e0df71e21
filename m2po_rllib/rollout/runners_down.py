"""While EnvRunners are down (a crash, or their node left the cluster): what the run is
waiting for, said when it starts, every 30 s while it lasts, and when it ends.

Ray restarts a failed runner's actor where its resources are free again
(`restart_failed_env_runners`): on the same node, or on a node that joins later with the
custom resource the runners ask for. Meanwhile the run goes on with the healthy runners; with
none left it waits, and fails once no round has come for `sample_timeout_s`.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

logger = logging.getLogger(__name__)

NOTICE_EVERY_S = 30.0


def runner_resources(config) -> dict[str, float]:
    """What one EnvRunner asks Ray for (what a node must offer for it to come back there)."""
    out = {"CPU": float(config.num_cpus_per_env_runner), "GPU": float(config.num_gpus_per_env_runner)}
    out.update({k: float(v) for k, v in (config.custom_resources_per_env_runner or {}).items()})
    return {k: v for k, v in out.items() if v}


class RunnersDown:
    def __init__(self, config, *, every_s: float = NOTICE_EVERY_S, log: Callable[[str], None] = logger.warning,
                 clock: Callable[[], float] = time.monotonic):
        self.config, self.every_s, self.log, self.clock = config, every_s, log, clock
        self.since: float | None = None  # when the first runner of this outage went down
        self._said = 0.0
        self.down: list[int] = []

    def observe(self, down: list[int]) -> None:
        """`down`: the runners not healthy after a restore attempt ([] when all are back)."""
        now = self.clock()
        if not down:
            if self.since is not None:
                self.log(f"EnvRunner(s) {self.down} back after {now - self.since:.0f} s")
            self.since, self.down = None, []
            return
        if self.since is None:
            self.since, self._said = now, -float("inf")
        self.down = sorted(down)
        if now - self._said >= self.every_s:
            self._said = now
            self.log(self.message(now))

    def message(self, now: float) -> str:
        cfg = self.config
        bundle = ", ".join(f"{v:g} {k}" for k, v in runner_resources(cfg).items())
        if cfg.async_rollouts:
            bound = f"once no round has come for `sample_timeout_s` ({cfg.sample_timeout_s:g} s)"
        else:
            bound = (f"after `env_runner_restore_timeout_s` + `sample_timeout_s` "
                     f"({cfg.env_runner_restore_timeout_s + cfg.sample_timeout_s:g} s) without samples")
        return (
            f"EnvRunner(s) {self.down} down for {now - self.since:.0f} s (crashed, or their node left the cluster): "
            f"Ray restarts each where {bundle} is free, the run going on with the others meanwhile; with none "
            f"left, it fails {bound}"
        )
