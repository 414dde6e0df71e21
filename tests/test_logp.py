"""Chunked log-probs (m2po_rllib/torch/logp.py) against the full-logits path of rl_module.py."""

from __future__ import annotations

import pytest
import torch

from _references import plain_truncated_logp
from _tolerance import accumulation_rtol, decoder_rtol
from m2po_rllib.models.tiny import tiny_qwen2_config
from m2po_rllib.torch.logp import chunked_logp_entropy, response_logp
from m2po_rllib.torch.logp import response_logp_and_entropy

V, PAD = 211, 0
PROMPT_LENS = (5, 3, 1)  # left-padded to P = 5
RESPONSE_LENS = (7, 4, 2)  # right-padded to R = 7


def tiny_model(tied: bool, dtype=torch.float32, seed: int = 0, vocab_size: int = V):
    from transformers import Qwen2ForCausalLM

    config = tiny_qwen2_config(vocab_size, hidden_size=64, intermediate_size=128, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(dtype)
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert model.lm_head.weight is not model.model.embed_tokens.weight
    return model


def rtol(model) -> float:
    """Rounding bound of two orders of the same float32 computation on `padded_batch`."""
    return decoder_rtol(model.config, tokens=len(PROMPT_LENS) * (max(PROMPT_LENS) + max(RESPONSE_LENS)))


def padded_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    P, R = max(PROMPT_LENS), max(RESPONSE_LENS)
    ids = torch.randint(1, V, (len(PROMPT_LENS), P + R), generator=g)
    attn = torch.zeros_like(ids)
    response_mask = torch.zeros(len(PROMPT_LENS), R)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
        attn[i, P - p : P + r] = 1
        response_mask[i, :r] = 1
    ids = ids.masked_fill(attn == 0, PAD)
    return {"input_ids": ids, "attention_mask": attn, "response_mask": response_mask}


def old_logp(model, batch, temperature, with_entropy=True):
    return response_logp_and_entropy(
        model, batch["input_ids"], batch["attention_mask"], batch["response_mask"].shape[1],
        temperature=temperature, with_entropy=with_entropy,
    )


def pg_loss(logp, batch, seed: int = 1):
    """A token-mean policy-gradient-like loss with random per-token weights."""
    g = torch.Generator().manual_seed(seed)
    mask = batch["response_mask"]
    weights = torch.randn(mask.shape, generator=g)
    return -(logp * weights * mask).sum() / mask.sum()


def grads(model, logp_fn):
    model.zero_grad(set_to_none=True)
    logp, _ = logp_fn()
    pg_loss(logp, padded_batch()).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def max_rel_diff(a: dict, b: dict) -> float:
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max()).item() for n in b)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 1000])  # 21 positions: 4 does not divide them
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_full_logits_path(tied, chunk_size, temperature):
    model = tiny_model(tied)
    batch = padded_batch()
    ref_logp, ref_ent = old_logp(model, batch, temperature)
    logp, ent = response_logp(model, batch, temperature, chunk_size=chunk_size)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == (3, 7)
    tol = rtol(model)
    # log-probs and entropies are O(5) here: relative and absolute bounds alike
    torch.testing.assert_close(logp, ref_logp.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(ent, ref_ent.detach(), rtol=tol, atol=tol)
    assert not ent.requires_grad  # a diagnostic: no gradient through the entropy

    ref = grads(model, lambda: old_logp(model, batch, temperature, with_entropy=False))
    new = grads(model, lambda: response_logp(model, batch, temperature, chunk_size, with_entropy=False))
    assert set(new) == {n for n, _ in model.named_parameters()}
    assert max_rel_diff(new, ref) < tol
    # the head's weight got the softmax gradient: a wrong chunked backward would not pass
    assert ref["lm_head.weight" if not tied else "model.embed_tokens.weight"].abs().max() > 0


def test_tied_head_weight_gets_both_gradients():
    """With tied embeddings the one parameter collects the embedding's and the head's
    gradient; dropping the head's part (e.g. by detaching the weight) would change it."""
    model = tiny_model(tied=True)
    batch = padded_batch()
    ref = grads(model, lambda: old_logp(model, batch, 1.0))["model.embed_tokens.weight"]
    new = grads(model, lambda: response_logp(model, batch, 1.0, 5))["model.embed_tokens.weight"]
    assert ((new - ref).abs().max() / ref.abs().max()).item() < rtol(model)
    # rows of tokens that never occur in the input get gradient only through the head
    unused = torch.ones(V, dtype=torch.bool)
    unused[batch["input_ids"].unique()] = False
    assert new[unused].abs().max() > 0


def test_bias_and_weight_inputs():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=True)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    targets = torch.randint(0, 50, (2, 9))
    logp, ent = chunked_logp_entropy(hidden, head, targets, temperature=1.3, chunk_size=4)
    ref_lp = (head(hidden) / 1.3).log_softmax(-1)
    tol = accumulation_rtol(torch.float32, 16, 50, 2 * 9)  # hidden, vocabulary, positions
    torch.testing.assert_close(logp, ref_lp.gather(-1, targets[..., None]).squeeze(-1), rtol=tol, atol=tol)
    torch.testing.assert_close(ent, -(ref_lp.exp() * ref_lp).sum(-1), rtol=tol, atol=tol)
    g = torch.randn(2, 9)
    ref_grads = torch.autograd.grad((ref_lp.gather(-1, targets[..., None]).squeeze(-1) * g).sum(), [hidden, head.weight, head.bias])
    new_grads = torch.autograd.grad((logp * g).sum(), [hidden, head.weight, head.bias])
    for a, b in zip(new_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())
    # the weight tensor with an explicit bias is the same computation
    logp2, ent2 = chunked_logp_entropy(hidden, head.weight, targets, 1.3, 5, with_entropy=False, bias=head.bias)
    torch.testing.assert_close(logp2, logp, rtol=tol, atol=tol)
    assert ent2 is None


