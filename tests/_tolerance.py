"""Float tolerances derived from the dtype and the number of terms a result accumulates.

Two code paths that compute the same quantity in a different order (chunked vs full logits,
micro-batched vs whole minibatch, two learners vs one) differ by rounding alone, and by how
much depends on the CPU's kernels (blocking, FMA, vector width), not on the code: a bound
set from what passed on one machine fails on the next. Recursive summation of n terms with
unit roundoff u (eps / 2) errs by at most gamma_n = n u / (1 - n u) relative to sum |x_i|
(Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 4.4); a chain of
reductions (each matmul's inner dimension, the softmax over the vocabulary, the tokens a
weight's gradient sums over) adds their lengths. The tests compare tensors relative to their
largest entry, where this worst-case bound holds with a wide margin on every machine, while a
real fault (a lost gradient term, a wrong chunk boundary) errs by O(1).
"""

from __future__ import annotations

import torch


def accumulation_rtol(dtype: torch.dtype, *lengths: int) -> float:
    """gamma_n for n = the sum of the reduction `lengths` the compared values went through."""
    n = sum(int(length) for length in lengths)
    u = torch.finfo(dtype).eps / 2
    if n * u >= 1:
        raise ValueError(f"{n} accumulated terms in {dtype}: no useful bound (n u = {n * u:.2f} >= 1)")
    return n * u / (1 - n * u)


def decoder_rtol(config, tokens: int, dtype: torch.dtype = torch.float32) -> float:
    """The bound for a causal LM's log-probs and parameter gradients over `tokens` positions:
    per layer the attention (over the positions and the head dimension) and the MLP (hidden,
    intermediate), then the head's softmax over the vocabulary, and the gradient's sum over
    the positions."""
    per_layer = tokens + config.hidden_size + 2 * config.intermediate_size
    return accumulation_rtol(dtype, config.num_hidden_layers * per_layer, config.vocab_size, tokens)
