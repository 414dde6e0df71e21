"""The generation engines (HF and vLLM) against the `GenerationEngine` contract.

One vLLM engine serves the whole module (each start costs ~35 s on CPU); the tests that change
its state run in file order: parity first, then weight syncs (which end on the original
weights), then the kill test last.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import torch

from _references import plain_truncated_logp
from _tolerance import decoder_rtol
from transformers import AutoConfig
from m2po_rllib.rollout.engine import EngineDeadError, SamplingConfig, make_engine
from m2po_rllib.rollout.hf_engine import HFEngine
from m2po_rllib.rollout.vllm_engine import VLLMEngine, serialize_weight_chunks
from m2po_rllib.rollout.vllm_health import pid_alive

PROMPTS = ["1+2=", "what is 3*4? ", "(7-5)*2=", "x"]
ENGINE_KINDS = ["hf", pytest.param("vllm", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # The tiny model's matmuls are far faster on one thread than on two contended ones.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf_engine(tiny_model_dir):
    engine = make_engine("hf", tiny_model_dir)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_dir):
    # With the native receive path over gloo too (vLLM's weight-transfer API; the object-store
    # path is unchanged by it): one engine start serves both paths' tests.
    engine = make_engine("vllm", tiny_model_dir, kv_cache_space_gb=1, weight_transport="gloo")
    print(f"vLLM engine start: {engine.startup_seconds:.1f} s")
    yield engine
    engine.shutdown()


@pytest.fixture
def engine(request):
    return request.getfixturevalue(f"{request.param}_engine")


@pytest.fixture(scope="module")
def prompt_ids(hf_engine):
    return [hf_engine.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    from m2po_rllib.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-seed1"), seed=1)


def load_hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def reference_logprobs(model, prompt, tokens, temperature, top_p=1.0, top_k=0):
    """Behaviour log-probs by one plain forward over prompt + completion, top-k and top-p
    written out as vLLM's rule: keep the logits >= the k-th largest, then drop tokens whose
    ascending cumulative probability (over the kept ones) is <= 1 - top_p."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    return [plain_truncated_logp(logits[step], top_k, top_p)[token].item() for step, token in enumerate(tokens)]


def assert_same(groups_a, groups_b):
    """Same tokens, text and finish reasons; log-probs equal up to kernel round-off."""
    for group_a, group_b in zip(groups_a, groups_b, strict=True):
        for a, b in zip(group_a, group_b, strict=True):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def max_logprob_diff(model, prompts, groups, temperature, top_p=1.0, top_k=0):
    diff = 0.0
    for prompt, group in zip(prompts, groups):
        for c in group:
            ref = reference_logprobs(model, prompt, c.token_ids, temperature, top_p, top_k)
            diff = max(diff, max(abs(a - b) for a, b in zip(ref, c.logprobs)))
    return diff


# --- the contract, no engine needed ---------------------------------------------------------


def test_make_engine_lists_valid_kinds():
    with pytest.raises(ValueError, match=r"'hf', 'vllm'"):
        make_engine("sglang", "/nowhere")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n": 0}, "`n`"),
        ({"temperature": -1}, "`temperature`"),
        ({"top_p": 0}, "`top_p`"),
        ({"top_k": -2}, "`top_k`"),
        ({"top_k": 2.0}, "`top_k`"),
        ({"max_tokens": 0}, "`max_tokens`"),
        ({"stop": ["a", ""]}, "`stop`"),
    ],
)
def test_sampling_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_request_seed_is_flat_sample_index():
    s = SamplingConfig(n=4, seed=100)
    assert [s.request_seed(i, j) for i in range(2) for j in range(4)] == list(range(100, 108))
    assert SamplingConfig(n=4).request_seed(1, 2) is None


def test_weight_chunks_are_bounded_and_clone_tied_weights():
    from safetensors.torch import load

    embed = torch.randn(100, 64)
    fused = torch.randn(3, 64, 64)
    weights = {"embed": embed, "lm_head": embed, "q": fused[0], "k": fused[1], "v": fused[2]}
    chunks = list(serialize_weight_chunks(weights, chunk_bytes=2 * 64 * 64 * 4))
    loaded = {k: v for c in chunks for k, v in load(c).items()}
    assert len(chunks) == 4  # embed (over the bound, alone) | lm_head | q, k | v
    assert loaded.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], tensor), name
    halves = load(next(serialize_weight_chunks({"w": embed}, 2**20, torch.bfloat16)))
    assert halves["w"].dtype == torch.bfloat16


# --- both engines ---------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINE_KINDS, indirect=True)
def test_samples_come_back_grouped_in_order(engine, prompt_ids):
    sampling = SamplingConfig(n=3, max_tokens=10, seed=7)
    groups = engine.generate(prompt_ids, sampling)
    assert [len(g) for g in groups] == [3] * len(PROMPTS)
    for group in groups:
        for c in group:
            assert 1 <= len(c.token_ids) == len(c.logprobs) <= 10
            assert c.finish_reason in ("stop", "length")
            assert all(lp <= 0 for lp in c.logprobs)
    # Sample j of prompt i is request i * n + j: alone with that seed, it comes out the same.
    for i, j in [(2, 0), (1, 2), (3, 1)]:
        alone = engine.generate([prompt_ids[i]], SamplingConfig(max_tokens=10, seed=7 + 3 * i + j))
        assert alone[0][0].token_ids == groups[i][j].token_ids, (i, j)
        assert alone[0][0].logprobs == pytest.approx(groups[i][j].logprobs, abs=1e-4)
    assert engine.generate([], sampling) == []


