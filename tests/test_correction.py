"""Rollout corrections (m2po_rllib/losses/correction.py) against plainly written references,
composed with every policy loss, and the mismatch metrics."""

from __future__ import annotations

import math
import re

import pytest
import torch

from m2po_rllib.common import keys
from m2po_rllib.losses import POLICY_LOSSES, compute_policy_loss
from m2po_rllib.losses.correction import ROLLOUT_CORRECTIONS, mismatch_metrics, rollout_correction


def batch(seed=0, B=6, T=9, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for i in range(B):
        valid[i, : 2 + i % (T - 1)] = True
    engine = -torch.rand(B, T, generator=g) * 3
    behav = engine + torch.randn(B, T, generator=g) * spread  # the learner's numerics
    behav[0, 1] = float("-inf")  # a token the learner's truncation drops
    return behav, engine, valid


def reference(name, behav, engine, valid, low, high):
    """One token / one sequence at a time, as the papers write them: (weight, keep, changed)."""
    B, T = valid.shape
    weight, keep = torch.zeros(B, T), torch.zeros(B, T, dtype=torch.bool)
    changed = valid.clone()
    for i in range(B):
        toks = [t for t in range(T) if valid[i, t]]
        log_rhos = {t: (behav[i, t] - engine[i, t]).item() for t in toks}
        if name.endswith("_seq"):
            if not all(math.isfinite(v) for v in log_rhos.values()):
                continue
            total = math.fsum(log_rhos.values())
            rhos = {t: math.exp(total) for t in toks}
        else:
            rhos = {t: math.exp(v) for t, v in log_rhos.items() if math.isfinite(v)}
        for t, rho in rhos.items():
            if name.startswith("tis"):
                keep[i, t], weight[i, t], changed[i, t] = True, min(rho, high), rho > high
            elif rho <= high and (low is None or rho >= low):
                keep[i, t], weight[i, t], changed[i, t] = True, rho, False
    return weight, keep, changed


@pytest.mark.parametrize("name", sorted(ROLLOUT_CORRECTIONS))
@pytest.mark.parametrize("bounds", [(None, None), (0.8, 1.5)])
def test_each_correction_equals_its_reference(name, bounds):
    low, high = bounds
    if name.startswith("tis") and low is not None:
        low = None
    behav, engine, valid = batch(spread=0.6 if name.endswith("token") or name == "icepop" else 0.05)
    spec = ROLLOUT_CORRECTIONS[name]
    ref_low = spec.low if low is None else low
    ref_high = spec.high if high is None else high
    weight, keep, metrics = rollout_correction(name, behav, engine, valid, low=low, high=high)
    ref_weight, ref_keep, changed = reference(name, behav, engine, valid, ref_low, ref_high)
    assert torch.equal(keep, ref_keep)
    torch.testing.assert_close(weight, ref_weight, rtol=1e-5, atol=1e-6)
    assert 0 < keep.sum() < valid.sum()  # the batch exercises both kinds
    w = ref_weight[ref_keep]
    assert metrics[keys.CORRECTION_CHANGED_FRAC].item() == pytest.approx(changed.sum().item() / valid.sum().item())
    assert metrics[keys.CORRECTION_WEIGHT_MEAN].item() == pytest.approx(w.mean().item(), rel=1e-5)
    assert metrics[keys.CORRECTION_WEIGHT_MAX].item() == pytest.approx(w.max().item(), rel=1e-5)
    assert metrics[keys.CORRECTION_ESS].item() == pytest.approx((w.sum() ** 2 / (len(w) * (w * w).sum())).item(), rel=1e-5)


@pytest.mark.parametrize("loss", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("name", ["tis_token", "icepop", "mis_seq"])
def test_a_correction_composes_with_every_loss(loss, name):
    """Loss with the correction == the loss with the dropped tokens left out (as non-finite
    tokens are: out of the loss and of M2PO's statistics, still in the token-mean
    denominator), each kept token's gradient times its weight."""
    behav, engine, valid = batch(seed=3, spread=0.5 if name != "mis_seq" else 0.05)
    g = torch.Generator().manual_seed(1)
    logp = (behav.masked_fill(torch.isinf(behav), -1.0) + torch.randn(behav.shape, generator=g) * 0.1).requires_grad_()
    adv = torch.randn(valid.shape[0], generator=g)
    weight, keep, _ = rollout_correction(name, behav, engine, valid)
    assert keep.sum() > 0 and ((valid & ~keep).sum() > 1 or name == "tis_token")  # tis drops only the -inf token

    loss_c, metrics = compute_policy_loss(loss, logp, behav, adv, valid, correction_weight=weight, correction_keep=keep)
    (grad_c,) = torch.autograd.grad(loss_c, logp)
    left_out = behav.masked_fill(valid & ~keep, float("nan"))
    (grad_ref,) = torch.autograd.grad(compute_policy_loss(loss, logp, left_out, adv, valid)[0], logp)
    torch.testing.assert_close(grad_c, grad_ref * weight, rtol=1e-5, atol=1e-7)
    assert (grad_c[valid & ~keep] == 0).all() and grad_c[keep].abs().sum() > 0
    assert metrics[keys.NONFINITE_TOKENS].item() == 1  # the -inf token, not the dropped ones


def test_the_m2po_mask_sees_only_the_tokens_the_correction_keeps():
    behav, engine, valid = batch(seed=5, spread=1.0)
    g = torch.Generator().manual_seed(2)
    logp = behav.masked_fill(torch.isinf(behav), -1.0) + torch.randn(behav.shape, generator=g) * 0.3
    adv = torch.ones(valid.shape[0])
    _, keep, _ = rollout_correction("icepop", behav, engine, valid)
    _, with_c = compute_policy_loss("m2po", logp, behav, adv, valid, correction_weight=torch.ones_like(logp),
                                    correction_keep=keep, m2_threshold=0.04)
    _, plain = compute_policy_loss("m2po", logp, behav.masked_fill(valid & ~keep, float("nan")), adv, valid,
                                   m2_threshold=0.04)
    assert 0 < with_c[keys.KEPT_TOKENS] < keep.sum()  # M2PO masked some of the kept tokens
    for key in (keys.M2_BEFORE, keys.M2_AFTER, keys.KEPT_TOKENS, keys.MASKED_TOKENS):
        assert with_c[key].item() == pytest.approx(plain[key].item())


def test_mismatch_metrics_against_plain_sums():
    behav, engine, valid = batch(seed=7, spread=0.08)
    stats = mismatch_metrics(behav, engine, valid.float())
    deltas = [(behav[i, t] - engine[i, t]).item() for i, t in valid.nonzero().tolist()]
    deltas = [d for d in deltas if math.isfinite(d)]
    rhos = [math.exp(d) for d in deltas]
    assert stats[keys.LOGP_MISMATCH_MAX] == pytest.approx(max(abs(d) for d in deltas))
    assert stats[keys.LOGP_MISMATCH_MEAN] == pytest.approx(sum(abs(d) for d in deltas) / len(deltas))
    assert stats[keys.LOGP_MISMATCH_KL] == pytest.approx(sum(r - 1 - d for r, d in zip(rhos, deltas)) / len(deltas))
    assert stats[keys.LOGP_MISMATCH_LARGE_FRAC] == pytest.approx(sum(abs(d) > 0.1 for d in deltas) / len(deltas))
    assert stats[keys.LOGP_MISMATCH_ESS] == pytest.approx(sum(rhos) ** 2 / (len(rhos) * sum(r * r for r in rhos)))
    assert mismatch_metrics(behav, engine, torch.zeros_like(valid)) == {}


@pytest.mark.parametrize("name, bounds, setting, why", [
    ("tis_token", dict(high=0.9), "rollout_correction_high", "must be > 1"),
    ("icepop", dict(low=1.5), "rollout_correction_low", "must be in [0, 1)"),
    ("tis_seq", dict(low=0.5), "rollout_correction_low", "truncates from above only"),
])
def test_one_rule_for_the_bounds_in_the_loss_and_in_validate(name, bounds, setting, why, tiny_model_dir):
    """The loss refuses the bounds `validate()` refuses, with the same reason (one rule:
    `correction.bound_errors`)."""
    from _configs import tiny_config

    from m2po_rllib.common.errors import ConfigError

    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=re.escape(why)):
        rollout_correction(name, x, x, torch.ones(1, 2), **bounds)
    cfg = tiny_config(tiny_model_dir, rollout_correction=name, recompute_behavior_logp=True,
                      **{f"rollout_correction_{k}": v for k, v in bounds.items()})
    with pytest.raises(ConfigError, match=re.escape(why)) as err:
        cfg.validate()
    assert f"`{setting}` ({next(iter(bounds.values()))})" in str(err.value) and setting in err.value.settings
