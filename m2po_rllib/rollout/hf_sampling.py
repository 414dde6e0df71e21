"""The HF engine's per-token rules: one token per row by the sampling settings (with the
log-prob it was drawn with), and where a stop string ends a sample; `generate` and the
continuous batch (`hf_stream.py`) both sample with them."""

from __future__ import annotations

import torch

from m2po_rllib.common.truncation import truncate_logits_
from m2po_rllib.rollout.engine import SamplingConfig


def sample_next(
    logits: torch.Tensor,
    sampling: SamplingConfig,
    generators: list[torch.Generator | None],
    rows: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples one token per row of `logits` (B, V); returns `(tokens, behavior_logp)`, both (B,).

    Only `rows` draw noise (each from its own generator, so a sample's random stream does not
    depend on the rest of the batch); the other rows get a don't-care token.
    """
    logits = logits.float()
    if sampling.temperature == 0:
        tokens = logits.argmax(dim=-1)
        logp = logits.log_softmax(dim=-1)
    else:
        scaled = truncate_logits_(logits / sampling.temperature, sampling.top_k, sampling.top_p)
        logp = scaled.log_softmax(dim=-1)  # (B, V); -inf outside the kept tokens
        # Exponential race (= Gumbel-max): argmax p / q with q ~ Exp(1) samples from p.
        noise = torch.ones_like(logp)
        for row in rows:
            noise[row].exponential_(generator=generators[row])
        tokens = (logp.exp() / noise).argmax(dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def find_stop(text: str, stop: list[str]) -> int | None:
    """Index where the earliest-completing stop string in `text` starts (vLLM's tie rule:
    earliest end, then list order), or None."""
    best_end, best_start = None, None
    for s in stop:
        start = text.find(s)
        if start != -1 and (best_end is None or start + len(s) < best_end):
            best_end, best_start = start + len(s), start
    return best_start
