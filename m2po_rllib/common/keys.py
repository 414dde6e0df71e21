"""Every metric key and result path of M2PO, once: the writers (losses, learner, runner,
algorithm) and the readers (`m2po train`'s history and progress line, the lab, the collapse
stopper, `m2po report`) import them from here. No Ray, no torch.

docs/guide/metrics.md says what each one means. Keys are namespaced as RLlib and CleanRL do
(`m2po/masked_frac`, `rollout/tokens_per_s`); a training result nests them: the runners'
under `env_runners`, the learners' under `learners/default_policy`, the algorithm's at the
top, held-out evaluation under `evaluation/env_runners`.
"""

from __future__ import annotations

# -- policy losses (m2po_rllib.losses), one family per loss: m2po/..., grpo/..., gspo/... --
M2_BEFORE = "m2po/m2_before"  # second moment of the log-ratios over the usable tokens
M2_AFTER = "m2po/m2_after"  # ... over the kept tokens
KEPT_TOKENS = "m2po/kept_tokens"
MASKED_TOKENS = "m2po/masked_tokens"
MASKED_FRAC = "m2po/masked_frac"
# tokens of the cut's value the mask keeps (Alg. 1 drops ties one at a time), over the valid
# tokens: what dropping every tie at the cut would have masked on top of M2PO's minimal set
TIED_KEPT_FRAC = "m2po/tied_kept_frac"
ENTROPY_ALL = "m2po/entropy_all"
ENTROPY_MASKED = "m2po/entropy_masked"
TAU_C = "m2po/tau_c"  # m2po_official: the clip bound found for the budget
CLIP_LOW = "m2po/clip_low"
CLIP_HIGH = "m2po/clip_high"
CLIP_FAMILIES = ("grpo", "gspo", "m2po")  # the clip losses: grpo, gspo, m2po_official


def clipped_frac(family: str) -> str:
    return f"{family}/clipped_frac"


def clipped_tokens(family: str) -> str:
    return f"{family}/clipped_tokens"


def entropy_clipped(family: str) -> str:
    return f"{family}/entropy_clipped"


# -- rollout corrections (m2po_rllib.losses.correction) -------------------------------------
CORRECTION_CHANGED_FRAC = "correction/changed_frac"  # valid tokens truncated or dropped
CORRECTION_WEIGHT_MEAN = "correction/weight_mean"  # over the kept tokens
CORRECTION_WEIGHT_MAX = "correction/weight_max"
CORRECTION_ESS = "correction/ess"  # (sum w)^2 / (n sum w^2)

LOG_RATIO_ABS_MEAN = "policy/log_ratio_abs_mean"
LOG_RATIO_ABS_MAX = "policy/log_ratio_abs_max"
RATIO_MEAN = "policy/ratio_mean"
VALID_TOKENS = "policy/valid_tokens"
NONFINITE_TOKENS = "policy/nonfinite_tokens"

# -- learner (m2po_rllib.torch.learner) ---------------------------------------------------
LOSS = "policy/loss"
GRAD_NORM = "policy/grad_norm"
SKIPPED_UPDATES = "policy/skipped_updates"
MICRO_BATCHES = "policy/micro_batches"
POLICY_VERSION = "policy_version"  # optimizer updates so far (also top-level in a result)
TRAINED_MIN = "staleness/trained_min"  # age in updates of a minibatch's rows when trained
TRAINED_MEAN = "staleness/trained_mean"
TRAINED_MAX = "staleness/trained_max"
# Private entries of a learner's result, popped by the algorithm before logging.
WEIGHTS_KEY = "_rl_module_state_after_update"  # RLlib's (IMPALA's) key for the state in a result
UPDATE_SECONDS_KEY = "_update_seconds"
VERSION_KEY = "_policy_version"  # the learner's policy version after the update
WEIGHT_SYNC_RECONNECT_KEY = "_weight_sync_reconnect"  # native sync: a send failed, the group must be formed again
NATIVE_SYNC_KEY = "_native_sync"  # native sync: the first learner's metrics of its last send (logged by the driver)

# Native weight sync (weight_sync="native"), the first learner's side of each broadcast.
NATIVE_SYNC_S = "weights/native_send_s"
NATIVE_SYNC_BYTES = "weights/native_bytes"  # this round's: less than the model with weight_sync_only_changed
NATIVE_SYNC_TENSORS = "weights/native_tensors"
NATIVE_SYNC_FAILURES = "weights/native_failures"  # sends that failed (the object store carried that version)
NATIVE_SYNC_CONNECTS = "weights/native_connects"  # groups formed so far (1 + runner restarts and failures)
NATIVE_SYNC_VERSION = "weights/native_version"  # the last version broadcast (-1: that send failed)
M2_BY_AGE_KEY = "_m2_by_age"  # {age: (sum of squared log-ratios, tokens)} of the update's tokens

