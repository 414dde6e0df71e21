"""Multi-turn episodes (rollout/episodes.py, envs/tool_env.py): the env protocol, the token
bookkeeping (policy tokens vs env tokens), the budgets, the sandboxed calculator env, and
training on episodes whose env tokens never reach the loss."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

import envs  # noqa: F401  (registers the env ids)
from envs.tool_env import ToolMathEnv, parse_call
from m2po_rllib import M2POConfig
from m2po_rllib.common import keys
from m2po_rllib.common.errors import ConfigError
from m2po_rllib.losses import compute_policy_loss, m2po_keep_mask
from m2po_rllib.models.builtin import resolve_model_path

MODEL = "builtin:arith-tiny"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(MODEL))


def _tool_env(tokenizer, **kw):
    # the built-in characters have no "<" or ">": markers made of what they have
    settings = dict(call_open="CALC(", call_close=")=", result_format="{}.", error_format="ERR.", digits=3,
                    tokenizer=tokenizer, template="compact")
    return gym.make("m2po/ToolArithmetic-v0", disable_env_checker=True, **{**settings, **kw}).unwrapped


def test_feedback_env_inserts_exactly_the_tokens_the_conversation_gains(tokenizer):
    """The prompt, the policy's turn and the env's `inserted_token_ids` are, token for
    token, the whole conversation the env renders next (text templates)."""
    env = gym.make("m2po/Arithmetic-v0", disable_env_checker=True, tokenizer=tokenizer, template="compact",
                   digits=2, max_turns=3).unwrapped
    assert env.multi_turn
    obs, _ = env.reset(seed=4)
    assert obs["inserted"] == "" and len(obs["inserted_token_ids"]) == 0
    action = "\\boxed{1}"
    nxt, reward, terminated, truncated, _ = env.step(action)
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert nxt["inserted"].startswith("\n\nThe answer 1 is not correct")
    policy = tokenizer(action, add_special_tokens=False)["input_ids"]
    assert nxt["prompt_token_ids"].tolist() == obs["prompt_token_ids"].tolist() + policy + nxt["inserted_token_ids"].tolist()


def test_tool_env_runs_calls_in_the_sandbox_and_scores_the_answer(tokenizer):
    env = _tool_env(tokenizer)
    obs, info = env.reset(seed=0)
    a, b = info["question"].split("*")
    # the runner hands step the text cut before the stop string (the closer)
    obs, reward, terminated, truncated, info = env.step(f"CALC({a}*{b}")
    assert (reward, terminated, truncated, info["tool_call"], info["tool_error"]) == (0.0, False, False, True, False)
    assert obs["inserted"] == f"{int(a) * int(b)}."
    assert tokenizer.decode(obs["inserted_token_ids"]) == obs["inserted"]
    obs, reward, terminated, truncated, info = env.step(f"\\boxed{{{int(a) * int(b)}}}")
    assert (reward, terminated, truncated, info["tool_call"]) == (1.0, True, False, False)


@pytest.mark.parametrize("call", ["__import__('os').system('id')", "open('/etc/passwd')", "9**9**9**9", "", "1+*"])
def test_hostile_or_unreadable_calls_get_an_error_observation(tokenizer, call):
    env = _tool_env(tokenizer, tool="python")
    env.reset(seed=1)
    obs, reward, terminated, truncated, info = env.step(f"CALC({call})=")
    assert obs["inserted"] == "ERR." and info["tool_error"] and not (terminated or truncated) and reward == 0.0


def test_a_call_on_the_last_turn_truncates_the_episode_with_reward_zero(tokenizer):
    env = _tool_env(tokenizer, max_turns=2)
    env.reset(seed=2)
    assert not env.step("CALC(1+1")[2]
    obs, reward, terminated, truncated, info = env.step("CALC(2+2")
    assert (reward, terminated, truncated, info["budget"]) == (0.0, False, True, "max_turns")
    with pytest.raises(RuntimeError, match="finished episode"):
        env.step("\\boxed{4}")


def test_tool_env_refuses_bad_markers_and_tools(tokenizer):
    with pytest.raises(ValueError, match="result_format='{}{}' must be a string with one"):
        _tool_env(tokenizer, result_format="{}{}")
    with pytest.raises(ValueError, match="tool='shell' must be one of"):
        _tool_env(tokenizer, tool="shell")
    assert parse_call("x CALC(1+2)= y", "CALC(", ")=") == "1+2" and parse_call("no call", "CALC(", ")=") is None


def test_text_that_is_not_unicode_gets_an_error_observation_not_an_exception(tokenizer):
    """A lone surrogate (no tokenizer encodes it): in a call, the call fails like any bad
    call, counted as a tool error; in a feedback episode's answer, the episode goes on."""
    env = _tool_env(tokenizer)
    env.reset(seed=1)
    obs, reward, terminated, truncated, info = env.step("CALC(1+\ud800")
    assert obs["inserted"] == "ERR." and info["tool_error"] and not (terminated or truncated)
    assert "\ufffd" in obs["prompt"] and len(obs["prompt_token_ids"]) > 0
    feedback = gym.make("m2po/Arithmetic-v0", disable_env_checker=True, tokenizer=tokenizer, template="compact",
                        digits=2, max_turns=3).unwrapped
    feedback.reset(seed=1)
    obs, reward, terminated, _, _ = feedback.step("\\boxed{1\ud800}")
    assert (reward, terminated) == (0.0, False) and "is not correct" in obs["inserted"]
    assert tokenizer.decode(obs["inserted_token_ids"]) == obs["inserted"].replace("\ufffd", "")


