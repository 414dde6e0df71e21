"""The driver's side of the learners: one room, as `rollout/sampler.py` is the runners'.

`LearnerRoom` holds what the driver knows of its learners, each quantity once:
- the policy version they last reported (the driver's one copy; `M2PO.policy_version`),
- the newest weights they published (`PublishedWeights`, which the next requests carry),
- the updates in flight (one result per learner per update),
- the native weight-sync group: formed at the start, and again after runners were restored
  or a send failed (`needs_reconnect`),
- the learners' private result keys (`keys.*_KEY`), read in `take` and nowhere else.

It also holds the only uses of `LearnerGroup` privates (Ray 2.60 has no public call to run a
function on the first learner alone, to unwrap `foreach_learner`'s results, or to poll
asynchronous updates without sending one; pyproject pins ray 2.60.*).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from m2po_rllib.common import keys
from m2po_rllib.wire.batch import num_rows, take_rows, to_train_batch
from m2po_rllib.wire.weights import PublishedWeights

POLL_S = 0.002  # between polls when nothing is ready


def on_learners(group, fn: Callable[[Any], Any], *, first_only: bool) -> list[Any]:
    """`fn(learner)` on every learner, or on the first healthy one (RLlib's choice of learner
    in `LearnerGroup.get_state`); their answers in learner order."""
    ids = group._worker_manager.healthy_actor_ids()[:1] if first_only and not group.is_local else None
    return group._get_results(group.foreach_learner(fn, remote_actor_ids=ids))


def ready_update_results(group) -> list[dict]:
    """The results of asynchronous updates that are done, without sending another one."""
    return group._get_results(group._worker_manager.fetch_ready_async_reqs(timeout_seconds=0.0))


def wait_until(done: Callable[[], bool], step: Callable[[], bool], timeout_s: float, what: Callable[[], str]) -> None:
    """Calls `step()` (True: it made progress) until `done()`; raises RuntimeError naming
    `what()` when nothing progressed for `timeout_s`. The driver's one polling loop."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if step():
            deadline = time.monotonic() + timeout_s
        elif time.monotonic() > deadline:
            raise RuntimeError(f"{what()} after {timeout_s} s without progress")
        else:
            time.sleep(POLL_S)


@dataclass
class UpdateReport:
    """What arrived learner results say, for the algorithm's metrics."""

    results: list[dict]  # the learners' public metrics, for `metrics.aggregate`
    native_stats: list[dict] = field(default_factory=list)  # native sends made during the updates
    m2_by_age: dict[int, tuple[float, float]] = field(default_factory=dict)  # summed over learners
    busy_s: float = 0.0  # learner seconds, per learner
    updates: float = 0.0  # optimizer updates completed


