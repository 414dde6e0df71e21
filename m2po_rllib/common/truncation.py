"""Truncated sampling (top-k, top-p): one rule for the engine that samples and the learner
that replays it. Pure torch, no Ray: the HF engine (`rollout/hf_engine.py`), the learner's
log-probs (`torch/logp.py`) and the plain reference (`torch/rl_module.py`) all call it.

With truncation the engine samples from, and reports log-probs of, the distribution
restricted to the kept tokens and renormalised over them:

    pi_trunc(a) = pi(a) / sum_{b kept} pi(b)   if a is kept, else 0

so the learner must compute its log-probs under the same restriction, or every
importance ratio is off by the kept mass even on-policy. The kept set is that of vLLM's
`apply_top_k_top_p_pytorch` (vllm/v1/sample/ops/topk_topp_sampler.py: what vLLM runs on
CPU; on GPU with Triton it runs a pivot-based kernel meant to keep the same set, where a
token on the boundary may fall differently), applied to the temperature-scaled logits,
top-k first:
- top-k: keep every token whose logit is >= the k-th largest (ties at the k-th value
  are all kept);
- top-p: over the top-k-restricted distribution, sort ascending, drop every token whose
  cumulative probability is <= 1 - top_p, always keep the most likely one.
A token the learner's weights drop has log-prob -inf: its ratio is 0 (the current policy
would never sample it), which the losses treat as a non-finite, unusable token.
"""

from __future__ import annotations

import torch

# `top_k` values that disable top-k (vLLM accepts both).
TOP_K_OFF = (0, -1)


def is_truncated(top_k: int, top_p: float) -> bool:
    """True when `top_k` / `top_p` restrict the sampling distribution."""
    return top_k not in TOP_K_OFF or top_p < 1.0


def dropped_tokens(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor | None:
    """The (n, V) bool mask of the tokens that `top_k` / `top_p` drop from temperature-scaled
    `logits` (n, V), or None when nothing is truncated. `logits` is not modified.

    Step for step vLLM's PyTorch rule (what it runs on CPU and without FlashInfer), so
    tied logits fall the same way: top-k alone by a threshold (`apply_top_k_only`), top-p
    (with or without top-k) on one ascending sort of the logits (`apply_top_k_top_p_pytorch`).
    """
    if not is_truncated(top_k, top_p):
        return None
    vocab = logits.shape[-1]
    use_k = top_k not in TOP_K_OFF and top_k < vocab
    if top_p >= 1.0:
        if not use_k:
            return torch.zeros_like(logits, dtype=torch.bool)
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (n, 1): the k-th largest
        return logits < kth
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if use_k:
        kth = sorted_logits[:, vocab - top_k : vocab - top_k + 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cum = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
    # 1 - p in float32, as vLLM computes it from its float32 `p` (0.100000024 at top_p=0.9,
    # where float64 would give 0.1000000015): a token on that boundary falls the same way
    drop_sorted = cum <= 1 - torch.tensor(top_p, dtype=torch.float32, device=cum.device)
    drop_sorted[:, -1] = False
    if use_k:
        drop_sorted |= torch.isneginf(sorted_logits)
    return torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)


def truncate_logits_(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Sets the dropped tokens of `logits` (n, V) to -inf in place; returns `logits`."""
    drop = dropped_tokens(logits, top_k, top_p)
    return logits if drop is None else logits.masked_fill_(drop, float("-inf"))
