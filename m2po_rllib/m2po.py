"""M2PO as an RLlib algorithm (`M2POConfig` lives in config.py).

`M2PO.training_step` runs one of two loops, each beat in its own `log_time` timer:
- synchronous (`async_rollouts=False`, the paper's stale-k protocol; ../shared/M2PO.md):
  sample a round of `prompts_per_step x group_size` completions with the current weights
  (every row tagged with the policy version that made it) -> push it into a FIFO queue and
  pop the round made `staleness` updates earlier (while the queue fills, nothing is
  trained) -> update the learners (`updates_per_step` minibatches) -> publish the weights.
- asynchronous (`async_rollouts=True`, async_step.py + async_rollouts.py): keep rounds in flight on every
  remote EnvRunner, admitted only if they will be trained within `max_staleness` updates
  of the weights that made them -> collect what is ready -> dispatch the next step to the
  learners without waiting (`async_update` with remote learners) -> publish the weights
  each update returns. One `training_step` call dispatches one step.
Weights are published once per update (`PublishedWeights`, one `ray.put` for all remote
runners) and ride with the next request to each runner, which loads them between rounds.
"""

from __future__ import annotations

import collections
import logging
import math
import time

import numpy as np
import ray
import torch

from ray.rllib.algorithms.algorithm import Algorithm
from ray.rllib.core import COMPONENT_LEARNER_GROUP, DEFAULT_MODULE_ID
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.annotations import override
from ray.rllib.utils.metrics import (
    ENV_RUNNER_RESULTS,
    ENV_RUNNER_SAMPLING_TIMER,
    LEARNER_RESULTS,
    LEARNER_UPDATE_TIMER,
    NUM_ENV_STEPS_SAMPLED_LIFETIME,
    SYNCH_WORKER_WEIGHTS_TIMER,
    TIMERS,
)

import envs  # noqa: F401  (registers the m2po/* env ids)
from m2po_rllib.async_rollouts import AsyncRollouts
from m2po_rllib.async_step import QUEUE_LEN, AsyncTrainingStep
from m2po_rllib.config import M2POConfig
from m2po_rllib.log_filters import quiet_gputil_hint_without_gpus
from m2po_rllib.losses import compute_advantages
from m2po_rllib.rollout.batch import concat_rollouts, learner_order, num_rows, take_rows, to_train_batch
from m2po_rllib.rollout.env_runner import round_seed, sample_and_metrics
from m2po_rllib.rollout.weights import PublishedWeights
from m2po_rllib.threads import use_cpus
from m2po_rllib.torch.learner import POLICY_VERSION, UPDATE_SECONDS_KEY, WEIGHTS_KEY

quiet_gputil_hint_without_gpus()
logger = logging.getLogger(__name__)

# Algorithm-level metric keys (README, "Metrics", says what each one means).
STALENESS_MEAN = "staleness/mean"
STALENESS_MAX = "staleness/max"
FILLING = "staleness/filling"
LEARNER_IDLE_FRAC = "async/learner_idle_frac"
RUNNER_IDLE_FRAC = "async/runner_idle_frac"
UPDATES_PER_S = "learner/updates_per_s"
LOGP_MISMATCH_MAX = "rollout/logp_mismatch_max"
LOGP_MISMATCH_MEAN = "rollout/logp_mismatch_mean"
TOKENS_TRAINED_PER_S = "learner/tokens_per_s"
LOGP_MISMATCH_TIMER = "logp_mismatch_timer"
HELDOUT_ACCURACY = "heldout_accuracy"


class _IterationPace:
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
            UPDATES_PER_S: self.updates / elapsed,
            LEARNER_IDLE_FRAC: max(0.0, 1 - self.learner_busy_s / elapsed),
            RUNNER_IDLE_FRAC: max(0.0, 1 - self.runner_busy_s / (elapsed * num_runners)),
        }


