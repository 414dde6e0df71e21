"""A check's answer, `Problem`: the settings at fault and a message naming the value and the
fix; the type each setting must have, and stage 1 of `validate()`, the types."""

from __future__ import annotations

from typing import Callable

from m2po_rllib.rollout.staleness import AUTO

Problem = tuple[tuple[str, ...], str]
Check = Callable[[object], list[Problem]]

# The type each M2PO setting (and the RLlib settings M2PO reads) must have.
INT, NUMBER = "an int", "a number"
_TYPES = {
    **dict.fromkeys(
        ("group_size", "prompts_per_step", "minibatch_prompts", "staleness", "num_epochs",
         "max_new_tokens", "logp_mismatch_interval", "eval_samples", "evaluation_duration",
         "num_env_runners", "num_learners", "broadcast_interval", "logp_chunk_size", "top_k"),
        INT,
    ),
    **dict.fromkeys(("m2_threshold", "temperature", "top_p", "weight_decay", "staleness_half_life"), NUMBER),
    "staleness_ceiling": INT,
}
_OPTIONAL = {
    "eps_low": NUMBER, "eps_high": NUMBER, "evaluation_interval": INT, "seed": INT,
    "micro_batch_size": INT, "staleness_floor": INT, "staleness_target_m2": NUMBER,
    "rollout_correction_low": NUMBER, "rollout_correction_high": NUMBER,
    "max_episode_turns": INT, "max_episode_tokens": INT,
}
_BOOLS = ("recompute_behavior_logp", "async_rollouts", "colocate", "streaming", "inflight_weight_updates")

def is_kind(value, kind: str) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if kind == INT else isinstance(value, (int, float))

def problem(settings: str | tuple[str, ...], message: str) -> Problem:
    return ((settings,) if isinstance(settings, str) else tuple(settings), message)


# -- stage 1: types ------------------------------------------------------------------------
def check_types(config) -> list[Problem]:
    out = [
        problem(name, f"`{name}` ({getattr(config, name)!r}) must be {kind}")
        for name, kind in [*_TYPES.items(), *_OPTIONAL.items()]
        if not is_kind(getattr(config, name), kind) and not (name in _OPTIONAL and getattr(config, name) is None)
    ]
    if not (config.max_staleness is None or config.max_staleness == AUTO or is_kind(config.max_staleness, INT)):
        out.append(problem(
            "max_staleness",
            f"`max_staleness` ({config.max_staleness!r}) must be an int (the bound, in optimizer updates), "
            f"{AUTO!r} (the bound follows the measured second moment) or None",
        ))
    if not (is_kind(config.lr, NUMBER) or isinstance(config.lr, (list, tuple))):
        out.append(problem("lr", f"`lr` ({config.lr!r}) must be a number (or an RLlib schedule, [[step, lr], ...])"))
    for name in _BOOLS:
        if not isinstance(getattr(config, name), bool):
            out.append(problem(name, f"`{name}` ({getattr(config, name)!r}) must be true or false"))
    return out
