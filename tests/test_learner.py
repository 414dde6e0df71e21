"""The M2PO learner: a micro-batched update has the gradient of the unsplit minibatch (one
global mask, whole-minibatch counts), on one learner and across 2 gloo learners."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _tolerance import decoder_rtol
from m2po_rllib import M2POConfig
from m2po_rllib.wire.batch import pack_rollouts, to_train_batch

GROUP = 4


def _config(model_dir, **training):
    params = dict(group_size=GROUP, prompts_per_step=2, minibatch_prompts=2, lr=1e-3, grad_clip=None)
    params.update(training)
    return (
        M2POConfig()
        .environment("m2po/Arithmetic-v0", env_config={"digits": 1})
        .env_runners(num_env_runners=0, rollout_engine="hf", max_new_tokens=6)
        .rl_module(model_config={"model": model_dir})
        .training(**params)
        .debugging(seed=0)
    )


def _learner(cfg):
    from m2po_rllib.rollout.env_runner import make_text_env

    return cfg.build_learner(env=make_text_env(cfg.env, cfg.env_config))


def _batch(model_dir, seed: int = 0, rows: int = 8, vocab: int = 30, noise: float = 0.3) -> dict:
    """Ragged prompts and responses; behaviour log-probs = the model's own plus noise, so the
    log-ratios are those of data a few updates stale and a tau of 0.05 masks some tokens."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, rng.integers(2, 6)).tolist() for _ in range(rows)]
    responses = [rng.integers(3, vocab, rng.integers(1, 7)).tolist() for _ in range(rows)]
    zeros = [[0.0] * len(r) for r in responses]
    rollout = pack_rollouts(prompts, responses, zeros, rng.integers(0, 2, rows).astype(float), policy_version=0)
    train = to_train_batch(rollout, rng.standard_normal(rows).astype(np.float32))
    own = _learner(_config(model_dir)).response_logp(train)
    noisy = own + noise * rng.standard_normal(own.shape).astype(np.float32)
    train["behavior_logp"] = np.where(train["response_mask"] > 0, noisy, 0.0).astype(np.float32)
    return train


def _update_grads(learner, train: dict) -> tuple[dict[str, torch.Tensor], dict]:
    from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

    result = learner.update(
        batch=MultiAgentBatch({"default_policy": SampleBatch(dict(train))}, env_steps=len(train["advantages"])),
        minibatch_size=len(train["advantages"]),
        num_epochs=1,
    )
    model = learner.module["default_policy"].unwrapped().model
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, result["default_policy"]


def _assert_same_gradient(a: dict, b: dict, rtol: float | None = None):
    """Equal up to rounding: the bound of the built-in test model's float32 computation over
    the batch of `_batch` (tests/_tolerance.py), unless `rtol` is given."""
    if rtol is None:
        from m2po_rllib.models.tiny import build_char_tokenizer, tiny_qwen2_config

        # `_batch`: 8 rows of at most 5 prompt and 6 response tokens
        rtol = decoder_rtol(tiny_qwen2_config(vocab_size=len(build_char_tokenizer())), tokens=8 * (5 + 6))
    assert a.keys() == b.keys() and a
    assert sum(float(g.norm()) for g in b.values()) > 0, "the test needs a non-zero gradient"
    for name in a:
        err = (a[name] - b[name]).norm() / b[name].norm().clamp_min(1e-12)
        assert err <= rtol, f"{name}: relative difference {err:.2e}"


def _peek(metrics: dict, key: str) -> float:
    value = metrics[key]
    return float(value.peek() if hasattr(value, "peek") else value)


@pytest.mark.parametrize(
    "policy_loss, agg",
    [
        ("m2po", "token-mean"),
        ("m2po", "seq-mean-token-mean"),
        ("m2po_official", "token-mean"),
        ("grpo", "seq-mean-token-sum-norm"),
        ("gspo", "seq-mean-token-mean"),
    ],
)
def test_micro_batched_update_has_the_unsplit_gradient(tiny_model_dir, policy_loss, agg):
    train = _batch(tiny_model_dir)
    results = {}
    for micro in (None, 3):  # 3 does not divide the 8 rows: micro-batches of 3, 3, 2
        cfg = _config(tiny_model_dir, policy_loss=policy_loss, loss_agg_mode=agg, m2_threshold=0.05,
                      micro_batch_size=micro)
        results[micro] = _update_grads(_learner(cfg), train)
    (whole, m_whole), (split, m_split) = results[None], results[3]
    _assert_same_gradient(split, whole)
    assert _peek(m_split, "policy/micro_batches") == 3 and _peek(m_whole, "policy/micro_batches") == 1
    assert _peek(m_split, "policy/loss") == pytest.approx(_peek(m_whole, "policy/loss"), rel=1e-5)
    if policy_loss == "m2po":
        assert 0 < _peek(m_whole, "m2po/masked_frac") < 0.5, "the test needs a minibatch that masks some tokens"
        assert _peek(m_split, "m2po/masked_tokens") == _peek(m_whole, "m2po/masked_tokens")
        assert _peek(m_split, "m2po/m2_after") == pytest.approx(_peek(m_whole, "m2po/m2_after"), rel=1e-5)


