"""Stage 2 of `validate()`, each value on its own (the loss, the correction, the optimizer,
sampling, the model and env, evaluation), and stage 3's batch shapes; `notices`, the valid
settings a user must still hear about."""

from __future__ import annotations

import math
import os

from m2po_rllib.config.validation.problems import INT, NUMBER, Problem, is_kind, problem
from m2po_rllib.losses import ADVANTAGE_ESTIMATORS, LOSS_AGG_MODES, MASK_SCOPES, POLICY_LOSSES, policy_loss_params
from m2po_rllib.losses.correction import ROLLOUT_CORRECTIONS, bound_errors
from m2po_rllib.torch.fsdp import FSDP, SHARDINGS

ROLLOUT_ENGINES = ("auto", "hf", "vllm")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
HEAD_DTYPES = (None, "float32")
MODEL_DTYPES = ("float32", "bfloat16")  # fp16 would need a gradient scaler; bf16 has fp32's range


# -- stage 2: each value on its own ----------------------------------------------------------
def check_loss(config) -> list[Problem]:
    out = []
    if config.policy_loss not in POLICY_LOSSES:
        out.append(problem("policy_loss", f"`policy_loss` ({config.policy_loss!r}) must be one of {sorted(POLICY_LOSSES)}"))
    else:
        accepted = policy_loss_params(config.policy_loss)
        unknown = set(config.policy_loss_kwargs or {}) - set(accepted)
        if unknown:
            out.append(problem(
                "policy_loss_kwargs",
                f"`policy_loss_kwargs` has {sorted(unknown)}, which `{config.policy_loss}` does not take; "
                f"it accepts {sorted(accepted)}",
            ))
    for name, valid in (("loss_agg_mode", LOSS_AGG_MODES), ("mask_scope", MASK_SCOPES),
                        ("advantage_estimator", ADVANTAGE_ESTIMATORS)):
        if getattr(config, name) not in valid:
            out.append(problem(name, f"`{name}` ({getattr(config, name)!r}) must be one of {list(valid)}"))
    if not config.m2_threshold > 0:
        out.append(problem("m2_threshold", f"`m2_threshold` ({config.m2_threshold}) must be > 0; the paper uses 0.04"))
    for name in ("eps_low", "eps_high", "weight_decay"):
        if getattr(config, name) is not None and getattr(config, name) < 0:
            out.append(problem(name, f"`{name}` ({getattr(config, name)}) must be >= 0"))
    return out


def check_correction(config) -> list[Problem]:
    """`rollout_correction`, its bounds, and the recomputed log-probs it corrects towards."""
    name, low, high = config.rollout_correction, config.rollout_correction_low, config.rollout_correction_high
    if name is None:
        unused = [n for n, v in (("rollout_correction_low", low), ("rollout_correction_high", high)) if v is not None]
        return [problem(
            (*unused, "rollout_correction"),
            f"{' and '.join(f'`{n}`' for n in unused)} bound a rollout correction, which is off; set "
            f"rollout_correction to one of {sorted(ROLLOUT_CORRECTIONS)}, or leave the bounds None",
        )] if unused else []
    if name not in ROLLOUT_CORRECTIONS:
        return [problem(
            "rollout_correction",
            f"`rollout_correction` ({name!r}) must be None or one of {sorted(ROLLOUT_CORRECTIONS)}",
        )]
    out = []
    if not config.recompute_behavior_logp:
        out.append(problem(
            ("rollout_correction", "recompute_behavior_logp"),
            f"`rollout_correction` ({name!r}) weights each token by pi_learner / pi_engine, which needs the "
            "behaviour log-probs in the learner's numerics: set recompute_behavior_logp=True (without it "
            "both are the engine's and every weight is 1)",
        ))
    for bound, why in bound_errors(name, low, high).items():  # the correction's own rule
        setting = f"rollout_correction_{bound}"
        at_fault = (setting, "rollout_correction") if bound == "low" and not ROLLOUT_CORRECTIONS[name].masks else setting
        out.append(problem(at_fault, f"`{setting}` {why}"))
    return out


