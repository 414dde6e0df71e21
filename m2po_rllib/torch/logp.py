"""Memory-bounded per-token log-probs and entropy of the response tokens of a causal LM.

The plain way (`logits = model(...).logits`, `log_softmax`, `gather`) holds float32 logits
for every position of the batch, (B, P + R, V), plus their log-softmax and the autograd
copies: at Qwen's vocabulary (V = 151,936) and 64 x 3,072 response tokens that is ~119 GB
per copy. Here the decoder runs alone (no logits for prompt positions) and the LM head,
the softmax and the target gather run chunk by chunk of positions inside one autograd
Function that saves only its inputs (hidden states, head weight, targets) and each
position's log-normaliser, and recomputes each chunk's logits in backward: the selective
log-softmax of TRL and verl with a backward of its own, so the extra memory is
O(chunk_size x V) float32 in forward and in backward, whatever the micro-batch (plus, in
backward, one float32 (V, H) accumulator for the head's gradient).

Logits are computed in the head's dtype (bf16 weights stay bf16 in the matmul), then
cast to float32 for the softmax, as the full-logits path does. The entropy is a
diagnostic: it is returned without gradient.

Truncated sampling (`top_k`, `top_p`) is replayed: each position's distribution is
restricted to the tokens the engine's rule keeps (`m2po_rllib.common.truncation`, applied to the
learner's own logits) and renormalised over them, in forward and in backward (the kept
set is recomputed with the chunk's logits), so an on-policy ratio is 1. A target outside
the kept set has log-prob -inf.
"""

from __future__ import annotations

from typing import Any

import torch

from m2po_rllib.common.truncation import dropped_tokens, truncate_logits_

DEFAULT_CHUNK_SIZE = 256