@pytest.mark.parametrize("engine", ENGINE_KINDS, indirect=True)
def test_seeds_make_sampling_reproducible(engine, prompt_ids):
    def tokens(seed):
        groups = engine.generate(prompt_ids, SamplingConfig(n=2, max_tokens=12, seed=seed))
        return [c.token_ids for g in groups for c in g]

    assert tokens(3) == tokens(3)
    assert tokens(3) != tokens(4)
    assert tokens(None) != tokens(None)


@pytest.mark.parametrize("engine", ENGINE_KINDS, indirect=True)
def test_stop_strings_end_generation(engine, prompt_ids):
    tok = engine.tokenizer
    free = engine.generate(prompt_ids, SamplingConfig(n=2, max_tokens=24, seed=11))
    checked = 0
    for i, group in enumerate(free):
        for j, c in enumerate(group):
            # Stop on the first single-character token whose character is new in the text, so
            # the seeded rerun must end exactly there.
            for k in range(1, len(c.token_ids)):
                before = tok.decode(c.token_ids[:k], skip_special_tokens=True)
                char = tok.decode(c.token_ids[k : k + 1])
                if len(char) == 1 and char not in before:
                    break
            else:
                continue
            stopped = engine.generate(
                [prompt_ids[i]], SamplingConfig(max_tokens=24, seed=11 + 2 * i + j, stop=["@@", char])
            )[0][0]
            assert stopped.finish_reason == "stop"
            assert stopped.text == before
            assert stopped.token_ids == c.token_ids[: k + 1]  # the stop-completing token stays
            assert len(stopped.logprobs) == k + 1
            checked += 1
    assert checked >= 4


@pytest.mark.parametrize("engine", ENGINE_KINDS, indirect=True)
@pytest.mark.parametrize(
    "temperature, top_p, top_k", [(1.0, 1.0, 0), (0.7, 1.0, 0), (0.8, 0.6, 0), (0.0, 1.0, 0), (1.0, 0.9, 20), (1.0, 1.0, 3)]
)
def test_logprobs_are_those_of_the_sampling_distribution(
    engine, prompt_ids, tiny_model_dir, temperature, top_p, top_k
):
    model = load_hf(tiny_model_dir)
    groups = engine.generate(
        prompt_ids, SamplingConfig(n=2, max_tokens=12, seed=5, temperature=temperature, top_p=top_p, top_k=top_k)
    )
    assert max_logprob_diff(model, prompt_ids, groups, temperature, top_p, top_k) < 1e-3
    if top_k:  # only the k most likely tokens were ever sampled
        assert max_logprob_diff(model, prompt_ids, groups, temperature, top_p) > 1e-2


@pytest.mark.parametrize("engine", ENGINE_KINDS, indirect=True)
def test_the_learner_replays_truncated_sampling_on_policy(engine, prompt_ids, tiny_model_dir):
    """The learner's log-probs (chunked, `m2po_rllib.torch.logp`) of the engine's samples at
    top_p=0.9, top_k=20 equal the engine's: an on-policy ratio of 1. Without the replay
    they differ by the kept mass."""
    from m2po_rllib.torch.logp import response_logp
    from m2po_rllib.wire.batch import pack_rollouts, to_train_batch

    groups = engine.generate(prompt_ids, SamplingConfig(n=4, max_tokens=12, seed=9, top_p=0.9, top_k=20))
    rows = [(p, c) for p, group in zip(prompt_ids, groups) for c in group]
    packed = pack_rollouts([p for p, _ in rows], [c.token_ids for _, c in rows], [c.logprobs for _, c in rows],
                           [0.0] * len(rows), 0)
    batch = {k: torch.as_tensor(v) for k, v in to_train_batch(packed, packed["rewards"]).items()}
    mask = batch["response_mask"] > 0
    model = load_hf(tiny_model_dir)
    with torch.no_grad():
        replayed, _ = response_logp(model, batch, 1.0, top_k=20, top_p=0.9)
        plain, _ = response_logp(model, batch, 1.0)
    engine_logp = batch["behavior_logp"]
    assert (replayed - engine_logp)[mask].abs().max() < 1e-4
    assert (plain - engine_logp)[mask].abs().max() > 1e-2


