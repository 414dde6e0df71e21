"""The second-moment trust region: M2PO's token mask and the official code's clip bound.

Both are searches over the largest squared log-ratios d = (log r)^2 of a batch. Neither
sorts the whole batch: one reduction gives the batch's sum of d, its token count and the
number of tokens above the threshold (an upper bound on how many tokens the search can
touch); only then are the top values fetched, with `torch.topk`, in a few widening
rounds. Across data-parallel ranks the same search runs on all-reduced sums and on the
merged per-rank top-m lists: any global top-m value is in its own rank's top-m, so the
merged prefix is exact and every rank reaches the same cut. Only O(m * world) values
travel, and nothing at all beyond four scalars when the batch is already within the
threshold (the common case).

Ties at the cut are broken as Algorithm 1 breaks them, one token at a time, in the order of
a global key per token, (sample id, position in the response): the mask drops exactly the
minimal number of tokens and still depends on nothing but each token's value and key, so
no row order, padding width or split over ranks changes it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from m2po_rllib.common import keys
from m2po_rllib.losses._dist import LOCAL, all_gather_cat, all_reduce_sum, world_size

# tau, the M2 budget of the paper and its official code (arXiv 2510.01161): M2POConfig's
# default and these functions'.
PAPER_M2_THRESHOLD = 0.04

__all__ = ["m2po_keep_mask", "m2po_keep_mask_global", "m2po_official_tau"]

# First top-k size of the search: max(_FIRST_TOP, n / _FIRST_TOP_FRACTION), widened
# _WIDEN x per round. M2PO masks ~0.06% of tokens (paper, s=256): one round.
_FIRST_TOP = 4096
_FIRST_TOP_FRACTION = 256
_WIDEN = 8
_NOT_A_CANDIDATE = -1.0  # d >= 0 for every candidate, so -1 sorts below all of them

# The tie-break key of token t of a row: (row id << _POS_BITS) | t, one int64 that orders
# as the pair (row id, t). The row id is the sample id, or without sample ids (rank <<
# _ROW_BITS) | row, the row's place in the ranks' batches concatenated in rank order.
_POS_BITS = 24  # responses up to 16.7M tokens
_ROW_BITS = 24  # without sample ids: up to 16.7M rows per rank, 32768 ranks
_MAX_ROW_ID = 1 << (63 - _POS_BITS)  # sample ids in [0, 2**39)
_NO_KEY = torch.iinfo(torch.int64).max  # above every key


def _check_inputs(log_ratio: torch.Tensor, valid: torch.Tensor, threshold: float, what: str, sample_id=None):
    if log_ratio.shape != valid.shape:
        raise ValueError(
            f"log_ratio {tuple(log_ratio.shape)} and valid {tuple(valid.shape)} must have one shape"
        )
    if sample_id is not None and (sample_id.dim() != 1 or len(sample_id) != len(valid)):
        raise ValueError(f"sample_id {tuple(sample_id.shape)} must be (B,) for a batch {tuple(valid.shape)}")
    if math.isnan(threshold) or threshold < 0:
        raise ValueError(
            f"{what} must be >= 0 (0 keeps only tokens with log-ratio exactly 0, "
            f"inf disables the trust region); got {threshold}"
        )


def _largest_f32_at_most(x: float) -> float:
    """The largest float32 <= x, so that `d > it` on float32 d means exactly `d > x`."""
    t = torch.tensor(x, dtype=torch.float32)
    if t.item() > x:
        t = torch.nextafter(t, torch.tensor(-math.inf))
    return t.item()


def _global_top(d: torch.Tensor, m: int, n: int, group):
    """The m largest candidates of `d` over all ranks, and the sum of all the others.

    `d` holds d >= 0 on the n candidates (n over all ranks, m <= n) and -1 elsewhere.
    Returns `top` (m,) descending and `rest` (m + 1,), float64, with rest[k] the sum of
    every candidate but top[:k]. It is summed directly, not as total - prefix, so there
    is no cancellation: tiny remainders after large values stay exact enough to compare.
    """
    flat = d.reshape(-1)
    top = flat.topk(min(m, flat.numel())).values
    if top.numel() < m:
        top = torch.cat([top, top.new_full((m - top.numel(),), _NOT_A_CANDIDATE)])
    if world_size(group) > 1:
        top = all_gather_cat(top, group).topk(m).values
    smallest = top[-1]
    below = flat < smallest
    sums = torch.stack(
        [
            torch.where(below, flat, 0.0).clamp_min(0).sum(dtype=torch.float64),
            torch.count_nonzero(below & (flat >= 0)).double(),
        ]
    )
    below_sum, n_below = all_reduce_sum(sums, group)
    # candidates equal to the m-th value that did not make it into the list
    rest_of_list = below_sum + (n - m - n_below) * smallest.double()
    top = top.double()
    suffix = top.flip(0).cumsum(0).flip(0)  # suffix[k] = sum(top[k:])
    rest = torch.cat([suffix, suffix.new_zeros(1)]) + rest_of_list
    return top, rest


def _first_true(ok: torch.Tensor) -> int | None:
    """Index of the first True in a 1-D bool tensor, or None."""
    if ok.numel() == 0:
        return None
    i = int(ok.to(torch.uint8).argmax())
    return i if bool(ok[i]) else None


def _row_ids(valid: torch.Tensor, sample_id, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The row ids of the tie-break keys, (B,) int64, and how many ids (or T) are out of
    range, a 0-d tensor (summed over the ranks with the other counts: all raise together)."""
    B, T = valid.shape
    if sample_id is None:
        rank = dist.get_rank(group) if world_size(group) > 1 else 0
        ids = torch.arange(B, device=valid.device, dtype=torch.int64) + (rank << _ROW_BITS)
        out_of_range = int(B > 1 << _ROW_BITS)
    else:
        ids = sample_id.to(valid.device, torch.int64)
        out_of_range = 0
    out_of_range += int(T > 1 << _POS_BITS)
    return ids, torch.count_nonzero((ids < 0) | (ids >= _MAX_ROW_ID)) + out_of_range


