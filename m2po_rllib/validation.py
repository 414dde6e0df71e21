"""The checks `M2POConfig.validate()` runs, each a function of the config that returns its
problems: `(settings, message)`, the settings at fault and a message naming the value and
the fix. `validate()` runs them in stages (types first: RLlib's own checks fail with a
traceback on e.g. `lr="abc"`; shapes only once every value is in range) and raises one
`ConfigError` listing every problem of the first stage that has any.
"""

from __future__ import annotations

import math
import os
from typing import Callable

from m2po_rllib.losses import ADVANTAGE_ESTIMATORS, LOSS_AGG_MODES, MASK_SCOPES, POLICY_LOSSES, policy_loss_params
from m2po_rllib.losses.correction import ROLLOUT_CORRECTIONS
from m2po_rllib.rollout.staleness import AUTO, DEFAULT_CEILING, DEFAULT_HALF_LIFE
from m2po_rllib.torch.fsdp import FSDP, SHARDINGS

Problem = tuple[tuple[str, ...], str]
Check = Callable[[object], list[Problem]]

ROLLOUT_ENGINES = ("auto", "hf", "vllm")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
HEAD_DTYPES = (None, "float32")
MODEL_DTYPES = ("float32", "bfloat16")  # fp16 would need a gradient scaler; bf16 has fp32's range

# The type each M2PO setting (and the RLlib settings M2PO reads) must have.
_INT, _NUMBER = "an int", "a number"
_TYPES = {
    **dict.fromkeys(
        ("group_size", "prompts_per_step", "minibatch_prompts", "staleness", "num_epochs",
         "max_new_tokens", "logp_mismatch_interval", "eval_samples", "evaluation_duration",
         "num_env_runners", "num_learners", "broadcast_interval", "logp_chunk_size", "top_k"),
        _INT,
    ),
    **dict.fromkeys(("m2_threshold", "temperature", "top_p", "weight_decay", "staleness_half_life"), _NUMBER),
    "staleness_ceiling": _INT,
}
_OPTIONAL = {
    "eps_low": _NUMBER, "eps_high": _NUMBER, "evaluation_interval": _INT, "seed": _INT,
    "micro_batch_size": _INT, "staleness_floor": _INT, "staleness_target_m2": _NUMBER,
    "rollout_correction_low": _NUMBER, "rollout_correction_high": _NUMBER,
    "max_episode_turns": _INT, "max_episode_tokens": _INT,
}
_BOOLS = ("recompute_behavior_logp", "async_rollouts", "colocate", "streaming", "inflight_weight_updates")


def _is(value, kind: str) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if kind == _INT else isinstance(value, (int, float))


def problem(settings: str | tuple[str, ...], message: str) -> Problem:
    return ((settings,) if isinstance(settings, str) else tuple(settings), message)


# -- stage 1: types ------------------------------------------------------------------------
def check_types(config) -> list[Problem]:
    out = [
        problem(name, f"`{name}` ({getattr(config, name)!r}) must be {kind}")
        for name, kind in [*_TYPES.items(), *_OPTIONAL.items()]
        if not _is(getattr(config, name), kind) and not (name in _OPTIONAL and getattr(config, name) is None)
    ]
    if not (config.max_staleness is None or config.max_staleness == AUTO or _is(config.max_staleness, _INT)):
        out.append(problem(
            "max_staleness",
            f"`max_staleness` ({config.max_staleness!r}) must be an int (the bound, in optimizer updates), "
            f"{AUTO!r} (the bound follows the measured second moment) or None",
        ))
    if not (_is(config.lr, _NUMBER) or isinstance(config.lr, (list, tuple))):
        out.append(problem("lr", f"`lr` ({config.lr!r}) must be a number (or an RLlib schedule, [[step, lr], ...])"))
    for name in _BOOLS:
        if not isinstance(getattr(config, name), bool):
            out.append(problem(name, f"`{name}` ({getattr(config, name)!r}) must be true or false"))
    return out


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
    if high is not None and not high > 1:
        out.append(problem(
            "rollout_correction_high",
            f"`rollout_correction_high` ({high}) must be > 1: an on-policy token has ratio 1 and must be kept "
            "(TIS/MIS use 2, IcePop 5)",
        ))
    if low is not None:
        if not ROLLOUT_CORRECTIONS[name].masks:
            out.append(problem(
                ("rollout_correction_low", "rollout_correction"),
                f"`rollout_correction_low` ({low}) means nothing for {name!r}, which truncates from above only; "
                "leave it None, or use a masking correction (mis_token, mis_seq, icepop)",
            ))
        elif not 0 <= low < 1:
            out.append(problem(
                "rollout_correction_low",
                f"`rollout_correction_low` ({low}) must be in [0, 1): an on-policy token has ratio 1 (IcePop uses 0.5)",
            ))
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
        and all(_is(v, _NUMBER) and math.isfinite(v) for v in delay.values())
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
    if tokens is not None and _is(config.max_new_tokens, _INT) and tokens < config.max_new_tokens:
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