def test_the_hf_engine_computes_its_head_in_fp32_when_asked(tiny_model_dir, prompt_ids):
    """bf16 engine, `head_dtype="float32"`: the logits it samples from (`_forward`, every
    position of the vocabulary) are the fp32 head's on the bf16 decoder's last hidden state
    (vLLM's rule: hidden states and weights cast up); with no head_dtype, the bf16 head's,
    which differ from them by bf16's rounding of the logits. Greedy log-probs follow."""
    from _tolerance import accumulation_rtol

    prompt = torch.tensor([prompt_ids[0]])
    args = (prompt, torch.ones_like(prompt), torch.arange(prompt.shape[1])[None], None)
    engines = {head: make_engine("hf", tiny_model_dir, dtype="bfloat16", head_dtype=head) for head in ("float32", None)}
    try:
        with torch.no_grad():
            logits = {head: e.forward(*args)[0][0] for head, e in engines.items()}
            model = engines[None].model
            hidden = model.get_decoder()(input_ids=prompt).last_hidden_state[0, -1].float()
            weight = model.get_output_embeddings().weight.float()
            greedy = engines["float32"].generate([prompt_ids[0]], SamplingConfig(n=1, temperature=0.0, max_tokens=1))
    finally:
        for e in engines.values():
            e.shutdown()
    fp32 = hidden @ weight.T
    # fp32 sums over H in another order: gamma_H times the sum of |h_k w_k| per logit
    bound = accumulation_rtol(torch.float32, hidden.shape[0]) * float((hidden.abs() @ weight.abs().T).max())
    assert logits["float32"].dtype == torch.float32
    torch.testing.assert_close(logits["float32"], fp32, rtol=0, atol=bound)
    assert (logits[None].float() - fp32).abs().max() > 10 * bound  # the bf16 head's rounding
    token = int(fp32.argmax())
    assert greedy[0][0].token_ids == [token]
    lse_bound = 2 * bound + accumulation_rtol(torch.float32, weight.shape[0])  # + the log-sum-exp's own sum
    assert greedy[0][0].logprobs[0] == pytest.approx(float(torch.log_softmax(fp32, -1)[token]), abs=lse_bound)


def test_the_truncation_rule_is_vllms():
    """`m2po_rllib.common.truncation` keeps the tokens vLLM's own sampler keeps (its PyTorch rule,
    the one vLLM runs on CPU), ties included, for top-k, top-p and both."""
    vllm_ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    from m2po_rllib.common.truncation import dropped_tokens

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 3
    logits[:8, :10] = 1.5  # ties at the top-k and top-p boundaries
    logits[8:16] = torch.randint(0, 4, (8, 50), generator=g).float()
    for top_k, top_p in [(5, 1.0), (10, 1.0), (0, 0.9), (0, 0.5), (7, 0.8), (1, 0.3), (50, 0.95)]:
        k = torch.full((64,), top_k) if top_k else None
        p = torch.full((64,), top_p) if top_p < 1 else None
        theirs = vllm_ops.apply_top_k_top_p_pytorch(logits.clone(), k, p, allow_cpu_sync=True)
        ours = dropped_tokens(logits, top_k, top_p)
        assert torch.equal(ours, torch.isneginf(theirs)), (top_k, top_p)
    assert dropped_tokens(logits, 0, 1.0) is None and dropped_tokens(logits, -1, 1.0) is None
    # a token whose mass (0.10000002 in float32) lies between 1 - 0.9 in float64 and in
    # float32 (vLLM's): vLLM drops it, and so must we
    boundary = torch.tensor([[-2.197224497336219, 0.0]])
    theirs = vllm_ops.apply_top_k_top_p_pytorch(boundary.clone(), None, torch.full((1,), 0.9), allow_cpu_sync=True)
    assert torch.isneginf(theirs[0, 0]) and torch.equal(dropped_tokens(boundary, 0, 0.9), torch.isneginf(theirs))


@pytest.mark.slow
def test_greedy_generation_agrees_between_hf_and_vllm(hf_engine, vllm_engine, prompt_ids):
    sampling = SamplingConfig(n=2, max_tokens=16, temperature=0)
    hf = hf_engine.generate(prompt_ids, sampling)
    assert [len(g) for g in hf] == [2] * len(PROMPTS)
    assert_same(hf, vllm_engine.generate(prompt_ids, sampling))


def test_multi_turn_episodes_are_the_same_on_vllm_and_hf(hf_engine, vllm_engine, tiny_model_dir):
    """The runner's episode loop (rollout/episodes.py) on both engines, greedy, feedback
    episodes of 3 turns: the same tokens, policy masks and rewards (each turn's context is
    the prompt and everything so far, as token ids)."""
    import gymnasium as gym
    from transformers import AutoTokenizer

    import envs  # noqa: F401
    from m2po_rllib.rollout.episodes import Episode, run_episodes

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    played = []
    for engine in (hf_engine, vllm_engine):
        episodes = []
        for seed in range(4):
            env = gym.make("m2po/Arithmetic-v0", disable_env_checker=True, tokenizer=tokenizer, template="compact",
                           digits=2, max_turns=3).unwrapped
            episodes.append(Episode(env.reset(seed=seed)[0]["prompt_token_ids"].tolist(), env))
        run_episodes(engine, episodes, lambda turn: SamplingConfig(n=1, max_tokens=8, temperature=0), max_turns=3)
        played.append(episodes)
    hf, vl = played
    assert max(e.turns for e in hf) > 1  # the random model is wrong: the env's feedback follows
    for a, b in zip(hf, vl):
        assert (a.token_ids, a.policy_mask, a.reward, a.turns) == (b.token_ids, b.policy_mask, b.reward, b.turns)
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x - y) < 1e-3


