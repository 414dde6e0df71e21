"""Held-out scoring on one EnvRunner, one plain function per mode (the driver's side, which
spreads the problems over the runners and adds their counts, is `m2po_rllib/driver/evaluation.py`).

Both return counts, not means, so results from several runners add up exactly:
`n` problems, `greedy_correct`, `sampled_correct` of `sampled_n` samples (mean@k with
`samples` > 1), `tokens` of the greedy answers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym

from m2po_rllib.rollout.rounds import play, sampling_config, turn_sampling


def _counts(n: int) -> dict[str, int]:
    return {"n": n, "greedy_correct": 0, "sampled_correct": 0, "sampled_n": 0, "tokens": 0}


def evaluate_single_turn(engine, config, env: gym.Env, indices: list[int], *, samples: int, seed: int) -> dict[str, Any]:
    """A greedy answer per problem (and `samples` sampled ones with samples > 1), scored by
    `env`'s verifier in one call per problem."""
    prompt_ids = [env.reset(options={"index": int(i)})[0]["prompt_token_ids"].tolist() for i in indices]
    out = _counts(len(indices))
    greedy = engine.generate(prompt_ids, sampling_config(config, env, n=1, greedy=True, seed=seed))
    sampled = (
        engine.generate(prompt_ids, sampling_config(config, env, n=samples, greedy=False, seed=seed))
        if samples > 1
        else [[] for _ in indices]
    )
    for i, first, group in zip(indices, greedy, sampled):
        env.reset(options={"index": int(i)})
        verdicts = env.unwrapped.score_group([first[0].text] + [c.text for c in group])
        out["greedy_correct"] += int(verdicts[0].reward > 0)
        out["tokens"] += len(first[0].token_ids)
        out["sampled_correct"] += sum(int(v.reward > 0) for v in verdicts[1:])
        out["sampled_n"] += len(group)
    return out


def evaluate_episodes(engine, config, envs: Callable[[int], list[gym.Env]], indices: list[int], *, samples: int,
                      seed: int, max_turns: int) -> dict[str, Any]:
    """A greedy episode per problem (and `samples` sampled ones with samples > 1), each on its
    own env; `envs(k)` returns k envs of the split."""
    out = _counts(len(indices))
    for greedy, k in [(True, 1)] + ([(False, samples)] if samples > 1 else []):
        pool = envs(len(indices) * k)  # k episodes of problem indices[j // k]
        first = [env.reset(options={"index": int(indices[j // k])})[0]["prompt_token_ids"].tolist()
                 for j, env in enumerate(pool)]
        episodes = play(engine, pool, first, turn_sampling(config, pool[0], greedy=greedy, seed=seed),
                        max_turns=max_turns, max_tokens=config.max_episode_tokens)
        if greedy:
            out["greedy_correct"] += sum(int(e.reward > 0) for e in episodes)
            out["tokens"] += sum(e.policy_tokens for e in episodes)
        else:
            out["sampled_correct"] += sum(int(e.reward > 0) for e in episodes)
            out["sampled_n"] += len(episodes)
    return out