def check_episode_budget(config) -> list[Problem]:
    """A multi-turn episode fits the model's context (rollout/budget.py): the longest prompt +
    min(max_episode_tokens, turns x max_new_tokens + (turns - 1) x the env's longest reply)
    <= the model's positions. Skipped where the env is single-turn or the model or the data
    are not on this machine."""
    from m2po_rllib.rollout.budget import episode_shape, model_positions

    model = (config.model_config or {}).get("model")
    try:
        shape = episode_shape(config.env, dict(config.env_config or {}), model, config.max_new_tokens)
    except ValueError as e:  # the env's own check of its env_config
        return [problem("env_config", str(e))]
    positions = model_positions(model) if shape is not None else None
    if positions is None:
        return []
    where = f"{model}'s max_position_embeddings"
    max_model_len = (config.engine_kwargs or {}).get("max_model_len")
    if max_model_len and config.resolved_rollout_engine() == "vllm" and max_model_len < positions:
        positions, where = max_model_len, "engine_kwargs max_model_len"
    turns = shape.max_turns if config.max_episode_turns is None else min(shape.max_turns, config.max_episode_turns)
    new, reply, cap, prompt = config.max_new_tokens, shape.reply_tokens, config.max_episode_tokens, shape.prompt_tokens
    room = positions - prompt
    uncapped = new if turns == 1 else None if reply is None else turns * new + (turns - 1) * reply
    if min(x for x in (cap, uncapped, math.inf) if x is not None) <= room:
        return []
    longest = f"the longest prompt ({prompt} tokens{'' if shape.prompt_exact else '; a large split sampled'})"
    limit = f"the model's {positions} positions ({where})"
    truncated = "episodes that reach it end truncated, reward 0"
    if prompt + new > positions:  # (max_episode_tokens >= max_new_tokens)
        return [problem(("max_new_tokens", "env_config"), (
            f"one turn does not fit {limit}: {longest} + `max_new_tokens` ({new}) = {prompt + new}; "
            + (f"lower max_new_tokens to {room}" if room >= 1 else "use shorter prompts")
        ))]
    if cap is not None:
        return [problem(("max_episode_tokens", "env_config"), (
            f"an episode may not fit {limit}: {longest} + `max_episode_tokens` ({cap}) = {prompt + cap}; lower "
            f"env_runners.max_episode_tokens to {room} ({truncated})"
        ))]
    if uncapped is None:
        return [problem(("max_episode_tokens", "env_config"), (
            f"{config.env}'s replies have no bound known before the run (a tool's result may be thousands "
            f"of tokens), so {turns}-turn episodes need a token cap to fit {limit}: set "
            f"env_runners.max_episode_tokens to at most {room} ({positions} - {prompt}; {truncated})"
        ))]
    fits = max((k for k in range(1, turns) if k * new + (k - 1) * reply <= room), default=1)
    return [problem(("env_config", "max_episode_turns", "max_episode_tokens"), (
        f"a {turns}-turn episode may not fit {limit}: {longest} + {turns} turns x `max_new_tokens` ({new}) + "
        f"{turns - 1} env replies x up to {reply} tokens (an upper estimate: the feedback, with the answer "
        f"it repeats counted at max_new_tokens) = {prompt + uncapped}; lower the turns to {fits} "
        f"(environment.env_config.max_turns or env_runners.max_episode_turns: "
        f"{prompt + fits * new + (fits - 1) * reply} tokens), or set env_runners.max_episode_tokens={room} "
        f"({truncated})"
    ))]


