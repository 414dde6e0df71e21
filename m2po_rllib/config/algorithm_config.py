"""`M2POConfig`: every M2PO setting, its default and its meaning, once; `validate()`.

Settings mirror RLlib's config methods (`training()`, `env_runners()`, ...), so YAML configs
(from_yaml.py) and Ray Tune spaces use the same names. `validate()` runs RLlib's checks, then
M2PO's (validation/): a `ConfigError` names the setting, the value and the fix.
"""

from __future__ import annotations

import functools
from typing import Any

from typing_extensions import Self

# DEPRECATED_VALUE: the -1 that RLlib's `get_state` drops (from where that method reads it).
from ray.rllib.algorithms.algorithm_config import DEPRECATED_VALUE, AlgorithmConfig, NotProvided
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.utils.annotations import override

from m2po_rllib.common.errors import ConfigError
from m2po_rllib.config.derived import DEFAULT_MODEL_DTYPE, DerivedSettings
from m2po_rllib.config.from_yaml import apply_overrides, config_from_spec, load_spec
from m2po_rllib.config.validation import STAGES, check_types, log_notices, raise_problems
from m2po_rllib.losses import PAPER_M2_THRESHOLD
from m2po_rllib.rollout.staleness import DEFAULT_CEILING, DEFAULT_HALF_LIFE
from m2po_rllib.torch.logp import DEFAULT_CHUNK_SIZE


@functools.cache
def _rllib_deprecated_settings() -> frozenset[str]:
    """The attributes RLlib itself initialises to `DEPRECATED_VALUE` (-1)."""
    return frozenset(
        k for k, v in AlgorithmConfig().__dict__.items() if type(v) is int and v == DEPRECATED_VALUE
    )