# -- streaming: groups join the running batch and come back whole ------------------------------
LONG = SamplingConfig(n=3, max_tokens=24, seed=11, temperature=1.0, top_k=20)
SHORT = SamplingConfig(n=2, max_tokens=4, seed=5, temperature=0.8, top_p=0.9)
GREEDY = SamplingConfig(n=2, max_tokens=10, temperature=0)


def stream(engine, plan: dict[int, list], limit: int = 200, resume: dict | None = None) -> tuple[dict, list]:
    """Steps `engine`, submitting plan[step]'s groups (key, prompt ids, sampling, index; each
    from `resume[key]` where given) before that step, until nothing is in flight; the groups by
    key with the step each came back in."""
    finished, order = {}, []
    for step in range(limit):
        for key, ids, sampling, index in plan.get(step, []):
            engine.submit(key, ids, sampling, index=index, resume=(resume or {}).get(key))
        for key, group in engine.step():
            assert key not in finished
            finished[key], order = (group, step), order + [key]
        if step >= max(plan) and not engine.in_flight:
            return finished, order
    raise AssertionError(f"still {engine.in_flight} groups in flight after {limit} steps")


@pytest.mark.parametrize("engine", ENGINE_KINDS, indirect=True)
def test_streamed_groups_join_the_running_batch_and_are_what_generate_gives(engine, prompt_ids, tiny_model_dir):
    """Groups submitted while others decode, each with its own settings and length, come back
    whole as they finish (a short one that joined later overtakes a long one), each sample the
    one `generate` draws for the same seed and prompt index."""
    plan = {0: [("long", prompt_ids[0], LONG, 0), ("short", prompt_ids[1], SHORT, 1)],
            2: [("greedy", prompt_ids[2], GREEDY, 0)],
            6: [("late", prompt_ids[3], LONG, 3), ("again", prompt_ids[0], SHORT, 4)]}
    finished, order = stream(engine, plan)
    assert sorted(finished) == sorted(k for groups in plan.values() for k, *_ in groups)
    assert order.index("short") < order.index("long") and order.index("greedy") < order.index("long")
    assert order.index("again") < order.index("late")
    assert engine.in_flight == 0
    for groups in plan.values():
        for key, ids, sampling, index in groups:
            group, _ = finished[key]
            assert len(group) == sampling.n
            alone = engine.generate([ids], dataclasses.replace(sampling, seed=sampling.request_seed(index, 0)))[0]
            for streamed, reference in zip(group, alone):
                assert streamed.token_ids == reference.token_ids, key
                assert streamed.finish_reason == reference.finish_reason and streamed.text == reference.text
                # one float32 forward each, of other batch shapes: rounding alone (_tolerance.py),
                # relative to the largest log-prob
                tol = decoder_rtol(AutoConfig.from_pretrained(tiny_model_dir), tokens=len(ids) + len(reference.token_ids))
                scale = max(1.0, max(abs(x) for x in reference.logprobs))
                assert streamed.logprobs == pytest.approx(reference.logprobs, abs=tol * scale)
    assert finished["long"][0][0].token_ids != finished["long"][0][1].token_ids  # own streams per sample


@pytest.mark.parametrize("engine", ENGINE_KINDS, indirect=True)
def test_a_streaming_engine_refuses_what_would_mix_versions_until_drained(engine, prompt_ids, tiny_model_dir):
    engine.submit("g", prompt_ids[0], SHORT)
    with pytest.raises(ValueError, match="'g' is already in flight"):
        engine.submit("g", prompt_ids[1], SHORT)
    with pytest.raises(RuntimeError, match="cannot load weights with 1 streamed groups in flight"):
        engine.update_weights({}, engine.version + 1)
    with pytest.raises(RuntimeError, match="cannot generate a batch with 1 streamed groups in flight"):
        engine.generate(prompt_ids[:1], SHORT)
    finished, _ = stream(engine, {0: []})
    assert list(finished) == ["g"] and engine.in_flight == 0
    assert engine.generate(prompt_ids[:1], SHORT)[0]  # drained: batches again


HANDED = SamplingConfig(n=3, max_tokens=12, temperature=1.0, top_k=20)  # seeded in the test