WEIGHT_SYNCS = ("object_store", "native")
WEIGHT_SYNC_BACKENDS = ("auto", "nccl", "gloo")
SERVED_DTYPES = ("float32", "bfloat16", "float16")


def check_weight_sync(config) -> list[Problem]:
    """`weight_sync` and its settings; "native" only where the learner can broadcast to the
    runners' vLLM workers."""
    if config.weight_sync not in WEIGHT_SYNCS:
        return [problem("weight_sync", f"`weight_sync` ({config.weight_sync!r}) must be one of {WEIGHT_SYNCS}")]
    out = []
    if config.weight_sync_backend not in WEIGHT_SYNC_BACKENDS:
        out.append(problem("weight_sync_backend", f"`weight_sync_backend` ({config.weight_sync_backend!r}) must be "
                                                  f"one of {WEIGHT_SYNC_BACKENDS}"))
    size = config.weight_sync_bucket_bytes
    if size is not None and (not _is(size, _INT) or size < 1):
        out.append(problem("weight_sync_bucket_bytes", f"`weight_sync_bucket_bytes` ({size!r}) must be an int >= 1, "
                                                       "or None for the backend's default"))
    if not isinstance(config.weight_sync_only_changed, bool):
        out.append(problem("weight_sync_only_changed",
                           f"`weight_sync_only_changed` ({config.weight_sync_only_changed!r}) must be True or False"))
    if config.weight_sync != "native" or config.in_evaluation or out:
        return out
    fix = "or weight_sync='object_store'"
    if config.resolved_rollout_engine() != "vllm":
        out.append(problem(("weight_sync", "rollout_engine"),
                           f"weight_sync='native' is vLLM's weight-transfer API; the rollout engine is "
                           f"{config.resolved_rollout_engine()!r}: set rollout_engine='vllm', {fix}"))
    if config.num_env_runners < 1:
        out.append(problem(("weight_sync", "num_env_runners"),
                           "weight_sync='native' broadcasts from the learner to remote EnvRunners' engines; "
                           f"`num_env_runners` is {config.num_env_runners} (the runner shares the learner's process, "
                           f"where the object store costs no copy): set num_env_runners >= 1, {fix}"))
    if config.runners_recompute_behavior_logp:
        out.append(problem(("weight_sync", "recompute_behavior_logp"),
                           "with recompute_behavior_logp in async mode each runner scores its rounds with a copy of "
                           "the learner's model, which a native sync (into vLLM only) does not update: set "
                           f"recompute_behavior_logp=False, {fix}"))
    served = (config.engine_kwargs or {}).get("dtype") or (config.model_config or {}).get("dtype")
    if served is not None and served not in SERVED_DTYPES:
        out.append(problem(("weight_sync", "engine_kwargs"),
                           f"weight_sync='native' sends the weights in the engine's dtype; engine_kwargs dtype "
                           f"{served!r} names none: use one of {SERVED_DTYPES}"))
    if config.weight_sync_backend == "nccl":
        import torch

        learner_gpu = config.learner_gpus
        if not torch.cuda.is_available() or not learner_gpu or not config.num_gpus_per_env_runner:
            out.append(problem(("weight_sync_backend",),
                               "weight_sync_backend='nccl' needs GPUs on both sides (CUDA here: "
                               f"{torch.cuda.is_available()}, GPUs per learner: {learner_gpu}, per EnvRunner: "
                               f"{config.num_gpus_per_env_runner}): use 'gloo' or 'auto'"))
    return out


