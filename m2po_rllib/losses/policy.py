"""Policy losses: a registry of pure functions, and `compute_policy_loss` in front of it.

Each registered loss takes a `PolicyLossInputs` and its own keyword parameters (with
their defaults in its signature) and returns the (B, T) per-token loss to minimise,
already zero wherever the token must not contribute, plus its family's metrics.
`compute_policy_loss` does everything they share: shapes, the log-ratio, non-finite
tokens, aggregation, global counts and the common diagnostics.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Callable

import torch

from m2po_rllib.common import keys
from m2po_rllib.losses._dist import LOCAL, all_reduce_sum, world_size
from m2po_rllib.losses.aggregation import aggregate_loss
from m2po_rllib.losses.mask import PAPER_M2_THRESHOLD, _m2po_cut, m2po_official_tau

__all__ = ["POLICY_LOSSES", "PolicyLossInputs", "compute_policy_loss", "register_policy_loss"]

MASK_SCOPES = ("global", "local")

POLICY_LOSSES: dict[str, Callable] = {}


def register_policy_loss(name: str):
    """Decorator: make `fn` available to `compute_policy_loss` as `name`."""

    def deco(fn):
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return deco


@functools.cache
def _signature_params(fn) -> dict[str, object]:
    """The keyword-only parameters of `fn` with their defaults, read once per function:
    `compute_policy_loss` runs every minibatch."""
    sig = inspect.signature(fn)
    return {p.name: p.default for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY}


@dataclass(frozen=True)
class PolicyLossInputs:
    """What every loss receives; all (B, T)."""

    log_ratio: torch.Tensor  # float32, carries the gradient; 0 wherever `usable` is False
    advantages: torch.Tensor  # float32, constant; 0 wherever `usable` is False
    valid: torch.Tensor  # bool, response tokens (the token-mean denominator)
    usable: torch.Tensor  # bool, valid and with a finite log-ratio
    keep_mask: torch.Tensor | None  # precomputed M2PO mask (gradient accumulation)
    group: object  # process group for global statistics; None with `scope_global` off
    scope_global: bool  # reduce mask statistics over the ranks of `group`
    entropy: torch.Tensor | None  # per-token entropy, for diagnostics only
    sample_id: torch.Tensor | None = None  # (B,) the rows' ids: the M2PO mask's tie-break key


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over mask; NaN for an empty mask (RLlib's metric means skip NaN)."""
    return torch.where(mask, x, 0.0).sum() / torch.count_nonzero(mask)


def _ppo_clip(x: PolicyLossInputs, ratio, low, high, family: str):
    """PPO's clipped surrogate max(-A r, -A clip(r, low, high)); bounds are ratios."""
    adv = x.advantages
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(low, high)
    per_token = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        was_clipped = x.usable & (clipped > unclipped)  # gradient zeroed there
        n_clipped = torch.count_nonzero(was_clipped)
        frac = n_clipped / torch.count_nonzero(x.valid).clamp_min(1)
        metrics = {keys.clipped_frac(family): frac, keys.clipped_tokens(family): n_clipped.float()}
        if x.entropy is not None:
            metrics[keys.entropy_clipped(family)] = _masked_mean(x.entropy, was_clipped)
    return torch.where(x.usable, per_token, 0.0), metrics


@register_policy_loss("m2po")
def m2po_loss(x: PolicyLossInputs, *, m2_threshold: float = PAPER_M2_THRESHOLD):
    """M2PO (arXiv 2510.01161): -M * r * A, M the second-moment mask; no epsilon-clip."""
    if x.keep_mask is not None:
        if x.keep_mask.shape != x.valid.shape:
            raise ValueError(
                f"keep_mask {tuple(x.keep_mask.shape)} must match the batch {tuple(x.valid.shape)}"
            )
        keep = x.keep_mask.bool() & x.usable
    else:
        group = x.group if x.scope_global else LOCAL
        keep, cut = _m2po_cut(x.log_ratio, x.usable, float(m2_threshold), group, x.sample_id)
    # exp of a zeroed log-ratio off `keep`: no inf * 0 in the forward or backward pass
    ratio = torch.exp(torch.where(keep, x.log_ratio, 0.0))
    per_token = torch.where(keep, -ratio * x.advantages, 0.0)
    with torch.no_grad():
        d = x.log_ratio.detach() ** 2
        masked = x.valid & ~keep
        n_kept, n_valid = torch.count_nonzero(keep), torch.count_nonzero(x.valid)
        metrics = {
            keys.M2_AFTER: _masked_mean(d, keep),
            keys.KEPT_TOKENS: n_kept.float(),
            keys.MASKED_TOKENS: torch.count_nonzero(masked).float(),
            keys.MASKED_FRAC: torch.count_nonzero(masked) / n_valid.clamp_min(1),
        }
        if x.keep_mask is None:  # a precomputed mask's caller reports it (m2po_keep_mask_global)
            metrics[keys.TIED_KEPT_FRAC] = cut["tied_kept"] / n_valid.clamp_min(1)
        if x.entropy is not None:
            metrics[keys.ENTROPY_MASKED] = _masked_mean(x.entropy, masked)
    return per_token, metrics


