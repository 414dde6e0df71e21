"""Sharded learner weights (`learner_sharding="fsdp"`, FSDP2 over 2 gloo learners on CPU):
the same gradient as one unsharded learner, forwards that stay in step when the learners'
shares differ, and checkpoints that gather the shards and put them back."""

from __future__ import annotations

import numpy as np
import pytest

from _configs import tiny_config
from test_learner import _assert_same_gradient, _batch, _config, _peek


def test_fsdp_needs_two_learners_and_a_known_name(tiny_model_dir):
    with pytest.raises(ValueError, match=r"`learner_sharding` \('fsdp'\).*num_learners` is 0; set num_learners >= 2"):
        _config(tiny_model_dir, learner_sharding="fsdp").validate()
    with pytest.raises(ValueError, match=r"`learner_sharding` \('zero3'\) must be one of \['ddp', 'fsdp'\]"):
        _config(tiny_model_dir, learner_sharding="zero3").learners(num_learners=2).validate()
    _config(tiny_model_dir, learner_sharding="fsdp").learners(num_learners=2).validate()


def _group(cfg):
    from m2po_rllib.rollout.env_runner import make_text_env

    return cfg.build_learner_group(env=make_text_env(cfg.env, cfg.env_config))


def _on_all(group, fn):
    results = group.foreach_learner(fn, timeout_seconds=120)  # a learner out of step would hang
    assert all(r.ok for r in results), [r.get() for r in results if not r.ok]
    return [r.get() for r in results]


