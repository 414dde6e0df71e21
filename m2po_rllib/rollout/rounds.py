"""One sampling round on an EnvRunner, one plain function per mode.

A round resets one text env per prompt (a GRPO group shares its prompt; multi-turn episodes
get one env per sample, the group's envs reset on the prompt's seed), generates
`group_size` completions per prompt and scores them:
- `single_turn_rows`: one batched `generate` call, one batched verifier call per group
  (`score_groups`, which streaming sampling, streaming.py, shares);
- `episode_rows`: the episode loop (episodes.py), scored by the env turn by turn
  (`played_rows`, shared with streaming sampling).
Both return `Rows`, which the runner packs (`wire.batch.pack_rollouts`). Seeds: the round's
seed and stream pick the prompts (`prompt_seed`) and the base of the per-request seeds
(`request_base`), so a round is reproducible and rounds never share random streams.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np

from m2po_rllib.rollout.engine import SamplingConfig


def round_seed(base_seed: int | None, round_index: int) -> int:
    """The seed of sampling round `round_index`: picks its prompts and seeds its sampler."""
    return (base_seed or 0) * 1_000_003 + round_index


def round_delay_s(delay: dict, seed: int, stream: int) -> float:
    """`round_delay`'s wait for the round seeded `seed` on `stream`: log-normal with median
    `median_s` and log-scale `sigma`."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, stream, 2]))
    return float(delay["median_s"]) * float(np.exp(float(delay.get("sigma", 0.0)) * rng.standard_normal()))


def prompt_seed(seed: int, stream: int, prompt: int) -> int:
    """The env-reset seed of prompt `prompt` of the round seeded `seed` on `stream`."""
    return int(np.random.SeedSequence([seed, stream, 0, prompt]).generate_state(1)[0])


def request_base(seed: int, stream: int) -> int:
    """The base of the round's per-request seeds (request i draws from base + i), spread so
    that consecutive rounds (seed, seed + 1) do not share per-request random streams."""
    return int(np.random.SeedSequence([seed, stream, 1]).generate_state(1)[0] >> 1)


def sampling_config(config, env: gym.Env, *, n: int, greedy: bool, seed: int | None) -> SamplingConfig:
    """The engine's sampling settings from the config (greedy: temperature 0, no truncation);
    the env's own stop strings are added to the config's."""
    env_stop = [s for s in getattr(env.unwrapped, "stop", ()) if s not in (config.stop or [])]
    return SamplingConfig(
        n=n,
        temperature=0.0 if greedy else config.temperature,
        top_p=1.0 if greedy else config.top_p,
        top_k=0 if greedy else config.top_k,
        max_tokens=config.max_new_tokens,
        stop=list(config.stop or []) + env_stop,
        seed=seed,
    )


def reset_prompts(envs: list[gym.Env], seed: int, stream: int, copies: int) -> list[list[int]]:
    """Resets each env, every `copies` consecutive ones on one prompt's seed; their prompts' tokens."""
    prompt_ids = []
    for i, env in enumerate(envs):
        obs, _ = env.reset(seed=prompt_seed(seed, stream, i // copies))
        prompt_ids.append(obs["prompt_token_ids"].tolist())
    return prompt_ids


@dataclass
class Rows:
    """A scored round, one entry per completion, and the seconds it took."""

    prompts: list[list[int]] = field(default_factory=list)
    responses: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)
    policy_masks: list[list[int]] | None = None  # multi-turn: 1 = the policy's token, 0 = the env's
    versions: list[list[int] | None] = field(default_factory=list)  # each token's version (None: unlabelled)
    scored: list[list[float] | None] | None = None  # rows' behaviour log-probs kept so far (segments.py)
    metrics: dict[str, float] = field(default_factory=dict)  # per-episode means (multi-turn)
    generate_s: float = 0.0
    score_s: float = 0.0


def single_turn_rows(engine, envs: list[gym.Env], prompt_ids: list[list[int]], sampling: SamplingConfig) -> Rows:
    """`sampling.n` completions per prompt in one `generate` call; one verifier call per group."""
    t0 = time.perf_counter()
    groups = engine.generate(prompt_ids, sampling)
    return score_groups(envs, prompt_ids, groups, generate_s=time.perf_counter() - t0)


def score_groups(envs: list[gym.Env], prompt_ids: list[list[int]], groups: list[list], *, generate_s: float) -> Rows:
    """A round's generated groups (one per prompt, in order) scored: one verifier call per group."""
    rows = Rows(generate_s=generate_s)
    t0 = time.perf_counter()
    for ids, env, completions in zip(prompt_ids, envs, groups):
        for c, verdict in zip(completions, env.unwrapped.score_group([c.text for c in completions])):
            rows.prompts.append(ids)
            rows.responses.append(list(c.token_ids))
            rows.logprobs.append(list(c.logprobs))
            rows.versions.append(c.token_versions())
            rows.rewards.append(float(verdict.reward))
            rows.correct.append(bool(verdict.correct))
    rows.score_s = time.perf_counter() - t0
    return rows


def play(engine, envs: list[gym.Env], prompt_ids: list[list[int]], sampling: Callable[[int], SamplingConfig],
         *, max_turns: int, max_tokens: int | None):
    """One episode per env (each reset; `prompt_ids` its first observation), played to the
    end; `sampling(turn)` is the turn's settings."""
    from m2po_rllib.rollout.episodes import new_episodes, run_episodes

    episodes = new_episodes(envs, prompt_ids)
    run_episodes(engine, episodes, sampling, max_turns=max_turns, max_tokens=max_tokens)
    return episodes


def turn_sampling(config, env: gym.Env, *, greedy: bool, seed: int) -> Callable[[int], SamplingConfig]:
    """Each turn's settings of an episode round: one sample per episode, seeded from `seed` and the turn."""
    return lambda turn: sampling_config(config, env, n=1, greedy=greedy, seed=seed + turn * 100_003)


def episode_rows(engine, envs: list[gym.Env], prompt_ids: list[list[int]], sampling: Callable[[int], SamplingConfig],
                 *, max_turns: int, max_tokens: int | None) -> Rows:
    """One multi-turn episode per env, scored by the env as it ends."""
    t0 = time.perf_counter()
    episodes = play(engine, envs, prompt_ids, sampling, max_turns=max_turns, max_tokens=max_tokens)
    return played_rows(episodes, generate_s=time.perf_counter() - t0)


def played_rows(episodes, *, generate_s: float) -> Rows:
    """A round's episodes, played to the end, as rows (streaming sampling shares it)."""
    from m2po_rllib.rollout.episodes import episode_metrics

    rows = Rows(generate_s=generate_s)
    t0 = time.perf_counter()
    for e in episodes:
        rows.prompts.append(e.prompt_ids)
        rows.responses.append(e.token_ids)
        rows.logprobs.append(e.logprobs)
        rows.versions.append(e.versions)
        rows.rewards.append(e.reward)
        rows.correct.append(e.correct)
    rows.policy_masks = [e.policy_mask for e in episodes]
    rows.metrics = episode_metrics(episodes)
    rows.score_s = time.perf_counter() - t0
    return rows