def test_markers_the_tokenizer_cannot_encode_are_refused_when_the_env_is_made(tokenizer):
    """The default markers need `<` and `>`, which the built-in vocabulary lacks: refused with
    the settings, the characters and the fix, before any episode; through the config too."""
    with pytest.raises(ValueError, match=r"no token for some characters of call_open='<calc>' \('<>'\), call_close="
                                         r"'</calc>' \('<>'\), result_format='<result>\{\}</result>' \('<>'\).*call_open='CALC\('"):
        _tool_env(tokenizer, call_open="<calc>", call_close="</calc>", result_format="<result>{}</result>",
                  error_format="ERR.")
    cfg = _config("m2po/ToolArithmetic-v0", {"digits": 3, "max_turns": 2}, max_episode_tokens=64)
    with pytest.raises(ConfigError, match=r"no token for some characters of call_open='<calc>'") as e:
        cfg.validate()
    assert "env_config" in e.value.settings


def test_characters_the_tokenizer_lacks_in_a_tool_result_are_counted(tokenizer):
    """`7/3 (~2.33333333333)`: the built-in vocabulary has no `~`; the inserted tokens lack
    it, and the turn's info, the episode and the round's metrics say so."""
    from m2po_rllib.rollout.engine import Completion
    from m2po_rllib.rollout.episodes import Episode, episode_metrics, play_turn

    env = _tool_env(tokenizer)
    env.reset(seed=1)
    episode = Episode([1, 2], env)
    play_turn(episode, Completion(tokenizer("CALC(7/3")["input_ids"], [-0.1] * 8, "CALC(7/3", "stop"),
              None, last_turn=False)
    assert env._obs["inserted"] == "7/3 (~2.33333333333)."
    assert tokenizer.decode(env._obs["inserted_token_ids"]) == "7/3 (2.33333333333)."
    assert episode.dropped_chars == 1 and episode_metrics([episode])[keys.EPISODE_DROPPED_CHARS] == 1.0
    assert env.step("\\boxed{2}")[4]["dropped_chars"] == 0


# -- the runner's episode loop -----------------------------------------------------------
def _config(env="m2po/Arithmetic-v0", env_config=None, **runners):
    return (
        M2POConfig()
        .environment(env, env_config={"digits": 2, "template": "compact", "max_turns": 3, **(env_config or {})})
        .env_runners(num_env_runners=0, rollout_engine="hf", max_new_tokens=6, **runners)
        .learners(num_learners=0)
        .rl_module(model_config={"model": MODEL})
        .training(group_size=2, prompts_per_step=2, minibatch_prompts=2, lr=1e-4, logp_mismatch_interval=1)
        .debugging(seed=0)
    )


@pytest.fixture(scope="module")
def runner():
    from m2po_rllib.rollout.env_runner import LLMEnvRunner

    runner = LLMEnvRunner(config=_config())
    yield runner
    runner.stop()


def test_a_round_of_episodes_marks_policy_and_env_tokens(runner, tokenizer):
    """One row per episode: policy tokens (response_mask) and env tokens (env_mask) never
    overlap and cover the row; env tokens carry no behaviour log-prob; a wrong answer is
    followed by the env's feedback, as tokens; the metrics count turns and both kinds of
    tokens."""
    batch = runner.sample(num_prompts=2, seed=3)
    policy, env = batch["response_mask"] > 0, batch["env_mask"] > 0
    assert not (policy & env).any()
    lengths = (policy | env).sum(1)
    assert all((policy | env)[i, :n].all() and not (policy | env)[i, n:].any() for i, n in enumerate(lengths))
    assert (batch["behavior_logp"][env] == 0).all() and (batch["behavior_logp"][policy] < 0).all()
    first_env = next(i for i in range(len(lengths)) if env[i].any())
    inserted = tokenizer.decode(batch["response_ids"][first_env][env[first_env]])
    assert "is not correct. Try again." in inserted or "could not find a final answer" in inserted
    metrics = runner.get_metrics()
    assert metrics[keys.EPISODE_TURNS].peek() > 1  # the random-ish model is wrong on its first try
    assert metrics[keys.EPISODE_POLICY_TOKENS].peek() == policy.sum() / len(policy)
    assert metrics[keys.EPISODE_ENV_TOKENS].peek() == env.sum() / len(env)