def test_bf16_close_to_fp32_and_to_the_bf16_full_logits_path():
    batch = padded_batch()
    fp32 = tiny_model(tied=True)
    bf16 = tiny_model(tied=True, dtype=torch.bfloat16)
    ref32, _ = response_logp(fp32, batch, 0.7, 4, with_entropy=False)
    ref16, ent16_ref = old_logp(bf16, batch, 0.7)
    logp16, ent16 = response_logp(bf16, batch, 0.7, 4)
    assert logp16.dtype == torch.float32  # fp32 softmax on bf16 weights
    valid = batch["response_mask"].bool()
    # bf16 weights: ~3 significant digits per matmul; log-probs here are ~ -5.4
    torch.testing.assert_close(logp16[valid], ref32[valid].detach(), rtol=0, atol=0.1)
    torch.testing.assert_close(logp16, ref16.detach(), rtol=0, atol=2e-2)
    torch.testing.assert_close(ent16, ent16_ref.detach(), rtol=0, atol=2e-2)
    ref = grads(bf16, lambda: old_logp(bf16, batch, 0.7, with_entropy=False))
    new = grads(bf16, lambda: response_logp(bf16, batch, 0.7, 4, with_entropy=False))
    assert all(g.dtype == torch.bfloat16 for g in new.values())
    assert max_rel_diff(new, ref) < 3e-2


def _largest_saved_non_parameter(model, fn) -> int:
    """numel of the largest tensor autograd saves for backward, parameters excluded."""
    params = {p.data_ptr() for p in model.parameters()}
    largest = [0]

    def pack(t):
        if t.data_ptr() not in params:
            largest[0] = max(largest[0], t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return largest[0]


def test_the_graph_saves_no_batch_by_vocab_tensor():
    vocab = 4096  # large against the decoder's activations, as a real vocabulary is
    model = tiny_model(tied=False, vocab_size=vocab)
    batch = padded_batch()
    B, R = batch["response_mask"].shape
    full = B * R * vocab
    old = _largest_saved_non_parameter(model, lambda: old_logp(model, batch, 0.7))
    new = _largest_saved_non_parameter(model, lambda: response_logp(model, batch, 0.7, 4))
    assert old >= full  # the full-logits path keeps (B, R, V) (and (B, P + R, V)) for backward
    H, P = model.config.hidden_size, batch["input_ids"].shape[1] - R
    # the decoder's own activations (B, P + R, intermediate) bound the new path; nothing scales with V
    assert new <= B * (P + R) * max(H, model.config.intermediate_size) < full


def test_gradient_checkpointing_gives_the_same_gradient():
    model = tiny_model(tied=True)
    batch = padded_batch()
    model.train()
    ref = grads(model, lambda: response_logp(model, batch, 1.0, 4, with_entropy=False))
    model.gradient_checkpointing_enable()
    new = grads(model, lambda: response_logp(model, batch, 1.0, 4, with_entropy=False))
    assert max_rel_diff(new, ref) < rtol(model)


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_bad_chunk_size_is_rejected(bad):
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_logp_entropy(torch.zeros(1, 2, 4), torch.zeros(5, 4), torch.zeros(1, 2, dtype=torch.long), chunk_size=bad)


# -- truncated sampling (top-k / top-p) replayed -------------------------------------------
def sampled_in_nucleus(model, temperature, top_k, top_p, seed=0):
    """A padded batch whose response tokens are drawn from the model's own truncated
    distribution (so every target is kept), token by token."""
    batch = padded_batch(seed)
    P = max(PROMPT_LENS)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in range(max(RESPONSE_LENS)):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           position_ids=(batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)).logits
            for i in range(len(PROMPT_LENS)):
                if batch["response_mask"][i, t] > 0:
                    logp = plain_truncated_logp(logits[i, P + t - 1] / temperature, top_k, top_p)
                    batch["input_ids"][i, P + t] = torch.multinomial(logp.exp(), 1, generator=g).item()
    return batch


