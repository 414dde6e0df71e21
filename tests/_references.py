"""Plainly written references that more than one test module checks the package against."""

from __future__ import annotations

import torch


def plain_truncated_logp(logits_row: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """log-probs (V,) of one temperature-scaled logits row under vLLM's truncation rule,
    written out: keep the logits >= the k-th largest, then drop (ascending) every token whose
    cumulative probability over the kept ones is <= 1 - top_p, keeping the most likely."""
    row = logits_row.clone()
    if top_k > 0:
        row[row < row.sort(descending=True).values[top_k - 1]] = float("-inf")
    if top_p < 1:
        order = row.argsort()  # ascending
        cum = row[order].softmax(-1).cumsum(-1)
        for rank, idx in enumerate(order[:-1].tolist()):
            if cum[rank] <= 1 - top_p:
                row[idx] = float("-inf")
    return row.log_softmax(-1)


def plain_m2po_keep(log_ratio: torch.Tensor, valid: torch.Tensor, tau: float, sample_id=None) -> torch.Tensor:
    """M2PO Alg. 1 (arXiv 2510.01161) as a slow loop: drop the largest d = (log r)^2 one
    token at a time, recomputing the mean of the rest, until it is <= tau; of equal d the
    token with the smaller key (sample id, position) goes first, the row index standing in
    for the sample id when there is none. Non-finite log-ratios are dropped first. d is
    squared in float32, as the mask squares it."""
    import math

    B, T = valid.shape
    ids = list(range(B)) if sample_id is None else [int(i) for i in sample_id]
    lr = log_ratio.float()
    d = (lr * lr).tolist()
    kept = {
        (b, t) for b in range(B) for t in range(T) if bool(valid[b, t]) and math.isfinite(d[b][t])
    }
    while kept and math.fsum(d[b][t] for b, t in kept) / len(kept) > tau:
        kept.remove(min(kept, key=lambda bt: (-d[bt[0]][bt[1]], ids[bt[0]], bt[1])))
    out = torch.zeros(B, T, dtype=torch.bool)
    for b, t in kept:
        out[b, t] = True
    return out