def test_micro_batched_update_with_a_rollout_correction_has_the_unsplit_gradient(tiny_model_dir):
    """The correction is computed once per minibatch and sliced per micro-batch, and the
    global M2PO mask sees the tokens it keeps: split and whole give the same gradient, mask
    and correction metrics."""
    train = _batch(tiny_model_dir)
    rng = np.random.default_rng(1)
    gap = rng.standard_normal(train["behavior_logp"].shape).astype(np.float32)  # |delta| > log 2 drops some
    train["engine_logp"] = np.where(train["response_mask"] > 0, train["behavior_logp"] + gap, 0.0).astype(np.float32)
    results = {}
    for micro in (None, 3):
        cfg = _config(tiny_model_dir, m2_threshold=0.05, micro_batch_size=micro, recompute_behavior_logp=True,
                      rollout_correction="icepop")
        results[micro] = _update_grads(_learner(cfg), train)
    (whole, m_whole), (split, m_split) = results[None], results[3]
    _assert_same_gradient(split, whole)
    assert 0 < _peek(m_whole, "correction/changed_frac") < 1
    for key in ("correction/changed_frac", "correction/weight_mean", "correction/ess", "m2po/m2_after"):
        assert _peek(m_split, key) == pytest.approx(_peek(m_whole, key), rel=1e-5), key
    assert _peek(m_split, "m2po/masked_tokens") == _peek(m_whole, "m2po/masked_tokens") > 0


def test_an_update_reports_squared_log_ratios_by_age_over_the_tokens_the_loss_sees(tiny_model_dir):
    """What `max_staleness="auto"` steers by: per age (learner version - row version), the sum
    of squared log-ratios and the token count, over the tokens the rollout correction keeps,
    micro-batched as whole, each row counted once."""
    from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

    from m2po_rllib.common.keys import M2_BY_AGE_KEY
    from m2po_rllib.losses.correction import rollout_correction

    train = _batch(tiny_model_dir)
    rng = np.random.default_rng(2)
    gap = rng.standard_normal(train["behavior_logp"].shape).astype(np.float32)
    train["engine_logp"] = np.where(train["response_mask"] > 0, train["behavior_logp"] + gap, 0.0).astype(np.float32)
    train["policy_version"] = np.array([5, 5, 4, 4, 4, 2, 2, 0])
    cfg = _config(tiny_model_dir, micro_batch_size=3, recompute_behavior_logp=True, rollout_correction="icepop",
                  async_rollouts=True, max_staleness="auto", logp_mismatch_interval=0)
    learner = _learner(cfg.env_runners(num_env_runners=1))  # recorded only for "auto" (its one reader)
    learner.module["default_policy"].unwrapped().policy_version = 5
    log_ratio = torch.as_tensor(learner.response_logp(train)) - torch.as_tensor(train["behavior_logp"])
    valid = torch.as_tensor(train["response_mask"]) > 0
    _, keep, _ = rollout_correction("icepop", torch.as_tensor(train["behavior_logp"]),
                                    torch.as_tensor(train["engine_logp"]), valid)
    usable = valid & keep
    assert 0 < int(usable.sum()) < int(valid.sum())  # the correction drops some tokens
    expected = {}
    for age in (0, 1, 3, 5):
        rows = torch.as_tensor(5 - train["policy_version"] == age)
        u = usable & rows[:, None]
        expected[age] = (float((log_ratio[u].double() ** 2).sum()), float(u.sum()))
    # two epochs: the second pass over a row sees weights already fitted to it and is not counted
    result = learner.update(batch=MultiAgentBatch({"default_policy": SampleBatch(dict(train))}, env_steps=8),
                            minibatch_size=8, num_epochs=2)
    assert learner.policy_version == 7
    got = result[M2_BY_AGE_KEY]
    assert got.keys() == expected.keys()
    for age, (sum_sq, tokens) in expected.items():
        assert got[age][1] == tokens and got[age][0] == pytest.approx(sum_sq, rel=1e-5), age


