"""Streaming sampling (rollout/streaming.py): rounds streamed through one engine are the
rounds round-based sampling makes at the same version (prompts, tokens, rewards, sample
ids); a round that needs newer weights waits for the groups in flight, then loads them; the
engine is handed over (`paused`) for evaluation; multi-turn episodes stream turn by turn;
bad settings are refused. Then the
algorithm with streaming runners: every trained token within `max_staleness`, whole groups,
each sample trained once, across a checkpoint and a runner killed with rounds in flight."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from _tolerance import decoder_rtol
from _configs import tiny_config
from transformers import AutoConfig

from m2po_rllib.wire.weights import PublishedWeights

G = 4  # tiny_config's group size


def _runner(model_dir, **training):
    import _test_envs

    from m2po_rllib.rollout.env_runner import LLMEnvRunner

    cfg = (tiny_config(model_dir, **training).env_runners(max_new_tokens=12)
           .environment(_test_envs.ENV_ID, env_config={"digits": 1, "heldout_size": 5}))
    return LLMEnvRunner(config=cfg)


def _weights(model_dir, version: int, shift: float) -> PublishedWeights:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PublishedWeights(version=version, weights={k: v + shift for k, v in model.state_dict().items()})


def _request(n: int, weights: PublishedWeights, min_version: int, prompts: int = 2) -> dict:
    return dict(num_prompts=prompts, seed=100 + n, stream=0, weights=weights, first_sample_id=n * prompts * G,
                min_version=min_version)


def _take_all(stream, rounds: int) -> dict[int, dict]:
    """Advances a stream (no thread) until `rounds` rounds are done; by first sample id."""
    done = {}
    while len(done) < rounds:
        assert stream.advance(), "the stream stopped with rounds unfinished"
        for batch in stream.take()[0]:
            done[int(batch["sample_id"][0])] = batch
    return done


def test_streamed_rounds_are_the_rounds_round_based_sampling_makes(tiny_model_dir):
    """Three rounds in one engine at once (the next round's groups start beside the last
    one's): each equals `sample()` of the same request, token for token."""
    runner = _runner(tiny_model_dir)
    try:
        w = _weights(tiny_model_dir, 1, 0.01)
        requests = [_request(n, w, min_version=1) for n in range(3)]
        streamed = {}
        while len(streamed) < 3:  # through the generating thread, as a remote runner runs it
            for batch in runner.stream(requests if not streamed else [], wait_s=5.0)[0]:
                streamed[int(batch["sample_id"][0])] = batch
        for request in requests:
            kwargs = {k: v for k, v in request.items() if k != "min_version"}
            expected = runner.sample(**kwargs)  # the engine is idle: a plain batched round
            got = streamed[request["first_sample_id"]]
            for key in ("prompt_ids", "response_ids", "response_mask", "rewards", "sample_id", "policy_version"):
                np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
            # the same tokens through one KV cache with other rows beside them: float32
            # reductions in another order, bounded relative to the largest log-prob (_tolerance.py)
            width = got["prompt_ids"].shape[1] + got["response_ids"].shape[1]
            tol = decoder_rtol(AutoConfig.from_pretrained(tiny_model_dir), tokens=width)
            scale = max(1.0, float(np.abs(expected["behavior_logp"]).max()))
            np.testing.assert_allclose(got["behavior_logp"], expected["behavior_logp"], atol=tol * scale, rtol=0)
        assert set(np.concatenate([b["policy_version"] for b in streamed.values()])) == {1}
    finally:
        runner.stop()


def test_a_round_that_needs_newer_weights_waits_for_the_groups_in_flight(tiny_model_dir):
    from m2po_rllib.rollout.streaming import RoundStream

    runner = _runner(tiny_model_dir)
    try:
        stream = RoundStream(runner.host, runner.plan_round, runner.pack_round)  # driven here, no thread
        v1, v2 = _weights(tiny_model_dir, 1, 0.01), _weights(tiny_model_dir, 2, -0.01)
        stream.put([_request(0, v1, min_version=1)])
        assert stream.advance() and runner.engine.version == 1 and runner.engine.in_flight == 2
        # round 1 may use version 1 (it starts now, beside round 0); round 2 needs version 2:
        # it starts once rounds 0 and 1 are done, after the load
        stream.put([_request(1, v2, min_version=1), _request(2, v2, min_version=2)])
        stream.advance()
        assert runner.engine.version == 1 and runner.engine.in_flight >= 3
        done = _take_all(stream, 3)
        assert [int(done[n * 2 * G]["policy_version"][0]) for n in range(3)] == [1, 1, 2]
        # an idle engine loads the newest weights a waiting round carries, even if older would do
        stream.put([_request(3, _weights(tiny_model_dir, 3, 0.02), min_version=0)])
        assert int(_take_all(stream, 1)[3 * 2 * G]["policy_version"][0]) == 3
    finally:
        runner.stop()


def assert_segments_are_their_weights(rollout: dict, weights: tuple, cfg, model_dir) -> None:
    """Each token's behaviour log-prob in `rollout` is the learner's under the weights of its
    version (`token_version`), and not under the others' (so the check can tell them apart)."""
    from transformers import AutoModelForCausalLM

    from m2po_rllib.torch.logp import response_logp
    from m2po_rllib.wire.batch import to_train_batch

    batch = {k: torch.as_tensor(v) for k, v in to_train_batch(rollout, rollout["rewards"]).items()}
    tol = decoder_rtol(AutoConfig.from_pretrained(model_dir), tokens=batch["input_ids"].shape[1])
    scale = max(1.0, float(batch["behavior_logp"].abs().max()))
    valid = rollout["response_mask"] > 0
    for w in weights:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.load_state_dict(w.get())
        with torch.no_grad():
            learner, _ = response_logp(model, batch, cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
        gap = (learner - batch["behavior_logp"]).abs()
        assert gap[torch.as_tensor(valid & (rollout["token_version"] == w.version))].max() <= tol * scale
        assert gap[torch.as_tensor(valid & (rollout["token_version"] != w.version))].max() > tol * scale


@pytest.mark.parametrize("scored", [False, True], ids=["engine", "runner-scored"])
def test_inflight_loads_move_the_groups_in_flight_to_newer_weights_token_by_token(tiny_model_dir, scored):
    """`inflight_loads`: newer weights handed over without a round are loaded between two
    engine steps with round 0's groups in flight, and a round that needs them starts at once
    (no drain). Each token's version is the batch's `token_version`, a row's `policy_version`
    its oldest token's, and the learner's log-probs of each segment, under that segment's
    weights, are the batch's behaviour log-probs: the engine's, or (`scored`: a runner that
    scores its rounds, `recompute_behavior_logp` in async mode) its scorer's, segment by
    segment (rollout/segments.py), not the last weights' for the whole row."""
    from m2po_rllib.rollout.streaming import RoundStream
    from m2po_rllib.wire.batch import versions_spanned

    runner = _runner(tiny_model_dir, **(dict(async_rollouts=True, recompute_behavior_logp=True) if scored else {}))
    try:
        stream = RoundStream(runner.host, runner.plan_round, runner.pack_round, inflight_loads=True)
        v1, v2 = _weights(tiny_model_dir, 1, 0.01), _weights(tiny_model_dir, 2, -0.01)
        stream.put([_request(0, v1, min_version=1)])
        for _ in range(3):  # round 0 starts (one token each) and takes two more steps
            assert stream.advance()
        assert runner.engine.in_flight == 2
        stream.put([_request(1, v2, min_version=2)], weights=v2)
        assert stream.advance()  # loads v2 with round 0 in flight, then starts round 1 beside it
        assert runner.engine.version == 2 and runner.engine.in_flight == 4
        done = _take_all(stream, 2)
        first, second = done[0], done[2 * G]
        valid = first["response_mask"] > 0
        expected = np.where(np.arange(valid.shape[1]) < 3, 1, 2)  # tokens 0-2 by v1, the rest by v2
        np.testing.assert_array_equal(np.where(valid, first["token_version"], 0), np.where(valid, expected, 0))
        np.testing.assert_array_equal(first["policy_version"], 1)  # a row's age counts from its oldest token
        assert (versions_spanned(first) == 2).sum() >= 2
        np.testing.assert_array_equal(second["token_version"][second["response_mask"] > 0], 2)
        np.testing.assert_array_equal(second["policy_version"], 2)

        assert ("engine_logp" in first) == scored
        assert_segments_are_their_weights(first, (v1, v2), runner.config, tiny_model_dir)
    finally:
        runner.stop()


def test_a_round_given_weights_older_than_it_needs_is_refused(tiny_model_dir):
    from m2po_rllib.rollout.streaming import RoundStream

    runner = _runner(tiny_model_dir)
    try:
        stream = RoundStream(runner.host, runner.plan_round, runner.pack_round)
        stream.put([_request(0, _weights(tiny_model_dir, 1, 0.0), min_version=2)])
        with pytest.raises(RuntimeError, match="needs weights of version >= 2, and the newest this runner was given is 1"):
            stream.advance()
    finally:
        runner.stop()


def test_evaluation_waits_for_the_groups_in_flight_and_streaming_goes_on(tiny_model_dir):
    runner = _runner(tiny_model_dir)
    try:
        w = _weights(tiny_model_dir, 1, 0.0)
        # both rounds start at once (queued together); the call returns once one is done
        first, _ = runner.stream([_request(n, w, min_version=1) for n in range(2)], wait_s=60.0)
        counts = runner.evaluate(indices=[0, 1, 2], weights=_weights(tiny_model_dir, 2, 0.01))
        assert counts["n"] == 3 and runner.engine.version == 2
        runner.stream([_request(2, w, min_version=1)], wait_s=0.0)
        done = {int(b["sample_id"][0]): b for b in first}
        deadline = time.monotonic() + 60
        while len(done) < 3 and time.monotonic() < deadline:
            done.update({int(b["sample_id"][0]): b for b in runner.stream([], wait_s=1.0)[0]})
        # rounds 0 and 1 were generated before the evaluation (version 1), round 2 after (2)
        assert {k: int(b["policy_version"][0]) for k, b in done.items()} == {0: 1, 8: 1, 16: 2}
    finally:
        runner.stop()


@pytest.mark.parametrize("settings, needle", [
    (dict(async_rollouts=False), "needs async_rollouts=True and num_env_runners >= 1"),
    (dict(num_env_runners=0), "needs async_rollouts=True and num_env_runners >= 1"),
    (dict(round_delay={"median_s": 0.1}), "streaming has no round barrier to delay"),
    (dict(streaming=False, inflight_weight_updates=True), "needs streaming=True"),
    (dict(weight_sync="native", rollout_engine="vllm"), "set inflight_weight_updates=True"),
])
def test_streaming_settings_it_cannot_serve_are_refused(tiny_model_dir, settings, needle):
    from m2po_rllib.common.errors import ConfigError

    named = "inflight_weight_updates" if "inflight_weight_updates" in settings else "streaming"
    cfg = tiny_config(tiny_model_dir, async_rollouts=settings.pop("async_rollouts", True), max_staleness=3,
                      recompute_behavior_logp=settings.pop("recompute_behavior_logp", False))
    cfg = cfg.env_runners(streaming=settings.pop("streaming", True), num_env_runners=settings.pop("num_env_runners", 1),
                          **settings)
    with pytest.raises(ConfigError, match=needle) as info:
        cfg.validate()
    assert named in str(info.value)


# -- the algorithm, with remote streaming runners ----------------------------------------
ray = pytest.importorskip("ray")


@pytest.mark.slow
def test_inflight_weight_updates_train_each_sample_once_with_ages_from_the_oldest_token(ray_session, tiny_model_dir):
    """Remote streaming runners loading weights mid-sequence: the driver hands them the newest
    weights with every call; each row's `policy_version` is its oldest token's and bounds its
    age (`max_staleness`); rows span versions; each sample is trained once."""
    from test_async import _async_config

    from m2po_rllib.common import keys

    cfg = (_async_config(tiny_model_dir, max_staleness=8)  # room for rounds in flight when weights arrive
           .env_runners(num_env_runners=1, streaming=True, inflight_weight_updates=True, max_new_tokens=24))
    algo = cfg.build_algo()
    try:
        rollouts, update = [], algo._update

        def spy(rollout):
            rollouts.append({k: np.array(rollout[k]) for k in ("token_version", "response_mask", "policy_version",
                                                               "sample_id")})
            return update(rollout)

        algo._update = spy

        def slow_steps(runner):  # generation slower than an update, as on a GPU with long answers
            engine = runner.host.engine
            step = engine.step
            engine.step = lambda: (time.sleep(0.02), step())[1]

        algo.env_runner_group.foreach_env_runner(slow_steps, local_env_runner=False)
        results = [algo.train() for _ in range(5)]
        assert algo.env_runner_group.foreach_env_runner(lambda r: r._stream.inflight_loads, local_env_runner=False) == [True]
    finally:
        algo.stop()
    assert max(r["staleness/max"] for r in results) <= 8
    spans = [r[keys.VERSIONS_SPANNED_MAX] for r in results if keys.VERSIONS_SPANNED_MAX in r]
    print("versions spanned (max per step):", spans)
    for r in rollouts:
        versions = np.where(r["response_mask"] > 0, r["token_version"], np.iinfo(np.int64).max)
        np.testing.assert_array_equal(r["policy_version"], versions.min(1))
    ids = np.concatenate([r["sample_id"] for r in rollouts]).tolist()
    assert sorted(ids) == list(range(len(ids)))
    assert max(spans) >= 2


def _turns(policy_mask) -> int:
    """Policy turns in a row: runs of policy tokens."""
    m = np.asarray(policy_mask) > 0
    return int(m[0]) + int((m[1:] & ~m[:-1]).sum()) if len(m) else 0


def _row(batch, i: int) -> dict:
    """Row i of a rollout batch without its padding (batches pad to their longest row)."""
    n = int(((batch["response_mask"][i] > 0) | (batch["env_mask"][i] > 0)).sum())
    return {"response_ids": batch["response_ids"][i][:n], "response_mask": batch["response_mask"][i][:n],
            "env_mask": batch["env_mask"][i][:n], "rewards": batch["rewards"][i]}


@pytest.mark.parametrize("scored", [False, True], ids=["engine", "runner-scored"])
def test_an_episode_spans_the_versions_loaded_while_it_is_played(scored):
    """Multi-turn episodes with `inflight_loads`: weights loaded during the first turn reach the
    rest of it and the later turns; each policy token keeps the version that sampled it, an
    env token its turn's last, a row's versions never go back, and its `policy_version` is its
    oldest. `scored` (a runner that scores its rounds): each policy token's behaviour log-prob
    is the learner's under its own version's weights, its episode's earlier turns and env
    replies the context."""
    from test_episodes import MODEL, _config

    from m2po_rllib.models.builtin import resolve_model_path
    from m2po_rllib.rollout.env_runner import LLMEnvRunner
    from m2po_rllib.rollout.streaming import RoundStream
    from m2po_rllib.wire.batch import versions_spanned

    cfg = _config()
    if scored:
        cfg = cfg.training(async_rollouts=True, recompute_behavior_logp=True)
    runner = LLMEnvRunner(config=cfg)
    try:
        path = resolve_model_path(MODEL)
        stream = RoundStream(runner.host, runner.plan_round, runner.pack_round, inflight_loads=True)
        g = runner.config.group_size
        v1, v2 = _weights(path, 1, 0.0), _weights(path, 2, -0.01)
        stream.put([dict(num_prompts=2, seed=41, stream=0, weights=v1, first_sample_id=0, min_version=1)])
        for _ in range(3):  # every episode's first turn has 3 tokens by version 1
            assert stream.advance()
        stream.put([], weights=v2)
        batch = _take_all(stream, 1)[0]
        assert len(batch["sample_id"]) == 2 * g
        policy, env = batch["response_mask"] > 0, batch["env_mask"] > 0
        for i in range(len(policy)):
            real = policy[i] | env[i]
            versions = batch["token_version"][i][real]
            assert versions[:3].tolist() == [1, 1, 1] and set(versions[3:].tolist()) <= {2}
            assert batch["policy_version"][i] == 1
        assert (versions_spanned(batch) == 2).sum() >= 2
        assert max(_turns(m) for m in batch["response_mask"]) > 1  # later turns, all by version 2
        if scored:
            assert_segments_are_their_weights(batch, (v1, v2), runner.config, path)
    finally:
        runner.stop()


def test_multi_turn_episodes_stream_turn_by_turn():
    """Each episode's next turn is submitted as its last one is played; streamed episodes are
    round-based ones wherever their seeds agree (turn t of episode e: the turn's seed + e;
    round-based: + e's rank among the episodes still running): every first turn, and every
    turn of an episode whose round-mates before it ran at least as long."""
    from test_episodes import _config

    from m2po_rllib.rollout.env_runner import LLMEnvRunner

    runner = LLMEnvRunner(config=_config())
    try:
        g, prompts = runner.config.group_size, 2
        requests = [dict(num_prompts=prompts, seed=40 + n, stream=0, weights=None, first_sample_id=n * prompts * g,
                         min_version=-1) for n in range(3)]
        streamed = {}
        while len(streamed) < 3:
            for batch in runner.stream(requests if not streamed else [], wait_s=5.0)[0]:
                streamed[int(batch["sample_id"][0])] = batch
        full = 0
        for request in requests:
            expected = runner.sample(**{k: v for k, v in request.items() if k != "min_version"})
            got = streamed[request["first_sample_id"]]
            turns = [_turns(m) for m in expected["response_mask"]]
            assert max(turns) > 1  # episodes went on after a wrong first answer
            for e in range(len(turns)):
                mine, theirs = _row(got, e), _row(expected, e)
                first = int(np.argmax(theirs["env_mask"] > 0)) or len(theirs["env_mask"])  # the first turn's end
                np.testing.assert_array_equal(mine["response_ids"][:first], theirs["response_ids"][:first])
                if all(turns[k] >= turns[e] for k in range(e)):
                    full += 1
                    for key, value in theirs.items():
                        np.testing.assert_array_equal(mine[key], value, err_msg=f"{key} of episode {e}")
        assert full >= 3  # every round's first episode at least
        assert set(np.concatenate([b["sample_id"] for b in streamed.values()]).tolist()) == set(range(3 * prompts * g))
    finally:
        runner.stop()