def check_rollout_mode(config) -> list[Problem]:
    """`async_rollouts` and what it needs; `max_staleness` only with it."""
    if not config.async_rollouts:
        out = _check_auto_only(config)
        if config.recompute_behavior_logp and config.broadcast_interval > 1:
            out.append(problem(
                ("recompute_behavior_logp", "broadcast_interval"),
                f"`recompute_behavior_logp` in sync mode has the learners score each round with their current "
                f"weights, which generated it only when they are broadcast every step; `broadcast_interval` is "
                f"{config.broadcast_interval}: set broadcast_interval=1, or async_rollouts=True (the runners "
                "then score their own rounds)",
            ))
        if config.max_staleness is None:
            return out
        return out + [problem(
            ("max_staleness", "async_rollouts"),
            f"`max_staleness` ({config.max_staleness}) bounds asynchronous rollouts, which are off; set "
            "async_rollouts=True, or use `staleness` for the exact-k protocol",
        )]
    if config.in_evaluation:  # evaluation has its own runners
        return []
    out = _check_auto_only(config)
    if config.num_env_runners < 1:
        out.append(problem(
            ("async_rollouts", "num_env_runners"),
            f"`async_rollouts` needs remote EnvRunners to generate while the learners train; "
            f"`num_env_runners` is {config.num_env_runners}: set it to >= 1 (or async_rollouts=False)",
        ))
    if config.staleness:
        out.append(problem(
            ("staleness", "async_rollouts"),
            f"`staleness` ({config.staleness}) is the exact-k protocol of synchronous runs; with "
            "`async_rollouts` the bound is `max_staleness`: set staleness=0",
        ))
    if config.max_staleness is None:
        out.append(problem(
            "max_staleness",
            f"`max_staleness` ({config.max_staleness}) must be an int with async_rollouts: the bound, "
            f"in optimizer updates, on the age of every trained token (>= {config.min_max_staleness}), "
            f"or {AUTO!r} to steer it by the measured second moment",
        ))
    elif config.max_staleness == AUTO:
        out += _check_auto_staleness(config)
    elif config.max_staleness < config.min_max_staleness:
        out.append(problem(
            ("max_staleness", "broadcast_interval"),
            f"`max_staleness` ({config.max_staleness}) must be >= {config.min_max_staleness} = "
            f"(broadcast_interval + 1) x updates_per_step - 1 ({config.broadcast_interval} + 1) x "
            f"{config.updates_per_step} - 1: one round in flight while the previous step trains is "
            f"already that old; raise max_staleness, or use async_rollouts=False for on-policy data",
        ))
    return out


_AUTO_ONLY = {  # the settings that steer "auto", and their defaults
    "staleness_target_m2": None, "staleness_floor": None, "staleness_ceiling": DEFAULT_CEILING,
    "staleness_half_life": DEFAULT_HALF_LIFE,
}


def _check_auto_staleness(config) -> list[Problem]:
    """`max_staleness="auto"`: its target, floor, ceiling and half-life."""
    out = []
    target = config.staleness_target_m2
    if target is not None and not (0 < target < float("inf")):
        out.append(problem(
            "staleness_target_m2",
            f"`staleness_target_m2` ({target}) must be a positive second moment of log-ratios (e.g. tau, "
            f"{config.m2_threshold}); None uses m2_threshold",
        ))
    floor = config.staleness_controller_settings()["floor"]
    if floor < config.min_max_staleness:
        out.append(problem(
            ("staleness_floor", "broadcast_interval"),
            f"`staleness_floor` ({floor}) must be >= {config.min_max_staleness}, the smallest bound async "
            f"mode can keep ((broadcast_interval + 1) x updates_per_step - 1); raise it, or leave it None",
        ))
    if config.staleness_ceiling < floor:
        out.append(problem(
            ("staleness_ceiling", "staleness_floor"),
            f"`staleness_ceiling` ({config.staleness_ceiling}) must be >= the floor ({floor}): the bound moves "
            "between them; raise the ceiling",
        ))
    if not config.staleness_half_life > 0:
        out.append(problem(
            "staleness_half_life",
            f"`staleness_half_life` ({config.staleness_half_life}) must be > 0 optimizer updates: how fast old "
            "measurements of M2 are forgotten (default 32)",
        ))
    return out


def _check_auto_only(config) -> list[Problem]:
    if config.max_staleness == AUTO:
        return []
    return [
        problem(
            (name, "max_staleness"),
            f"`{name}` ({getattr(config, name)}) steers max_staleness='auto', but max_staleness is "
            f"{config.max_staleness!r}: set max_staleness='auto', or leave {name} at its default ({default})",
        )
        for name, default in _AUTO_ONLY.items()
        if getattr(config, name) != default
    ]


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