@pytest.mark.parametrize("engine", ENGINE_KINDS, indirect=True)
def test_groups_in_flight_are_handed_over_as_far_as_they_got_and_continued(engine, prompt_ids, tiny_model_dir):
    """`partials()` between two steps: every group in flight, each sample the prefix of what
    its group then returns (tokens, log-probs, versions), a sample that already ended whole
    (vLLM: from its request's aggregator). Continued under other keys (`submit(resume=...)`),
    each sample keeps what it was handed and goes on within its budget, its new tokens sampled
    from the policy given them (their log-probs a plain forward's over the whole sequence), a
    greedy one as the uninterrupted sample (vLLM: one request's sample copied n times, each
    copy continued); an ended one is not generated further. (A sampled continuation draws a
    stream of its own on vLLM, which keeps no random state; on the HF engine it is the
    uninterrupted one: test_partials.)"""
    at = 5
    for seed in range(0, 4000, 100):  # a round in which a sample ends (an EOS) while its group goes on
        sampling = dataclasses.replace(HANDED, seed=seed)
        plan = [("a", prompt_ids[0], sampling, 0), ("b", prompt_ids[1], sampling, 1), ("c", prompt_ids[3], sampling, 2),
                ("greedy", prompt_ids[2], GREEDY, 3)]
        for key, ids, group_sampling, index in plan:
            engine.submit(key, ids, group_sampling, index=index)
        early = [key for _ in range(at) for key, _ in engine.step()]
        handed = engine.partials()
        assert sorted(handed) == sorted({"a", "b", "c", "greedy"} - set(early)) and engine.in_flight == len(handed)
        going = [p for group in handed.values() for p in group if p.finish_reason is None]
        assert all(0 < len(p.token_ids) <= at for p in going)  # a token a step at most (vLLM's core schedules)
        if going and len(going) < sum(map(len, handed.values())):
            break
        stream(engine, {0: []})
    else:
        pytest.fail("no seed gave a sample that ended while its group went on")
    finished, _ = stream(engine, {0: []})
    for key, group in handed.items():
        for p, c in zip(group, finished[key][0], strict=True):
            k = len(p.token_ids)
            assert (c.token_ids[:k], c.logprobs[:k], c.token_versions()[:k]) == (p.token_ids, p.logprobs, p.versions)
            assert p.finish_reason is None or (len(c.token_ids), c.finish_reason) == (k, p.finish_reason)

    model = load_hf(tiny_model_dir)
    resumed, _ = stream(engine, {0: [(f"{key}'", *rest) for key, *rest in plan if key in handed]},
                        resume={f"{key}'": group for key, group in handed.items()})
    groups = {key: (ids, group_sampling) for key, ids, group_sampling, _ in plan}
    for key, group in handed.items():
        ids, sampling = groups[key]
        for p, c, whole in zip(group, resumed[f"{key}'"][0], finished[key][0], strict=True):
            k, n = len(p.token_ids), len(c.token_ids)
            assert (c.token_ids[:k], c.logprobs[:k], c.token_versions()[:k]) == (p.token_ids, p.logprobs, p.versions)
            if p.finish_reason is not None:
                assert (n, c.finish_reason) == (k, p.finish_reason)
                continue
            assert k < n <= sampling.max_tokens and c.token_versions()[k:] == [engine.version] * (n - k)
            if sampling.temperature == 0:  # greedy: the continuation is the uninterrupted sample
                assert c.token_ids == whole.token_ids
            ref = reference_logprobs(model, ids, c.token_ids, sampling.temperature, top_k=sampling.top_k)
            tol = decoder_rtol(AutoConfig.from_pretrained(tiny_model_dir), tokens=len(ids) + n)
            assert c.logprobs[k:] == pytest.approx(ref[k:], abs=tol * max(1.0, *map(abs, ref)))


def test_a_stop_string_across_a_resumed_samples_two_parts_ends_it_where_it_completes(hf_engine):
    """vLLM checks stop strings in a continuation's own text; a stop string that begins in the
    handed-over tokens and ends in the continuation's is found when the two are joined: the
    sample ends at the token completing it, its text cut before it."""
    from m2po_rllib.rollout.engine import Completion, Partial
    from m2po_rllib.rollout.vllm_stream import VLLMStream, _Resumed

    encode = hf_engine.tokenizer.encode
    sampling = SamplingConfig(n=1, max_tokens=12, seed=1, stop=["=7"])
    joined = VLLMStream(hf_engine)._joined(
        _Resumed(4, sampling),
        Partial(encode("12="), [-0.1, -0.2, -0.3], [3, 3, 3]),
        Completion(encode("7 ok"), [-0.4, -0.5, -0.6, -0.7], "7 ok", "length", [(4, 0, 4)]),
    )
    assert (joined.token_ids, joined.logprobs, joined.token_versions()) == (encode("12=7"), [-0.1, -0.2, -0.3, -0.4],
                                                                           [3, 3, 3, 4])
    assert (joined.finish_reason, joined.text) == ("stop", "12")
    plain = VLLMStream(hf_engine)._joined(  # no stop string across them: the continuation's end kept
        _Resumed(4, sampling), Partial(encode("12"), [-0.1, -0.2], [3, 3]),
        Completion(encode("+5"), [-0.4, -0.5], "+5", "length", [(4, 0, 2)]),
    )
    assert (plain.token_ids, plain.finish_reason, plain.text) == (encode("12+5"), "length", "12+5")


