"""Partially generated groups handed over and continued (the ground of a mid-generation
checkpoint, issue 44 item 2): `GenerationEngine.partials()` gives every group in flight as far
as it got, and `submit(..., resume=...)` on another engine goes on from there. On the HF
engine a continued sample is the uninterrupted one: the same tokens (each sample's random
stream is handed over with it), log-probs to rounding (its context prefilled again), the
handed-over tokens keeping the version that sampled them."""

from __future__ import annotations

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
