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
