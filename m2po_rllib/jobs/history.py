"""The per-iteration history record built from a training result (keys from
`m2po_rllib.common.keys`): one table shared by `m2po train` (history.json), the collapse stopper
and `m2po report`.

A result is RLlib's nested training result (`Algorithm.train()`, Tune's result.json) or its
flattened form (Tune's progress.csv: `learners/default_policy/m2po/masked_frac`); `lookup`
reads both. No Ray import.
"""

from __future__ import annotations

import math
from typing import Any

from m2po_rllib.common import keys
from m2po_rllib.common.keys import HELDOUT_ACCURACY, POLICY_VERSION, learner, runner

# history field -> result path
FIELDS: dict[str, tuple[str, ...]] = {
    "reward": runner(keys.REWARD_MEAN),
    "train_accuracy": runner(keys.ACCURACY),
    "tokens_per_s": runner(keys.TOKENS_PER_S),
    "staleness_mean": (keys.STALENESS_MEAN,),
    "staleness_max": (keys.STALENESS_MAX,),
    "trained_staleness_max": learner(keys.TRAINED_MAX),
    "logp_mismatch_max": (keys.LOGP_MISMATCH_MAX,),
    "logp_mismatch_mean": (keys.LOGP_MISMATCH_MEAN,),
    "logp_mismatch_kl": (keys.LOGP_MISMATCH_KL,),
    "correction_changed_frac": learner(keys.CORRECTION_CHANGED_FRAC),
    "masked_frac": learner(keys.MASKED_FRAC),
    "tied_kept_frac": learner(keys.TIED_KEPT_FRAC),
    "m2_before": learner(keys.M2_BEFORE),
    "m2_after": learner(keys.M2_AFTER),
    "entropy_all": learner(keys.ENTROPY_ALL),
    "entropy_masked": learner(keys.ENTROPY_MASKED),
    "log_ratio_abs_max": learner(keys.LOG_RATIO_ABS_MAX),
    "loss": learner(keys.LOSS),
    "updates_per_s": (keys.UPDATES_PER_S,),
    "runner_idle_frac": (keys.RUNNER_IDLE_FRAC,),
    "staleness_bound": (keys.STALENESS_BOUND,),  # async: the max_staleness in force
    "rounds_waiting": (keys.ROUNDS_WAITING,),
    # multi-turn episodes (means per episode of the iteration's rounds)
    "episode_turns": runner(keys.EPISODE_TURNS),
    "tool_calls": runner(keys.EPISODE_TOOL_CALLS),
    "tool_errors": runner(keys.EPISODE_TOOL_ERRORS),
    "episode_truncated": runner(keys.EPISODE_TRUNCATED),
    "env_tokens": runner(keys.EPISODE_ENV_TOKENS),
    "dropped_chars": runner(keys.EPISODE_DROPPED_CHARS),
}
# One of these per clip loss (grpo, gspo, m2po_official).
CLIPPED_FRAC = keys.CLIPPED_FRAC_PATHS
ENTROPY_CLIPPED = keys.ENTROPY_CLIPPED_PATHS

# Every field of a history record, in order.
RECORD_FIELDS = (
    "iteration", "time_s", HELDOUT_ACCURACY, POLICY_VERSION, *FIELDS, "clipped_frac", "entropy_clipped",
)


def lookup(result: dict, path: tuple[str, ...] | str) -> float | None:
    """result[path[0]][path[1]]..., or the flattened result["a/b/c"]; None when missing or
    NaN (RLlib reports NaN for a mean over nothing, e.g. the entropy of zero masked tokens)."""
    if isinstance(path, str):
        path = (path,)
    node: Any = result
    for key in path:
        if not isinstance(node, dict) or key not in node:
            node = result.get("/".join(path)) if isinstance(result, dict) else None
            break
        node = node[key]
    if isinstance(node, str):
        try:
            node = float(node)
        except ValueError:
            return None
    if isinstance(node, bool) or not isinstance(node, (int, float)):
        return None
    return None if math.isnan(node) else node


def first(result: dict, paths) -> float | None:
    """The first of `paths` that the result holds (the clip losses' keys are exclusive)."""
    return next((v for p in paths if (v := lookup(result, p)) is not None), None)


def heldout_accuracy(result: dict) -> float | None:
    value = lookup(result, HELDOUT_ACCURACY)
    return value if value is not None else lookup(result, keys.EVAL_ACCURACY_PATH)


def history_record(result: dict, iteration: int, time_s: float) -> dict[str, Any]:
    """One history.json entry for a training result: every field of `RECORD_FIELDS`, None
    where this result has no value (e.g. `masked_frac` for GRPO, anything while the stale
    queue fills)."""
    version = lookup(result, POLICY_VERSION)
    record: dict[str, Any] = {
        "iteration": int(iteration),
        "time_s": float(time_s),
        HELDOUT_ACCURACY: heldout_accuracy(result),
        POLICY_VERSION: None if version is None else int(version),
    }
    record.update({name: lookup(result, path) for name, path in FIELDS.items()})
    record["clipped_frac"] = first(result, CLIPPED_FRAC)
    record["entropy_clipped"] = first(result, ENTROPY_CLIPPED)
    return record


# What TensorBoard gets by default, named as the result names it (docs/guide/metrics.md): the
# algorithm's keys (native weight sync's `weights/native_*` among them), the learners'
# (learners/default_policy/...), the runners' rollout and verifier keys, held-out
# evaluation, RLlib's timers (`run.tensorboard: all` writes every number of the result).
TENSORBOARD_KEYS = (keys.HELDOUT_ACCURACY, keys.POLICY_VERSION)
TENSORBOARD_PREFIXES = (
    "timers/", "async/", "learner/", "staleness/", "rollout/", "weights/", "/".join(keys.LEARNER) + "/",
    "/".join(keys.RUNNERS) + "/rollout/", "/".join(keys.RUNNERS) + "/reward/", "/".join(keys.EVALUATION) + "/eval/",
)


def _numbers(result: dict, prefix: str = "") -> dict[str, float]:
    out = {}
    for key, value in result.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_numbers(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out


def tensorboard_scalars(result: dict, everything: bool = False) -> dict[str, float]:
    """The scalars of one iteration, each under its path in the result (`heldout_accuracy`,
    `learners/default_policy/m2po/masked_frac`, ...); with `everything`, every number."""
    numbers = _numbers(result)
    if everything:
        return numbers
    return {k: v for k, v in numbers.items() if k in TENSORBOARD_KEYS or k.startswith(TENSORBOARD_PREFIXES)}
