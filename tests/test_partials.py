"""Partially generated groups handed over and continued (the ground of a mid-generation
checkpoint, issue 44 item 2): `GenerationEngine.partials()` gives every group in flight as far
as it got, and `submit(..., resume=...)` on another engine goes on from there. On the HF
engine a continued sample is the uninterrupted one: the same tokens (each sample's random
stream is handed over with it), log-probs to rounding (its context prefilled again), the
handed-over tokens keeping the version that sampled them. A streaming runner's rounds are read
the same way (`RoundStream.snapshot`), and a checkpoint of the algorithm keeps them instead of
waiting for them, resumed after a restore (the last test)."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from _tolerance import decoder_rtol
from m2po_rllib.rollout.engine import Partial, SamplingConfig, make_engine

PROMPTS = ["12+7=", "3+45=", "80+9="]
LONG = SamplingConfig(n=3, max_tokens=16, seed=11, temperature=1.0, top_k=20)
SHORT = SamplingConfig(n=2, max_tokens=3, seed=5, temperature=0.8, top_p=0.9)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    made = [make_engine("hf", tiny_model_dir) for _ in range(2)]
    yield made
    for engine in made:
        engine.shutdown()
    torch.set_num_threads(threads)


def _groups(engine):
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    return [("a", ids[0], LONG, 0), ("b", ids[1], LONG, 1), ("short", ids[2], SHORT, 2)]


def _run(engine, groups, steps: int | None = None) -> dict:
    """Submits `groups` and steps until all are back (or `steps` steps); the finished ones by key."""
    for key, ids, sampling, index, *resume in groups:
        engine.submit(key, ids, sampling, index=index, resume=resume[0] if resume else None)
    done, n = {}, 0
    while engine.in_flight and (steps is None or n < steps):
        done.update(engine.step())
        n += 1
    return done


def test_a_group_handed_over_mid_generation_goes_on_as_if_uninterrupted(engines, tiny_model_dir):
    first, second = engines
    first.update_weights({}, 3)  # the versions that sampled each part
    second.update_weights({}, 4)
    groups = _groups(first)
    uninterrupted = _run(first, groups)
    assert first.in_flight == 0

    before = _run(first, groups, steps=5)  # the short group ends within 5 steps, the long ones do not
    assert set(before) == {"short"}
    partials = first.partials()
    assert set(partials) == {"a", "b"} and all(len(p.token_ids) == 5 for g in partials.values() for p in g
                                                if p.finish_reason is None)
    first.step()  # the first engine goes on (what a checkpoint taken here does not keep)
    resumed = _run(second, [(k, ids, s, i, partials[k]) for k, ids, s, i in groups if k in partials])
    assert set(resumed) == {"a", "b"}
    for key, group in resumed.items():
        for got, want, handed in zip(group, uninterrupted[key], partials[key]):
            assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
            assert got.token_ids[:len(handed.token_ids)] == handed.token_ids
            tol = decoder_rtol(AutoConfig.from_pretrained(tiny_model_dir), tokens=len(want.token_ids) + 8)
            assert got.logprobs == pytest.approx(want.logprobs, abs=tol * max(1.0, *map(abs, want.logprobs)))
            k = len(handed.token_ids)
            if handed.finish_reason is None:  # its tokens keep version 3, the rest are version 4's
                assert got.token_versions() == [3] * k + [4] * (len(got.token_ids) - k)
            else:
                assert got.token_versions() == [3] * k
    while first.in_flight:
        first.step()


def test_a_group_whose_samples_had_all_ended_comes_back_as_it_was(engines):
    _, second = engines
    ids = second.tokenizer.encode(PROMPTS[0])
    ended = [Partial([5, 6], [-0.5, -0.25], [2, 2], "length"), Partial([7], [-1.0], [2], "stop", "x")]
    back = dict(_run(second, [("done", ids, SHORT, 0, ended)]))
    assert [(c.token_ids, c.logprobs, c.finish_reason, c.token_versions()) for c in back["done"]] == [
        ([5, 6], [-0.5, -0.25], "length", [2, 2]), ([7], [-1.0], "stop", [2])]
    assert back["done"][1].text == "x"


def test_partials_that_do_not_fit_their_group_are_refused(engines):
    _, second = engines
    ids = second.tokenizer.encode(PROMPTS[0])
    with pytest.raises(ValueError, match="resume holds 1 samples for a group of n=2"):
        second.submit("x", ids, SHORT, resume=[Partial([], [], [])])
    with pytest.raises(ValueError, match="has 1 log-probs and 0 versions"):
        second.submit("y", ids, SHORT, resume=[Partial([1, 2], [0.0], []), Partial([], [], [])])
    with pytest.raises(ValueError, match="is at its budget"):
        second.submit("z", ids, SHORT, resume=[Partial([1, 2, 3], [0.0] * 3, [0] * 3), Partial([], [], [])])
    assert second.in_flight == 0


# -- a streaming runner's rounds as far as they got (RoundStream.snapshot) ---------------------
@pytest.mark.parametrize("scored", [False, True], ids=["engine", "runner-scored"])
def test_a_streams_rounds_handed_over_mid_generation_go_on_from_where_they_were(tiny_model_dir, scored):
    """Round 0 partly generated and round 1 not started when the stream is read; another
    runner given the snapshot (and newer weights) continues round 0's samples from their
    tokens so far and starts round 1: each row keeps the first runner's tokens, labelled with
    their version, and only the rest is generated again, by the new weights; the row's
    `policy_version` is its oldest token's. `scored`: runners that score their rounds
    (`recompute_behavior_logp` in async mode) hand each sample's log-probs so far over with it
    (`Partial.scored`), so the resumed row's are each token's weights', not the last ones';
    a round handed over without them is refused by such a runner."""
    from test_streaming import _request, _runner, _take_all, _weights, assert_segments_are_their_weights

    from m2po_rllib.rollout.streaming import RoundStream

    training = dict(async_rollouts=True, recompute_behavior_logp=True) if scored else {}
    first, second = _runner(tiny_model_dir, **training), _runner(tiny_model_dir, **training)
    try:
        v1, v2 = _weights(tiny_model_dir, 1, 0.01), _weights(tiny_model_dir, 2, -0.02)
        stream = RoundStream(first.host, first.plan_round, first.pack_round)  # driven here, no thread
        stream.put([_request(0, v1, min_version=1)])
        for _ in range(4):
            stream.advance()
        stream.put([_request(1, v1, min_version=1)])
        stream._pause_requests += 1  # round 1 waits: not started when the snapshot is read
        snapshot = stream.snapshot()
        stream._pause_requests -= 1
        assert sorted(sorted(e) for e in snapshot) == [["prompt_ids", "request", "resume"], ["request"]]
        (generating,) = [e for e in snapshot if "resume" in e]
        (waiting,) = [e for e in snapshot if "resume" not in e]
        assert generating["request"]["first_sample_id"] == 0 and "weights" not in generating["request"]
        handed = generating["resume"]
        assert max(len(p.token_ids) for group in handed.values() for p in group) == 4  # 4 steps so far

        resumed = RoundStream(second.host, second.plan_round, second.pack_round)
        if scored:  # handed over without the log-probs its runner scored: refused, nothing started
            bare = {i: [dataclasses.replace(p, scored=None) for p in group] for i, group in handed.items()}
            resumed.put([{**generating["request"], "weights": v2, "resume": bare}])
            with pytest.raises(ValueError, match="saved without its runner's behaviour log-probs"):
                resumed.advance()
            assert second.engine.in_flight == 0
            resumed = RoundStream(second.host, second.plan_round, second.pack_round)
        resumed.put([{**generating["request"], "weights": v2, "resume": handed, "prompt_ids": generating["prompt_ids"]},
                     {**waiting["request"], "weights": v2}])
        done = _take_all(resumed, 2)
        if scored:
            assert_segments_are_their_weights(done[0], (v1, v2), second.config, tiny_model_dir)
    finally:
        first.stop()
        second.stop()
    batch = done[0]
    mask, versions = batch["response_mask"].astype(bool), batch["token_version"]
    samples = [p for i in sorted(handed) for p in handed[i]]
    assert len(samples) == len(batch["sample_id"])
    for row, p in enumerate(samples):
        k = len(p.token_ids)
        assert batch["response_ids"][row][:k].tolist() == p.token_ids  # the first runner's tokens, kept
        assert (p.scored is not None and len(p.scored) == k) == scored
        np.testing.assert_allclose(batch["behavior_logp"][row][:k], p.scored if scored else p.logprobs, rtol=0, atol=0)
        got = versions[row][mask[row]].tolist()
        n_new = int(mask[row].sum()) - k
        assert got == [1] * k + [2] * n_new and (n_new == 0) == (p.finish_reason is not None)
    assert batch["policy_version"].tolist() == [1] * len(samples)  # each row's oldest token
    assert set(done[1 * 2 * 4]["policy_version"].tolist()) == {2}  # round 1: begun by the second runner


@pytest.mark.parametrize("scored", [False, True], ids=["engine", "runner-scored"])
def test_a_multi_turn_round_handed_over_mid_episode_goes_on_from_where_it_was(scored):
    """A multi-turn round read with episodes past their first turn and a turn in flight: another
    runner replays each episode's played turns into its own env (reset on the same seed) and
    continues the turn in flight. With the same weights (under a new version) the round is the
    uninterrupted one, token for token (the HF engine continues each sample's random stream),
    its env replies and rewards included; the handed-over tokens keep their version. An env
    that replies otherwise on the replay is refused. `scored` (runners that score their
    rounds, other weights after the hand-over): each policy token's behaviour log-prob is its
    own weights'."""
    from test_episodes import MODEL, _config
    from test_streaming import _take_all, _weights, assert_segments_are_their_weights

    from m2po_rllib.models.builtin import resolve_model_path
    from m2po_rllib.rollout.env_runner import LLMEnvRunner
    from m2po_rllib.rollout.streaming import RoundStream

    cfg = _config().training(async_rollouts=True, recompute_behavior_logp=True) if scored else _config()
    first, second = LLMEnvRunner(config=cfg), LLMEnvRunner(config=cfg)
    try:
        path = resolve_model_path(MODEL)
        v1, v2 = _weights(path, 1, 0.0), _weights(path, 2, -0.01 if scored else 0.0)
        stream = RoundStream(first.host, first.plan_round, first.pack_round)
        stream.put([dict(num_prompts=2, seed=41, stream=0, weights=v1, first_sample_id=0, min_version=1)])
        for _ in range(40):  # until an episode is in its second turn, a token or more into it
            assert stream.advance()
            (r,) = stream._active.values()
            partials = first.engine.partials()
            if any(e.turns >= 1 and not e.done and partials[(0, i)][0].token_ids for i, e in enumerate(r.episodes)):
                break
        (entry,) = stream.snapshot()
        handed = entry["resume"]
        mid = [e for e, so_far in handed.items() if so_far.played and so_far.turn is not None and so_far.turn.token_ids]
        assert mid, "no episode was handed over mid-turn after its first turn"
        uninterrupted = _take_all(stream, 1)[0]  # the first runner goes on

        request = {**entry["request"], "weights": v2, "resume": handed, "prompt_ids": entry["prompt_ids"]}
        if not scored:  # an env whose replies on the replay differ from the saved row: refused
            e = mid[0]
            tampered = dict(handed)
            tampered[e] = dataclasses.replace(handed[e], token_ids=handed[e].token_ids[:-1] + [handed[e].token_ids[-1] + 1])
            refused = RoundStream(second.host, second.plan_round, second.pack_round)
            refused.put([{**request, "resume": tampered}])
            with pytest.raises(ValueError, match=f"episode {e} .* replied otherwise"):
                refused.advance()
        resumed = RoundStream(second.host, second.plan_round, second.pack_round)
        resumed.put([request])
        got = _take_all(resumed, 1)[0]
    finally:
        first.stop()
        second.stop()
    real = (got["response_mask"] > 0) | (got["env_mask"] > 0)
    for e, so_far in handed.items():
        k = len(so_far.token_ids) + (len(so_far.turn.token_ids) if so_far.turn is not None else 0)
        assert got["response_ids"][e][:k].tolist() == so_far.token_ids + (so_far.turn.token_ids if so_far.turn else [])
        versions = got["token_version"][e][real[e]].tolist()
        assert versions[:k] == [1] * k and set(versions[k:]) <= {2}
        if scored:
            policy = got["response_mask"][e][:k] > 0  # an env token has no log-prob
            np.testing.assert_array_equal(got["behavior_logp"][e][:k][policy], np.asarray(so_far.scored, np.float32)[policy])
    if scored:
        assert_segments_are_their_weights(got, (v1, v2), cfg, path)
    else:
        for key in ("response_ids", "response_mask", "env_mask", "rewards", "sample_id"):
            np.testing.assert_array_equal(got[key], uninterrupted[key], err_msg=key)
        tol = decoder_rtol(AutoConfig.from_pretrained(path), tokens=got["prompt_ids"].shape[1] + got["response_ids"].shape[1])
        scale = max(1.0, float(np.abs(uninterrupted["behavior_logp"]).max()))
        np.testing.assert_allclose(got["behavior_logp"], uninterrupted["behavior_logp"], atol=tol * scale, rtol=0)


# -- a checkpoint taken with rounds generating (the algorithm, remote streaming runners) --------
@pytest.mark.slow
def test_streaming_trains_within_the_bound_and_loses_nothing_across_a_checkpoint_and_a_kill(
        ray_session, tiny_model_dir, tmp_path):
    """A checkpoint taken with rounds generating does not wait for them: each runner's stream
    is read as far as it got (issue 44 item 2). Restored (new runners), those rounds go on from
    their saved tokens (each resumed row begins with them: no saved token generated again),
    a runner is killed with rounds in its engine, and each sample is trained once, within the
    bound. The runners score their rounds (`recompute_behavior_logp`): a resumed row's saved
    tokens keep the behaviour log-probs their runner scored before the checkpoint."""
    from test_async import _async_config, _record_trained_ids

    from m2po_rllib import M2PO

    cfg = (_async_config(tiny_model_dir, max_staleness=4, recompute_behavior_logp=True)
           .env_runners(streaming=True, max_new_tokens=12)
           .fault_tolerance(restart_failed_env_runners=True))

    def slow_steps(runner, delay_s: float):  # generation slower than an update, as on a GPU with long answers
        engine = runner.host.engine
        step = getattr(engine, "unslowed_step", engine.step)
        engine.unslowed_step = step
        engine.step = lambda: (time.sleep(delay_s), step())[1]

    algo = cfg.build_algo()
    try:
        seen = _record_trained_ids(algo)
        algo.env_runner_group.foreach_env_runner(lambda r: slow_steps(r, 0.02), local_env_runner=False)
        ages = []
        algo.train()
        streams = algo.env_runner_group.foreach_env_runner(lambda r: r._stream is not None, local_env_runner=False)
        assert streams == [True, True]  # the rounds went through the runners' streams
        for _ in range(2):
            result = algo.train()
            ages.append(result["learners"]["default_policy"]["staleness/trained_max"])
        # the rounds just requested are a token or so in when the checkpoint reads them
        algo.env_runner_group.foreach_env_runner(lambda r: slow_steps(r, 0.5), local_env_runner=False)
        ckpt = algo.save_to_path(str(tmp_path / "ckpt"))
        assert algo.sampler.num_in_flight() > 0  # not drained: the rounds went on generating
        before = list(seen)
    finally:
        algo.stop()
    algo = M2PO.from_checkpoint(ckpt)
    try:
        resumed = dict(algo.sampler._resume)  # the checkpoint's rounds as far as they got
        assert resumed and any(p.token_ids for r in resumed.values() for g in r["resume"].values() for p in g)
        # saved again before they are back: they keep what they were restored with
        assert algo.get_state()["m2po"]["sampler"]["partials"].keys() == resumed.keys()
        after = _record_trained_ids(algo)
        rollouts, update = [], algo._update

        def spy(rollout):
            rollouts.append({k: np.array(rollout[k]) for k in ("sample_id", "response_ids", "token_version",
                                                               "behavior_logp")})
            return update(rollout)

        algo._update = spy
        algo.train()
        pids = algo.env_runner_group.foreach_env_runner(lambda r: os.getpid(), local_env_runner=False)
        assert algo.sampler.admission.num_in_flight(1) > 0
        os.kill(pids[0], signal.SIGKILL)  # runner 1 dies with rounds in its engine
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            result = algo.train()
            ages.append(result["learners"]["default_policy"]["staleness/trained_max"])
            if result["fault_tolerance"]["num_remote_worker_restarts"] >= 1 and len(ages) >= 6:
                break
        assert result["fault_tolerance"]["num_remote_worker_restarts"] >= 1
        assert algo.policy_version == algo.iteration * algo.config.updates_per_step
    finally:
        algo.stop()
    assert max(ages) <= 4
    trained = np.concatenate(before + after).tolist()
    assert sorted(trained) == list(range(len(trained)))  # each sample once, whole rounds (hence groups)
    # every resumed round was trained (a round of the killed runner resumed again elsewhere),
    # each row beginning with its saved tokens and versions
    rows = {int(i): (r["response_ids"][j], r["token_version"][j], r["behavior_logp"][j])
            for r in rollouts for j, i in enumerate(r["sample_id"])}
    rows_per_round = algo.sampler.rows_per_round
    for n, entry in resumed.items():
        samples = [p for i in sorted(entry["resume"]) for p in entry["resume"][i]]
        for j, p in enumerate(samples):
            ids, versions, logp = rows[n * rows_per_round + j]
            k = len(p.token_ids)
            assert ids[:k].tolist() == p.token_ids and versions[:k].tolist() == p.versions
            np.testing.assert_array_equal(logp[:k], np.asarray(p.scored or [], np.float32))