def check_optimization(config) -> list[Problem]:
    out = []
    if isinstance(config.lr, (int, float)) and not config.lr > 0:
        out.append(problem("lr", f"`lr` ({config.lr}) must be > 0; the paper uses 1e-6, the built-in job 3e-5"))
    if config.group_size < 2:
        out.append(problem(
            "group_size",
            f"`group_size` ({config.group_size}) must be an int >= 2: group-relative advantages need 2+ samples per prompt",
        ))
    for name in ("prompts_per_step", "minibatch_prompts", "num_epochs", "max_new_tokens"):
        if getattr(config, name) < 1:
            out.append(problem(name, f"`{name}` ({getattr(config, name)}) must be a positive int"))
    if config.logp_mismatch_interval < 0:
        out.append(problem(
            "logp_mismatch_interval",
            f"`logp_mismatch_interval` ({config.logp_mismatch_interval}) must be >= 0 (0 = never)",
        ))
    if config.micro_batch_size is not None and config.micro_batch_size < 1:
        out.append(problem(
            "micro_batch_size",
            f"`micro_batch_size` ({config.micro_batch_size}) must be a positive int (sequences per forward/backward) or None",
        ))
    for name in ("logp_chunk_size", "broadcast_interval"):
        if getattr(config, name) < 1:
            out.append(problem(name, f"`{name}` ({getattr(config, name)}) must be a positive int"))
    if config.learner_sharding not in SHARDINGS:
        out.append(problem(
            "learner_sharding", f"`learner_sharding` ({config.learner_sharding!r}) must be one of {list(SHARDINGS)}"
        ))
    elif config.learner_sharding == FSDP and config.num_learners < 2 and not config.in_evaluation:
        out.append(problem(
            ("learner_sharding", "num_learners"),
            f"`learner_sharding` ('fsdp') shards the weights over the learners, but `num_learners` is "
            f"{config.num_learners}; set num_learners >= 2, or learner_sharding='ddp'",
        ))
    return out


def check_sampling(config) -> list[Problem]:
    out = []
    if config.rollout_engine not in ROLLOUT_ENGINES:
        out.append(problem("rollout_engine", f"`rollout_engine` ({config.rollout_engine!r}) must be one of {list(ROLLOUT_ENGINES)}"))
    if not config.temperature > 0:
        out.append(problem("temperature", f"`temperature` ({config.temperature}) must be > 0 for training rollouts"))
    if not (0 < config.top_p <= 1):
        out.append(problem("top_p", f"`top_p` ({config.top_p}) must be in (0, 1]; 1 keeps every token"))
    if config.top_k < -1:
        out.append(problem("top_k", f"`top_k` ({config.top_k}) must be >= 1 tokens kept, or 0 (or -1) to keep every token"))
    delay = config.round_delay
    if delay is not None and not (
        isinstance(delay, dict) and set(delay) <= {"median_s", "sigma"} and "median_s" in delay
        and all(is_kind(v, NUMBER) and math.isfinite(v) for v in delay.values())
        and delay["median_s"] > 0 and delay.get("sigma", 0) >= 0
    ):
        out.append(problem(
            "round_delay",
            f"`round_delay` ({delay!r}) must be None or {{'median_s': m > 0, 'sigma': s >= 0}}: each round "
            "waits a log-normal time (median m seconds, log-scale s)",
        ))
    if config.max_episode_turns is not None and config.max_episode_turns < 1:
        out.append(problem("max_episode_turns", f"`max_episode_turns` ({config.max_episode_turns}) must be >= 1 "
                                                "policy turns, or None for the env's own max_turns"))
    tokens = config.max_episode_tokens
    if tokens is not None and is_kind(config.max_new_tokens, INT) and tokens < config.max_new_tokens:
        out.append(problem(("max_episode_tokens", "max_new_tokens"),
                           f"`max_episode_tokens` ({tokens}) caps a whole episode and must be >= `max_new_tokens` "
                           f"({config.max_new_tokens}), one turn's; raise it, or None for no cap"))
    return out


def check_model_and_env(config) -> list[Problem]:
    out = []
    model_config = config.model_config or {}
    model = model_config.get("model")
    if not model:
        out.append(problem(
            "model_config",
            "no model: set `.rl_module(model_config={'model': <HF dir, hub name or 'builtin:arith-tiny'>})`",
        ))
    else:
        from m2po_rllib.models.builtin import resolve_model_path

        try:
            path = resolve_model_path(model, check_hub=False)
        except (ValueError, OSError) as e:
            out.append(problem("model_config", str(e)))
        else:
            if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
                out.append(problem(
                    "model_config",
                    f"model_config['model'] ({model!r}) has no tokenizer ({' / '.join(TOKENIZER_FILES[:2])}): the "
                    "runners tokenize every prompt with the policy's own; save it beside the weights "
                    "(`tokenizer.save_pretrained(dir)`)",
                ))
    if model_config.get("head_dtype") not in HEAD_DTYPES:
        out.append(problem(
            "model_config",
            f"model_config['head_dtype'] ({model_config.get('head_dtype')!r}) must be None (the head computes in "
            "the model's dtype) or 'float32' (the learner's and the engines' LM head in fp32: closer log-probs "
            "between a bf16 engine and the learner)",
        ))
    if model_config.get("dtype") not in MODEL_DTYPES:
        out.append(problem(
            "model_config", f"model_config['dtype'] ({model_config.get('dtype')!r}) must be one of {list(MODEL_DTYPES)}"
        ))
    owned = sorted({"temperature", "top_k", "top_p", "logp_chunk_size"} & set(config._model_config or {}))
    if owned:
        out.append(problem(
            "model_config",
            f"model_config sets {owned}: these are M2PO settings (env_runners temperature / top_k / top_p, "
            "training logp_chunk_size), passed to the module by the config; set them there",
        ))
    if config.env is None:
        out.append(problem("env", "no env: set `.environment('m2po/Arithmetic-v0', env_config={...})`"))
    elif (error := env_id_error(config.env)) is not None:
        out.append(problem("env", error))
    return out