def _drop_through(d, finite, top, k: int, n: int, row_ids, group):
    """Keep mask once the k + 1 largest d are dropped, ties in the order of their keys, and
    how many tokens of this rank have the cut's value and are kept.

    Every d above the cut's value top[k] is in top[:k], so those go whole. Of the tokens
    equal to it, the n_tied with the smallest keys go: each rank sends its own n_tied
    smallest keys, and the n_tied-th smallest of all of them is the last key dropped.
    """
    cut = top[k]
    keep = finite & (d < cut.float())
    n_drop = k + 1
    if n_drop == n or (n_drop < len(top) and top[n_drop] < cut):
        return keep, 0  # every token of the cut's value is needed
    n_tied = n_drop - int(torch.count_nonzero(top[:n_drop] > cut))  # >= 1
    rows, pos = torch.nonzero(finite & (d == cut.float()), as_tuple=True)
    key = (row_ids[rows] << _POS_BITS) | pos  # (number tied here,)
    first = key.topk(min(n_tied, key.numel()), largest=False).values  # ascending
    first = torch.cat([first, first.new_full((n_tied - first.numel(),), _NO_KEY)])
    if world_size(group) > 1:
        first = all_gather_cat(first, group).topk(n_tied, largest=False).values
    # first[-1] is a real key: at least n_tied tokens have the cut's value (top[:n_drop]).
    # Repeated keys at it go together; with unique keys exactly n_tied tokens go.
    spared = key > first[-1]
    keep[rows[spared], pos[spared]] = True
    return keep, int(torch.count_nonzero(spared))


