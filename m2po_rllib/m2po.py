"""M2PO as an RLlib algorithm: `M2POConfig` and `M2PO`.

`M2PO.training_step` (see ../shared/M2PO.md, "stale-k"):
  1. sample `prompts_per_step x group_size` completions from the EnvRunnerGroup with the
     current weights; every row carries the policy version (optimizer updates) that made it,
  2. push the round into a FIFO queue; train on the round popped from it, which was made
     `staleness` optimizer updates earlier (staleness 0 = on-policy; while the queue fills,
     nothing is trained),
  3. update the LearnerGroup (`updates_per_step` minibatches), then sync weights to runners.
"""

from __future__ import annotations

import collections
import logging
import time

import numpy as np
import torch

from ray.rllib.algorithms.algorithm import Algorithm
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
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
from m2po_rllib.config import M2POConfig
from m2po_rllib.losses import compute_advantages
from m2po_rllib.rollout.batch import concat_rollouts, learner_order, num_rows, take_rows, to_train_batch

logger = logging.getLogger(__name__)

# Algorithm-level metric keys.
STALENESS_MEAN = "staleness/mean"
STALENESS_MAX = "staleness/max"
QUEUE_LEN = "staleness/queue_len"
POLICY_VERSION = "policy_version"
FILLING = "staleness/filling"
LOGP_MISMATCH_MAX = "rollout/logp_mismatch_max"
LOGP_MISMATCH_MEAN = "rollout/logp_mismatch_mean"
TOKENS_TRAINED_PER_S = "learner/tokens_per_s"


