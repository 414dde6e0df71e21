"""M2PO as an RLlib algorithm (`M2POConfig` lives in config/algorithm_config.py).

`M2PO.training_step` is RLlib's beats, each in its own `log_time` timer, in both modes:
  1. sample   - the next step's rollouts from the `RolloutSampler` (rollout/sampler.py);
     while the stale-k queue fills there is none and the step ends here,
  2. check    - sync: the learner's log-probs against the engine's (or, with
     `recompute_behavior_logp`, in place of them); async: the runners recompute them,
  3. update   - the step goes to the learners (`updates_per_step` minibatches),
  4. publish  - the weights an update returns go out with the next requests.
Synchronous (`async_rollouts=False`, the paper's stale-k protocol; ../shared/M2PO.md):
sample a round with the current weights, queue it, train the round made `staleness`
updates earlier. Asynchronous (`async_rollouts=True`, as RLlib's APPO/IMPALA): rounds stay
in flight on every remote EnvRunner, admitted only within `max_staleness`; the learners
update without the driver waiting (`async_update` with remote learners). One
`training_step` call dispatches one step.

Weights are published once per update (`PublishedWeights`, one `ray.put` for all remote
runners) and ride with the next request to each runner, which loads them between rounds.
"""

from __future__ import annotations

import logging
import time

import numpy as np
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
from m2po_rllib.common import keys
from m2po_rllib.common.log_filters import quiet_gputil_hint_without_gpus, quiet_rllib_new_api_stack_notice
from m2po_rllib.common.threads import use_cpus
from m2po_rllib.config.algorithm_config import M2POConfig
from m2po_rllib.driver import checkpoints
from m2po_rllib.driver.learners import LearnerRoom, UpdateReport, wait_until
from m2po_rllib.driver.pace import IterationPace
from m2po_rllib.driver.resources import actors_placed
from m2po_rllib.losses import compute_advantages
from m2po_rllib.losses.correction import mismatch_metrics
from m2po_rllib.rollout.sampler import RolloutSampler, runner_actors
from m2po_rllib.wire.batch import (
    learner_order, num_rows, row_ages, take_rows, to_train_batch, token_ages, versions_spanned,
)

quiet_gputil_hint_without_gpus()
quiet_rllib_new_api_stack_notice()
logger = logging.getLogger(__name__)