@torch.no_grad()
def _m2po_cut(log_ratio, valid, threshold: float, group, sample_id=None):
    """Shared body of the M2PO masks: keep (B, T) bool, and the global sums as python
    floats with this rank's count of tokens tied at the cut and kept (`tied_kept`)."""
    sample_id = None if sample_id is None else torch.as_tensor(sample_id)
    _check_inputs(log_ratio, valid, threshold, "m2_threshold", sample_id)
    valid = valid.bool()
    lr = log_ratio.detach().float()
    finite = valid & torch.isfinite(lr)
    d = torch.where(finite, lr * lr, _NOT_A_CANDIDATE)  # (B, T)
    above = d > _largest_f32_at_most(threshold)
    row_ids, bad_ids = _row_ids(valid, sample_id, group)
    sums = torch.stack(
        [
            d.clamp_min(0).sum(dtype=torch.float64),
            torch.count_nonzero(finite).double(),
            torch.count_nonzero(above).double(),
            bad_ids.double(),
        ]
    )
    total, n, n_above, bad_ids = all_reduce_sum(sums, group).tolist()
    if bad_ids:  # every rank raises, none is left waiting in a collective
        raise ValueError(
            f"the M2PO mask's tie-break needs sample ids in [0, 2**{63 - _POS_BITS}) and responses "
            f"of at most 2**{_POS_BITS} tokens (without sample ids: at most 2**{_ROW_BITS} rows "
            f"per rank); got {int(bad_ids)} ids or shapes out of range"
        )
    stats = {"sum": total, "n": n, "tied_kept": 0}
    if n == 0 or total <= threshold * n or n_above == 0:  # the last: float64 rounding
        return finite, stats

    # M2PO Alg. 1 (arXiv 2510.01161): drop the largest d until the kept mean is <= tau.
    # Dropping every d > tau always suffices, so the cut lies within the top n_above.
    n_above = int(n_above)
    m = min(n_above, max(_FIRST_TOP, int(n) // _FIRST_TOP_FRACTION))
    while True:
        top, rest = _global_top(d, m, int(n), group)  # (m,) descending, (m + 1,)
        dropped = torch.arange(1, m + 1, device=top.device, dtype=torch.float64)
        ok = (rest[1:] <= threshold * (n - dropped)) | (dropped == n)
        k = _first_true(ok)
        if k is not None:
            keep, stats["tied_kept"] = _drop_through(d, finite, top, k, int(n), row_ids, group)
            return keep, stats
        if m >= n_above:
            # Only float64 rounding can get here; dropping all d > tau is exactly valid.
            return finite & ~above, stats
        m = min(n_above, _WIDEN * m)


def m2po_keep_mask(
    log_ratio: torch.Tensor,
    valid: torch.Tensor,
    threshold: float = PAPER_M2_THRESHOLD,
    *,
    sample_id: torch.Tensor | None = None,
) -> torch.Tensor:
    """M2PO's token mask (Alg. 1, arXiv 2510.01161) over one batch, on this process only.

    Let d = log_ratio**2 over the valid tokens and M2 = mean(d). While M2 > threshold the
    largest d is dropped and M2 recomputed over the rest; the result marks the tokens that
    stay in the loss. Of equal d, the token with the smaller key (sample id, position in
    the response) goes first. Vectorised: one reduction, then `topk` + suffix sums, no sort of
    the whole batch and no loop over tokens. No gradient flows through the mask.

    Args:
        log_ratio: (B, T) log pi_theta - log pi_behav, any float dtype (the search runs in
            float32 with float64 sums).
        valid: (B, T) bool (or 0/1), True on response tokens; padding is ignored
            whatever its log_ratio holds (NaN included).
        threshold: tau >= 0 (paper: 0.04). 0 keeps exactly the tokens with log_ratio == 0;
            inf keeps every finite token. Negative or NaN raises ValueError.
        sample_id: (B,) int, each row's id in [0, 2**39) (the rollout batch's
            `sample_id`), unique in the batch: then the mask of a token depends only on
            the values and keys of the batch's tokens, not on the row order or the
            padding width. None: the row index in this batch stands in for it.

    Returns:
        (B, T) bool, True for tokens that stay in the loss; always False on padding.

    Defined edge cases:
        - Ties at the cut: only as many tokens of the cut's value go as the bound needs,
          those with the smallest keys (Alg. 1 drops one token at a time). So the count
          is minimal: putting any one dropped token back breaks the bound. Rows with
          the same sample id share keys; tokens of one key at the cut go together.
        - No valid tokens: all False. M2 already <= threshold: keep every valid token.
        - Every token above threshold: dropping continues; when no non-empty set is
          within the bound, every token is dropped (the loss is then 0 with zero grad).
        - NaN or +-inf log_ratio on a valid token: the token is dropped, as the largest
          possible d, and the search runs over the finite tokens; nothing raises, so one
          bad log-prob cannot stop a run (the loss reports them as
          `policy/nonfinite_tokens`).
    """
    return _m2po_cut(log_ratio, valid, float(threshold), LOCAL, sample_id)[0]


def m2po_keep_mask_global(
    log_ratio: torch.Tensor,
    valid: torch.Tensor,
    threshold: float = PAPER_M2_THRESHOLD,
    group=None,
    *,
    sample_id: torch.Tensor | None = None,
    return_stats: bool = False,
):
    """`m2po_keep_mask` over the union of the batches of every rank in `group`.

    Each rank passes its own shard (any number of rows, possibly none valid) and gets
    back the mask of its shard; the kept set equals `m2po_keep_mask` on the concatenated
    batch. With `sample_id` (each rank its rows' ids, unique over the ranks) the mask of a
    token does not depend on which rank holds its row or where; without, ties at the cut
    are broken by the row's place in the ranks' batches concatenated in rank order.
    Cost: one all-reduce of 4 float64 scalars and, only when the batch exceeds the
    threshold, an all-gather of each rank's top-m d (m = max(4096, N/256) in the first
    round, N the global token count), and, only when tokens of the cut's value are split
    by it, an all-gather of each rank's n smallest keys of that value (n of them go).
    Every rank of `group` must call it. Without torch.distributed it is
    `m2po_keep_mask`.

    With gradient accumulation, call it once per optimizer minibatch on log-ratios from
    a no-grad forward of the whole local minibatch, then pass slices of the mask to
    `compute_policy_loss(..., keep_mask=...)` for each micro-batch.

    Exactness: the kept set matches the single-process one except when the kept mean
    equals the threshold to within float64 rounding of the sum (the ranks sum in a
    different order than one process does).

    Returns:
        keep (B, T) bool; with `return_stats`, also a dict of global 0-d float32 tensors
        `m2po/m2_before`, `m2po/m2_after`, `m2po/kept_tokens`, `m2po/masked_tokens`,
        `m2po/masked_frac`, `m2po/tied_kept_frac` (one more all-reduce of 4 scalars).
    """
    keep, s = _m2po_cut(log_ratio, valid, float(threshold), group, sample_id)
    if not return_stats:
        return keep
    lr = log_ratio.detach().float()
    kept = torch.stack(
        [
            torch.where(keep, lr * lr, 0.0).sum(dtype=torch.float64),
            torch.count_nonzero(keep).double(),
            torch.count_nonzero(valid).double(),
            torch.tensor(float(s["tied_kept"]), dtype=torch.float64, device=keep.device),
        ]
    )
    kept_sum, n_kept, n_valid, tied_kept = all_reduce_sum(kept, group).tolist()
    nan = float("nan")
    stats = {
        keys.M2_BEFORE: s["sum"] / s["n"] if s["n"] else nan,
        keys.M2_AFTER: kept_sum / n_kept if n_kept else nan,
        keys.KEPT_TOKENS: n_kept,
        keys.MASKED_TOKENS: n_valid - n_kept,
        keys.MASKED_FRAC: (n_valid - n_kept) / n_valid if n_valid else nan,
        keys.TIED_KEPT_FRAC: tied_kept / n_valid if n_valid else nan,
    }
    device = log_ratio.device
    return keep, {k: torch.tensor(v, dtype=torch.float32, device=device) for k, v in stats.items()}


@torch.no_grad()
def m2po_official_tau(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    m2_threshold: float = PAPER_M2_THRESHOLD,
    group=None,
    *,
    solver: str = "exact",
) -> float:
    """The official M2PO code's clip radius tau_c, over every rank of `group`.

    Only "harmful" tokens count: (A > 0 and r > 1) or (A < 0 and r < 1). With d their
    squared log-ratios and n their number, tau_c solves sum_i min(d_i, tau_c^2) =
    m2_threshold * n; the loss then clips the ratio to [exp(-tau_c), exp(tau_c)].

    Args:
        log_ratio, advantages, valid: (B, T); advantages already broadcast per token.
        m2_threshold: the M2 budget (official code: 0.04), >= 0.
        group: process group for the global form; None is the default group (a no-op
            without torch.distributed). Pass a group of one rank for a local value.
        solver: "exact" solves the equation exactly (piecewise linear in tau_c^2);
            "breakpoint" reproduces the official code, which rounds tau_c^2 down to the
            largest d_i at which the capped sum is still within budget.

    Returns:
        tau_c as a python float; inf when there is no harmful token or their M2 is
        already within budget.
    """
    if solver not in ("exact", "breakpoint"):
        raise ValueError(f"solver must be 'exact' or 'breakpoint'; got {solver!r}")
    _check_inputs(log_ratio, valid, float(m2_threshold), "m2_threshold")
    budget = float(m2_threshold)
    lr = log_ratio.detach().float()
    adv = advantages.detach()
    harmful = valid.bool() & torch.isfinite(lr) & (((adv > 0) & (lr > 0)) | ((adv < 0) & (lr < 0)))
    d = torch.where(harmful, lr * lr, _NOT_A_CANDIDATE)
    sums = torch.stack(
        [
            d.clamp_min(0).sum(dtype=torch.float64),
            torch.count_nonzero(harmful).double(),
            torch.count_nonzero(d > _largest_f32_at_most(budget)).double(),
        ]
    )
    total, n, n_above = all_reduce_sum(sums, group).tolist()
    target = budget * n
    if n == 0 or total <= target:
        return math.inf

    # Capping the k largest at c in [u_{k+1}, u_k] gives rest_k + k*c (u descending,
    # rest_k the sum of all but the k largest, u_{n+1} = 0). The cap is >= budget, so
    # k <= n_above and u_{k+1} is in the top n_above + 1.
    n, bound = int(n), min(int(n), int(n_above) + 1)
    m = min(bound, max(_FIRST_TOP, n // _FIRST_TOP_FRACTION))
    while True:
        top, rest = _global_top(d, m, n, group)  # (m,) descending, (m + 1,)
        nxt = torch.cat([top[1:], top.new_zeros(1)])  # u_{k+1}; 0 past the last token
        k = torch.arange(1, m + 1, device=top.device, dtype=torch.float64)
        ok = rest[1:] + k * nxt <= target
        if m < n:
            ok[-1] = False  # u_{m+1} is not known yet
        i = _first_true(ok)
        if i is not None:
            if solver == "breakpoint":
                cap = nxt[i].item()
            else:
                cap = (target - rest[i + 1].item()) / (i + 1)
            return math.sqrt(max(cap, 0.0))
        if m >= bound:
            return math.sqrt(budget)  # only float64 rounding gets here
        m = min(bound, _WIDEN * m)