def test_the_hf_stream_keeps_only_live_rows_and_columns_in_its_cache(hf_engine, prompt_ids):
    """Rows leave the KV cache as they finish and columns no live row attends to are dropped:
    a stream fed for many steps holds a cache as long as its longest live sequence."""
    plan = {step: [(f"g{step}", prompt_ids[step % 4], SHORT, step)] for step in range(0, 60, 3)}
    widths = []
    original = hf_engine.step

    def step():
        out = original()
        if hf_engine._stream.rows:
            live = max(len(r.prompt) + len(r.tokens) for r in hf_engine._stream.rows)
            widths.append((hf_engine._stream.mask.shape[1], live, len(hf_engine._stream.rows)))
        return out

    hf_engine.step = step
    try:
        finished, _ = stream(hf_engine, plan)
    finally:
        del hf_engine.step
    assert len(finished) == 20
    # the cache holds the longest live sequence (its last token is fed by the next step), no more
    assert all(width == live for width, live, _ in widths), widths
    assert max(rows for *_, rows in widths) <= 2 * SHORT.n  # a 4-token group lives through <= 2 joins
    assert hf_engine._stream.past is None


@pytest.mark.parametrize("engine", ENGINE_KINDS, indirect=True)
def test_weight_sync_changes_the_policy_and_ignores_stale_versions(
    engine, prompt_ids, tiny_model_dir, other_model_dir
):
    greedy = SamplingConfig(max_tokens=16, temperature=0)
    sampled = SamplingConfig(n=2, max_tokens=16, seed=9, temperature=0.9)
    original, other = load_hf(tiny_model_dir), load_hf(other_model_dir)
    before = engine.generate(prompt_ids, greedy)
    start = engine.version

    assert engine.update_weights(other.state_dict(), start + 1)
    assert engine.version == start + 1
    after = engine.generate(prompt_ids, greedy)
    assert [g[0].token_ids for g in after] != [g[0].token_ids for g in before]
    # each token labelled with the version that sampled it (vLLM's own labels; the HF engine's)
    assert [c.weight_versions for g in before for c in g] == [[(start, 0, len(c.token_ids))] for g in before for c in g]
    assert [c.weight_versions for g in after for c in g] == [[(start + 1, 0, len(c.token_ids))] for g in after for c in g]
    diff = max_logprob_diff(other, prompt_ids, engine.generate(prompt_ids, sampled), 0.9)
    print(f"{type(engine).__name__}: max |logp - transformers| after sync = {diff:.2e}")
    assert diff < 1e-3

    # A duplicate or stale sync changes nothing, not even with different weights.
    assert not engine.update_weights(original.state_dict(), start + 1)
    assert not engine.update_weights(original.state_dict(), start)
    assert engine.version == start + 1
    assert_same(engine.generate(prompt_ids, greedy), after)

    # Back to the original weights in small chunks (layers straddle chunks on vLLM).
    if hasattr(engine, "sync_chunk_bytes"):
        engine.sync_chunk_bytes, chunk_bytes = 50_000, engine.sync_chunk_bytes
    try:
        assert engine.update_weights(original.state_dict(), start + 2)
    finally:
        if hasattr(engine, "sync_chunk_bytes"):
            engine.sync_chunk_bytes = chunk_bytes
    if hasattr(engine, "last_sync_stats"):
        assert engine.last_sync_stats["chunks"] > 10
    assert_same(engine.generate(prompt_ids, greedy), before)
    assert max_logprob_diff(original, prompt_ids, engine.generate(prompt_ids, sampled), 0.9) < 1e-3


@pytest.mark.parametrize("engine", ENGINE_KINDS, indirect=True)
def test_a_mid_sequence_load_goes_on_with_the_new_weights_and_labels_each_token(
    engine, prompt_ids, tiny_model_dir, other_model_dir
):
    """`update_weights(..., mid_sequence=True)` between two decoding steps: the groups in flight
    go on, each token labelled with the version that sampled it, and each segment's log-probs
    are a plain forward's over the whole sequence under that segment's weights (the KV cache
    was recomputed by the new weights, not kept: HF prefills again, vLLM preempts and
    recomputes); a group that joins after the load is all the new version's. (vLLM's engine
    core steps its requests on its own, ahead of our `step()` calls: where its load falls is
    read from its labels.)"""
    at = 5
    original, other = load_hf(tiny_model_dir), load_hf(other_model_dir)
    start = engine.version
    sampling = SamplingConfig(n=3, max_tokens=150, seed=3, temperature=1.0)
    engine.submit("before", prompt_ids[0], sampling)
    for _ in range(at):
        assert engine.step() == []
    assert engine.update_weights(other.state_dict(), start + 1, mid_sequence=True)
    finished, _ = stream(engine, {0: [("after", prompt_ids[1], sampling, 1)]})
    spanning = 0
    for key, ids in (("before", prompt_ids[0]), ("after", prompt_ids[1])):
        for c in finished[key][0]:
            versions, n = c.token_versions(), len(c.token_ids)
            k = versions.count(start) if key == "before" else 0  # tokens sampled before the load
            assert versions == [start] * k + [start + 1] * (n - k), key
            if isinstance(engine, HFEngine) and key == "before":
                assert k == min(at, n)
            spanning += 0 < k < n
            tol = decoder_rtol(AutoConfig.from_pretrained(tiny_model_dir), tokens=len(ids) + n)
            scale = max(1.0, max(abs(x) for x in c.logprobs))
            for model, version in ((original, start), (other, start + 1)):
                mine = [i for i, v in enumerate(versions) if v == version]
                ref = reference_logprobs(model, ids, c.token_ids, sampling.temperature)
                assert [c.logprobs[i] for i in mine] == pytest.approx([ref[i] for i in mine], abs=tol * scale)
    assert spanning >= 2  # samples long enough to cross the load
    assert engine.update_weights(original.state_dict(), start + 2)  # the module's engine back as it was