def test_budgets_truncate_with_reward_zero(tokenizer):
    from m2po_rllib.rollout.env_runner import LLMEnvRunner

    runner = LLMEnvRunner(config=_config(max_episode_tokens=8, max_episode_turns=2))
    try:
        batch = runner.sample(num_prompts=2, seed=5)
        # a first turn fits (<= 6 tokens); the feedback after a wrong answer does not: every
        # wrong episode ends there, truncated, reward 0, with no env token kept
        metrics = runner.get_metrics()
        assert batch["env_mask"].sum() == 0 and batch["response_mask"].sum(1).max() <= 6
        assert metrics[keys.EPISODE_TURNS].peek() == 1
        assert metrics[keys.EPISODE_TRUNCATED].peek() == np.mean(batch["rewards"] == 0) > 0
        assert runner.max_episode_turns == 2
    finally:
        runner.stop()


def test_runner_caps_are_validated():
    with pytest.raises(ConfigError, match=r"`max_episode_tokens` \(4\) caps a whole episode and must be >= `max_new_tokens` \(6\)"):
        _config(max_episode_tokens=4).validate()
    with pytest.raises(ConfigError, match=r"`max_episode_turns` \(0\) must be >= 1"):
        _config(max_episode_turns=0).validate()


def test_an_episode_that_may_not_fit_the_models_context_is_refused_with_the_arithmetic():
    """builtin:arith-tiny has 256 positions; 3 turns of 6 tokens after a 6-token prompt with two
    feedbacks of up to 113 + 6 tokens (the answer it repeats) need 262: refused with each
    term and both fixes, which pass; a cap past the positions and a tool env without a cap
    (its results have no bound) are refused too."""
    terms = (r"the longest prompt \(6 tokens; a large split sampled\) \+ 3 turns x `max_new_tokens` \(6\) "
             r"\+ 2 env replies x up to 119 tokens .* = 262")
    fixes = r"lower the turns to 2 .*137 tokens\), or set env_runners.max_episode_tokens=250 \(episodes"
    with pytest.raises(ConfigError, match=r"a 3-turn episode may not fit the model's 256 positions \(builtin:arith-tiny's "
                                          rf"max_position_embeddings\): {terms}; {fixes}"):
        _config().validate()
    _config(max_episode_tokens=250).validate()
    _config(env_config={"max_turns": 2}).validate()
    _config(max_episode_turns=2).validate()
    with pytest.raises(ConfigError, match=r"`max_episode_tokens` \(251\) = 257; lower env_runners.max_episode_tokens to 250"):
        _config(max_episode_tokens=251).validate()
    tool = {"digits": 3, "call_open": "CALC(", "call_close": ")=", "result_format": "{}.", "error_format": "ERR."}
    with pytest.raises(ConfigError, match=r"m2po/ToolArithmetic-v0's replies have no bound known before the run .* "
                                          r"env_runners.max_episode_tokens to at most 248 \(256 - 8"):
        _config("m2po/ToolArithmetic-v0", tool).validate()
    _config("m2po/ToolArithmetic-v0", tool, max_episode_tokens=64).validate()


def test_the_feedback_after_any_turn_is_within_the_envs_estimate(tokenizer):
    """`longest_reply(n)` bounds what the env inserts after a turn of n tokens: the worst
    turn, a bare n-digit number that the feedback repeats, reaches it exactly (one token a
    character)."""
    env = gym.make("m2po/Arithmetic-v0", disable_env_checker=True, tokenizer=tokenizer, template="compact",
                   digits=2, max_turns=3).unwrapped
    for turn in ("987654", "\\boxed{9}", "no answer", ""):
        env.reset(seed=0)
        assert len(env.step(turn)[0]["inserted_token_ids"]) <= env.longest_reply(6)
    env.reset(seed=0)
    assert len(env.step("987654")[0]["inserted_token_ids"]) == env.longest_reply(6) == 119
    assert env.longest_prompt() == (6, False)


def test_an_env_that_breaks_the_protocol_is_named(tokenizer):
    from m2po_rllib.rollout.engine import Completion
    from m2po_rllib.rollout.episodes import Episode, play_turn

    class Broken(gym.Env):
        spec = None

        def step(self, action):
            return {"prompt": "x"}, 0.0, False, False, {}  # goes on, but says nothing of its tokens

    episode = Episode([1, 2], Broken())
    with pytest.raises(TypeError, match=r"env 'Broken' went on after a turn without obs\['inserted_token_ids'\]"):
        play_turn(episode, Completion([5, 6], [-0.1, -0.2], "ab", "stop"), None, last_turn=False)