def test_local_mask_scope_masks_each_micro_batch_on_its_own(tiny_model_dir):
    from m2po_rllib.losses import m2po_keep_mask

    train = _batch(tiny_model_dir)
    learner = _learner(_config(tiny_model_dir, m2_threshold=0.05, micro_batch_size=4, mask_scope="local"))
    logp = torch.as_tensor(learner.response_logp(train))
    valid = torch.as_tensor(train["response_mask"]) > 0
    log_ratio = logp - torch.as_tensor(train["behavior_logp"])
    expected = sum(
        int((valid[s] & ~m2po_keep_mask(log_ratio[s], valid[s], 0.05)).sum()) for s in (slice(0, 4), slice(4, 8))
    )
    _, metrics = _update_grads(learner, train)
    assert _peek(metrics, "m2po/masked_tokens") == expected


def test_non_finite_gradients_skip_the_step_but_count_the_update(tiny_model_dir):
    learner = _learner(_config(tiny_model_dir))
    model = learner.module["default_policy"].unwrapped().model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    hook = next(model.parameters()).register_hook(lambda g: torch.full_like(g, float("nan")))
    _, metrics = _update_grads(learner, _batch(tiny_model_dir))
    hook.remove()
    assert _peek(metrics, "policy/skipped_updates") == 1
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert learner.policy_version == 1


@pytest.mark.slow
def test_two_gloo_learners_micro_batched_equal_one_learner_unsplit(ray_session, tiny_model_dir):
    """One minibatch through 1 learner whole and through 2 gloo learners (DDP) in
    micro-batches of 2: the same global mask and the same gradient on both ranks."""
    from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

    from m2po_rllib.rollout.env_runner import make_text_env

    train = _batch(tiny_model_dir)
    batch = MultiAgentBatch({"default_policy": SampleBatch(dict(train))}, env_steps=8)
    grads, metrics = [], []
    for num_learners, micro in ((0, None), (2, 2)):
        cfg = _config(tiny_model_dir, m2_threshold=0.05, micro_batch_size=micro).learners(num_learners=num_learners)
        group = cfg.build_learner_group(env=make_text_env(cfg.env, cfg.env_config))
        try:
            result = group.update(batch=batch, minibatch_size=8 // max(1, num_learners), num_epochs=1)[0]
            metrics.append({k: _peek(result["default_policy"], k) for k in ("m2po/masked_tokens", "m2po/masked_frac", "policy/micro_batches")})

            def read(learner):
                model = learner.module["default_policy"].unwrapped().model
                return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

            grads.append(group._get_results(group.foreach_learner(read)))
        finally:
            group.shutdown()
    one, two = metrics
    assert 0 < one["m2po/masked_frac"] < 0.5, f"the test needs a minibatch that masks some tokens: {one}"
    assert two["m2po/masked_tokens"] == one["m2po/masked_tokens"]
    assert two["policy/micro_batches"] == 2  # 4 sequences per learner, 2 per micro-batch
    _assert_same_gradient(grads[1][0], grads[0][0])
    _assert_same_gradient(grads[1][1], grads[0][0])  # DDP: both ranks hold the global gradient


def test_bfloat16_compute_keeps_float32_master_weights(tiny_model_dir):
    """dtype=bfloat16 is the compute dtype: parameters, gradients and AdamW's moments stay
    float32, so updates of lr 1e-6 (the paper's) are not rounded away as bf16 weights
    would round them."""
    cfg = _config(tiny_model_dir, lr=1e-6).rl_module(model_config={"model": tiny_model_dir, "dtype": "bfloat16"})
    learner = _learner(cfg)
    model = learner.module["default_policy"].unwrapped().model
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads, _ = _update_grads(learner, _batch(tiny_model_dir))
    assert {g.dtype for g in grads.values()} == {torch.float32}
    changed = sum(int((p != before[n]).sum()) for n, p in model.named_parameters() if n in grads)
    total = sum(int((grads[n] != 0).sum()) for n in grads)
    assert changed >= 0.99 * total  # every weight with a gradient moved
    # the log-probs were computed in bf16: close to, not equal to, the float32 ones
    train = _batch(tiny_model_dir)
    fp32 = _learner(_config(tiny_model_dir)).response_logp(train)
    bf16 = _learner(cfg).response_logp(train)
    mask = train["response_mask"] > 0
    diff = np.abs(bf16 - fp32)[mask]
    assert 0 < diff.max() < 0.1