@pytest.mark.slow
def test_fsdp_learners_shard_and_match_one_unsharded_learner(ray_session, tiny_model_dir):
    """One minibatch through 1 learner whole and through 2 FSDP learners in micro-batches of
    3 (4 rows each: micro-batches of 3 and 1): each learner holds half of every sharded
    weight, the global mask and the gradient equal the unsharded ones; log-probs computed
    together from shares of unequal micro-batch counts (rows 0-2 and 2-5 of 5, in
    micro-batches of 2: one learner pads) equal the unsharded ones."""
    from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

    train = _batch(tiny_model_dir)
    batch = MultiAgentBatch({"default_policy": SampleBatch(dict(train))}, env_steps=8)
    five = {k: v[:5] for k, v in train.items()}

    one = _group(_config(tiny_model_dir, m2_threshold=0.05))
    try:
        metrics_one = one.update(batch=batch, minibatch_size=8, num_epochs=1)[0]["default_policy"]
        model = one._learner.module["default_policy"].unwrapped().model
        grads_one = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        logp_one = one._learner.response_logp(five)
    finally:
        one.shutdown()

    cfg = _config(tiny_model_dir, m2_threshold=0.05, micro_batch_size=3, learner_sharding="fsdp")
    two = _group(cfg.learners(num_learners=2))
    try:
        metrics_two = two.update(batch=batch, minibatch_size=4, num_epochs=1)[0]["default_policy"]

        def full_grads(learner):
            from torch.distributed.tensor import DTensor

            model = learner.module["default_policy"].unwrapped().model
            local = {n: p.grad.to_local().numel() for n, p in model.named_parameters() if isinstance(p.grad, DTensor)}
            return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None}, local

        (grads_a, local_a), (grads_b, _) = _on_all(two, full_grads)
        shares = _on_all(two, lambda learner, b=five: learner.response_logp_share(b))
    finally:
        two.shutdown()

    assert 0 < _peek(metrics_one, "m2po/masked_frac") < 0.5, "the test needs a minibatch that masks some tokens"
    assert _peek(metrics_two, "m2po/masked_tokens") == _peek(metrics_one, "m2po/masked_tokens")
    assert _peek(metrics_two, "policy/micro_batches") == 2
    # sharded: every parameter is a DTensor, and rank 0 holds half of (the rounded-up rows of) each
    assert local_a.keys() == grads_one.keys()
    for name, numel in local_a.items():
        rows = grads_one[name].shape[0]
        assert numel == -(-rows // 2) * grads_one[name][0].numel(), name
    _assert_same_gradient(grads_a, grads_one)
    _assert_same_gradient(grads_b, grads_one)
    (rank_a, logp_a), (rank_b, logp_b) = sorted(shares, key=lambda s: s[0])
    assert (rank_a, rank_b, len(logp_a), len(logp_b)) == (0, 1, 2, 3)
    np.testing.assert_allclose(np.concatenate([logp_a, logp_b]), logp_one, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_fsdp_algorithm_checkpoint_resume_matches_uninterrupted_run(ray_session, tiny_model_dir, tmp_path):
    """M2PO with 2 FSDP learners: weight broadcasts, the log-prob mismatch check (a forward
    on every learner) and a checkpoint (whole weights and AdamW state gathered from the
    shards: a rank's shard alone would not load) work, and a resumed run gives the losses of
    the uninterrupted one (its weights and AdamW moments came back)."""
    from m2po_rllib import M2PO

    def losses(algo, n):
        return [algo.train()["learners"]["default_policy"]["policy/loss"] for _ in range(n)]

    cfg = tiny_config(tiny_model_dir, micro_batch_size=2, learner_sharding="fsdp").learners(num_learners=2)
    algo = cfg.build_algo()
    try:
        first = algo.train()
        assert first["rollout/logp_mismatch_max"] < 1e-3  # the runner got the gathered weights
        losses(algo, 1)
        ckpt = algo.save_to_path(str(tmp_path / "ckpt"))
        expected = losses(algo, 2)
        assert algo.policy_version == 8
    finally:
        algo.stop()

    resumed = M2PO.from_checkpoint(ckpt)
    try:
        assert resumed.policy_version == 4
        got = losses(resumed, 2)
    finally:
        resumed.stop()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_fsdp_learners_broadcast_native_syncs_per_tensor_and_agree_on_deltas(ray_session, tiny_model_dir):
    """weight_sync="native" with 2 FSDP learners: the first broadcasts (gloo) while both
    gather one tensor at a time, and no whole copy of the weights is made for it; a runner
    (here a gloo receiver with vLLM's receive code, no vLLM engine) gets the learners'
    whole weights at connect; with only the changed units sent, an update that changes
    nothing (lr 0) sends none, both learners agreeing on that (a disagreement would leave
    one waiting in a gather)."""
    import torch
    from types import SimpleNamespace

    import ray

    from m2po_rllib.sync.transports import weight_layout

    @ray.remote(num_cpus=0)
    class Receiver:
        def __init__(self, layout):
            self.layout, self.got, self.rounds = layout, {}, []

        def m2po_weight_layout(self):
            return self.layout

        def m2po_join_weight_group(self, init_info):
            from m2po_rllib.sync.gloo import _open_group

            self.bucket_bytes = init_info["packed_buffer_size_bytes"]
            self.group = _open_group(init_info["master_address"], init_info["master_port"], init_info["rank_offset"],
                                     init_info["world_size"], 60)

        def m2po_receive_weights(self, update_info, version):
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

            from m2po_rllib.sync.gloo import GlooWeightTransferEngine

            model = SimpleNamespace(load_weights=lambda ts: self.got.update({n: t.clone() for n, t in ts}))
            worker = SimpleNamespace(group=self.group, bucket_bytes=self.bucket_bytes, model=model)
            GlooWeightTransferEngine.receive_weights(worker, NCCLWeightTransferUpdateInfo(**update_info))
            self.rounds.append((version, len(update_info["names"])))
            return True

        def received(self):
            return self.got, self.rounds

    cfg = _config(tiny_model_dir, lr=0.0, learner_sharding="fsdp")
    cfg.env_runners(num_env_runners=1, rollout_engine="vllm", weight_sync="native", weight_sync_backend="gloo",
                    weight_sync_only_changed=True, weight_sync_bucket_bytes=50_000)
    two = _group(cfg.learners(num_learners=2))
    receiver = Receiver.remote(weight_layout(tiny_model_dir))
    try:
        connected = _on_all(two, lambda learner, r=[receiver]: learner.connect_weight_sync(r, [1]))
        sent, _ = ray.get(receiver.received.remote())
        whole = _on_all(two, lambda learner: learner.publish_weights())[0].get()
        assert connected[1] is None and connected[0]["weights/native_tensors"] == len(whole)
        assert sent.keys() == whole.keys()
        for name, value in whole.items():
            torch.testing.assert_close(sent[name], value, rtol=0, atol=0, msg=name)

        from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

        batch = MultiAgentBatch({"default_policy": SampleBatch(dict(_batch(tiny_model_dir)))}, env_steps=8)
        results = two.update(batch=batch, minibatch_size=4, num_epochs=1, return_state=True)
        weights = results[0]["_rl_module_state_after_update"]
        assert weights.native and weights.version == 1
        assert results[0]["_native_sync"]["weights/native_tensors"] == 0  # lr 0: nothing changed
        _, rounds = ray.get(receiver.received.remote())
        assert rounds == [(0, len(whole)), (1, 0)]
        # the learners made no whole copy of the weights for the sync (it is made on demand)
        assert _on_all(two, lambda learner: learner._full_weights_version) == [0, 0]
    finally:
        two.shutdown()
        ray.kill(receiver)
