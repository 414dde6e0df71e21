"""Rollout corrections: importance weights for the gap between the engine that sampled and
the learner's numerics. Pure torch, no Ray; composable with every policy loss.

The engine samples from pi_engine (its own kernels and dtype, e.g. bf16 vLLM); the policy
loss wants tokens from pi_behav, the generating weights in the learner's numerics
(`recompute_behavior_logp`). Per token

    rho = pi_behav / pi_engine = exp(behavior_logp - engine_logp)

and a correction turns rho into a constant weight on each token's loss and a mask of the
tokens that take part at all (in the loss and in M2PO's second moment):

- "tis_token": truncated IS, w = min(rho, high), every token kept (Yao et al. 2025, "Your
  efficient RL framework secretly brings you off-policy RL training"; verl, slime).
- "tis_seq": the same on the sequence's rho (the product over its tokens), broadcast.
- "mis_token": masked IS, w = rho where low <= rho <= high, the token dropped elsewhere
  (Liu et al. 2025, "When speed kills stability"; verl's rejection sampling).
- "mis_seq": the same on the sequence's rho: a whole sequence kept or dropped.
- "icepop": IcePop's two-sided token mask (Ring-1T, arXiv 2510.18855): w = rho on
  [low, high] = [0.5, 5] by default, dropped outside.

`low` / `high` are ratios. A token whose rho is not finite (e.g. a token the learner's
truncation drops, rho = 0 as a log of -inf) is dropped by every correction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from m2po_rllib.common import keys


@dataclass(frozen=True)
class Correction:
    level: str  # "token" | "seq"
    masks: bool  # drops tokens outside [low, high] (else truncates at high)
    low: float | None  # default lower bound (masks only); None = no lower bound
    high: float  # default upper bound


ROLLOUT_CORRECTIONS: dict[str, Correction] = {
    "tis_token": Correction("token", masks=False, low=None, high=2.0),
    "tis_seq": Correction("seq", masks=False, low=None, high=2.0),
    "mis_token": Correction("token", masks=True, low=None, high=2.0),
    "mis_seq": Correction("seq", masks=True, low=None, high=2.0),
    "icepop": Correction("token", masks=True, low=0.5, high=5.0),
}


def correction_bounds(name: str, low: float | None = None, high: float | None = None) -> tuple[float | None, float]:
    """`(low, high)` of correction `name`: the given ones, else its defaults."""
    spec = ROLLOUT_CORRECTIONS[name]
    return (spec.low if low is None else low), (spec.high if high is None else high)


def bound_errors(name: str, low: float | None = None, high: float | None = None) -> dict[str, str]:
    """The one rule for correction `name`'s bounds (None: its default): "low" / "high" -> why
    that bound is wrong; empty when both hold. An on-policy token (ratio 1) must be kept, so
    high > 1 and 0 <= low < 1; a correction that only truncates from above takes no low."""
    out = {}
    if high is not None and not high > 1:
        out["high"] = f"({high}) must be > 1: an on-policy token has ratio 1 and must be kept (TIS/MIS use 2, IcePop 5)"
    if low is not None and not ROLLOUT_CORRECTIONS[name].masks:
        out["low"] = (f"({low}) means nothing for {name!r}, which truncates from above only; leave it None, or use "
                      "a masking correction (mis_token, mis_seq, icepop)")
    elif low is not None and not 0 <= low < 1:
        out["low"] = f"({low}) must be in [0, 1): an on-policy token has ratio 1 (IcePop uses 0.5)"
    return out


def rollout_correction(
    name: str,
    behavior_logp: torch.Tensor,
    engine_logp: torch.Tensor,
    valid: torch.Tensor,
    *,
    low: float | None = None,
    high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """`(weight, keep, metrics)` of correction `name` for a (B, T) batch.

    weight: (B, T) float32, the constant factor on each token's loss (0 off `keep`);
    keep: (B, T) bool, the valid tokens that take part; metrics: the share of valid tokens
    the correction changed (truncated or dropped), and the weights' mean, max and effective
    sample size (ESS, (sum w)^2 / (n sum w^2), 1 when every weight is equal) over the kept
    tokens.
    """
    if name not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout correction {name!r}; valid: {sorted(ROLLOUT_CORRECTIONS)}")
    spec = ROLLOUT_CORRECTIONS[name]
    if errors := bound_errors(name, low, high):
        raise ValueError(f"rollout correction {name!r}: " + "; ".join(f"{k} {why}" for k, why in errors.items()))
    low, high = correction_bounds(name, low, high)
    with torch.no_grad():
        valid = valid.bool()
        log_rho = torch.where(valid, behavior_logp.float() - engine_logp.float(), 0.0)
        finite = valid & torch.isfinite(log_rho)
        log_rho = torch.where(finite, log_rho, 0.0)
        if spec.level == "seq":  # the sequence's log-ratio, on each of its tokens
            seq_finite = (finite | ~valid).all(dim=1, keepdim=True)
            log_rho = log_rho.sum(dim=1, keepdim=True).expand_as(log_rho)
            finite = valid & seq_finite
        # exp of a clamped log: a huge sequence ratio is inf-free, and above `high` anyway
        rho = torch.exp(log_rho.clamp(max=math.log(high) + 1.0))
        if spec.masks:
            inside = rho <= high
            if low is not None:
                inside &= rho >= low
            keep = finite & inside
            weight = torch.where(keep, rho, 0.0)
            changed = valid & ~keep
        else:
            keep = finite
            weight = torch.where(keep, rho.clamp(max=high), 0.0)
            changed = valid & (~finite | (rho > high))
        n_valid = torch.count_nonzero(valid)
        w = weight[keep]
        n = w.numel()
        metrics = {
            keys.CORRECTION_CHANGED_FRAC: torch.count_nonzero(changed) / n_valid.clamp_min(1),
            keys.CORRECTION_WEIGHT_MEAN: w.mean() if n else torch.tensor(math.nan),
            keys.CORRECTION_WEIGHT_MAX: w.max() if n else torch.tensor(math.nan),
            keys.CORRECTION_ESS: _ess(w) if n else torch.tensor(math.nan),
        }
    return weight, keep, metrics


def _ess(w: torch.Tensor) -> torch.Tensor:
    """Effective sample size of importance weights as a fraction: (sum w)^2 / (n sum w^2)."""
    return w.sum() ** 2 / (w.numel() * (w * w).sum())


def mismatch_metrics(learner_logp, engine_logp, valid, large: float = None) -> dict[str, float]:
    """How far the engine's log-probs are from the learner's on the same tokens and weights,
    over the valid tokens: |delta| max and mean, KL(engine || learner) (the k3 estimator on the
    engine's own samples: E[rho - 1 - log rho], rho = p_learner / p_engine; >= 0, unbiased),
    the fraction with |delta| > `large` (default `keys.MISMATCH_LARGE`), and the ESS of rho.
    Numpy or torch (B, T) inputs; empty dict when nothing is valid."""
    large = keys.MISMATCH_LARGE if large is None else large
    learner_logp, engine_logp = torch.as_tensor(learner_logp), torch.as_tensor(engine_logp)
    mask = torch.as_tensor(valid) > 0
    delta = (learner_logp.double() - engine_logp.double())[mask]
    delta = delta[torch.isfinite(delta)]
    if not delta.numel():
        return {}
    rho = torch.exp(delta)
    return {
        keys.LOGP_MISMATCH_MAX: float(delta.abs().max()),
        keys.LOGP_MISMATCH_MEAN: float(delta.abs().mean()),
        keys.LOGP_MISMATCH_KL: float((rho - 1 - delta).mean()),
        keys.LOGP_MISMATCH_LARGE_FRAC: float((delta.abs() > large).double().mean()),
        keys.LOGP_MISMATCH_ESS: float(_ess(rho)),
    }
