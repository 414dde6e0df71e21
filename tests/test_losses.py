"""Tests of the pure-torch loss library against plainly written references."""

import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import m2po_rllib.losses.mask as mask_module
from _references import plain_m2po_keep as reference_keep
from m2po_rllib.losses import (
    LOCAL,
    POLICY_LOSSES,
    aggregate_loss,
    compute_advantages,
    compute_policy_loss,
    m2po_keep_mask,
    m2po_keep_mask_global,
    m2po_official_tau,
    policy_loss_params,
    register_policy_loss,
)

# ---------------------------------------------------------------- references


def reference_tau(d, budget, solver):
    """tau_c for sum min(d_i, c) = budget * n by bisection ("exact") or by trying every
    breakpoint ("breakpoint"); d is the list of harmful squared log-ratios."""
    n, target = len(d), budget * len(d)
    if n == 0 or math.fsum(d) <= target:
        return math.inf

    def capped(c):
        return math.fsum(min(x, c) for x in d)

    if solver == "breakpoint":
        return math.sqrt(max([0.0] + [c for c in d if capped(c) <= target]))
    lo, hi = 0.0, max(d)
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if capped(mid) <= target else (lo, mid)
    return math.sqrt(lo)


def random_batch(seed, B=6, T=20, scale=0.3, kind="normal", p_valid=0.8, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        lr = torch.randn(B, T, generator=g) * scale
    elif kind == "heavy":  # Cauchy tails: a few huge log-ratios
        lr = torch.tan(math.pi * (torch.rand(B, T, generator=g) - 0.5)) * scale * 0.2
    elif kind == "ties":  # dyadic values: many exact ties, exact float sums
        lr = torch.randint(-6, 7, (B, T), generator=g).float() / 8
    else:
        raise ValueError(kind)
    valid = torch.rand(B, T, generator=g) < p_valid
    # dyadic, so that logp - behavior gives back lr exactly (ties stay ties)
    behavior = -torch.randint(0, 24, (B, T), generator=g).float() / 8
    logp = (behavior + lr).to(dtype)
    adv = torch.randn(B, generator=g)
    return logp, behavior, adv, valid, logp.float() - behavior


# ---------------------------------------------------------------- the mask


@pytest.mark.parametrize("kind", ["normal", "heavy", "ties"])
@pytest.mark.parametrize("first_top", [2, 4096])  # 2 exercises the widening search
def test_mask_matches_reference(kind, first_top, monkeypatch):
    monkeypatch.setattr(mask_module, "_FIRST_TOP", first_top)
    for seed in range(60):
        g = torch.Generator().manual_seed(seed)
        B, T = (int(torch.randint(1, hi, (1,), generator=g)) for hi in (8, 40))
        tau = [0.0, 0.01, 0.04, 0.1, 1.0][seed % 5]
        _, _, _, valid, lr = random_batch(seed, B, T, scale=[0.05, 0.3, 1.0][seed % 3], kind=kind)
        got = m2po_keep_mask(lr, valid, tau)
        assert torch.equal(got, reference_keep(lr, valid, tau)), (seed, tau)


def _values(min_size=1):
    finite = st.floats(-5, 5, allow_nan=False, width=32)
    return st.lists(finite, min_size=min_size, max_size=60)


def _mean(xs):
    return math.fsum(xs) / len(xs) if xs else 0.0


@settings(max_examples=150, deadline=None)
@given(_values(), st.sampled_from([0.0, 0.001, 0.04, 0.3, 2.0]))
def test_mask_properties(values, tau):
    lr = torch.tensor([values])
    keep = m2po_keep_mask(lr, torch.ones_like(lr, dtype=torch.bool), tau)[0]
    d = (lr[0] * lr[0]).tolist()
    kept = [x for x, k in zip(d, keep.tolist()) if k]
    dropped = [x for x, k in zip(d, keep.tolist()) if not k]
    assert _mean(kept) <= tau  # the bound holds
    if kept and dropped:
        assert min(dropped) >= max(kept)  # the largest go first
        if min(dropped) == max(kept):  # a tie split at the cut: earlier positions go first
            at_cut = [i for i, x in enumerate(d) if x == min(dropped)]
            assert keep[at_cut].tolist() == sorted(keep[at_cut].tolist())
    if dropped:  # minimality (Alg. 1's count): any one dropped token back breaks the bound
        assert _mean(kept + [min(dropped)]) > tau


@settings(max_examples=60, deadline=None)
@given(_values(), st.integers(0, 2**31 - 1))
def test_mask_ignores_order_and_padding(values, seed):
    # one token per row, each row with its sample id (the tie-break key travels with it)
    lr = torch.tensor(values)[:, None]  # (n, 1)
    ids = torch.arange(len(values)) * 7 + 3
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(values), generator=g)
    keep = m2po_keep_mask(lr, torch.ones_like(lr, dtype=torch.bool), 0.04, sample_id=ids)[:, 0]
    # the same rows shuffled into a batch with a padding row and padding columns of garbage
    padded = torch.full((len(values) + 1, 3), float("nan"))
    padded[1:, 0] = lr[perm, 0]
    valid = torch.zeros(len(values) + 1, 3, dtype=torch.bool)
    valid[1:, 0] = True
    keep_padded = m2po_keep_mask(padded, valid, 0.04, sample_id=torch.cat([ids[:1] + 1, ids[perm]]))
    assert not keep_padded[0].any() and not keep_padded[:, 1:].any()
    assert torch.equal(keep_padded[1:, 0], keep[perm])