@pytest.mark.parametrize("top_k, top_p", [(20, 1.0), (0, 0.9), (20, 0.9), (1, 1.0)])
@pytest.mark.parametrize("chunk_size", [4, 1000])
def test_truncated_logp_and_gradient_are_those_of_the_kept_distribution(top_k, top_p, chunk_size):
    model = tiny_model(tied=False)
    temperature = 0.8
    batch = sampled_in_nucleus(model, temperature, top_k, top_p)
    logp, ent = response_logp(model, batch, temperature, chunk_size, top_k=top_k, top_p=top_p)

    P, mask = max(PROMPT_LENS), batch["response_mask"] > 0
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=(batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)).logits
    tol = rtol(model)
    for i, t in mask.nonzero().tolist():
        plain = plain_truncated_logp(logits[i, P + t - 1] / temperature, top_k, top_p)
        assert logp[i, t].item() == pytest.approx(plain[batch["input_ids"][i, P + t]].item(), rel=tol, abs=tol)
        kept = plain > float("-inf")
        plain_entropy = -(plain[kept].exp() * plain[kept]).sum()
        assert ent[i, t].item() == pytest.approx(plain_entropy.item(), rel=tol, abs=tol)
    if top_k == 1:  # one token kept: every log-prob is 0 and carries no gradient
        assert logp[mask].abs().max() == 0
    else:
        untruncated, _ = response_logp(model, batch, temperature, chunk_size)
        assert (logp[mask] - untruncated[mask]).min() > 1e-3  # renormalised: above the full softmax's

    ref = grads(model, lambda: response_logp_and_entropy(
        model, batch["input_ids"], batch["attention_mask"], batch["response_mask"].shape[1],
        temperature=temperature, with_entropy=False, top_k=top_k, top_p=top_p))
    new = grads(model, lambda: response_logp(model, batch, temperature, chunk_size, with_entropy=False,
                                             top_k=top_k, top_p=top_p))
    if top_k == 1:
        assert all(g.abs().max() == 0 for g in new.values())
    else:
        assert max_rel_diff(new, ref) < rtol(model)


def test_a_target_outside_the_kept_tokens_has_log_prob_minus_inf():
    """The current weights would never sample it: ratio 0, which the losses drop as a
    non-finite token. Exactly the targets outside the plain rule's top 5 are -inf."""
    model = tiny_model(tied=False)
    batch = padded_batch()  # random targets: most fall outside a top-5 nucleus
    logp, _ = response_logp(model, batch, 1.0, 4, top_k=5)
    P, mask = max(PROMPT_LENS), batch["response_mask"] > 0
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=(batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)).logits
    expected = torch.zeros_like(mask)
    for i, t in mask.nonzero().tolist():
        expected[i, t] = torch.isneginf(plain_truncated_logp(logits[i, P + t - 1], 5, 1.0)[batch["input_ids"][i, P + t]])
    assert expected.any() and (~expected & mask).any()  # the batch has both kinds
    assert torch.equal(torch.isneginf(logp) & mask, expected)


def test_an_fp32_head_projects_the_bf16_hidden_states_in_fp32():
    """`head_dtype=float32` with a bf16 compute dtype: the decoder under bf16 autocast, then the
    head (the fp32 master weights) and the softmax in fp32, as vLLM's fp32 head does; the
    gradient reaches the master weights. A bf16 head gives other values."""
    from m2po_rllib.torch.logp import response_hidden_states

    batch, T = padded_batch(), 0.7
    model = tiny_model(tied=False)  # float32 master weights
    R = batch["response_mask"].shape[1]
    model.zero_grad(set_to_none=True)
    logp, _ = response_logp(model, batch, T, 4, with_entropy=False, compute_dtype=torch.bfloat16,
                            head_dtype=torch.float32)
    pg_loss(logp, batch).backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.dtype == torch.float32
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = response_hidden_states(model, batch["input_ids"], batch["attention_mask"], R)
    with torch.no_grad():
        hidden, weight = hidden.float(), model.lm_head.weight
        logits = hidden @ weight.T / T
        targets = batch["input_ids"][:, -R:]
        ref = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
        # fp32 matmuls over H and a log-softmax over V in another order: log-probs differ by at
        # most twice a logit's rounding, gamma_(H + V) times the sum of |h_k w_k| / T
        bound = 2 * accumulation_rtol(torch.float32, hidden.shape[-1], V) * ((hidden.abs() @ weight.abs().T) / T).max()
    valid = batch["response_mask"].bool()
    torch.testing.assert_close(logp.detach()[valid], ref[valid], rtol=0, atol=float(bound))
    bf16_head, _ = response_logp(model, batch, T, 4, with_entropy=False, compute_dtype=torch.bfloat16)
    assert (bf16_head.detach() - logp.detach())[valid].abs().max() > 10 * bound  # the setting changes the head
