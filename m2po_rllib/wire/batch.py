"""Rollout batches: padded numpy arrays that travel from EnvRunners to the learners.

A rollout batch holds B = prompts x group_size sequences, each group of `group_size`
consecutive rows sharing one prompt:
    prompt_ids      (B, P) int64, left-padded     prompt_mask   (B, P) float32
    response_ids    (B, R) int64, right-padded    response_mask (B, R) float32
    behavior_logp   (B, R) float32   log-prob of each token under the generating weights
    env_mask        (B, R) float32   only for multi-turn episodes: 1 for the tokens the env
                                     inserted (a tool's result, feedback), which the learner
                                     attends to but never trains on (response_mask is 0 there)
    engine_logp     (B, R) float32   only with recompute_behavior_logp: the engine's own
                                     log-probs, while behavior_logp holds the learner-numerics
                                     ones (what rollout corrections and mismatch metrics compare)
    token_version   (B, R) int64     the policy version whose weights sampled each token (an env
                                     token: its turn's last); more than one per row only where
                                     the runner loaded weights mid-sequence
    rewards         (B,)   float32
    policy_version  (B,)   int64     the row's oldest token's version (a row's age when trained:
                                     the trained version minus this)
    sample_id       (B,)   int64     unique per sampled completion over the run

Padding holds 0 in every array. The masks say which entries are real, and the learner
reads nothing under a 0 mask (positions come from the attention mask), so no pad token id
is needed downstream of the EnvRunner (a tokenizer without one works too).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

ROW_KEYS_2D_LEFT = ("prompt_ids", "prompt_mask")
ROW_KEYS_2D_RIGHT = ("response_ids", "response_mask", "behavior_logp", "engine_logp", "env_mask", "token_version")
ROW_KEYS_1D = ("rewards", "policy_version", "sample_id")


def _pad(rows: Sequence[Sequence], width: int, dtype, left: bool) -> np.ndarray:
    out = np.zeros((len(rows), width), dtype=dtype)
    for i, row in enumerate(rows):
        n = len(row)
        if n:
            if left:
                out[i, width - n :] = row
            else:
                out[i, :n] = row
    return out


def pack_rollouts(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    behavior_logp: Sequence[Sequence[float]],
    rewards: Sequence[float],
    policy_version: int,
    sample_ids: Sequence[int] | None = None,
    policy_masks: Sequence[Sequence[int]] | None = None,
    token_versions: Sequence[Sequence[int] | None] | None = None,
) -> dict[str, np.ndarray]:
    """Pads one rollout round into a batch (rows in the order given); `sample_ids` default
    to 0..B-1. `policy_masks` (multi-turn episodes): per response token, 1 if the policy
    generated it, 0 if the env inserted it; the batch then has `env_mask`. `token_versions`:
    per response token, the version that sampled it (a row's None, or no argument: all
    `policy_version`); `policy_version` is the round's, which no token may be older than,
    and each row's `policy_version` column its oldest token's."""
    n = len(prompt_ids)
    if not (len(response_ids) == len(behavior_logp) == len(rewards) == n):
        raise ValueError(
            f"pack_rollouts got {n} prompts, {len(response_ids)} responses, "
            f"{len(behavior_logp)} log-prob rows and {len(rewards)} rewards; they must match"
        )
    if sample_ids is None:
        sample_ids = range(n)
    elif len(sample_ids) != n:
        raise ValueError(f"pack_rollouts got {len(sample_ids)} sample ids for {n} rows")
    for i, (r, lp) in enumerate(zip(response_ids, behavior_logp)):
        if len(r) != len(lp):
            raise ValueError(f"row {i}: {len(r)} response tokens but {len(lp)} log-probs")
        if policy_masks is not None and len(policy_masks[i]) != len(r):
            raise ValueError(f"row {i}: {len(r)} response tokens but a policy mask of {len(policy_masks[i])}")
    versions = [
        [policy_version] * len(r) if token_versions is None or token_versions[i] is None else list(token_versions[i])
        for i, r in enumerate(response_ids)
    ]
    for i, (r, v) in enumerate(zip(response_ids, versions)):
        if len(v) != len(r):
            raise ValueError(f"row {i}: {len(r)} response tokens but {len(v)} token versions")
        if v and min(v) < policy_version:
            raise ValueError(f"row {i}: a token of version {min(v)}, older than its round's {policy_version}")
    p = max((len(x) for x in prompt_ids), default=0)
    r = max(1, max((len(x) for x in response_ids), default=0))
    policy = policy_masks if policy_masks is not None else [[1.0] * len(x) for x in response_ids]
    batch = {
        "prompt_ids": _pad(prompt_ids, p, np.int64, left=True),
        "prompt_mask": _pad([[1.0] * len(x) for x in prompt_ids], p, np.float32, left=True),
        "response_ids": _pad(response_ids, r, np.int64, left=False),
        "response_mask": _pad(policy, r, np.float32, left=False),
        # the env's tokens carry no behaviour log-prob
        "behavior_logp": _pad(behavior_logp, r, np.float32, left=False) * (_pad(policy, r, np.float32, left=False) > 0),
        "rewards": np.asarray(rewards, dtype=np.float32),
        "token_version": _pad(versions, r, np.int64, left=False),
        "policy_version": np.asarray([min(v, default=policy_version) for v in versions], dtype=np.int64),
        "sample_id": np.asarray(list(sample_ids), dtype=np.int64),
    }
    if policy_masks is not None:
        batch["env_mask"] = _pad([[1.0 - float(m) for m in row] for row in policy_masks], r, np.float32, left=False)
    return batch


def _repad(a: np.ndarray, width: int, left: bool) -> np.ndarray:
    extra = width - a.shape[1]
    if extra == 0:
        return a
    pad = ((0, 0), (extra, 0)) if left else ((0, 0), (0, extra))
    return np.pad(a, pad)


def concat_rollouts(batches: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Concatenates rollout batches row-wise, re-padding prompts (left) and responses (right)."""
    if not batches:
        raise ValueError("concat_rollouts needs at least one batch")
    if len(batches) == 1:
        return dict(batches[0])
    p = max(b["prompt_ids"].shape[1] for b in batches)
    r = max(b["response_ids"].shape[1] for b in batches)
    out = {}
    for key in batches[0]:
        if key in ROW_KEYS_2D_LEFT:
            out[key] = np.concatenate([_repad(b[key], p, left=True) for b in batches])
        elif key in ROW_KEYS_2D_RIGHT:
            out[key] = np.concatenate([_repad(b[key], r, left=False) for b in batches])
        else:
            out[key] = np.concatenate([b[key] for b in batches])
    return out