def test_mask_edge_cases():
    lr = torch.tensor([[0.0, 0.5, -0.5, 0.0, 3.0]])
    valid = torch.ones_like(lr, dtype=torch.bool)
    assert not m2po_keep_mask(lr, torch.zeros_like(valid), 0.04).any()  # no valid tokens
    assert torch.equal(m2po_keep_mask(lr, valid, math.inf), valid)
    assert torch.equal(m2po_keep_mask(lr, valid, 0.0), lr == 0)  # tau 0: only r == 1
    # ties at the cut: of the two 0.25 values only one goes (Alg. 1's count), the earlier
    assert m2po_keep_mask(lr, valid, 0.1).tolist() == [[True, False, True, True, False]]
    # every token above the threshold: everything is dropped
    big = torch.tensor([[1.0, -2.0, 1.5]])
    assert not m2po_keep_mask(big, torch.ones_like(big, dtype=torch.bool), 0.04).any()
    for bad in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="m2_threshold must be >= 0"):
            m2po_keep_mask(lr, valid, bad)
    with pytest.raises(ValueError, match="one shape"):
        m2po_keep_mask(lr, valid[:, :2], 0.04)
    assert m2po_keep_mask(torch.zeros(0, 5), torch.zeros(0, 5, dtype=torch.bool)).shape == (0, 5)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_empty_batch_gives_zero_loss_and_nan_means(name):
    for B in (0, 2):  # no rows; rows of padding only
        zeros, no_tokens = torch.zeros(B, 5), torch.zeros(B, 5, dtype=torch.bool)
        loss, grad, m = _grad(name, zeros, zeros, torch.ones(B), no_tokens)
        assert loss == 0 and not grad.any()
        assert math.isnan(m["m2po/m2_before"]) and math.isnan(m["policy/log_ratio_abs_max"])


def test_mask_nonfinite_tokens_are_dropped_first():
    lr = torch.tensor([[0.1, float("nan"), 0.1, float("inf"), -float("inf"), 0.1]])
    valid = torch.ones_like(lr, dtype=torch.bool)
    assert m2po_keep_mask(lr, valid, 0.04).tolist() == [[True, False, True, False, False, True]]
    assert torch.equal(m2po_keep_mask(lr, valid, 0.04), reference_keep(lr, valid, 0.04))


def test_mask_global_without_distributed_is_local():
    _, _, _, valid, lr = random_batch(3, scale=0.5)
    keep, stats = m2po_keep_mask_global(lr, valid, 0.04, return_stats=True)
    assert torch.equal(keep, m2po_keep_mask(lr, valid, 0.04))
    d = lr * lr
    assert stats["m2po/m2_after"] <= 0.04 < stats["m2po/m2_before"]
    torch.testing.assert_close(stats["m2po/m2_before"], d[valid].mean())
    assert stats["m2po/kept_tokens"] + stats["m2po/masked_tokens"] == valid.sum()