class M2PO(AsyncTrainingStep, Algorithm):
    @classmethod
    @override(Algorithm)
    def get_default_config(cls) -> M2POConfig:
        return M2POConfig()

    @classmethod
    @override(Algorithm)
    def _should_create_evaluation_env_runners(cls, eval_config) -> bool:
        # Evaluation runs on the training runners unless dedicated ones are asked for.
        return eval_config.evaluation_num_env_runners > 0

    @override(Algorithm)
    def setup(self, config) -> None:
        use_cpus(config.num_cpus_for_main_process)  # this process computes with its own CPUs
        self._queue: collections.deque = collections.deque()  # sync: the stale-k FIFO
        self._sample_round = 0  # sync: rounds sampled so far
        self._heldout_accuracy: float | None = None
        super().setup(config)
        self._weights = self.learner_weights()
        # The learner owns the policy version; the driver keeps what it last reported and
        # what it will be once every step dispatched so far is trained.
        self._learner_version = self._weights.version
        self._dispatched_version = self._weights.version
        self._pending_results = 0  # learner results still to come: one per learner per update
        self._async = (
            AsyncRollouts(
                rounds_per_step=config.num_env_runners,
                updates_per_step=config.updates_per_step,
                max_staleness=config.max_staleness,
                rows_per_round=config.prompts_per_step // config.num_env_runners * config.group_size,
            )
            if config.async_rollouts
            else None
        )
        self._iter = _IterationPace()

    @property
    def policy_version(self) -> int:
        """Optimizer updates of the learners' weights, as they last reported it."""
        return self._learner_version

    @property
    def stale_queue(self) -> list[dict]:
        return list(self._queue)

    @property
    def _updates_in_flight(self) -> int:
        return -(-self._pending_results // max(1, self.config.num_learners))

    # -- one iteration ------------------------------------------------------------------
    @override(Algorithm)
    def step(self):
        if self.config.evaluation_interval and self._heldout_accuracy is None:
            self.evaluate()  # the starting point: from iteration 1 on, every result has one
        self._iter = _IterationPace()
        result = super().step()
        if self.config.evaluation_interval:
            result[HELDOUT_ACCURACY] = self._heldout_accuracy
        result[POLICY_VERSION] = self._learner_version
        result.update(self._iter.metrics(max(1, self.env_runner_group.num_remote_env_runners())))
        return result

    def record_heldout_accuracy(self, accuracy: float) -> None:
        """Called by the evaluation function; carried into every later result."""
        self._heldout_accuracy = float(accuracy)

    @override(Algorithm)
    def training_step(self) -> None:
        if self._async is not None:
            self._async_training_step()
        else:
            self._sync_training_step()

    # -- synchronous: sample -> queue -> update -> publish --------------------------------
    def _sync_training_step(self) -> None:
        cfg: M2POConfig = self.config
        with self.metrics.log_time((TIMERS, ENV_RUNNER_SAMPLING_TIMER)):
            rollout, runner_metrics = self._sample_from_runners()
        self.metrics.aggregate(runner_metrics, key=ENV_RUNNER_RESULTS)
        with self.metrics.log_time((TIMERS, LOGP_MISMATCH_TIMER)):
            if cfg.recompute_behavior_logp:
                self._recompute_behavior_logp(rollout)
            elif cfg.logp_mismatch_interval and self._sample_round % cfg.logp_mismatch_interval == 0:
                self._log_logp_mismatch(rollout)
        self._sample_round += 1

        self._queue.append(rollout)
        filling = len(self._queue) <= cfg.queue_lag_steps
        batch = None if filling else self._queue.popleft()
        self.metrics.log_value(FILLING, int(filling), window=1)
        self.metrics.log_value(QUEUE_LEN, len(self._queue), window=1)
        if batch is None:
            return
        with self.metrics.log_time((TIMERS, LEARNER_UPDATE_TIMER)):
            results = self._update(batch, async_update=False)
        with self.metrics.log_time((TIMERS, SYNCH_WORKER_WEIGHTS_TIMER)):
            self._take_update_results(results)

    def _sample_from_runners(self):
        """One round from every runner (the local one when there are no remote runners)."""
        cfg = self.config
        group = self.env_runner_group
        local = group.num_remote_env_runners() == 0
        n = max(1, group.num_remote_env_runners())
        per_runner = cfg.prompts_per_step // n
        rows = per_runner * cfg.group_size
        seed, weights, first_round = round_seed(cfg.seed, self._sample_round), self._weights, self._sample_round * n
        deadline = time.monotonic() + cfg.env_runner_restore_timeout_s + cfg.sample_timeout_s
        while True:
            out = group.foreach_env_runner(
                lambda runner: sample_and_metrics(
                    runner, num_prompts=per_runner, seed=seed, weights=weights,
                    first_sample_id=(first_round + max(0, runner.worker_index - 1)) * rows,
                ),
                local_env_runner=local,
                timeout_seconds=cfg.sample_timeout_s,
            )
            if out:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"no EnvRunner returned samples within {cfg.sample_timeout_s} s, and none could "
                    "be restored; see the runners' logs (raise `sample_timeout_s` for slow rounds)"
                )
            # A failed runner (e.g. a dead vLLM engine) is restarted by Ray; bring it back and
            # sample this round again (requests carry the current weights).
            logger.warning("no EnvRunner returned samples; restoring failed runners and retrying")
            time.sleep(1.0)
            self.restore_env_runners(group)
        if len(out) != n:
            logger.warning("%d of %d EnvRunners returned samples this round; training on %d prompts",
                           len(out), n, len(out) * per_runner)
        self._iter.runner_busy_s += sum(busy for _, _, busy in out)
        return concat_rollouts([b for b, _, _ in out]), [m for _, m, _ in out]

    # -- learners -------------------------------------------------------------------------
    def _update(self, rollout: dict, *, async_update: bool) -> list[dict]:
        """Sends one step (a rollout batch) to the learners; returns the results ready now."""
        cfg = self.config
        age = self._dispatched_version - rollout["policy_version"]  # at the step's first minibatch
        self.metrics.log_value(STALENESS_MEAN, float(age.mean()), window=1)
        self.metrics.log_value(STALENESS_MAX, float(age.max()), window=1)
        advantages = compute_advantages(
            torch.as_tensor(np.array(rollout["rewards"])), cfg.group_size, estimator=cfg.advantage_estimator
        )
        train = to_train_batch(rollout, advantages.numpy())
        minibatch = cfg.minibatch_prompts * cfg.group_size
        train = take_rows(train, learner_order(num_rows(train), minibatch, max(1, cfg.num_learners)))
        self._pending_results += max(1, cfg.num_learners)
        self._dispatched_version += cfg.updates_per_step
        steps_since_broadcast = (self._dispatched_version - self._weights.version) // cfg.updates_per_step
        t0 = time.perf_counter()
        results = self.learner_group.update(
            batch=MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch(train)}, env_steps=num_rows(train)),
            minibatch_size=cfg.minibatch_size_per_learner,
            num_epochs=cfg.num_epochs,
            shuffle_batch_per_epoch=False,
            async_update=async_update,
            return_state=steps_since_broadcast >= cfg.broadcast_interval,
            timesteps={
                NUM_ENV_STEPS_SAMPLED_LIFETIME: self.metrics.peek(
                    (ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME), default=0
                )
            },
        )
        if not async_update:
            tokens = float(train["response_mask"].sum()) * cfg.num_epochs
            self.metrics.log_value(TOKENS_TRAINED_PER_S, tokens / (time.perf_counter() - t0), window=1)
        return results

    def _take_update_results(self, results: list[dict]) -> bool:
        """Learner results: their metrics, the weights the first learner returned (the next
        requests carry them), and how long the learners were busy."""
        if not results:
            return False
        learners = max(1, self.config.num_learners)
        for result in results:
            weights = result.pop(WEIGHTS_KEY, None)
            self._iter.learner_busy_s += result.pop(UPDATE_SECONDS_KEY, 0.0) / learners
            if weights is not None and weights.version > self._weights.version:
                self._weights = weights
                self._learner_version = max(self._learner_version, weights.version)
        self._pending_results -= len(results)
        self._iter.updates += len(results) / learners * self.config.updates_per_step
        self.metrics.aggregate(results, key=LEARNER_RESULTS)
        reported = self.metrics.peek((LEARNER_RESULTS, DEFAULT_MODULE_ID, POLICY_VERSION), default=None)
        if reported is not None and not math.isnan(reported):
            self._learner_version = max(self._learner_version, int(reported))
        return True

    def learner_weights(self) -> PublishedWeights:
        """The first learner's current weights, published (RLlib's choice of learner in
        `LearnerGroup.get_state`)."""
        return self._on_one_learner(lambda learner: learner.publish_weights(), forward=False)

    def _on_one_learner(self, fn, forward: bool = True):
        """`fn(learner)` on the first learner, the one that answers; with sharded weights a
        `forward` (a collective) runs on every learner and the first one's answer is kept."""
        group = self.learner_group
        every = forward and self.config.sharded_learners
        ids = None if group.is_local or every else group._worker_manager.healthy_actor_ids()[:1]
        return group._get_results(group.foreach_learner(fn, remote_actor_ids=ids))[0]

    # -- log-probs: the engine's against the learner's --------------------------------------
    def _logp_rows(self) -> int:
        return self.config.minibatch_prompts * self.config.group_size

    def _log_logp_mismatch(self, rollout: dict) -> None:
        """On one learner, whose weights generated the round (sync mode), for the first
        minibatch's worth of rows."""
        rows = slice(0, min(self._logp_rows(), num_rows(rollout)))
        train = to_train_batch(take_rows(rollout, np.arange(num_rows(rollout))[rows]), np.zeros(rows.stop, np.float32))
        stats = self._on_one_learner(lambda learner: learner.logp_mismatch(train))
        if stats:
            self.metrics.log_value(LOGP_MISMATCH_MAX, stats["max"], window=1)
            self.metrics.log_value(LOGP_MISMATCH_MEAN, stats["mean"], window=1)

    def _recompute_behavior_logp(self, rollout: dict) -> None:
        """The official code's choice: behaviour log-probs from the learner (sync mode, whose
        weights generated the round), computed by the learners together."""
        train_ref = ray.put(to_train_batch(rollout, np.zeros(num_rows(rollout), np.float32)))
        results = self.learner_group.foreach_learner(
            lambda learner, ref=train_ref: learner.response_logp_share(ray.get(ref))
        )
        learner_logp = np.concatenate([logp for _, logp in sorted(self.learner_group._get_results(results), key=lambda r: r[0])])
        mask = rollout["response_mask"] > 0
        diff = np.abs(learner_logp - rollout["behavior_logp"])[mask]
        if diff.size:
            self.metrics.log_value(LOGP_MISMATCH_MAX, float(diff.max()), window=1)
            self.metrics.log_value(LOGP_MISMATCH_MEAN, float(diff.mean()), window=1)
        rollout["behavior_logp"] = np.where(mask, learner_logp, 0.0).astype(np.float32)

    # -- checkpoints: the stale queue and the rounds in flight are training state ---------
    @override(Algorithm)
    def get_state(self, components=None, *, not_components=None, **kwargs):
        self._drain()
        if self.config.sharded_learners and self._check_component(COMPONENT_LEARNER_GROUP, components, not_components):
            # the optimizer state is sharded: gathered to the first learner by all at once
            self.learner_group.foreach_learner(lambda learner: learner.gather_optimizer_state())
        state = super().get_state(components, not_components=not_components, **kwargs)
        state["m2po"] = {
            "queue": list(self._queue),
            "sample_round": self._sample_round,
            "heldout_accuracy": self._heldout_accuracy,
            "async": self._async.get_state() if self._async is not None else None,
        }
        return state

    @override(Algorithm)
    def set_state(self, state) -> None:
        super().set_state(state)
        if "m2po" in state:
            m = state["m2po"]
            self._queue = collections.deque(m["queue"])
            self._sample_round = int(m["sample_round"])
            self._heldout_accuracy = m.get("heldout_accuracy")
            if self._async is not None and m.get("async") is not None:
                self._async.set_state(m["async"])
        self._weights = self.learner_weights()
        self._learner_version = self._dispatched_version = self._weights.version


def _register() -> None:
    from ray.tune.registry import register_trainable

    register_trainable("M2PO", M2PO)


_register()
