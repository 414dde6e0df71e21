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
from typing import Any

import numpy as np
import torch
from typing_extensions import Self

from ray.rllib.algorithms.algorithm import Algorithm
from ray.rllib.algorithms.algorithm_config import AlgorithmConfig, NotProvided
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
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
from m2po_rllib.losses import (
    ADVANTAGE_ESTIMATORS,
    LOSS_AGG_MODES,
    MASK_SCOPES,
    POLICY_LOSSES,
    compute_advantages,
    policy_loss_params,
)
from m2po_rllib.rollout.batch import concat_rollouts, learner_order, num_rows, take_rows, to_train_batch

logger = logging.getLogger(__name__)

ROLLOUT_ENGINES = ("auto", "hf", "vllm")

# Algorithm-level metric keys.
STALENESS_MEAN = "staleness/mean"
STALENESS_MAX = "staleness/max"
QUEUE_LEN = "staleness/queue_len"
POLICY_VERSION = "policy_version"
FILLING = "staleness/filling"
LOGP_MISMATCH_MAX = "rollout/logp_mismatch_max"
LOGP_MISMATCH_MEAN = "rollout/logp_mismatch_mean"
TOKENS_TRAINED_PER_S = "learner/tokens_per_s"


class M2POConfig(AlgorithmConfig):
    """Configuration of M2PO (and of the baselines, through `policy_loss`).

    Every M2PO-specific setting has its default and its meaning here, once.
    """

    def __init__(self, algo_class=None):
        super().__init__(algo_class=algo_class or M2PO)
        from m2po_rllib.evaluation import evaluate_heldout
        from m2po_rllib.rollout.env_runner import LLMEnvRunner

        # -- training() -----------------------------------------------------------------
        # Policy loss by name: m2po | m2po_official | grpo | grpo_no_tr | gspo.
        self.policy_loss = "m2po"
        # tau: bound on the second moment of the log importance ratios (paper: 0.04).
        self.m2_threshold = 0.04
        # Clip bounds for the clip losses; None = the loss's own default (GRPO 0.2/0.2,
        # GSPO 3e-4/4e-4). eps_high > eps_low is DAPO's clip-higher.
        self.eps_low = None
        self.eps_high = None
        # Extra keyword arguments for the policy loss (validated against its signature).
        self.policy_loss_kwargs = {}
        # token-mean (paper) | seq-mean-token-mean | seq-mean-token-sum-norm (Dr. GRPO).
        self.loss_agg_mode = "token-mean"
        # global: the M2PO mask is a property of the optimizer minibatch, across learners;
        # local: per learner shard (cheaper, split-dependent, as other implementations).
        self.mask_scope = "global"
        # grpo (mean/std) | drgrpo (mean only) | rloo.
        self.advantage_estimator = "grpo"
        # Completions per prompt (the GRPO group).
        self.group_size = 8
        # Prompts per training step, over all EnvRunners.
        self.prompts_per_step = 32
        # Prompts per optimizer minibatch: updates per step = prompts_per_step / minibatch_prompts.
        self.minibatch_prompts = 8
        # Data lag in optimizer updates (stale-k); a multiple of updates per step.
        self.staleness = 0
        # Recompute behaviour log-probs with the learner at generation time (the official
        # code's choice) instead of trusting the rollout engine's.
        self.recompute_behavior_logp = False
        # Measure |engine log-prob - learner log-prob| every this many steps (0 = never).
        self.logp_mismatch_interval = 1
        self.lr = 1e-6
        self.grad_clip = 1.0
        self.grad_clip_by = "global_norm"
        self.weight_decay = 0.0
        self.adam_betas = (0.9, 0.999)
        self.num_epochs = 1

        # -- env_runners() ----------------------------------------------------------------
        self.env_runner_cls = LLMEnvRunner
        # auto: vllm with a GPU, else the transformers engine (faster for tiny models
        # on CPU; see README).
        self.rollout_engine = "auto"
        self.engine_kwargs = {}
        self.temperature = 1.0
        self.top_p = 1.0
        self.max_new_tokens = 64
        self.stop = []

        # -- evaluation() -----------------------------------------------------------------
        # Held-out evaluation on the training runners (greedy; mean@k with eval_samples > 1).
        self.evaluation_duration = 200
        self.evaluation_duration_unit = "episodes"
        self.eval_samples = 1
        self.custom_evaluation_function = evaluate_heldout

    # -------------------------------------------------------------------------------------
    def training(
        self,
        *,
        policy_loss=NotProvided,
        m2_threshold=NotProvided,
        eps_low=NotProvided,
        eps_high=NotProvided,
        policy_loss_kwargs=NotProvided,
        loss_agg_mode=NotProvided,
        mask_scope=NotProvided,
        advantage_estimator=NotProvided,
        group_size=NotProvided,
        prompts_per_step=NotProvided,
        minibatch_prompts=NotProvided,
        staleness=NotProvided,
        recompute_behavior_logp=NotProvided,
        logp_mismatch_interval=NotProvided,
        weight_decay=NotProvided,
        adam_betas=NotProvided,
        **kwargs,
    ) -> Self:
        super().training(**kwargs)
        self._set_provided(
            policy_loss=policy_loss,
            m2_threshold=m2_threshold,
            eps_low=eps_low,
            eps_high=eps_high,
            policy_loss_kwargs=policy_loss_kwargs,
            loss_agg_mode=loss_agg_mode,
            mask_scope=mask_scope,
            advantage_estimator=advantage_estimator,
            group_size=group_size,
            prompts_per_step=prompts_per_step,
            minibatch_prompts=minibatch_prompts,
            staleness=staleness,
            recompute_behavior_logp=recompute_behavior_logp,
            logp_mismatch_interval=logp_mismatch_interval,
            weight_decay=weight_decay,
            adam_betas=adam_betas,
        )
        return self

    def env_runners(
        self,
        *,
        rollout_engine=NotProvided,
        engine_kwargs=NotProvided,
        temperature=NotProvided,
        top_p=NotProvided,
        max_new_tokens=NotProvided,
        stop=NotProvided,
        **kwargs,
    ) -> Self:
        super().env_runners(**kwargs)
        self._set_provided(
            rollout_engine=rollout_engine,
            engine_kwargs=engine_kwargs,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            stop=stop,
        )
        return self

    def evaluation(self, *, eval_samples=NotProvided, **kwargs) -> Self:
        super().evaluation(**kwargs)
        self._set_provided(eval_samples=eval_samples)
        return self

    def _set_provided(self, **settings) -> None:
        for name, value in settings.items():
            if value is not NotProvided:
                setattr(self, name, value)

    # -- derived quantities ---------------------------------------------------------------
    @property
    def updates_per_step(self) -> int:
        return self.num_epochs * (self.prompts_per_step // self.minibatch_prompts)

    @property
    def queue_lag_steps(self) -> int:
        """Training steps between generating a round and training on it."""
        return self.staleness // self.updates_per_step

    @property
    def minibatch_size_per_learner(self) -> int:
        return self.minibatch_prompts * self.group_size // max(1, self.num_learners)

    def resolved_rollout_engine(self) -> str:
        if self.rollout_engine != "auto":
            return self.rollout_engine
        return "vllm" if torch.cuda.is_available() else "hf"

    def policy_loss_params(self) -> dict[str, Any]:
        """Keyword arguments for `compute_policy_loss(self.policy_loss, ...)`."""
        accepted = policy_loss_params(self.policy_loss)
        params = {}
        for name, value in (("m2_threshold", self.m2_threshold), ("eps_low", self.eps_low), ("eps_high", self.eps_high)):
            if name in accepted and value is not None:
                params[name] = value
        params.update(self.policy_loss_kwargs or {})
        return params

    # -- RLlib hooks ----------------------------------------------------------------------
    def get_default_rl_module_spec(self) -> RLModuleSpec:
        from m2po_rllib.torch.rl_module import HFCausalLMModule

        return RLModuleSpec(module_class=HFCausalLMModule)

    def get_default_learner_class(self):
        from m2po_rllib.torch.learner import M2POTorchLearner

        return M2POTorchLearner

    def validate(self) -> None:
        super().validate()
        errors = []

        def bad(msg):
            errors.append(msg)

        if self.policy_loss not in POLICY_LOSSES:
            bad(f"`policy_loss` ({self.policy_loss!r}) must be one of {sorted(POLICY_LOSSES)}")
        else:
            accepted = policy_loss_params(self.policy_loss)
            unknown = set(self.policy_loss_kwargs or {}) - set(accepted)
            if unknown:
                bad(
                    f"`policy_loss_kwargs` has {sorted(unknown)}, which `{self.policy_loss}` does "
                    f"not take; it accepts {sorted(accepted)}"
                )
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            bad(f"`loss_agg_mode` ({self.loss_agg_mode!r}) must be one of {list(LOSS_AGG_MODES)}")
        if self.mask_scope not in MASK_SCOPES:
            bad(f"`mask_scope` ({self.mask_scope!r}) must be one of {list(MASK_SCOPES)}")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            bad(
                f"`advantage_estimator` ({self.advantage_estimator!r}) must be one of "
                f"{list(ADVANTAGE_ESTIMATORS)}"
            )
        if not (isinstance(self.m2_threshold, (int, float)) and self.m2_threshold > 0):
            bad(f"`m2_threshold` ({self.m2_threshold}) must be > 0; the paper uses 0.04")
        if not isinstance(self.group_size, int) or self.group_size < 2:
            bad(f"`group_size` ({self.group_size}) must be an int >= 2: group-relative advantages need 2+ samples per prompt")
        for name in ("prompts_per_step", "minibatch_prompts", "num_epochs", "max_new_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                bad(f"`{name}` ({value}) must be a positive int")
        if errors:
            self._raise(errors)
        if self.minibatch_prompts > self.prompts_per_step:
            bad(
                f"`minibatch_prompts` ({self.minibatch_prompts}) must be <= `prompts_per_step` "
                f"({self.prompts_per_step}); lower minibatch_prompts or raise prompts_per_step"
            )
        elif self.prompts_per_step % self.minibatch_prompts:
            bad(
                f"`prompts_per_step` ({self.prompts_per_step}) must be a multiple of "
                f"`minibatch_prompts` ({self.minibatch_prompts})"
            )
        elif not isinstance(self.staleness, int) or self.staleness < 0 or self.staleness % self.updates_per_step:
            bad(
                f"`staleness` ({self.staleness}) must be a non-negative multiple of the optimizer "
                f"updates per step ({self.updates_per_step} = num_epochs x prompts_per_step / "
                f"minibatch_prompts); e.g. staleness={self.updates_per_step * max(1, round(self.staleness / self.updates_per_step)) if isinstance(self.staleness, int) else 0}"
            )
        runners = max(1, self.num_env_runners)
        if self.prompts_per_step % runners:
            bad(
                f"`prompts_per_step` ({self.prompts_per_step}) must be a multiple of "
                f"`num_env_runners` ({self.num_env_runners}) so each runner samples whole groups"
            )
        learners = max(1, self.num_learners)
        if (self.minibatch_prompts * self.group_size) % learners:
            bad(
                f"a minibatch ({self.minibatch_prompts} prompts x {self.group_size}) must split evenly "
                f"over `num_learners` ({self.num_learners})"
            )
        if self.rollout_engine not in ROLLOUT_ENGINES:
            bad(f"`rollout_engine` ({self.rollout_engine!r}) must be one of {list(ROLLOUT_ENGINES)}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            bad(f"`temperature` ({self.temperature}) must be > 0 for training rollouts")
        if not (0 < self.top_p <= 1):
            bad(f"`top_p` ({self.top_p}) must be in (0, 1]")
        if not (self.model_config or {}).get("model"):
            bad(
                "no model: set `.rl_module(model_config={'model': <HF dir, hub name or "
                "'builtin:arith-tiny'>})`"
            )
        if self.env is None:
            bad("no env: set `.environment('m2po/Arithmetic-v0', env_config={...})`")
        if self.evaluation_interval and self.evaluation_duration_unit != "episodes":
            bad("`evaluation_duration_unit` must be 'episodes' (held-out problems) for M2PO")
        if not isinstance(self.eval_samples, int) or self.eval_samples < 1:
            bad(f"`eval_samples` ({self.eval_samples}) must be an int >= 1")
        if errors:
            self._raise(errors)

    @staticmethod
    def _raise(errors):
        raise ValueError("Invalid M2POConfig:\n  - " + "\n  - ".join(errors))

    # -- YAML -----------------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str, overrides: dict | None = None) -> "M2POConfig":
        from m2po_rllib.config_io import config_from_yaml

        return config_from_yaml(path, overrides=overrides, config_cls=cls)


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