def row_ages(batch, version):
    """Each row's age when trained by weights of `version`: `version` minus the row's
    `policy_version`, its oldest token's (numpy or torch, as the batch's column). The one
    definition admission, `max_staleness`, the staleness metrics and M2 by age use."""
    return version - batch["policy_version"]


def token_ages(batch: dict[str, np.ndarray], version: int) -> np.ndarray:
    """The trained (policy) tokens' ages when trained by weights of `version`, each from the
    version that sampled it (flat, over `response_mask`)."""
    return (version - batch["token_version"])[batch["response_mask"] > 0]


def versions_spanned(batch: dict[str, np.ndarray]) -> np.ndarray:
    """(B,) how many policy versions each row's tokens were sampled by (1: no load mid-row)."""
    real = batch["response_mask"] + batch.get("env_mask", 0) > 0
    ordered = np.sort(np.where(real, batch["token_version"], -1), axis=1)  # -1: padding, first
    new = ordered >= 0
    new[:, 1:] &= ordered[:, 1:] != ordered[:, :-1]
    return np.maximum(new.sum(axis=1), 1)


def num_rows(batch: dict[str, np.ndarray]) -> int:
    return int(batch["response_mask"].shape[0])


def take_rows(batch: dict[str, np.ndarray], index: np.ndarray) -> dict[str, np.ndarray]:
    return {k: v[index] for k, v in batch.items()}


def to_train_batch(batch: dict[str, np.ndarray], advantages: np.ndarray) -> dict[str, np.ndarray]:
    """The learner's view: one token sequence per row plus what the loss needs."""
    extra = {"engine_logp": batch["engine_logp"]} if "engine_logp" in batch else {}
    attended = batch["response_mask"] + batch["env_mask"] if "env_mask" in batch else batch["response_mask"]
    return extra | {
        "input_ids": np.concatenate([batch["prompt_ids"], batch["response_ids"]], axis=1),
        # every real token is attended to; the loss reads response_mask (the policy's tokens)
        "attention_mask": np.concatenate([batch["prompt_mask"], attended], axis=1),
        "response_mask": batch["response_mask"],
        "behavior_logp": batch["behavior_logp"],
        "advantages": advantages.astype(np.float32),
        "policy_version": batch["policy_version"],
        "sample_id": batch["sample_id"],
    }


def learner_order(n: int, minibatch: int, num_learners: int) -> np.ndarray:
    """Row order that makes RLlib's contiguous sharding + minibatching reproduce the global
    minibatches: learner l's j-th minibatch is the l-th slice of global minibatch j."""
    if num_learners == 1:
        return np.arange(n)
    idx = np.arange(n).reshape(n // minibatch, num_learners, minibatch // num_learners)
    return idx.transpose(1, 0, 2).reshape(-1)