@register_policy_loss("m2po_official")
def m2po_official_loss(
    x: PolicyLossInputs,
    *,
    m2_threshold: float = PAPER_M2_THRESHOLD,
    min_clip_low: float | None = 0.3,
    min_clip_high: float | None = 0.5,
    tau_solver: str = "exact",
    tau_c: float | None = None,
):
    """M2PO as in the official code: PPO clip with bounds [exp(-tau_c), exp(tau_c)].

    tau_c comes from `m2po_official_tau` (M2 budget over harmful tokens). The bounds are
    never tighter than [1 - min_clip_low, 1 + min_clip_high] (the official defaults
    0.3 / 0.5; None disables). Pass `tau_c` to reuse a value computed once per
    minibatch under gradient accumulation.
    """
    if tau_c is None:
        group = x.group if x.scope_global else LOCAL
        tau_c = m2po_official_tau(
            x.log_ratio, x.advantages, x.usable, m2_threshold, group, solver=tau_solver
        )
    bounded = math.isfinite(tau_c)
    low, high = math.exp(-tau_c), math.exp(tau_c)
    if min_clip_low is not None:
        low = min(low, 1.0 - min_clip_low)
    if min_clip_high is not None:
        high = max(high, 1.0 + min_clip_high)
    per_token, metrics = _ppo_clip(x, torch.exp(x.log_ratio), low, high, "m2po")
    with torch.no_grad():
        lr, adv = x.log_ratio.detach(), x.advantages
        harmful = x.usable & (((adv > 0) & (lr > 0)) | ((adv < 0) & (lr < 0)))
        capped = torch.minimum(lr * lr, torch.tensor(tau_c * tau_c, device=lr.device))
        metrics.update(
            {
                keys.M2_AFTER: _masked_mean(capped, harmful),
                # NaN, not inf, when the budget sets no bound: metric means skip NaN
                keys.TAU_C: torch.tensor(tau_c if bounded else math.nan, device=lr.device),
                keys.CLIP_LOW: torch.tensor(low if bounded else math.nan, device=lr.device),
                keys.CLIP_HIGH: torch.tensor(high if bounded else math.nan, device=lr.device),
            }
        )
    return per_token, metrics


@register_policy_loss("grpo")
def grpo_loss(
    x: PolicyLossInputs,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    clip_ratio_c: float | None = None,
):
    """GRPO/PPO clip to [1 - eps_low, 1 + eps_high]; eps_high > eps_low is DAPO's clip-higher.

    clip_ratio_c: optional dual-clip (arXiv 1912.09729): for A < 0 the loss is capped at
    -A * clip_ratio_c (verl's default 3.0, which the paper's GRPO baseline ran with).
    """
    ratio = torch.exp(x.log_ratio)
    per_token, metrics = _ppo_clip(x, ratio, 1.0 - eps_low, 1.0 + eps_high, "grpo")
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1:
            raise ValueError(f"clip_ratio_c must be > 1; got {clip_ratio_c}")
        capped = torch.minimum(per_token, -x.advantages * clip_ratio_c)
        per_token = torch.where(x.advantages < 0, capped, per_token)
    return per_token, metrics


@register_policy_loss("grpo_no_tr")
def grpo_no_tr_loss(x: PolicyLossInputs):
    """Importance-weighted policy gradient with no trust region: -r * A."""
    return torch.where(x.usable, -torch.exp(x.log_ratio) * x.advantages, 0.0), {}