# -- EnvRunner (m2po_rllib.rollout.env_runner) --------------------------------------------
REWARD_MEAN = "rollout/reward_mean"
ACCURACY = "rollout/accuracy"
RESPONSE_LEN = "rollout/response_len_mean"
TOKENS_PER_S = "rollout/tokens_per_s"
GENERATE_S = "rollout/generate_s"
SCORE_S = "rollout/score_s"
WEIGHT_SYNC_S = "rollout/weight_sync_s"
ENGINE_VERSION = "rollout/engine_policy_version"
ENGINE_START_S = "rollout/engine_start_s"
# colocate=True: the engines' sleep around each update (the driver's view; 0 s where skipped)
ENGINE_SLEEP_S = "rollout/engine_sleep_s"
ENGINE_WAKE_S = "rollout/engine_wake_s"
# Multi-turn episodes (rollout/episodes.py), means per episode of a round
EPISODE_TURNS = "episode/turns"
EPISODE_POLICY_TOKENS = "episode/policy_tokens"
EPISODE_ENV_TOKENS = "episode/env_tokens"
EPISODE_TRUNCATED = "episode/truncated_frac"  # a turn or token budget ran out: reward 0
EPISODE_TOOL_CALLS = "episode/tool_calls"
EPISODE_TOOL_ERRORS = "episode/tool_errors"  # calls the tool refused or failed (an error observation)
EPISODE_DROPPED_CHARS = "episode/dropped_chars"  # inserted characters the tokenizer has no token for
EVAL_ACCURACY = "eval/accuracy"
EVAL_MEAN_AT_K = "eval/mean_at_k"
EVAL_RESPONSE_LEN = "eval/response_len_mean"
EVAL_PROBLEMS = "num_problems"

# -- algorithm (m2po_rllib.driver.m2po, m2po_rllib.rollout.sampler) ------------------------------
HELDOUT_ACCURACY = "heldout_accuracy"  # carried between evaluations into every result
STALENESS_MEAN = "staleness/mean"  # age of the dispatched step's rows at its first minibatch
STALENESS_MAX = "staleness/max"
STALENESS_TOKEN_MEAN = "staleness/token_mean"  # the step's trained tokens' mean age (from each token's own version)
# inflight_weight_updates: the most policy versions one row's tokens were sampled by (1: none crossed a load)
VERSIONS_SPANNED_MAX = "staleness/versions_spanned_max"
FILLING = "staleness/filling"  # sync: the stale-k queue is still filling (nothing trained)
QUEUE_LEN = "staleness/queue_len"
DROPPED_ROWS = "staleness/dropped_rows"
ROUNDS_IN_FLIGHT = "async/rounds_in_flight"
ROUNDS_ADMITTED = "async/rounds_admitted"  # rounds requested so far (re-requests included)
ROUNDS_WAITING = "async/rounds_waiting"  # runner slots the bound held back at the last request
STALENESS_BOUND = "staleness/bound"  # async: the max_staleness in force (moves with "auto")
STALENESS_BOUND_CHANGES = "staleness/bound_changes"  # "auto": times the bound moved so far
LEARNER_IDLE_FRAC = "async/learner_idle_frac"
RUNNER_IDLE_FRAC = "async/runner_idle_frac"
UPDATES_PER_S = "learner/updates_per_s"
TOKENS_TRAINED_PER_S = "learner/tokens_per_s"
# The engine's log-probs against the learner's on the same tokens and weights (correction.py's
# `mismatch_metrics`): |delta| max / mean, KL(engine || learner), the fraction of tokens with
# |delta| > MISMATCH_LARGE, and the effective sample size of the ratios.
LOGP_MISMATCH_MAX = "rollout/logp_mismatch_max"
LOGP_MISMATCH_MEAN = "rollout/logp_mismatch_mean"
LOGP_MISMATCH_KL = "rollout/logp_mismatch_kl"
LOGP_MISMATCH_LARGE_FRAC = "rollout/logp_mismatch_large_frac"
LOGP_MISMATCH_ESS = "rollout/logp_mismatch_ess"
MISMATCH_LARGE = 0.1  # nats: a ratio off by more than ~10%
LOGP_MISMATCH_TIMER = "logp_mismatch_timer"
BEHAVIOR_LOGP_S = "rollout/behavior_logp_s"  # a runner's seconds recomputing behaviour log-probs
# before weights loaded mid-sequence: the rows in flight scored so far (rollout/segments.py)
SEGMENT_SCORE_S = "rollout/segment_score_s"
SEGMENT_SCORE_ROWS = "rollout/segment_score_rows"

# -- where a training result holds them (RLlib's nesting) ---------------------------------
RUNNERS = ("env_runners",)
LEARNER = ("learners", "default_policy")
EVALUATION = ("evaluation", "env_runners")


def m2_at_age(bucket: int) -> str:
    """'auto' staleness: the measured M2 of the tokens aged [bucket, 2 x bucket) (0: age 0),
    exponentially forgotten (rollout/staleness.py)."""
    return f"staleness/m2_age_{bucket}"


def runner(key: str) -> tuple[str, ...]:
    return RUNNERS + (key,)


def learner(key: str) -> tuple[str, ...]:
    return LEARNER + (key,)


EVAL_ACCURACY_PATH = EVALUATION + (EVAL_ACCURACY,)
# One of these per clip loss (the clip losses' keys are exclusive).
CLIPPED_FRAC_PATHS = tuple(learner(clipped_frac(f)) for f in CLIP_FAMILIES)
ENTROPY_CLIPPED_PATHS = tuple(learner(entropy_clipped(f)) for f in CLIP_FAMILIES)