@pytest.mark.slow
def test_vllm_on_cpu_syncs_through_the_object_store_or_gloo_never_nccl(vllm_engine, tiny_model_dir, prompt_ids):
    greedy = SamplingConfig(max_tokens=16, temperature=0)
    before = vllm_engine.generate(prompt_ids, greedy)
    version = vllm_engine.version
    assert vllm_engine.update_weights(load_hf(tiny_model_dir).state_dict(), version + 1)
    stats = vllm_engine.last_sync_stats
    assert stats["transport"] == "object_store" and stats["chunks"] >= 1 and stats["bytes"] > 0
    assert_same(vllm_engine.generate(prompt_ids, greedy), before)  # same weights, same policy
    assert vllm_engine.native.name == "gloo"
    # No NCCL on CPU: asking for it fails at once, before vLLM starts.
    with pytest.raises(ValueError, match="`weight_transport='nccl'` needs vLLM on CUDA"):
        make_engine("vllm", tiny_model_dir, weight_transport="nccl")


@pytest.mark.slow
def test_native_transfer_over_gloo_moves_the_policy_in_buckets_and_keeps_versions(
    vllm_engine, tiny_model_dir, other_model_dir, prompt_ids
):
    """vLLM's weight-transfer API end to end on CPU: the learner's sender (rank 0, this
    process) opens a gloo group with the engine's worker, broadcasts another model's weights
    in small buckets, and the engine serves exactly that model; versions only move forward,
    and the original weights come back the same way."""

    from m2po_rllib.common.net import free_port
    from m2po_rllib.sync.sender import EngineTarget, NativeWeightSender, RunnerGroupClient

    greedy = SamplingConfig(max_tokens=16, temperature=0)
    sampled = SamplingConfig(n=2, max_tokens=16, seed=9, temperature=0.9)
    original, other = load_hf(tiny_model_dir), load_hf(other_model_dir)
    before = vllm_engine.generate(prompt_ids, greedy)
    holder = {"model": other}
    client = RunnerGroupClient([EngineTarget(vllm_engine)])
    sender = NativeWeightSender(client, lambda: holder["model"].state_dict(), vllm_engine.dtype, backend="gloo",
                                master_address="127.0.0.1", master_port=free_port(), bucket_bytes=50_000, timeout_s=120)
    sender.connect()
    try:
        start = vllm_engine.version
        sender.send(start + 1)
        stats = vllm_engine.last_sync_stats
        assert vllm_engine.version == start + 1 and stats["transport"] == "gloo"
        expected = other.state_dict()  # the tied lm_head included (the reload unties it otherwise)
        assert stats["tensors"] == len(expected) and stats["bytes"] == sum(t.numel() * 4 for t in expected.values())
        assert max_logprob_diff(other, prompt_ids, vllm_engine.generate(prompt_ids, sampled), 0.9) < 1e-3
        assert [g[0].token_ids for g in vllm_engine.generate(prompt_ids, greedy)] != [g[0].token_ids for g in before]

        # A version that is not newer never reaches the collective (a skipped rank would hang it).
        with pytest.raises(ValueError, match="not newer"):
            sender.send(start + 1)
        holder["model"] = original
        sender.send(start + 2)
        assert vllm_engine.version == start + 2
        assert_same(vllm_engine.generate(prompt_ids, greedy), before)
    finally:
        sender.close()

    # A learner that reconnects (a new group) with delta rounds: a full round first, then only
    # what changed moves; an unchanged round moves the version alone (no collective), and the
    # policy is the learner's throughout.
    delta = NativeWeightSender(client, lambda: holder["model"].state_dict(), vllm_engine.dtype, backend="gloo",
                               master_address="127.0.0.1", master_port=free_port(), only_changed=True, timeout_s=120)
    delta.connect()
    try:
        delta.send(start + 3)
        assert vllm_engine.last_sync_stats["tensors"] == len(expected)  # a new group: everything once
        delta.send(start + 4)
        assert vllm_engine.version == start + 4 and vllm_engine.last_sync_stats["tensors"] == 0
        with torch.no_grad():
            original.model.norm.weight.mul_(2.0)
        delta.send(start + 5)
        assert vllm_engine.last_sync_stats["tensors"] == 1 and vllm_engine.last_sync_stats["bytes"] == 4 * original.model.norm.weight.numel()
        assert max_logprob_diff(original, prompt_ids, vllm_engine.generate(prompt_ids, sampled), 0.9) < 1e-3
        # One projection of a fused layer (vLLM loads up_proj with gate_proj as gate_up_proj):
        # the whole decoder layer goes, so the part left unchanged is not lost in the reload.
        up = original.model.layers[0].mlp.up_proj.weight
        saved = up.detach().clone()
        with torch.no_grad():
            original.model.norm.weight.mul_(0.5)
            up.mul_(1.5)
        delta.send(start + 6)
        layer0 = [n for n in expected if n.startswith("model.layers.0.")]
        assert vllm_engine.last_sync_stats["tensors"] == len(layer0) + 1
        assert max_logprob_diff(original, prompt_ids, vllm_engine.generate(prompt_ids, sampled), 0.9) < 1e-3
        with torch.no_grad():
            up.copy_(saved)
        delta.send(start + 7)
        assert_same(vllm_engine.generate(prompt_ids, greedy), before)
    finally:
        delta.close()


