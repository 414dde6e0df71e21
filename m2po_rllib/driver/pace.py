"""The pace of one training iteration: optimizer updates per second, and the share of its
wall time the learners and the runners sat idle (`keys.UPDATES_PER_S`, `LEARNER_IDLE_FRAC`,
`RUNNER_IDLE_FRAC`). The algorithm adds what each beat reports; `metrics` closes it."""

from __future__ import annotations

import time

from m2po_rllib.common import keys


class IterationPace:
    """What one iteration did, for the pace metrics: updates completed, and the seconds the
    learners and the runners were busy."""

    def __init__(self):
        self.since = time.perf_counter()
        self.updates = 0.0
        self.learner_busy_s = 0.0
        self.runner_busy_s = 0.0

    def metrics(self, num_runners: int) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self.since, 1e-9)
        return {
            keys.UPDATES_PER_S: self.updates / elapsed,
            keys.LEARNER_IDLE_FRAC: max(0.0, 1 - self.learner_busy_s / elapsed),
            keys.RUNNER_IDLE_FRAC: max(0.0, 1 - self.runner_busy_s / (elapsed * num_runners)),
        }
