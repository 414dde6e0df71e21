"""Group-relative advantages and the reduction of a per-token loss to a scalar."""

from __future__ import annotations

import torch

__all__ = ["ADVANTAGE_ESTIMATORS", "LOSS_AGG_MODES", "aggregate_loss", "compute_advantages"]

ADVANTAGE_ESTIMATORS = ("grpo", "drgrpo", "rloo")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def compute_advantages(
    rewards: torch.Tensor, group_size: int, estimator: str = "grpo", eps: float = 1e-6
) -> torch.Tensor:
    """Per-sample advantages from outcome rewards, each sample against its own group.

    Args:
        rewards: (P * G,) one scalar per completion, laid out as P contiguous groups of
            the G completions of one prompt.
        group_size: G >= 2.
        estimator: "grpo" (R - mean) / (std + eps) with the unbiased std, as GRPO and
            verl; "drgrpo" R - mean (Dr. GRPO, arXiv 2503.20783, drops the std);
            "rloo" R - mean of the other G-1 rewards (arXiv 2402.14740).
        eps: added to the GRPO std so that a group of equal rewards gives 0.

    Returns:
        (P * G,) float advantages, same layout as `rewards`.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; valid: {ADVANTAGE_ESTIMATORS}"
        )
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (P * G,); got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"got {group_size} samples per prompt; group advantages need at least 2")
    if rewards.numel() % group_size:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of {group_size} "
            f"({rewards.numel()} % {group_size} = {rewards.numel() % group_size})"
        )
    r = rewards.float().reshape(-1, group_size)  # (P, G)
    centered = r - r.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        adv = centered / (r.std(dim=1, keepdim=True) + eps)
    elif estimator == "drgrpo":
        adv = centered
    else:  # R_i - mean_{j != i} R_j = G / (G - 1) * (R_i - mean)
        adv = centered * (group_size / (group_size - 1))
    return adv.reshape(-1)


def aggregate_loss(
    per_token_loss: torch.Tensor,
    valid: torch.Tensor,
    mode: str = "token-mean",
    num_global_tokens: float | int | torch.Tensor | None = None,
    max_tokens: int | None = None,
    num_global_seqs: float | int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar; padding never contributes.

    Modes:
        "token-mean": sum over valid tokens / number of valid tokens. The paper's
            default; tokens masked by M2PO or clipped still count in the denominator.
        "seq-mean-token-mean": the mean over valid tokens of each sequence, averaged
            over sequences (rows with at least one valid token).
        "seq-mean-token-sum-norm": Dr. GRPO's constant normaliser (arXiv 2503.20783):
            sum over valid tokens / (sequences * max_tokens), max_tokens defaulting to T.
            Set it to the maximum response length so it stays constant across batches.

    A sharded or micro-batched update reproduces the whole minibatch's loss (as a sum
    of the parts) and gradient when every part passes the whole minibatch's counts:
    `num_global_tokens` (token-mean) or `num_global_seqs` (the seq-mean modes).
    Without them the counts of this call are used. A count of 0 gives a loss of 0.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid: {LOSS_AGG_MODES}")
    if per_token_loss.shape != valid.shape or per_token_loss.dim() != 2:
        raise ValueError(
            f"per_token_loss {tuple(per_token_loss.shape)} and valid {tuple(valid.shape)} "
            "must both be (B, T)"
        )
    valid = valid.bool()
    masked = torch.where(valid, per_token_loss, 0.0)  # where, not *: padding may be NaN
    if mode == "token-mean":
        n = torch.count_nonzero(valid) if num_global_tokens is None else num_global_tokens
        return masked.sum() / _at_least_one(n, masked)
    n_seqs = torch.count_nonzero(valid.any(dim=1)) if num_global_seqs is None else num_global_seqs
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=1) / valid.sum(dim=1).clamp_min(1)  # (B,)
        return per_seq.sum() / _at_least_one(n_seqs, masked)
    if max_tokens is None:
        max_tokens = valid.shape[1]
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1; got {max_tokens}")
    return masked.sum() / (_at_least_one(n_seqs, masked) * max_tokens)


def _at_least_one(n, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(n, dtype=like.dtype, device=like.device).clamp_min(1)