def test_vllm_reload_drops_only_the_rotary_warning():
    """vLLM's layerwise reload (what every weight sync runs in the worker) reports a rotary
    embedding's derived cache as "Failed to load weights"; the filter the sync installs
    drops that line and keeps the same warning for a layer whose weights were not sent."""
    import logging

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

    from m2po_rllib.common.log_filters import quiet_vllm_rotary_reload

    with set_current_vllm_config(VllmConfig()):
        model = torch.nn.ModuleDict({"rope": get_rope(8, max_position=32), "proj": torch.nn.Linear(2, 2)})
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    logger.addHandler(handler)
    try:
        quiet_vllm_rotary_reload()
        record_metadata_for_reloading(model)
        initialize_layerwise_reload(model)  # a sync that sends no weights at all
        finalize_layerwise_reload(model, None)
    finally:
        logger.removeHandler(handler)
    assert seen == ["Linear: Failed to load weights"]


def test_hf_engine_rejects_unknown_or_misshapen_weights(hf_engine):
    with pytest.raises(KeyError, match="not in the model"):
        hf_engine.update_weights({"model.nope.weight": torch.zeros(1)}, hf_engine.version + 1)
    with pytest.raises(ValueError, match="shape"):
        hf_engine.update_weights({"model.norm.weight": torch.zeros(3)}, hf_engine.version + 1)


def test_hf_engine_after_shutdown(tiny_model_dir, prompt_ids):
    engine = make_engine("hf", tiny_model_dir)
    assert engine.is_healthy()
    engine.shutdown()
    engine.shutdown()
    assert not engine.is_healthy()
    with pytest.raises(EngineDeadError, match="shut down"):
        engine.generate(prompt_ids, SamplingConfig())


def test_vllm_on_cpu_prefills_whole_prompts_unless_the_user_chose():
    from m2po_rllib.rollout.vllm_cpu import cpu_llm_kwargs

    def settings(llm_kwargs):
        return cpu_llm_kwargs(llm_kwargs, kv_cache_space_gb=1, num_threads=None)

    assert settings({}) == {"enable_chunked_prefill": False}
    assert settings({"enable_chunked_prefill": True}) == {"enable_chunked_prefill": True}  # the user's choice
    assert settings({"max_num_batched_tokens": 8192}) == {"enable_chunked_prefill": False, "max_num_batched_tokens": 8192}


@pytest.mark.slow
def test_vllm_on_cpu_samples_a_seeded_round_longer_than_a_step(vllm_engine):
    """A round whose prompts pass vLLM's step budget (4096 tokens on CPU) is prefilled in
    several steps; vLLM 0.32's CPU worker crashed the engine when a seeded request's prefill was
    split across two (`vllm_cpu.py`). Every prompt is prefilled whole on CPU: the round comes
    back, every sample its prompt's, and the engine lives."""
    scheduler = vllm_engine.llm.llm_engine.vllm_config.scheduler_config
    # whole prompts, in a step vLLM sized to hold the longest sequence
    assert not scheduler.enable_chunked_prefill
    assert scheduler.max_num_batched_tokens >= vllm_engine.llm.llm_engine.model_config.max_model_len
    n_prompts, length = 100, 50
    assert n_prompts * length > scheduler.max_num_batched_tokens  # several steps' worth of prompts
    prompts = [[(i * 7 + j) % 20 + 3 for j in range(length)] for i in range(n_prompts)]
    out = vllm_engine.generate(prompts, SamplingConfig(n=2, temperature=1.0, max_tokens=4, seed=1))
    assert [len(group) for group in out] == [2] * n_prompts
    assert all(len(c.token_ids) == len(c.logprobs) >= 1 for group in out for c in group)
    assert vllm_engine.is_healthy()


# --- last: kills the shared vLLM engine -----------------------------------------------------


@pytest.mark.slow
def test_killed_vllm_worker_makes_engine_unhealthy(vllm_engine, prompt_ids):
    assert vllm_engine.is_healthy()
    pids = list(vllm_engine.worker_pids)
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while vllm_engine.is_healthy() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not vllm_engine.is_healthy()
    with pytest.raises(EngineDeadError, match="dead"):
        vllm_engine.generate(prompt_ids, SamplingConfig(max_tokens=4))
    with pytest.raises(EngineDeadError):
        vllm_engine.update_weights({}, vllm_engine.version + 1)
    vllm_engine.shutdown()
    core_pids = [p.pid for p in vllm_engine._core_processes]
    deadline = time.monotonic() + 10
    while any(pid_alive(pid) for pid in pids + core_pids):
        assert time.monotonic() < deadline, "vLLM processes outlived shutdown()"
        time.sleep(0.1)