def response_hidden_states(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
) -> torch.Tensor:
    """The decoder's last hidden states at the positions that predict the response tokens.

    Batch layout as `HFCausalLMModule` (prompt left-padded, response right-padded), so
    response token t is predicted by position `prompt_len - 1 + t`. Position ids count
    only attended tokens, as the rollout engines' do.

    Returns (B, R, H) in the model's dtype.
    """
    if not 0 < response_len < input_ids.shape[1]:
        raise ValueError(
            f"response_len ({response_len}) must be in [1, {input_ids.shape[1] - 1}] for "
            f"input_ids of shape {tuple(input_ids.shape)}: at least one prompt token predicts the first response token"
        )
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden = model.get_decoder()(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state  # (B, P + R, H)
    prompt_len = input_ids.shape[1] - response_len
    return hidden[:, prompt_len - 1 : -1, :]  # (B, R, H)


class _ChunkBuffers:
    """The buffers one call reuses for every chunk: float32 (n, V) logits; in forward a
    float32 (n, V) work buffer; and, when the head is not float32, (n, V) and (in backward)
    (V, H) ones in its dtype for the matmuls. Reuse matters on CPU, where each fresh (n, V)
    tensor is a new mmap and its page faults."""

    def __init__(self, rows, weight, backward: bool):
        V, low = weight.shape[0], weight.dtype != torch.float32
        self.logits = weight.new_empty(rows, V, dtype=torch.float32)
        self.work = None if backward else weight.new_empty(rows, V, dtype=torch.float32)
        self.low = weight.new_empty(rows, V) if low else None
        self.low_weight_grad = torch.empty_like(weight) if low and backward else None

    def logits_of(self, h, weight, bias, temperature):
        """float32 logits / temperature of one chunk (n, V), computed in the weight's dtype."""
        n = h.shape[0]
        out = self.logits[:n]
        if self.low is None:
            torch.mm(h, weight.t(), out=out)
            if bias is not None:
                out.add_(bias)
        else:
            low = torch.mm(h, weight.t(), out=self.low[:n])
            if bias is not None:
                low.add_(bias)
            out.copy_(low)
        return out.div_(temperature) if temperature != 1.0 else out


class _ChunkedLogp(torch.autograd.Function):
    """log softmax((h W^T + b) / temperature)[target] over chunks of flattened positions."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, with_entropy, top_k, top_p):
        # hidden (N, H), targets (N,)
        n_pos = hidden.shape[0]
        logp = hidden.new_empty(n_pos, dtype=torch.float32)
        lse = hidden.new_empty(n_pos, dtype=torch.float32)  # kept for backward: N floats
        entropy = hidden.new_empty(n_pos, dtype=torch.float32) if with_entropy else None
        bufs = _ChunkBuffers(min(chunk_size, n_pos), weight, backward=False)
        for start in range(0, n_pos, chunk_size):
            end = min(start + chunk_size, n_pos)
            logits = bufs.logits_of(hidden[start:end], weight, bias, temperature)  # (n, V)
            drop = dropped_tokens(logits, top_k, top_p)  # None without truncation
            if drop is not None:
                logits.masked_fill_(drop, float("-inf"))
            top = logits.amax(-1, keepdim=True)  # (n, 1), finite: one token is always kept
            unnormalised = torch.sub(logits, top, out=bufs.work[: end - start]).exp_()  # (n, V)
            total = unnormalised.sum(-1, keepdim=True)
            chunk_lse = (top + total.log()).squeeze(-1)  # (n,)
            lse[start:end] = chunk_lse
            logp[start:end] = logits.gather(-1, targets[start:end, None]).squeeze(-1) - chunk_lse
            if with_entropy:  # H = lse - E_p[logits] (dropped tokens: p = 0, no -inf * 0)
                finite_logits = logits if drop is None else logits.masked_fill_(drop, 0.0)
                mean_logit = unnormalised.mul_(finite_logits).sum(-1) / total.squeeze(-1)
                entropy[start:end] = chunk_lse - mean_logit
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.truncation = (top_k, top_p)
        if with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_logp = grad_logp.float()
        grad_hidden = torch.empty_like(hidden) if need_h else None
        # float32 accumulators across chunks (one V x H buffer); cast to the weight's dtype at the end
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        bufs = _ChunkBuffers(min(chunk_size, hidden.shape[0]), weight, backward=True)
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            h = hidden[start:end]
            logits = bufs.logits_of(h, weight, bias, temperature)  # (n, V)
            drop = dropped_tokens(logits, *ctx.truncation)  # the forward's kept set
            if drop is not None:  # softmax over the kept tokens: 0 elsewhere
                logits.masked_fill_(drop, float("-inf"))
            # d logp / d logits = (onehot(target) - softmax) / temperature, in place
            grad_logits = logits.sub_(lse[start:end, None]).exp_().neg_()
            grad_logits.scatter_add_(-1, targets[start:end, None], torch.ones_like(grad_logits[:, :1]))
            grad_logits.mul_((grad_logp[start:end] / temperature)[:, None])
            if need_b:
                grad_bias += grad_logits.sum(0)
            if bufs.low is not None:  # the matmuls run in the weight's dtype, as autograd's would
                grad_logits = bufs.low[: end - start].copy_(grad_logits)
            if need_h:
                torch.mm(grad_logits, weight, out=grad_hidden[start:end])
            if need_w:
                if bufs.low is None:
                    grad_weight.addmm_(grad_logits.t(), h)
                else:  # a (V, H) product in the weight's dtype, summed in float32
                    grad_weight += torch.mm(grad_logits.t(), h, out=bufs.low_weight_grad)
        del bufs
        if need_w:
            grad_weight = grad_weight.to(weight.dtype)
        if need_b:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def chunked_logp_entropy(
    hidden: torch.Tensor,
    lm_head: torch.nn.Linear | torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = True,
    bias: torch.Tensor | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-prob of `targets` (and entropy) under softmax(lm_head(hidden) / T),
    restricted to the `top_k` / `top_p` kept tokens when those truncate.

    Args:
        hidden: (B, R, H) hidden states that predict the targets.
        lm_head: the output projection (an `nn.Linear`), or its weight (V, H) with `bias`.
            A head tied to the input embedding is fine: its gradient reaches the shared
            parameter through autograd like any other use of it.
        targets: (B, R) token ids.
        temperature: logits are divided by it before the softmax (the sampling distribution).
        chunk_size: positions per chunk over the flattened (B * R) positions; the extra
            memory is ~2 x chunk_size x V x 4 bytes at a time (+ V x H x 4 in backward).
        with_entropy: also return the per-token entropy (float32, no gradient).
        top_k, top_p: the sampling truncation to replay (`m2po_rllib.common.truncation`); the
            defaults keep every token.

    Returns:
        (logp, entropy): (B, R) float32 each; entropy None unless `with_entropy`.
    """
    if isinstance(lm_head, torch.nn.Linear):
        weight, bias = lm_head.weight, lm_head.bias
    else:
        weight = lm_head
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise ValueError(f"chunk_size ({chunk_size!r}) must be a positive int of positions per chunk, e.g. 256")
    if not temperature > 0:
        raise ValueError(f"temperature ({temperature}) must be > 0")
    if hidden.dim() != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be (B, R, H) and targets {tuple(targets.shape)} (B, R)"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(f"lm_head weight {tuple(weight.shape)} must be (V, H={hidden.shape[2]})")
    B, R, H = hidden.shape
    logp, entropy = _ChunkedLogp.apply(
        hidden.reshape(B * R, H),
        weight,
        bias,
        targets.reshape(B * R).long(),
        float(temperature),
        chunk_size,
        with_entropy,
        int(top_k),
        float(top_p),
    )
    return logp.view(B, R), (entropy.view(B, R) if with_entropy else None)


def response_logp(
    model: torch.nn.Module,
    batch: dict[str, Any],
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = True,
    compute_dtype: torch.dtype | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
    head_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(logp, entropy)`, (B, R) float32, of a batch's response tokens under `model`
    (sampled at `temperature`, truncated by `top_k` / `top_p`).

    `batch` holds `input_ids`, `attention_mask` (B, P + R) and `response_mask` (B, R), the
    layout of `HFCausalLMModule`. Same values as the full-logits path
    (`response_logp_and_entropy`), with memory bounded by `chunk_size`.
    `compute_dtype` (e.g. bfloat16) runs the decoder under autocast and the head's matmuls
    in that dtype while the parameters (and their gradients, and AdamW's state) stay in
    their own dtype, float32 master weights; the softmax is float32 either way.
    `head_dtype` (float32) runs the head's matmuls in that dtype instead (the decoder's
    hidden states cast up), as the engines do with `model_config["head_dtype"]`.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(
            f"{type(model).__name__}'s output head is {type(head).__name__}; chunked log-probs "
            "need a plain nn.Linear head"
        )
    for name in ("final_logit_softcapping", "logit_scale"):
        if getattr(model.config, name, None) not in (None, 1.0):
            raise ValueError(
                f"{type(model).__name__} has config.{name}={getattr(model.config, name)}: its logits "
                "are not lm_head(hidden), which chunked log-probs assume; use the full-logits path"
            )
    input_ids = batch["input_ids"]
    response_len = batch["response_mask"].shape[1]
    dtype = compute_dtype or head.weight.dtype
    mixed = dtype != head.weight.dtype
    with torch.autocast(device_type=input_ids.device.type, dtype=dtype, enabled=mixed):
        hidden = response_hidden_states(model, input_ids, batch["attention_mask"], response_len)
    targets = input_ids[:, input_ids.shape[1] - response_len :]  # (B, R)
    # the casts are autograd ops: the head's gradient reaches the master weights
    head_dtype = head_dtype or dtype
    weight = head.weight.to(head_dtype)
    bias = None if head.bias is None else head.bias.to(head_dtype)
    return chunked_logp_entropy(
        hidden.to(head_dtype), weight, targets, temperature, chunk_size, with_entropy, bias=bias, top_k=top_k, top_p=top_p
    )


def response_logp_and_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    temperature: float = 1.0,
    with_entropy: bool = True,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob (and entropy) of each response token under `model`, from the full logits
    (B, P + R, V): the plainly written reference that `response_logp` (what the module
    uses) is tested against, and the old path of `bench/bench_learner_memory.py` and
    `bench/gpu_learner_check.py`. Pure torch, as this whole module (no Ray).

    Logits are divided by `temperature` before the softmax: the log-probs are those of
    the distribution the rollout engine sampled from (as verl computes them), restricted
    to the `top_k` / `top_p` kept tokens when those truncate (`m2po_rllib.common.truncation`).
    Returns `(B, R)` tensors, float32.
    """
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).logits
    # Token t of the response is predicted by position t - 1.
    prompt_len = input_ids.shape[1] - response_len
    logits = logits[:, prompt_len - 1 : -1, :].float()  # (B, R, V)
    if temperature != 1.0:
        logits = logits / temperature
    B, R, V = logits.shape
    logits = truncate_logits_(logits.reshape(B * R, V).clone(), top_k, top_p).view(B, R, V)
    log_probs = logits.log_softmax(-1)
    targets = input_ids[:, prompt_len:]
    logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, R)
    entropy = None
    if with_entropy:
        entropy = -(log_probs.exp() * log_probs.masked_fill(log_probs == float("-inf"), 0.0)).sum(-1)
    return logp, entropy