# ---------------------------------------------------------------- the official variant


@pytest.mark.parametrize("solver", ["exact", "breakpoint"])
def test_official_tau_matches_reference(solver, monkeypatch):
    monkeypatch.setattr(mask_module, "_FIRST_TOP", 3)
    for seed in range(40):
        scale, kind = [0.1, 0.4, 1.5][seed % 3], ["normal", "heavy"][seed % 2]
        _, _, adv, valid, lr = random_batch(seed, scale=scale, kind=kind)
        adv = adv[:, None].expand_as(lr)
        budget = [0.0001, 0.04, 0.2][seed % 3]
        harmful = valid & (((adv > 0) & (lr > 0)) | ((adv < 0) & (lr < 0)))
        d = (lr * lr)[harmful].tolist()
        got = m2po_official_tau(lr, adv, valid, budget, solver=solver)
        want = reference_tau(d, budget, solver)
        assert got == want if math.isinf(want) else math.isclose(got, want, rel_tol=1e-5), seed


def test_official_loss_bounds_and_floor():
    lr = torch.tensor([[0.3, -0.3, 0.05, -0.05]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    valid = torch.ones_like(lr, dtype=torch.bool)
    logp = lr.clone().requires_grad_(True)
    tau = m2po_official_tau(lr, adv, valid, 0.04)
    assert math.isclose(tau, math.sqrt((0.04 * 4 - 2 * 0.05**2) / 2), rel_tol=1e-5)
    # without a floor the two 0.3 tokens are clipped; the official floor [0.7, 1.5] frees them
    zero = torch.zeros_like(lr)
    _, m = compute_policy_loss(
        "m2po_official", logp, zero, adv, valid, min_clip_low=None, min_clip_high=None
    )
    assert m["m2po/clipped_frac"] == 0.5
    _, m = compute_policy_loss("m2po_official", logp, zero, adv, valid)
    assert m["m2po/clipped_frac"] == 0.0 and m["m2po/clip_low"] == pytest.approx(0.7)
    # within budget: no bound at all, reported as NaN rather than inf
    _, m = compute_policy_loss("m2po_official", logp, zero, adv, valid, m2_threshold=1.0)
    assert math.isnan(m["m2po/tau_c"]) and m["m2po/clipped_frac"] == 0.0


# ---------------------------------------------------------------- losses and gradients


def _grad(name, logp, behavior, adv, valid, **kw):
    logp = logp.detach().clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(name, logp, behavior, adv, valid, **kw)
    loss.backward()
    return loss, logp.grad, metrics


@pytest.mark.parametrize("seed", range(5))
def test_m2po_gradient_is_masked_r_a_over_n(seed):
    logp, behavior, adv, valid, lr = random_batch(seed, scale=0.4)
    loss, grad, m = _grad("m2po", logp, behavior, adv, valid)
    keep = m2po_keep_mask(lr, valid, 0.04)
    r = torch.exp(logp - behavior)
    n = valid.sum()
    a = adv[:, None].expand_as(r)
    torch.testing.assert_close(grad, torch.where(keep, -r * a / n, 0.0))
    torch.testing.assert_close(loss, -(r * a)[keep].sum() / n)
    assert 0 < m["m2po/masked_tokens"] < valid.sum()


def test_clip_losses_gradients():
    logp, behavior, adv, valid, _ = random_batch(7, scale=0.4)
    r = torch.exp(logp - behavior)
    a = adv[:, None].expand_as(r)
    n = valid.sum()
    # grpo: gradient -A r / N except where the ratio left [1-eps_low, 1+eps_high] the harmful way
    _, grad, m = _grad("grpo", logp, behavior, adv, valid, eps_low=0.1, eps_high=0.3)
    clipped = ((a > 0) & (r > 1.3)) | ((a < 0) & (r < 0.9))
    torch.testing.assert_close(grad, torch.where(valid & ~clipped, -r * a / n, 0.0))
    torch.testing.assert_close(m["grpo/clipped_frac"], (valid & clipped).sum() / n)
    _, grad, _ = _grad("grpo_no_tr", logp, behavior, adv, valid)
    torch.testing.assert_close(grad, torch.where(valid, -r * a / n, 0.0))
    # gspo: s_i = exp(mean log r), d loss / d logp_t = -A_i s_i / N unless s_i is clipped
    lr = torch.where(valid, logp - behavior, 0.0)
    s = torch.exp(lr.sum(1, keepdim=True) / valid.sum(1, keepdim=True).clamp_min(1)).expand_as(r)
    _, grad, _ = _grad("gspo", logp, behavior, adv, valid, eps_low=0.01, eps_high=0.01)
    seq_clipped = ((a > 0) & (s > 1.01)) | ((a < 0) & (s < 0.99))
    torch.testing.assert_close(grad, torch.where(valid & ~seq_clipped, -a * s / n, 0.0))


def test_dual_clip_caps_negative_advantage_loss():
    logp = torch.tensor([[2.0, 2.0]], requires_grad=True)
    adv = torch.tensor([[-1.0, 1.0]])
    valid = torch.ones(1, 2, dtype=torch.bool)
    loss, _ = compute_policy_loss("grpo", logp, torch.zeros(1, 2), adv, valid, clip_ratio_c=3.0)
    torch.testing.assert_close(loss, torch.tensor((3.0 - 1.2) / 2))


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_padding_and_nonfinite_invariance(name):
    logp, behavior, adv, valid, _ = random_batch(11, B=4, T=10, scale=0.4)
    loss, grad, m = _grad(name, logp, behavior, adv, valid)
    # pad with garbage columns and rows, and poison padding with NaN / inf
    B, T = logp.shape
    def big(x, fill):  # (B + 2, T + 5)
        return torch.cat([torch.cat([x, torch.full((B, 5), fill)], 1), torch.full((2, T + 5), fill)])

    logp2, beh2 = big(logp, float("nan")), big(behavior, float("inf"))
    valid2 = big(valid.float(), 0.0).bool()
    adv2 = torch.cat([adv, torch.full((2,), float("nan"))])
    loss2, grad2, m2 = _grad(name, logp2, beh2, adv2, valid2)
    torch.testing.assert_close(loss2, loss)
    torch.testing.assert_close(grad2[:B, :T], grad)
    assert not grad2[B:].any() and not grad2[:, T:].any()
    assert m2["policy/nonfinite_tokens"] == 0
    # a NaN and an inf on valid tokens: dropped, counted, loss and gradient stay finite
    logp3 = logp.clone()
    logp3[valid.nonzero()[0].tolist()[0], valid.nonzero()[0].tolist()[1]] = float("nan")
    logp3[valid.nonzero()[1].tolist()[0], valid.nonzero()[1].tolist()[1]] = float("inf")
    loss3, grad3, m3 = _grad(name, logp3, behavior, adv, valid)
    assert torch.isfinite(loss3) and torch.isfinite(grad3).all()
    assert m3["policy/nonfinite_tokens"] == 2


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_bf16_matches_fp32(name):
    logp, behavior, adv, valid, _ = random_batch(5, scale=0.3, dtype=torch.bfloat16)
    loss16, grad16, _ = _grad(name, logp, behavior, adv, valid)
    loss32, grad32, _ = _grad(name, logp.float(), behavior, adv, valid)
    assert loss16.dtype == torch.float32 and grad16.dtype == torch.bfloat16
    torch.testing.assert_close(loss16, loss32)  # same log-ratios: only the grad is rounded
    torch.testing.assert_close(grad16.float(), grad32, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_micro_batches_reproduce_the_whole_batch(name, mode):
    logp, behavior, adv, valid, lr = random_batch(21, B=8, T=12, scale=0.5)
    valid[3] = False  # a fully padded row
    whole, grad, _ = _grad(name, logp, behavior, adv, valid, loss_agg_mode=mode, max_tokens=16)
    extra = {}
    if name == "m2po":
        keep = m2po_keep_mask(lr, valid, 0.04)  # the no-grad pass over the minibatch
    if name == "m2po_official":
        extra["tau_c"] = m2po_official_tau(lr, adv[:, None].expand_as(lr), valid, 0.04)
    counts = dict(num_global_tokens=valid.sum(), num_global_seqs=valid.any(1).sum())
    total, grads = 0.0, []
    for rows in (slice(0, 3), slice(3, 4), slice(4, 8)):
        if name == "m2po":
            extra["keep_mask"] = keep[rows]
        part, g, _ = _grad(
            name, logp[rows], behavior[rows], adv[rows], valid[rows],
            loss_agg_mode=mode, max_tokens=16, **counts, **extra,
        )
        total, grads = total + part, grads + [g]
    torch.testing.assert_close(total, whole)
    torch.testing.assert_close(torch.cat(grads), grad)


def test_local_scope_mask_depends_on_the_split():
    lr = torch.tensor([[0.3, 0.0, 0.0, 0.0], [0.3, 0.3, 0.3, 0.3]])
    valid = torch.ones_like(lr, dtype=torch.bool)
    whole = m2po_keep_mask(lr, valid, 0.04)
    per_row = torch.cat([m2po_keep_mask(lr[i : i + 1], valid[i : i + 1], 0.04) for i in range(2)])
    assert not torch.equal(whole, per_row)
    assert m2po_keep_mask_global(lr, valid, 0.04, group=LOCAL).equal(whole)


def test_metrics():
    logp, behavior, adv, valid, lr = random_batch(2, scale=0.5)
    entropy = torch.rand_like(logp) + torch.where(lr.abs() > 0.5, 5.0, 0.0)  # masked = high entropy
    for name in POLICY_LOSSES:
        _, m = compute_policy_loss(name, logp, behavior, adv, valid, entropy=entropy)
        assert all(v.dim() == 0 and not v.requires_grad for v in m.values()), name
        torch.testing.assert_close(m["m2po/m2_before"], (lr * lr)[valid].mean())
        torch.testing.assert_close(m["policy/log_ratio_abs_max"], lr.abs()[valid].max())
        torch.testing.assert_close(m["policy/log_ratio_abs_mean"], lr.abs()[valid].mean())
        torch.testing.assert_close(m["policy/ratio_mean"], lr.exp()[valid].mean())
        torch.testing.assert_close(m["m2po/entropy_all"], entropy[valid].mean())
    _, m = compute_policy_loss("m2po", logp, behavior, adv, valid, entropy=entropy)
    keep = m2po_keep_mask(lr, valid, 0.04)
    torch.testing.assert_close(m["m2po/entropy_masked"], entropy[valid & ~keep].mean())
    torch.testing.assert_close(m["m2po/m2_after"], (lr * lr)[keep].mean())
    assert m["m2po/entropy_masked"] > m["m2po/entropy_all"]
    assert m["m2po/masked_frac"] == (valid & ~keep).sum() / valid.sum()


# ---------------------------------------------------------------- registry and errors


def test_registry_errors():
    logp, behavior, adv, valid, _ = random_batch(0)
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo'.*'grpo'.*'m2po'"):
        compute_policy_loss("ppo", logp, behavior, adv, valid)
    typo = r"'m2po' got unknown parameter\(s\) \['m2_treshold'\].*m2_threshold"
    with pytest.raises(TypeError, match=typo):
        compute_policy_loss("m2po", logp, behavior, adv, valid, m2_treshold=0.1)
    with pytest.raises(ValueError, match="keep_mask applies to the 'm2po' loss only"):
        compute_policy_loss("grpo", logp, behavior, adv, valid, keep_mask=valid)
    with pytest.raises(ValueError, match="unknown mask_scope"):
        compute_policy_loss("m2po", logp, behavior, adv, valid, mask_scope="rank")
    with pytest.raises(ValueError, match="advantages"):
        compute_policy_loss("m2po", logp, behavior, adv[:2], valid)
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("m2po")(lambda x: None)
    assert policy_loss_params("gspo") == {"eps_low": 3e-4, "eps_high": 4e-4}
    assert policy_loss_params("grpo")["eps_high"] == 0.2


def test_register_a_custom_loss():
    @register_policy_loss("test_sign")
    def sign_loss(x, *, scale: float = 1.0):
        return torch.where(x.usable, -scale * x.log_ratio * x.advantages, 0.0), {}

    try:
        logp, behavior, adv, valid, _ = random_batch(0)
        loss, m = compute_policy_loss("test_sign", logp, behavior, adv, valid, scale=2.0)
        assert torch.isfinite(loss) and "m2po/m2_before" in m
    finally:
        del POLICY_LOSSES["test_sign"]


def test_loss_signatures_are_read_once_per_function(monkeypatch):
    @register_policy_loss("test_once")
    def scaled_loss(x, *, scale: float = 1.0):
        return torch.where(x.usable, -scale * x.log_ratio * x.advantages, 0.0), {}

    import m2po_rllib.losses.policy as policy

    seen = []
    real = policy.inspect.signature
    monkeypatch.setattr(policy.inspect, "signature", lambda fn: seen.append(fn) or real(fn))
    try:
        logp, behavior, adv, valid, _ = random_batch(0)
        for _ in range(3):  # three minibatches
            compute_policy_loss("test_once", logp, behavior, adv, valid, scale=2.0)
        params = policy_loss_params("test_once")
        assert params == {"scale": 1.0}
        params["scale"] = 5.0  # a caller's copy: the registry's defaults stay
        assert policy_loss_params("test_once") == {"scale": 1.0}
        assert seen.count(scaled_loss) == 1
    finally:
        del POLICY_LOSSES["test_once"]


def test_no_ray_import():
    # In a fresh interpreter: other test modules of the session import Ray themselves.
    code = (
        "import sys, m2po_rllib.losses;"
        "bad = [n for n in sys.modules if n == 'ray' or n.startswith('ray.')];"
        "assert not bad, bad"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


# ---------------------------------------------------------------- aggregation, advantages


def test_aggregation_modes():
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(4, 6, generator=g)
    valid = torch.rand(4, 6, generator=g) < 0.6
    valid[0] = False
    valid[1, 0] = True
    rows = [[loss[i, t].item() for t in range(6) if valid[i, t]] for i in range(4)]
    flat = [x for r in rows for x in r]
    seqs = [r for r in rows if r]
    loss_nan = torch.where(valid, loss, float("nan"))
    agg = lambda *a, **kw: aggregate_loss(*a, **kw).item()  # noqa: E731
    assert agg(loss_nan, valid, "token-mean") == pytest.approx(sum(flat) / len(flat))
    assert aggregate_loss(loss_nan, valid, "seq-mean-token-mean").item() == pytest.approx(
        sum(sum(r) / len(r) for r in seqs) / len(seqs)
    )
    dr_grpo = agg(loss_nan, valid, "seq-mean-token-sum-norm", max_tokens=10)
    assert dr_grpo == pytest.approx(sum(flat) / (len(seqs) * 10))
    assert agg(loss, valid, "token-mean", num_global_tokens=100) == pytest.approx(sum(flat) / 100)
    assert aggregate_loss(loss, torch.zeros_like(valid), "token-mean").item() == 0.0
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'"):
        aggregate_loss(loss, valid, "mean")


def test_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    G = 3
    groups = rewards.reshape(-1, G).tolist()
    want = {"grpo": [], "drgrpo": [], "rloo": []}
    for grp in groups:
        mean = sum(grp) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (G - 1))
        for i, x in enumerate(grp):
            want["grpo"].append((x - mean) / (std + 1e-6))
            want["drgrpo"].append(x - mean)
            want["rloo"].append(x - (sum(grp) - x) / (G - 1))
    for est, values in want.items():
        torch.testing.assert_close(compute_advantages(rewards, G, est), torch.tensor(values))
    with pytest.raises(ValueError, match="9 rewards do not split into groups of 4"):
        compute_advantages(rewards, 4)
    with pytest.raises(ValueError, match="got 1 samples per prompt"):
        compute_advantages(rewards, 1)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages(rewards, 3, "ppo")