def check_evaluation(config) -> list[Problem]:
    out = []
    if config.evaluation_interval is not None and config.evaluation_interval < 0:
        out.append(problem(
            "evaluation_interval",
            f"`evaluation_interval` ({config.evaluation_interval}) must be >= 0 (0 or None = no evaluation)",
        ))
    if config.evaluation_interval and config.evaluation_duration < 1:
        out.append(problem(
            "evaluation_duration", f"`evaluation_duration` ({config.evaluation_duration}) must be >= 1 held-out problem"
        ))
    if config.evaluation_interval and config.evaluation_duration_unit != "episodes":
        out.append(problem(
            "evaluation_duration_unit", "`evaluation_duration_unit` must be 'episodes' (held-out problems) for M2PO"
        ))
    if config.eval_samples < 1:
        out.append(problem("eval_samples", f"`eval_samples` ({config.eval_samples}) must be an int >= 1"))
    return out


# -- stage 3: how the values fit together ----------------------------------------------------
def check_batch_shapes(config) -> list[Problem]:
    """A step splits into whole minibatches, the stale-k lag into whole steps, and a
    minibatch over the learners, a step's prompts over the runners."""
    out = []
    if config.minibatch_prompts > config.prompts_per_step:
        out.append(problem(
            ("minibatch_prompts", "prompts_per_step"),
            f"`minibatch_prompts` ({config.minibatch_prompts}) must be <= `prompts_per_step` "
            f"({config.prompts_per_step}); lower minibatch_prompts or raise prompts_per_step",
        ))
    elif config.prompts_per_step % config.minibatch_prompts:
        out.append(problem(
            ("prompts_per_step", "minibatch_prompts"),
            f"`prompts_per_step` ({config.prompts_per_step}) must be a multiple of "
            f"`minibatch_prompts` ({config.minibatch_prompts})",
        ))
    elif config.staleness < 0 or config.staleness % config.updates_per_step:
        nearest = config.updates_per_step * max(1, round(config.staleness / config.updates_per_step))
        out.append(problem(
            "staleness",
            f"`staleness` ({config.staleness}) must be a non-negative multiple of the optimizer "
            f"updates per step ({config.updates_per_step} = num_epochs x prompts_per_step / "
            f"minibatch_prompts); e.g. staleness={nearest}",
        ))
    if config.prompts_per_step % max(1, config.num_env_runners):
        out.append(problem(
            ("prompts_per_step", "num_env_runners"),
            f"`prompts_per_step` ({config.prompts_per_step}) must be a multiple of "
            f"`num_env_runners` ({config.num_env_runners}) so each runner samples whole groups",
        ))
    if (config.minibatch_prompts * config.group_size) % max(1, config.num_learners):
        out.append(problem(
            ("minibatch_prompts", "group_size", "num_learners"),
            f"a minibatch ({config.minibatch_prompts} prompts x {config.group_size}) must split evenly "
            f"over `num_learners` ({config.num_learners})",
        ))
    return out


def notices(config) -> list[str]:
    """Settings that are valid but make the run wrong in a way the user must know about."""
    out = []
    engine_dtype = (config.engine_kwargs or {}).get("dtype")
    learner_dtype = (config.model_config or {}).get("dtype")
    if engine_dtype and engine_dtype != learner_dtype and not config.recompute_behavior_logp:
        out.append(
            f"the rollout engine computes in {engine_dtype} (engine_kwargs), the learner in {learner_dtype}: the "
            "behaviour log-probs are the engine's, so every importance ratio (and M2PO's second moment) carries "
            "the engine's numerical error; set recompute_behavior_logp=True, and a rollout_correction for the "
            "sampling gap (docs/numerics.md)"
        )
    return out


def env_id_error(env) -> str | None:
    """None if `env` is a gymnasium id `gymnasium.make` can build, else why not."""
    import difflib
    import importlib

    import gymnasium as gym

    import envs  # noqa: F401  (registers the m2po/* ids)

    if not isinstance(env, str):
        return f"`env` ({env!r}) must be a gymnasium env id (str), e.g. 'm2po/Arithmetic-v0'"
    module, _, env_id = env.rpartition(":")
    if module:
        try:
            importlib.import_module(module)
        except ImportError as e:
            return f"`env` ({env!r}): cannot import module {module!r} ({e})"
    if env_id in gym.registry:
        return None
    close = difflib.get_close_matches(env_id, list(gym.registry), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(map(repr, close))}?" if close else "the project's are 'm2po/Arithmetic-v0', 'm2po/ColumnAddition-v0' and 'm2po/MathDataset-v0'"
    return f"`env` ({env!r}) is not a registered gymnasium env id; {hint}"