class M2PO(Algorithm):
    @classmethod
    def get_default_config(cls) -> M2POConfig:
        return M2POConfig()

    @classmethod
    def _should_create_evaluation_env_runners(cls, eval_config) -> bool:
        # Evaluation runs on the training runners unless dedicated ones are asked for.
        return eval_config.evaluation_num_env_runners > 0

    def setup(self, config) -> None:
        self._queue: collections.deque = collections.deque()
        self._sample_round = 0
        self._policy_version = 0
        super().setup(config)

    # -- the loop -------------------------------------------------------------------------
    def training_step(self) -> None:
        cfg: M2POConfig = self.config
        with self.metrics.log_time((TIMERS, ENV_RUNNER_SAMPLING_TIMER)):
            rollout, runner_metrics = self._sample_round_from_runners()
        self.metrics.aggregate(runner_metrics, key=ENV_RUNNER_RESULTS)
        if cfg.recompute_behavior_logp or (
            cfg.logp_mismatch_interval and self._sample_round % cfg.logp_mismatch_interval == 0
        ):
            self._check_behavior_logp(rollout)
        self._sample_round += 1

        self._queue.append(rollout)
        self.metrics.log_value(QUEUE_LEN, len(self._queue), window=1)
        self.metrics.log_value(POLICY_VERSION, self._policy_version, window=1)
        if len(self._queue) <= cfg.queue_lag_steps:
            self.metrics.log_value(FILLING, 1, window=1)
            return
        self.metrics.log_value(FILLING, 0, window=1)
        batch = self._queue.popleft()

        age = self._policy_version - batch["policy_version"]
        self.metrics.log_value(STALENESS_MEAN, float(age.mean()), window=1)
        self.metrics.log_value(STALENESS_MAX, float(age.max()), window=1)

        rewards = torch.as_tensor(batch["rewards"])
        advantages = compute_advantages(rewards, cfg.group_size, estimator=cfg.advantage_estimator)
        train = to_train_batch(batch, advantages.numpy())
        order = learner_order(num_rows(train), cfg.minibatch_prompts * cfg.group_size, max(1, cfg.num_learners))
        train = take_rows(train, order)
        n_tokens = float(train["response_mask"].sum())

        with self.metrics.log_time((TIMERS, LEARNER_UPDATE_TIMER)):
            t0 = time.perf_counter()
            results = self.learner_group.update(
                batch=MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch(train)}, env_steps=num_rows(train)),
                minibatch_size=cfg.minibatch_size_per_learner,
                num_epochs=cfg.num_epochs,
                shuffle_batch_per_epoch=False,
                timesteps={
                    NUM_ENV_STEPS_SAMPLED_LIFETIME: self.metrics.peek(
                        (ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME), default=0
                    )
                },
            )
            seconds = time.perf_counter() - t0
            self.metrics.log_value(TOKENS_TRAINED_PER_S, n_tokens * cfg.num_epochs / seconds, window=1)
        self.metrics.aggregate(results, key=LEARNER_RESULTS)
        self._policy_version += cfg.updates_per_step

        with self.metrics.log_time((TIMERS, SYNCH_WORKER_WEIGHTS_TIMER)):
            self.env_runner_group.sync_weights(
                from_worker_or_learner_group=self.learner_group,
                inference_only=True,
                timeout_seconds=600.0,
            )

    def restore_env_runners(self, env_runner_group) -> list[int]:
        """RLlib's restore, plus the learners' current weights for each restarted runner
        (the default copies the local runner's state, which holds no LLM weights)."""
        restored = super().restore_env_runners(env_runner_group)
        if restored:
            env_runner_group.sync_weights(
                from_worker_or_learner_group=self.learner_group,
                to_worker_indices=restored,
                inference_only=True,
                timeout_seconds=600.0,
            )
        return restored

    @staticmethod
    def _runner_plan(group) -> tuple[bool, int]:
        """(sample on the local runner?, runners sharing the round's prompts)."""
        remote = group.num_remote_env_runners()
        return remote == 0, max(1, remote)

    def _sample_round_from_runners(self):
        cfg = self.config
        local, n = self._runner_plan(self.env_runner_group)
        per_runner = cfg.prompts_per_step // n
        seed = (cfg.seed or 0) * 1_000_003 + self._sample_round
        deadline = time.monotonic() + cfg.env_runner_restore_timeout_s + 600
        while True:
            out = self.env_runner_group.foreach_env_runner(
                lambda runner: (runner.sample(num_prompts=per_runner, seed=seed), runner.get_metrics()),
                local_env_runner=local,
            )
            if out:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("no EnvRunner returned samples, and none could be restored; see the runners' logs")
            # Failed runners (e.g. a dead vLLM engine) are restarted by Ray; bring them back
            # with the current weights and sample this round again.
            logger.warning("no EnvRunner returned samples; restoring failed runners and retrying")
            time.sleep(1.0)
            self.restore_env_runners(self.env_runner_group)
        if len(out) * per_runner != cfg.prompts_per_step:
            logger.warning(
                "%d of %d EnvRunners returned samples this round; training on %d prompts",
                len(out), n, len(out) * per_runner,
            )
        batches = [b for b, _ in out]
        return concat_rollouts(batches, pad_id=self._pad_id()), [m for _, m in out]

    def _pad_id(self) -> int:
        if not hasattr(self, "_pad_token_id"):
            from transformers import AutoTokenizer

            from m2po_rllib.models.builtin import resolve_model_path

            tok = AutoTokenizer.from_pretrained(resolve_model_path(self.config.model_config["model"]))
            self._pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return self._pad_token_id

    def _check_behavior_logp(self, rollout: dict) -> None:
        """Learner log-probs of the rollout with the generating weights, vs the engine's."""
        train = to_train_batch(rollout, np.zeros(num_rows(rollout), np.float32))

        def logp_fn(learner, batch=train):
            return learner.compute_response_logp(batch)

        result = self.learner_group.foreach_learner(logp_fn)
        learner_logp = next(iter(result)).get()
        mask = rollout["response_mask"] > 0
        diff = np.abs(learner_logp - rollout["behavior_logp"])[mask]
        if diff.size:
            self.metrics.log_value(LOGP_MISMATCH_MAX, float(diff.max()), window=1)
            self.metrics.log_value(LOGP_MISMATCH_MEAN, float(diff.mean()), window=1)
        if self.config.recompute_behavior_logp:
            rollout["behavior_logp"] = np.where(mask, learner_logp, 0.0).astype(np.float32)

    # -- checkpoints: the stale queue is training state -----------------------------------
    def get_state(self, components=None, *, not_components=None, **kwargs):
        state = super().get_state(components, not_components=not_components, **kwargs)
        state["m2po"] = {
            "queue": list(self._queue),
            "sample_round": self._sample_round,
            "policy_version": self._policy_version,
        }
        return state

    def set_state(self, state) -> None:
        super().set_state(state)
        if "m2po" in state:
            self._queue = collections.deque(state["m2po"]["queue"])
            self._sample_round = int(state["m2po"]["sample_round"])
            self._policy_version = int(state["m2po"]["policy_version"])

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def stale_queue(self) -> list[dict]:
        return list(self._queue)


def _register() -> None:
    from ray.tune.registry import register_trainable

    register_trainable("M2PO", M2PO)


_register()
