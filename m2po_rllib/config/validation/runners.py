"""The runners' side of `validate()`: an episode fits the model (stage 3), weight sync, the
rollout mode and its staleness bound (fixed or "auto"), GPU requests, where vLLM's engine
core runs, colocation and streaming (stage 4)."""

from __future__ import annotations

import math

from m2po_rllib.config.validation.problems import INT, Problem, is_kind, problem
from m2po_rllib.rollout.staleness import AUTO, DEFAULT_CEILING, DEFAULT_HALF_LIFE

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
    if size is not None and (not is_kind(size, INT) or size < 1):
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


def check_engine_core(config) -> list[Problem]:
    """`engine_kwargs` `core` (where vLLM's engine core runs, rollout/vllm_cpu.py): one of its
    values, and inline only in a process that is the engine's own (a remote runner)."""
    from m2po_rllib.rollout.vllm_cpu import CORES

    core = (config.engine_kwargs or {}).get("core")
    if core is None or config.resolved_rollout_engine() != "vllm":
        return []
    if core not in CORES:
        return [problem("engine_kwargs", f"engine_kwargs core ({core!r}) must be one of {CORES}: 'auto' (inline "
                                         "on CPU), 'process' (vLLM's default), 'inline'")]
    if core != "process" and config.num_env_runners < 1 and not config.in_evaluation:
        return [problem(("engine_kwargs", "num_env_runners"), (
            f"engine_kwargs core={core!r} runs vLLM's worker inline, in the algorithm's own process "
            "(num_env_runners is 0), which it would take over (its random seeds, torch's threads, "
            "torch.distributed's default group): set core='process', or num_env_runners >= 1"))]
    return []


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
    if config.native_weight_sync and not config.inflight_weight_updates:
        out.append(problem(
            ("streaming", "weight_sync"),
            "`streaming=True` loads weights only between groups, and a native broadcast would make the learner wait "
            "for a runner's groups in flight; set inflight_weight_updates=True (a broadcast then lands between two "
            "decoding steps), or use weight_sync='object_store' with streaming (or streaming=False)",
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
    return out