def check_gpu_requests(config) -> list[Problem]:
    """GPU requests that no actor would carry. (Whether the machine has the GPUs is checked
    where they are used: `resources.py`, at build.)"""
    runners = config.num_env_runners + (config.evaluation_num_env_runners or 0)
    if config.in_evaluation or not config.num_gpus_per_env_runner or runners:
        return []
    return [problem(
        ("num_gpus_per_env_runner", "num_env_runners"),
        f"`num_gpus_per_env_runner` ({config.num_gpus_per_env_runner:g}) asks GPUs for each remote EnvRunner, and "
        "`num_env_runners` is 0: no runner would get them (the local runner's engine runs in the main process, "
        "with the main process's devices). Set num_env_runners >= 1 to give each runner a GPU, or "
        "num_gpus_per_env_runner=0 (with num_gpus_per_learner > 0 the main process has the GPU)",
    )]


def check_colocate(config) -> list[Problem]:
    """`colocate=True`: the engine and the learner take turns on one GPU, in one process."""
    if not config.colocate or config.in_evaluation:
        return []
    out = []
    if config.async_rollouts:
        out.append(problem(
            ("colocate", "async_rollouts"),
            "`colocate=True` has the engine sleep while the learner updates on the same GPU, so rollouts and "
            "updates take turns: the synchronous stale-k protocol (the paper's). Set async_rollouts=False "
            "(staleness=k for data k updates old), or colocate=False with remote EnvRunners on GPUs of their own",
        ))
    if config.num_env_runners or config.num_learners:
        out.append(problem(
            ("colocate", "num_env_runners", "num_learners"),
            f"`colocate=True` runs the engine beside the learner in the main process (num_env_runners=0, "
            f"num_learners=0, num_gpus_per_learner=1: one GPU); `num_env_runners` is {config.num_env_runners} and "
            f"`num_learners` {config.num_learners}: set both to 0, or colocate=False (colocation over several GPUs "
            "is not built yet; docs/guide/gpus-and-clusters.md)",
        ))
    return out


def check_streaming(config) -> list[Problem]:
    """`streaming=True` (rollout/streaming.py): asynchronous rollouts on remote runners, whose
    engines load weights between groups, or mid-sequence with `inflight_weight_updates`."""
    if config.in_evaluation:
        return []
    out = _check_inflight_weight_updates(config)
    if not config.streaming:
        return out
    if not config.async_rollouts or config.num_env_runners < 1:
        out.append(problem(
            ("streaming", "async_rollouts", "num_env_runners"),
            f"`streaming=True` keeps remote runners generating while the learners train; it needs async_rollouts=True "
            f"and num_env_runners >= 1 (async_rollouts is {config.async_rollouts}, num_env_runners "
            f"{config.num_env_runners}). The synchronous stale-k protocol samples round by round: set streaming=False",
        ))
    if config.native_weight_sync:
        out.append(problem(
            ("streaming", "weight_sync"),
            "`streaming=True` loads weights only between groups, and a native broadcast would make the learner wait "
            "for a runner's groups in flight; use weight_sync='object_store' with streaming (or streaming=False)",
        ))
    if config.round_delay is not None:
        out.append(problem(
            ("streaming", "round_delay"),
            f"`round_delay` ({config.round_delay!r}) emulates the tail of round-based sampling; streaming has no "
            "round barrier to delay: set round_delay=None, or streaming=False",
        ))
    return out


def _check_inflight_weight_updates(config) -> list[Problem]:
    if not config.inflight_weight_updates:
        return []
    out = []
    if not config.streaming:
        out.append(problem(("inflight_weight_updates", "streaming"),
                           "`inflight_weight_updates=True` loads weights into a streaming runner's engine between two "
                           "decoding steps; it needs streaming=True (round-based runners load between rounds)"))
    if config.recompute_behavior_logp:
        out.append(problem(("inflight_weight_updates", "recompute_behavior_logp"),
                           "`recompute_behavior_logp=True` rescores a round with the weights its runner serves when it "
                           "ends, and a row that crossed a load was sampled by several: keep the engine's own "
                           "log-probs (recompute_behavior_logp=False), or inflight_weight_updates=False"))
    return out


# Stages after RLlib's own `validate()`: a later stage assumes the earlier ones passed.
STAGES: tuple[tuple[Check, ...], ...] = (
    (check_loss, check_correction, check_optimization, check_sampling, check_model_and_env, check_evaluation),
    (check_batch_shapes, check_episode_budget),
    (check_rollout_mode, check_weight_sync, check_gpu_requests, check_colocate, check_streaming),
)


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