class M2PO(Algorithm):
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
        self._heldout_accuracy: float | None = None
        with actors_placed(config, self.default_resource_request(config).bundles):
            super().setup(config)
        # The learners' side (learners.py) and the runners' (rollout/sampler.py), one room each.
        self._learners = LearnerRoom(self.learner_group, config)
        self._sampler = RolloutSampler(config, self.env_runner_group, self._restore_runners, self._learners.version)
        self._iter = IterationPace()
        if config.native_weight_sync:
            self._connect_weight_sync()

    # -- native weight sync (weight_sync="native") ------------------------------------------
    def _connect_weight_sync(self) -> None:
        """Forms the learners' weight-transfer group with every healthy training runner and
        sends them the current weights (at the start, and after runners were restored or a
        send failed; with none up, nothing until one is restored). Updates in flight finish
        first: their broadcasts use the old group."""
        self._learners.wait_idle(self._absorb)
        handles = runner_actors(self.env_runner_group)
        stats = self._learners.connect_weight_sync(handles)
        if stats is None:
            logger.info("native weight sync: no runner is up; the group is formed once one is restored")
            return
        self._log_native_sync(stats)
        version = int(stats[keys.NATIVE_SYNC_VERSION])
        logger.info("native weight sync: group formed with %d runners (%s)", len(handles),
                    f"version {version} sent" if version >= 0 else "the first send failed")
        if version < 0:  # a runner gone meanwhile: RLlib takes it out of service, restores it later
            self.env_runner_group.foreach_env_runner(lambda runner: None, local_env_runner=False)

    def _log_native_sync(self, stats: dict | None) -> None:
        for key, value in (stats or {}).items():
            self.metrics.log_value(key, value, window=1)

    def _restore_runners(self) -> None:
        """RLlib brings failed runners back; with a native sync they join a new group."""
        restored = self.restore_env_runners(self.env_runner_group)
        if restored and self.config.native_weight_sync:
            self._connect_weight_sync()

    @property
    def policy_version(self) -> int:
        """Optimizer updates of the learners' weights, as they last reported it."""
        return self._learners.version

    @override(Algorithm)
    def get_module(self, module_id: str = DEFAULT_MODULE_ID):
        """The trained RLModule (an `HFCausalLMModule`), RLlib's way to inspect or export a
        policy. M2PO's EnvRunners hold a generation engine, not a module, so it comes from
        the learners: a local learner's own module (it keeps training with the algorithm);
        with remote learners, a module built here holding their current weights and version
        (a copy, taken after the updates in flight finish). None for an unknown id, as RLlib."""
        group = self.learner_group
        if group.is_local:
            modules = group._learner.module
            return modules[module_id].unwrapped() if module_id in modules.keys() else None
        if module_id != DEFAULT_MODULE_ID:
            return None
        self._drain()
        published = self._learners.publish()
        spec = self.config.get_rl_module_spec(spaces=self.env_runner_group.get_spaces())
        module = spec.build()
        module.set_state({"weights": published.get(), "policy_version": published.version})
        return module

    @property
    def sampler(self) -> RolloutSampler:
        return self._sampler

    @property
    def stale_queue(self) -> list[dict]:
        """Sync mode: the sampled rounds waiting to be trained, oldest first."""
        return list(self._sampler.queue)

    # -- one iteration ------------------------------------------------------------------
    @override(Algorithm)
    def step(self):
        if self.config.evaluation_interval and self._heldout_accuracy is None:
            self.evaluate()  # the starting point: from iteration 1 on, every result has one
        self._iter = IterationPace()
        result = super().step()
        if self.config.evaluation_interval:
            result[keys.HELDOUT_ACCURACY] = self._heldout_accuracy
        result[keys.POLICY_VERSION] = self._learners.version
        result.update(self._iter.metrics(max(1, self.env_runner_group.num_remote_env_runners())))
        return result

    def record_heldout_accuracy(self, accuracy: float) -> None:
        """Called by the evaluation function; carried into every later result."""
        self._heldout_accuracy = float(accuracy)

    @override(Algorithm)
    def training_step(self) -> None:
        if self._learners.needs_reconnect:  # a native send failed: runners restored, group formed again
            self._restore_runners()
            if self._learners.needs_reconnect:
                self._connect_weight_sync()
        batch = self._next_async_step() if self.config.async_rollouts else self._next_sync_step()
        for key, value in self._sampler.metrics().items():
            self.metrics.log_value(key, value, window=1)
        if batch is None:
            return  # the stale-k queue is filling
        with self.metrics.log_time((TIMERS, LEARNER_UPDATE_TIMER)):
            with self._sampler.engines_asleep(lambda key, s: self.metrics.log_value(key, s, window=1)):
                results = self._update(batch)  # colocate=True: the engine's GPU memory is the learner's
        with self.metrics.log_time((TIMERS, SYNCH_WORKER_WEIGHTS_TIMER)):
            self._absorb(self._learners.take(results))
            self._sampler.request(self._learners.weights)  # async: the new weights go out at once

    # -- beats 1-2, synchronous: sample -> check the log-probs -> queue ----------------------
    def _next_sync_step(self) -> dict | None:
        cfg: M2POConfig = self.config
        with self.metrics.log_time((TIMERS, ENV_RUNNER_SAMPLING_TIMER)):
            rollout, runner_metrics, busy_s = self._sampler.sample(self._learners.weights)
        self.metrics.aggregate(runner_metrics, key=ENV_RUNNER_RESULTS)
        self._iter.runner_busy_s += busy_s
        with self.metrics.log_time((TIMERS, keys.LOGP_MISMATCH_TIMER)):
            if cfg.recompute_behavior_logp:
                self._recompute_behavior_logp(rollout)
            elif (
                cfg.logp_mismatch_interval
                and (self._sampler.steps_sampled - 1) % cfg.logp_mismatch_interval == 0
                # only a round the learner's current weights generated (broadcast_interval > 1:
                # the runners may serve older ones)
                and int(rollout["policy_version"].min()) == self.policy_version
            ):
                self._log_logp_mismatch(rollout)
        batch = self._sampler.push(rollout)
        self.metrics.log_value(keys.FILLING, int(batch is None), window=1)
        return batch

    # -- beat 1, asynchronous: collect and request rounds until the next step is in -------
    def _next_async_step(self) -> dict:
        """Collects rounds and requests new ones (with the newest weights) until a step is
        admitted; with remote learners, at most 2 updates in flight. Timed once, as a wait."""
        remote_learners = self.learner_group.is_remote
        max_updates_in_flight = 2 if remote_learners else 1
        step: list[dict] = []

        def progress() -> bool:
            progressed = self._collect_rounds()
            self._sampler.request(self._learners.weights)
            if remote_learners:
                progressed |= self._absorb(self._learners.poll())
            if self._learners.in_flight < max_updates_in_flight:
                batch, dropped = self._sampler.pop_step()
                if batch is not None:
                    step.append(batch)
                progressed |= dropped  # rounds over the bound were dropped and re-requested
            return progressed

        with self.metrics.log_time((TIMERS, ENV_RUNNER_SAMPLING_TIMER)):
            wait_until(lambda: bool(step), progress, self.config.sample_timeout_s, lambda: (
                f"async rollouts made no progress (rounds in flight: {self._sampler.num_in_flight()}, healthy "
                f"runners: {self.env_runner_group.healthy_env_runner_ids()}, updates in flight: "
                f"{self._learners.in_flight}); see the runners' logs, or raise `sample_timeout_s` if one round "
                "takes longer"))
        return step[0]

    def _collect_rounds(self) -> bool:
        progressed, runner_metrics, busy_s = self._sampler.collect()
        if runner_metrics:
            self.metrics.aggregate(runner_metrics, key=ENV_RUNNER_RESULTS)
        self._iter.runner_busy_s += busy_s
        return progressed

    def _drain(self) -> None:
        """Waits for every round and update in flight, so that a checkpoint loses nothing."""
        if not self.config.async_rollouts:
            return

        def progress() -> bool:
            self._sampler.poll()  # streaming: the runners' calls go on, with no new rounds
            return self._collect_rounds() | self._absorb(self._learners.poll())

        wait_until(lambda: not (self._sampler.num_in_flight() or self._learners.in_flight), progress,
                   self.config.sample_timeout_s, lambda: (
                       f"checkpoint: {self._sampler.num_in_flight()} rounds and {self._learners.in_flight} updates "
                       "still in flight"))

    def _snapshot_rounds(self) -> dict[int, dict] | None:
        """A checkpoint with streaming runners: the updates in flight finish, the rounds in
        flight do not (they are read as far as they got: `RolloutSampler.snapshot_in_flight`);
        None where they cannot be (then `_drain` waits for them)."""
        if not self._sampler.streaming:
            return None
        self._learners.wait_idle(self._absorb)
        wait_until(lambda: not self._sampler.calls_in_flight, lambda: self._collect_rounds(),
                   self.config.sample_timeout_s, lambda: f"checkpoint: {self._sampler.calls_in_flight} runner calls "
                                                         "still in flight")
        return self._sampler.snapshot_in_flight()

    # -- beats 3-4: update, publish --------------------------------------------------------
    def _update(self, rollout: dict) -> list[dict]:
        """Sends one step (a rollout batch) to the learners; returns the results ready now
        (with remote learners in async mode, those of earlier updates)."""
        cfg = self.config
        async_update = cfg.async_rollouts and self.learner_group.is_remote
        start = self._sampler.dispatched_version - cfg.updates_per_step  # this step's first update
        if cfg.async_rollouts and "engine_logp" in rollout:  # the runners recomputed them
            self._log_mismatch(rollout)
        age = row_ages(rollout, start)
        self.metrics.log_value(keys.STALENESS_MEAN, float(age.mean()), window=1)
        self.metrics.log_value(keys.STALENESS_MAX, float(age.max()), window=1)
        self.metrics.log_value(keys.STALENESS_TOKEN_MEAN, float(token_ages(rollout, start).mean()), window=1)
        if cfg.inflight_weight_updates:
            self.metrics.log_value(keys.VERSIONS_SPANNED_MAX, float(versions_spanned(rollout).max()), window=1)
        advantages = compute_advantages(
            torch.as_tensor(np.array(rollout["rewards"])), cfg.group_size, estimator=cfg.advantage_estimator
        )
        train = to_train_batch(rollout, advantages.numpy())
        minibatch = cfg.minibatch_prompts * cfg.group_size
        train = take_rows(train, learner_order(num_rows(train), minibatch, max(1, cfg.num_learners)))
        t0 = time.perf_counter()
        results = self._learners.update(
            MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch(train)}, env_steps=num_rows(train)),
            dispatched_version=self._sampler.dispatched_version, async_update=async_update,
            env_steps_lifetime=self.metrics.peek((ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME), default=0),
        )
        if not async_update:
            tokens = float(train["response_mask"].sum()) * cfg.num_epochs
            self.metrics.log_value(keys.TOKENS_TRAINED_PER_S, tokens / (time.perf_counter() - t0), window=1)
        return results

    def _absorb(self, report: UpdateReport | None) -> bool:
        """An update report into the iteration: the learners' metrics, native sends, their
        busy time and updates, and the trained tokens' M2 by age (the staleness bound
        follows it with "auto"). False when there was none."""
        if report is None:
            return False
        for stats in report.native_stats:
            self._log_native_sync(stats)
        self._iter.learner_busy_s += report.busy_s
        self._iter.updates += report.updates
        self._sampler.observe_m2(report.m2_by_age, self._learners.version)
        self.metrics.aggregate(report.results, key=LEARNER_RESULTS)
        return True

    def learner_weights(self):
        """The learners' current weights, published now (`LearnerRoom.publish`)."""
        return self._learners.publish()

    # -- beat 2: log-probs, the engine's against the learner's --------------------------------
    def _log_logp_mismatch(self, rollout: dict) -> None:
        for key, value in self._learners.logp_mismatch(rollout).items():
            self.metrics.log_value(key, value, window=1)

    def _recompute_behavior_logp(self, rollout: dict) -> None:
        """The official code's choice: behaviour log-probs from the learners (sync mode, whose
        weights generated the round); the engine's are kept as `engine_logp`."""
        mask = rollout["response_mask"] > 0
        rollout["engine_logp"] = rollout["behavior_logp"]
        rollout["behavior_logp"] = np.where(mask, self._learners.response_logp(rollout), 0.0).astype(np.float32)
        self._log_mismatch(rollout)

    def _log_mismatch(self, rollout: dict) -> None:
        """The engine's log-probs against the recomputed ones of a round (`mismatch_metrics`)."""
        stats = mismatch_metrics(rollout["behavior_logp"], rollout["engine_logp"], rollout["response_mask"])
        for key, value in stats.items():
            self.metrics.log_value(key, value, window=1)

    # -- checkpoints: the stale queue and the rounds in flight are training state ---------
    # Paths: RLlib reads a relative path as a URI without a scheme and fails; a local path
    # (relative, or with ~) is made absolute here, at the API's edge. URIs pass unchanged.
    # A local save replaces the previous checkpoint whole or not at all, and a restore takes
    # the newest complete one (checkpoints.py): a kill mid-save loses nothing saved before.
    @override(Algorithm)
    def save_to_path(self, path=None, *args, **kwargs) -> str:
        path = checkpoints.local_path(path)
        if path is None or "://" in str(path):
            return super().save_to_path(path, *args, **kwargs)
        write = lambda directory: super(M2PO, self).save_to_path(directory, *args, **kwargs)  # noqa: E731
        return checkpoints.save(path, write, iteration=self.iteration)

    @override(Algorithm)
    def restore_from_path(self, path, *args, **kwargs):
        return super().restore_from_path(checkpoints.restorable(path), *args, **kwargs)

    @classmethod
    @override(Algorithm)
    def from_checkpoint(cls, path, *args, **kwargs):
        return super().from_checkpoint(checkpoints.restorable(path), *args, **kwargs)

    @override(Algorithm)
    def get_state(self, components=None, *, not_components=None, **kwargs):
        partials = self._snapshot_rounds()
        if partials is None:
            self._drain()
        if self.config.sharded_learners and self._check_component(COMPONENT_LEARNER_GROUP, components, not_components):
            # the optimizer state is sharded: gathered to the first learner by all at once
            self.learner_group.foreach_learner(lambda learner: learner.gather_optimizer_state())
        state = super().get_state(components, not_components=not_components, **kwargs)
        state["m2po"] = {"sampler": self._sampler.get_state(partials), "heldout_accuracy": self._heldout_accuracy}
        return state

    @override(Algorithm)
    def set_state(self, state) -> None:
        super().set_state(state)
        self._learners.restored()
        if self.config.native_weight_sync:
            self._connect_weight_sync()  # the restored weights, to every runner
        if "m2po" in state:
            self._sampler.set_state(state["m2po"]["sampler"], self._learners.version)
            self._heldout_accuracy = state["m2po"]["heldout_accuracy"]


def _register() -> None:
    from ray.tune.registry import register_trainable

    register_trainable("M2PO", M2PO)


_register()