@register_policy_loss("gspo")
def gspo_loss(x: PolicyLossInputs, *, eps_low: float = 3e-4, eps_high: float = 4e-4):
    """GSPO (arXiv 2507.18071), token form: the sequence ratio s_i = exp(mean_t log r)
    is clipped to [1 - eps_low, 1 + eps_high]; each token's gradient is that of s_i
    times its own advantage. The paper averages over sequences: use
    loss_agg_mode="seq-mean-token-mean" to reproduce it.
    """
    usable = x.usable
    n_tok = usable.sum(dim=1, keepdim=True).clamp_min(1)
    seq_log_ratio = torch.where(usable, x.log_ratio, 0.0).sum(dim=1, keepdim=True) / n_tok  # (B, 1)
    # value s_i, gradient s_i * d log pi(y_t) per token: GSPO-token (the paper's eq. 13)
    log_s = seq_log_ratio.detach() + x.log_ratio - x.log_ratio.detach()
    return _ppo_clip(x, torch.exp(log_s), 1.0 - eps_low, 1.0 + eps_high, "gspo")


def policy_loss_params(name: str) -> dict[str, object]:
    """The parameters loss `name` accepts, with their defaults."""
    return dict(_signature_params(_lookup(name)))


def _lookup(name: str):
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; valid: {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


def compute_policy_loss(
    name: str,
    logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    *,
    entropy: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    keep_mask: torch.Tensor | None = None,
    num_global_tokens: float | int | torch.Tensor | None = None,
    num_global_seqs: float | int | torch.Tensor | None = None,
    max_tokens: int | None = None,
    group=None,
    mask_scope: str = "global",
    correction_weight: torch.Tensor | None = None,
    correction_keep: torch.Tensor | None = None,
    sample_id: torch.Tensor | None = None,
    **params,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The scalar policy loss to minimise (minus the objective) and its metrics.

    Args:
        name: a key of POLICY_LOSSES: "m2po" (default in the config), "m2po_official",
            "grpo", "grpo_no_tr", "gspo".
        logp: (B, T) log pi_theta of the sampled tokens, with gradient; any float dtype
            (the loss is computed in float32).
        behavior_logp: (B, T) log pi_behav from the sampler; treated as a constant.
        advantages: (B,) per sequence or (B, T) per token; treated as a constant.
        valid: (B, T) bool (or 0/1), True on response tokens. Padding contents are
            ignored, NaN included.
        entropy: optional (B, T) per-token entropy; adds the entropy of masked/clipped
            tokens vs all tokens to the metrics.
        loss_agg_mode: see `aggregate_loss`.
        keep_mask: (B, T) precomputed M2PO mask ("m2po" only), e.g. slices of one
            `m2po_keep_mask_global` call per minibatch under gradient accumulation.
        num_global_tokens, num_global_seqs: the whole minibatch's valid-token and
            sequence counts over every shard and micro-batch. Default: this call's
            counts, all-reduced over `group` when the scope is global.
        max_tokens: Dr. GRPO's constant for "seq-mean-token-sum-norm" (default T).
        group: torch.distributed process group (None: the default group).
        mask_scope: "global" computes the M2PO mask, the official tau_c and the default
            counts over every rank of `group` when torch.distributed runs with more than
            one rank; "local" uses this call's tokens only (cheaper, but the mask then
            depends on how the minibatch is split).
        correction_weight, correction_keep: a rollout correction (`losses.correction`):
            (B, T) constant weights on each token's loss, and the tokens that take part
            (the others leave the loss and M2PO's second moment, and still count in the
            token-mean denominator). Any loss composes with any correction.
        sample_id: (B,) the rows' unique ids (the rollout batch's `sample_id`): the M2PO
            mask breaks ties at its cut by (sample id, position), so that it does not
            depend on the row order or the split over ranks (None: the row index).
        **params: the loss's own parameters (`policy_loss_params(name)` lists them):
            m2_threshold (m2po*, default 0.04), eps_low / eps_high (grpo 0.2 / 0.2,
            gspo 3e-4 / 4e-4), clip_ratio_c, min_clip_low / min_clip_high, tau_solver,
            tau_c. An unknown name raises.

    Returns:
        (loss, metrics): loss is a 0-d float32 tensor. Summed over the shards and
        micro-batches of a minibatch (given the global counts), it equals the whole
        minibatch's loss, and so do its gradients; data-parallel learners that average
        gradients (DDP) must therefore scale the loss by the world size. Metrics are
        detached 0-d tensors over this call's tokens; means over no tokens are NaN.

    Non-finite log-ratios (NaN/inf in logp or behavior_logp on a valid token) never
    raise and never reach the loss or its gradient: such tokens are left out of every
    loss (M2PO treats them as the largest d), still count in the token-mean
    denominator, and are counted in `policy/nonfinite_tokens`.
    """
    fn = _lookup(name)
    accepted = _signature_params(fn)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise TypeError(
            f"policy loss {name!r} got unknown parameter(s) {unknown}; "
            f"it accepts {sorted(accepted)}"
        )
    if mask_scope not in MASK_SCOPES:
        raise ValueError(f"unknown mask_scope {mask_scope!r}; valid: {MASK_SCOPES}")
    if keep_mask is not None and name != "m2po":
        raise ValueError(f"keep_mask applies to the 'm2po' loss only, not {name!r}")
    if logp.dim() != 2 or behavior_logp.shape != logp.shape or valid.shape != logp.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)}, behavior_logp {tuple(behavior_logp.shape)} and valid "
            f"{tuple(valid.shape)} must all be (B, T)"
        )
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)  # (B, 1)
    B, T = logp.shape
    if advantages.dim() != 2 or advantages.shape[0] != B or advantages.shape[1] not in (1, T):
        raise ValueError(
            f"advantages {tuple(advantages.shape)} must be (B,) or (B, T) for logp {(B, T)}"
        )

    if entropy is not None and entropy.shape != logp.shape:
        raise ValueError(f"entropy {tuple(entropy.shape)} must match logp {(B, T)}")
    valid = valid.bool()
    raw = logp.float() - behavior_logp.detach().float()  # (B, T)
    finite = valid & torch.isfinite(raw)
    usable = finite if correction_keep is None else finite & correction_keep.bool()
    adv = advantages.detach().float().expand_as(raw)
    inputs = PolicyLossInputs(
        log_ratio=torch.where(usable, raw, 0.0),
        advantages=torch.where(usable, adv, 0.0),
        valid=valid,
        usable=usable,
        keep_mask=keep_mask,
        group=group,
        scope_global=mask_scope == "global",
        entropy=None if entropy is None else entropy.detach().float(),
        sample_id=sample_id,
    )
    per_token, metrics = fn(inputs, **params)
    if correction_weight is not None:
        per_token = per_token * torch.where(usable, correction_weight.detach().float(), 0.0)

    if mask_scope == "global" and world_size(group) > 1 and (
        num_global_tokens is None or num_global_seqs is None
    ):
        counts = torch.stack([torch.count_nonzero(valid), torch.count_nonzero(valid.any(dim=1))])
        counts = counts.double()
        n_tok, n_seq = all_reduce_sum(counts, group)
        num_global_tokens = n_tok if num_global_tokens is None else num_global_tokens
        num_global_seqs = n_seq if num_global_seqs is None else num_global_seqs
    loss = aggregate_loss(
        per_token, valid, loss_agg_mode, num_global_tokens, max_tokens, num_global_seqs
    )
    metrics.update(_common_metrics(inputs))
    metrics[keys.NONFINITE_TOKENS] = torch.count_nonzero(valid & ~finite)
    return loss, {k: torch.as_tensor(v).detach().float() for k, v in metrics.items()}


@torch.no_grad()
def _common_metrics(x: PolicyLossInputs) -> dict[str, torch.Tensor]:
    """The M2 diagnostics of every loss, so that baselines plot against M2PO."""
    lr = x.log_ratio.detach()
    abs_lr = lr.abs()
    metrics = {
        keys.M2_BEFORE: _masked_mean(lr * lr, x.usable),
        keys.LOG_RATIO_ABS_MEAN: _masked_mean(abs_lr, x.usable),
        keys.LOG_RATIO_ABS_MAX: torch.where(x.usable, abs_lr, -math.inf).amax()
        if lr.numel() and x.usable.any()
        else torch.tensor(math.nan, device=lr.device),
        keys.RATIO_MEAN: _masked_mean(torch.exp(lr), x.usable),
        keys.VALID_TOKENS: torch.count_nonzero(x.valid),
    }
    if x.entropy is not None:
        metrics[keys.ENTROPY_ALL] = _masked_mean(x.entropy, x.valid)
    return metrics