class LearnerRoom:
    def __init__(self, learner_group, config):
        self.group = learner_group
        self.config = config
        self._learners = max(1, config.num_learners)
        self.weights: PublishedWeights = self.publish()
        self.version: int = self.weights.version
        self._pending_results = 0
        self.needs_reconnect = False  # native: a send failed; the group is formed again before the next step

    # -- weights --------------------------------------------------------------------------
    def publish(self) -> PublishedWeights:
        """The first learner's current weights, published through the object store (sharded
        with a native sync: every learner gathers them, the whole copy is made on demand)."""
        every = self.config.sharded_learners and self.config.native_weight_sync
        return on_learners(self.group, lambda learner: learner.publish_weights(), first_only=not every)[0]

    def restored(self) -> None:
        """After the learners' state was set from a checkpoint: their weights and version."""
        self.weights = self.publish()
        self.version = self.weights.version

    def connect_weight_sync(self, runner_handles: list) -> dict | None:
        """Forms the learners' weight-transfer group with `runner_handles` and sends them the
        current weights; returns the send's stats. Updates in flight finish first (their
        broadcasts use the old group): take their report with `wait_idle`. With no runner
        up it forms nothing and returns None, `needs_reconnect` set: the group is formed
        once RLlib restores one. (Sharded learners form it even then: every learner runs
        each send's gathers, which a group of the learners alone keeps in step.)"""
        if not runner_handles and not self.config.sharded_learners:
            self.needs_reconnect = True
            return None
        tp = int((self.config.engine_kwargs or {}).get("tensor_parallel_size", 1))
        stats = on_learners(
            self.group, lambda learner, h=runner_handles: learner.connect_weight_sync(h, [tp] * len(h)),
            first_only=not self.config.sharded_learners,
        )[0]
        version = int(stats[keys.NATIVE_SYNC_VERSION])
        self.needs_reconnect = version < 0
        if version >= 0:
            self.weights = PublishedWeights.broadcast(version)
        return stats

    # -- updates --------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Updates sent whose results have not all arrived."""
        return -(-self._pending_results // self._learners)

    def update(self, batch, *, dispatched_version: int, async_update: bool, env_steps_lifetime: int) -> list[dict]:
        """Sends one step's batch (a MultiAgentBatch) to the learners; returns the results
        ready now (with remote learners in async mode, those of earlier updates). The first
        learner returns its weights when `broadcast_interval` steps passed since the last."""
        cfg = self.config
        self._pending_results += self._learners
        steps_since_broadcast = (dispatched_version - self.weights.version) // cfg.updates_per_step
        from ray.rllib.utils.metrics import NUM_ENV_STEPS_SAMPLED_LIFETIME

        return self.group.update(
            batch=batch,
            minibatch_size=cfg.minibatch_size_per_learner,
            num_epochs=cfg.num_epochs,
            shuffle_batch_per_epoch=False,
            async_update=async_update,
            return_state=steps_since_broadcast >= cfg.broadcast_interval,
            timesteps={NUM_ENV_STEPS_SAMPLED_LIFETIME: env_steps_lifetime},
        )

    def take(self, results: list[dict]) -> UpdateReport | None:
        """Reads learner results: the version they report, the weights the first learner
        returned, their busy time, the trained tokens' M2 by age, native sends, a failed send
        (`needs_reconnect`). None when there are none."""
        if not results:
            return None
        report = UpdateReport(results)
        for result in results:
            weights = result.pop(keys.WEIGHTS_KEY, None)
            self.needs_reconnect |= bool(result.pop(keys.WEIGHT_SYNC_RECONNECT_KEY, False))
            if (native := result.pop(keys.NATIVE_SYNC_KEY, None)) is not None:
                report.native_stats.append(native)
            self.version = max(self.version, result.pop(keys.VERSION_KEY))
            report.busy_s += result.pop(keys.UPDATE_SECONDS_KEY) / self._learners
            for age, (sum_sq, tokens) in result.pop(keys.M2_BY_AGE_KEY, {}).items():
                s, n = report.m2_by_age.get(age, (0.0, 0.0))
                report.m2_by_age[age] = (s + sum_sq, n + tokens)
            if weights is not None and weights.version > self.weights.version:
                self.weights = weights
        self._pending_results -= len(results)
        report.updates = len(results) / self._learners * self.config.updates_per_step
        return report

    def poll(self) -> UpdateReport | None:
        """The results of asynchronous updates that are done (None if none)."""
        return self.take(ready_update_results(self.group)) if self.in_flight else None

    def wait_idle(self, absorb: Callable[[UpdateReport], None]) -> None:
        """Waits for every update in flight, passing each report to `absorb`."""

        def step() -> bool:
            report = self.poll()
            if report is not None:
                absorb(report)
            return report is not None

        wait_until(lambda: not self.in_flight, step, self.config.sample_timeout_s,
                   lambda: f"{self.in_flight} updates still in flight")

    # -- log-probs outside training -------------------------------------------------------
    def logp_mismatch(self, rollout: dict) -> dict[str, float]:
        """The engine's log-probs against the learner's on the weights that generated the
        round (sync mode), for the first minibatch's worth of rows, on one learner (with
        sharded weights every learner runs the forward, a collective, and the first answers)."""
        rows = min(self.config.minibatch_prompts * self.config.group_size, num_rows(rollout))
        train = to_train_batch(take_rows(rollout, np.arange(rows)), np.zeros(rows, np.float32))
        return on_learners(
            self.group, lambda learner: learner.logp_mismatch(train), first_only=not self.config.sharded_learners
        )[0]

    def response_logp(self, rollout: dict) -> np.ndarray:
        """The learners' log-probs of a round's response tokens, (rows, response_len),
        computed by all learners together (each its share of the rows)."""
        import ray

        train_ref = ray.put(to_train_batch(rollout, np.zeros(num_rows(rollout), np.float32)))
        shares = on_learners(
            self.group, lambda learner, ref=train_ref: learner.response_logp_share(ray.get(ref)), first_only=False
        )
        return np.concatenate([logp for _, logp in sorted(shares, key=lambda r: r[0])])