class M2POConfig(DerivedSettings, AlgorithmConfig):
    """Configuration of M2PO (and of the baselines, through `policy_loss`).

    Every M2PO-specific setting has its default and its meaning here, once.
    """

    def __init__(self, algo_class=None):
        from m2po_rllib.driver.m2po import M2PO

        super().__init__(algo_class=algo_class or M2PO)
        from m2po_rllib.driver.evaluation import evaluate_heldout
        from m2po_rllib.rollout.env_runner import LLMEnvRunner

        # -- training() -----------------------------------------------------------------
        # Policy loss by name: m2po | m2po_official | grpo | grpo_no_tr | gspo.
        self.policy_loss = "m2po"
        # tau: bound on the second moment of the log importance ratios (paper: 0.04).
        self.m2_threshold = PAPER_M2_THRESHOLD
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
        # Behaviour log-probs in the learner's numerics (its code, dtype and kernels) with the
        # weights that generated each round, instead of the engine's (the official code's
        # choice): computed by the learners in sync mode (they hold those weights when the
        # round arrives), by the runner beside its engine in async mode. The engine's stay
        # in the batch as `engine_logp`, for the mismatch metrics and `rollout_correction`.
        self.recompute_behavior_logp = False
        # Off-policy correction of the engine/learner gap (losses/correction.py), composable
        # with every policy loss: None | tis_token | tis_seq | mis_token | mis_seq | icepop;
        # its ratio bounds (None: the correction's defaults, e.g. TIS/MIS 2.0, IcePop
        # [0.5, 5]). Needs recompute_behavior_logp.
        self.rollout_correction = None
        self.rollout_correction_low = None
        self.rollout_correction_high = None
        # Measure |engine log-prob - learner log-prob| every this many steps (0 = never), on
        # one minibatch's worth of the round, on one learner (sync mode; see docs/numerics.md).
        self.logp_mismatch_interval = 10
        # Asynchronous rollouts (async_rollouts.py): remote EnvRunners generate while the
        # learners train, and `max_staleness` bounds the age, in optimizer updates, of every
        # trained token (at least (broadcast_interval + 1) x updates_per_step - 1, what one
        # round in flight implies). Off: the paper's exact stale-k protocol (`staleness`).
        self.async_rollouts = False
        self.max_staleness = None
        # max_staleness="auto" (rollout/staleness.py): the bound follows the measured second
        # moment of the trained tokens' log-ratios by age, kept where M2 at the oldest admitted
        # age is `staleness_target_m2` (None: tau, `m2_threshold`: data M2PO need barely
        # mask), within [`staleness_floor` (None: the smallest bound async mode can keep,
        # `min_max_staleness`), `staleness_ceiling`], forgetting measurements with a
        # half-life of `staleness_half_life` optimizer updates.
        self.staleness_target_m2 = None
        self.staleness_floor = None
        self.staleness_ceiling = DEFAULT_CEILING
        self.staleness_half_life = DEFAULT_HALF_LIFE
        # Training steps between weight broadcasts to the EnvRunners.
        self.broadcast_interval = 1
        # Sequences per forward/backward on each learner, with gradient accumulation over
        # the minibatch (None: the whole per-learner minibatch at once). It need not divide
        # the minibatch: the last micro-batch is smaller, and the gradient is the same.
        self.micro_batch_size = None
        # Response positions per chunk of the log-prob / entropy computation: peak memory
        # O(micro_batch_size x logp_chunk_size x vocab) instead of the whole response.
        self.logp_chunk_size = DEFAULT_CHUNK_SIZE
        # How the learners hold the weights: "ddp" (RLlib's default: a full replica on each
        # learner, gradients all-reduced) or "fsdp" (FSDP2: parameters, gradients and AdamW
        # moments sharded over the learners; needs num_learners >= 2; torch/fsdp.py).
        self.learner_sharding = "ddp"
        # The optimizer, AdamW: RLlib's `lr`, `grad_clip` (by the global norm) and
        # `num_epochs` with M2PO's defaults, and its weight decay and betas.
        self.lr = 1e-6
        self.grad_clip = 1.0
        self.grad_clip_by = "global_norm"
        self.weight_decay = 0.0
        self.adam_betas = (0.9, 0.999)
        self.num_epochs = 1

        # -- env_runners() ----------------------------------------------------------------
        self.env_runner_cls = LLMEnvRunner
        # Async mode keeps one more round queued on each runner, so it never waits for the
        # driver between rounds (admission control still bounds the staleness).
        self.max_requests_in_flight_per_env_runner = 2
        # Longest wait for a round (or an update) before training stops with an error.
        self.sample_timeout_s = 600.0
        # LLM runners have no connector state to merge; RLlib's per-iteration merge would ask
        # every runner for it and wait behind its round in flight (IMPALA turns it off too).
        self._dont_auto_sync_env_runner_states = True
        # auto: vllm with a GPU, else the transformers engine (faster for tiny models on CPU).
        self.rollout_engine = "auto"
        # The engine's keyword arguments (dtype, gpu_memory_utilization, max_model_len, ...;
        # vLLM's `core`: a remote runner's "auto" runs its engine core inline on CPU).
        self.engine_kwargs = {}
        # How the learner's weights reach the runners' engines (sync/):
        # "object_store" (every runner fetches one `ray.put` of them and loads it through its
        # engine; any engine, any machine) or "native" (vLLM's weight-transfer API: the first
        # learner broadcasts to every runner's vLLM workers after each update that publishes;
        # remote vLLM runners only). `weight_sync_backend`: the native group's, "auto" (NCCL
        # when the learners and the runners have GPUs, else gloo), "nccl" or "gloo";
        # `weight_sync_bucket_bytes`: bytes per broadcast bucket (None: the backend's, 64 MiB
        # for gloo); `weight_sync_only_changed`: send only the decoder layers / modules whose
        # served-dtype values changed since the last sync (frozen or unchanged parts cost
        # nothing; the learner keeps one more copy of the model on its CPU to compare).
        self.weight_sync = "object_store"
        self.weight_sync_backend = "auto"
        self.weight_sync_bucket_bytes = None
        self.weight_sync_only_changed = False
        # The rollout engine on the learner's GPU (TRL's vllm_mode="colocate", verl's hybrid
        # engine): one process holds both (num_env_runners=0, num_learners=0), and around each
        # learner update the engine sleeps (vLLM's sleep mode, level 1: weights to CPU, KV cache
        # freed), so the learner gets its memory back; it wakes before the next round, which
        # loads the new weights. Synchronous rollouts only. Where the engine has no sleep mode
        # (vLLM on CPU, the HF engine) the step is skipped, said once in the log.
        self.colocate = False
        # Sampling temperature of the rollouts (the learner's log-probs are taken at it).
        self.temperature = 1.0
        # Truncated sampling, vLLM's rule (m2po_rllib.common.truncation): the learner replays it,
        # so on-policy ratios stay 1. top_p = 1 and top_k = 0 (or -1) keep every token.
        self.top_p = 1.0
        self.top_k = 0
        # Most tokens per completion (per turn, in multi-turn episodes), and stop strings (the
        # env's own are added to them).
        self.max_new_tokens = 64
        self.stop = []
        # Multi-turn episodes (rollout/episodes.py; envs whose `multi_turn` is True: the
        # feedback mode, env_config max_turns > 1, and tool envs): the runner's caps on policy
        # turns (None: the env's own max_turns) and on the tokens after the prompt, the
        # policy's and the env's (None: no cap but max_new_tokens per turn). An episode that
        # reaches a cap before it ends is truncated with reward 0. validate() checks that an
        # episode fits the model's positions (rollout/budget.py).
        self.max_episode_turns = None
        self.max_episode_tokens = None
        # Emulated long-tailed generation time (experiments on machines where generation is
        # fast and even): each round also waits a log-normal time, {"median_s": m, "sigma": s},
        # drawn from the round's seed; None: no wait.
        self.round_delay = None
        # Streaming sampling (rollout/streaming.py; async rollouts, remote runners): a runner
        # keeps its engine full across rounds, the next round's groups starting as the last
        # round's finish, instead of one batched generate per round that waits for its longest
        # answer; each group is generated by one policy version, the engine loading newer
        # weights when idle or when `max_staleness` needs them. Multi-turn episodes stream
        # turn by turn (an episode's next turn starts as its last one is played).
        self.streaming = False
        # With streaming: a runner loads newer weights as soon as it holds them, between two
        # decoding steps, instead of letting the groups in flight finish first; each token is
        # labelled with the version that sampled it (the batch's `token_version`), and a row's
        # age is its oldest token's. Both engines recompute the KV cache of the sequences in
        # flight with the new weights (HF: prefill again; vLLM: paused, preempted, recomputed).
        self.inflight_weight_updates = False

        # -- evaluation() -----------------------------------------------------------------
        # Held-out evaluation on the training runners (greedy; mean@k with eval_samples > 1).
        self.evaluation_duration = 200
        self.evaluation_duration_unit = "episodes"
        self.eval_samples = 1
        self.custom_evaluation_function = evaluate_heldout

    @override(AlgorithmConfig)
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
        rollout_correction=NotProvided,
        rollout_correction_low=NotProvided,
        rollout_correction_high=NotProvided,
        logp_mismatch_interval=NotProvided,
        async_rollouts=NotProvided,
        max_staleness=NotProvided,
        staleness_target_m2=NotProvided,
        staleness_floor=NotProvided,
        staleness_ceiling=NotProvided,
        staleness_half_life=NotProvided,
        broadcast_interval=NotProvided,
        micro_batch_size=NotProvided,
        logp_chunk_size=NotProvided,
        learner_sharding=NotProvided,
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
            rollout_correction=rollout_correction,
            rollout_correction_low=rollout_correction_low,
            rollout_correction_high=rollout_correction_high,
            logp_mismatch_interval=logp_mismatch_interval,
            async_rollouts=async_rollouts,
            max_staleness=max_staleness,
            staleness_target_m2=staleness_target_m2,
            staleness_floor=staleness_floor,
            staleness_ceiling=staleness_ceiling,
            staleness_half_life=staleness_half_life,
            broadcast_interval=broadcast_interval,
            micro_batch_size=micro_batch_size,
            logp_chunk_size=logp_chunk_size,
            learner_sharding=learner_sharding,
            weight_decay=weight_decay,
            adam_betas=adam_betas,
        )
        return self

    @override(AlgorithmConfig)
    def env_runners(
        self,
        *,
        rollout_engine=NotProvided,
        engine_kwargs=NotProvided,
        temperature=NotProvided,
        top_p=NotProvided,
        top_k=NotProvided,
        max_new_tokens=NotProvided,
        stop=NotProvided,
        round_delay=NotProvided,
        streaming=NotProvided,
        inflight_weight_updates=NotProvided,
        max_episode_turns=NotProvided,
        max_episode_tokens=NotProvided,
        weight_sync=NotProvided,
        weight_sync_backend=NotProvided,
        weight_sync_bucket_bytes=NotProvided,
        weight_sync_only_changed=NotProvided,
        colocate=NotProvided,
        **kwargs,
    ) -> Self:
        super().env_runners(**kwargs)
        self._set_provided(
            colocate=colocate,
            max_episode_turns=max_episode_turns,
            max_episode_tokens=max_episode_tokens,
            weight_sync=weight_sync,
            weight_sync_backend=weight_sync_backend,
            weight_sync_bucket_bytes=weight_sync_bucket_bytes,
            weight_sync_only_changed=weight_sync_only_changed,
            rollout_engine=rollout_engine,
            engine_kwargs=engine_kwargs,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=max_new_tokens,
            stop=stop,
            round_delay=round_delay,
            streaming=streaming,
            inflight_weight_updates=inflight_weight_updates,
        )
        return self

    @override(AlgorithmConfig)
    def evaluation(self, *, eval_samples=NotProvided, **kwargs) -> Self:
        super().evaluation(**kwargs)
        self._set_provided(eval_samples=eval_samples)
        return self

    def _set_provided(self, **settings) -> None:
        for name, value in settings.items():
            if value is not NotProvided:
                setattr(self, name, value)

    # -- RLlib hooks ----------------------------------------------------------------------
    @override(AlgorithmConfig)
    def get_state(self) -> dict[str, Any]:
        """RLlib's state, keeping settings that are -1.

        RLlib's `get_state` drops every value equal to `DEPRECATED_VALUE` (-1), and
        `Algorithm.__init__` rebuilds the config from that state: `staleness=-1` would
        silently become the default 0 and pass validation. Only RLlib's own deprecated
        settings are dropped here, so `build_algo()` rejects -1 exactly as `validate()`.
        """
        state = super().get_state()
        dropped = set(self.__dict__) - set(state) - {"algo_class", "_is_frozen"}
        for name in dropped - _rllib_deprecated_settings():
            state[name] = self.__dict__[name]
        return state

    @property
    @override(AlgorithmConfig)
    def _model_config_auto_includes(self) -> dict[str, Any]:
        """What the module reads besides the user's `model_config` (which wins for `dtype`):
        the sampling temperature and truncation its log-probs are taken at, and their chunk size."""
        return super()._model_config_auto_includes | {
            "dtype": DEFAULT_MODEL_DTYPE,
            "head_dtype": None,  # the compute dtype's head; "float32" for an fp32 LM head (learner and engines)
            "temperature": float(self.temperature),
            "top_k": int(self.top_k),
            "top_p": float(self.top_p),
            "logp_chunk_size": int(self.logp_chunk_size),
        }

    @override(AlgorithmConfig)
    def get_default_rl_module_spec(self) -> RLModuleSpec:
        from m2po_rllib.torch.rl_module import HFCausalLMModule

        return RLModuleSpec(module_class=HFCausalLMModule)

    @override(AlgorithmConfig)
    def get_default_learner_class(self):
        from m2po_rllib.torch.learner import M2POTorchLearner

        return M2POTorchLearner

    @override(AlgorithmConfig)
    def validate(self) -> None:
        """RLlib's checks, then M2PO's (validation/), in stages; one `ConfigError` naming
        every bad setting of the first stage that has any, each with the fix."""
        raise_problems(check_types(self))  # RLlib's own fail with a traceback on lr="abc"
        try:
            super().validate()
        except ConfigError:
            raise
        except ValueError as e:  # RLlib's own messages name the setting and the fix too
            raise ConfigError(f"Invalid M2POConfig: {e}") from e
        for stage in STAGES:
            raise_problems([p for check in stage for p in check(self)])
        log_notices(self)

    # -- YAML -----------------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: dict) -> "M2POConfig":
        """A config from a YAML-shaped mapping: {section: {setting: value}} (from_yaml.py)."""
        return config_from_spec(spec, cls)

    @classmethod
    def from_yaml(cls, path: str, overrides: dict | list | None = None) -> "M2POConfig":
        """A config from `configs/*.yaml`, with `section.key=value` overrides."""
        return cls.from_spec(apply_overrides(load_spec(path), overrides))