# -- the loss sees the policy's tokens only ------------------------------------------------
def test_env_tokens_never_reach_the_loss_and_the_mask_is_that_of_the_policy_tokens_laid_flat():
    """Whatever the env tokens' log-ratios (here huge), M2PO's second moment, mask and loss
    are those of the policy tokens alone: the same as for a batch holding only the policy
    tokens, laid out flat in one row."""
    g = torch.Generator().manual_seed(0)
    B, R = 4, 12
    policy = torch.zeros(B, R, dtype=torch.bool)
    for row, spans in enumerate([[(0, 3), (7, 10)], [(0, 5)], [(0, 2), (4, 6), (9, 12)], [(0, 4), (8, 9)]]):
        for a, b in spans:
            policy[row, a:b] = True
    env_tokens = ~policy & (torch.arange(R) < 11)
    logp = -torch.rand(B, R, generator=g) - 0.1
    behavior = logp + 0.4 * torch.randn(B, R, generator=g)
    adv = torch.randn(B, generator=g)
    garbage = torch.where(env_tokens, torch.full_like(behavior, 50.0), behavior)

    keep = m2po_keep_mask(logp - behavior, policy, threshold=0.04)
    assert m2po_keep_mask(logp - garbage, policy, threshold=0.04).eq(keep).all()
    flat_ratio = (logp - behavior)[policy][None]
    flat_keep = m2po_keep_mask(flat_ratio, torch.ones_like(flat_ratio, dtype=torch.bool), threshold=0.04)
    assert 0 < int((~keep & policy).sum()) and flat_keep[0].eq(keep[policy]).all()

    def loss_and_grad(behavior_logp):
        x = logp.clone().requires_grad_(True)
        loss, _ = compute_policy_loss("m2po", x, behavior_logp, adv, policy, m2_threshold=0.04)
        loss.backward()
        return loss.detach(), x.grad

    (loss_a, grad_a), (loss_b, grad_b) = loss_and_grad(behavior), loss_and_grad(garbage)
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b) and grad_a[~policy].eq(0).all()


@pytest.mark.slow
def test_training_on_feedback_episodes_replays_the_engine_exactly(ray_session):
    """M2PO trains on multi-turn episodes (the HF engine in the driver): the learner attends
    to the env's tokens, so its log-probs of every policy token, later turns included, equal
    the engine's (a learner that dropped the env tokens from its context would disagree on
    every turn after the first)."""
    algo = _config(max_episode_tokens=250).build_algo()  # 3 turns within the model's 256 positions
    try:
        result = algo.train()
        assert result[keys.LOGP_MISMATCH_MAX] < 1e-4
        assert result["env_runners"][keys.EPISODE_TURNS] > 1
        assert np.isfinite(result["learners"]["default_policy"][keys.LOSS])
    finally:
        algo.stop()


def test_the_builtin_tool_model_needs_the_tool():
    """builtin:tool-tiny through the runner's multi-turn evaluation (greedy episodes, the HF
    engine, the sandboxed calculator): right on some problems with the calculator, on
    almost none without it (max_turns 1: a call is then no answer)."""
    from m2po_rllib.models.builtin import BUILTIN_MODELS, tool_env_config
    from m2po_rllib.rollout.env_runner import LLMEnvRunner

    spec = BUILTIN_MODELS["tool-tiny"]
    accuracy = {}
    for turns in (3, 1):
        cfg = _config("m2po/ToolArithmetic-v0", {**tool_env_config("tool-tiny"), "max_turns": turns})
        cfg.rl_module(model_config={"model": "builtin:tool-tiny"}).env_runners(max_new_tokens=spec.answer_tokens)
        runner = LLMEnvRunner(config=cfg)
        try:
            out = runner.evaluate(indices=list(range(100)))
            accuracy[turns] = out["greedy_correct"] / out["n"]
        finally:
            runner.stop()
    assert accuracy[3] >= 0.1 and accuracy[1] <= 0.02, accuracy


@pytest.mark.slow
def test_async_rollouts_train_on_episodes(ray_session):
    """Multi-turn episodes from a remote runner in async mode: several turns per episode,
    every trained row within the bound, a finite loss."""
    cfg = _config(max_episode_turns=2)
    cfg.env_runners(num_env_runners=1).training(async_rollouts=True, max_staleness=3, logp_mismatch_interval=0)
    algo = cfg.build_algo()
    try:
        for _ in range(2):
            result = algo.train()
        assert result["env_runners"][keys.EPISODE_TURNS] > 1 and result["staleness/max"] <= 3
        assert np.isfinite(result["learners"]["default_policy"][keys.LOSS])
    finally:
        algo.stop()
