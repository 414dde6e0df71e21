"""Multi-turn episodes: generate -> env.step -> append -> generate, one token sequence per
episode with a mask of the tokens the policy generated.

The runner's loop for envs whose episodes take several policy turns (`env.multi_turn`: the
feedback mode, `max_turns > 1`, and tool envs). Each turn generates one completion for every
episode still running (one batched `engine.generate`, each request's context the prompt plus
everything so far, so vLLM's prefix cache reuses the earlier turns), hands its text to
`env.step`, and, if the episode goes on, appends the env's reply as the env tokenized it
(`obs["inserted_token_ids"]`): the policy's own token ids are never re-tokenized.

Bookkeeping per episode: `token_ids` (everything after the prompt), `logprobs` (the
engine's behaviour log-probs of policy tokens, 0 for env tokens), `policy_mask` (1 for
policy tokens, 0 for env tokens). The rollout batch's `response_mask` is the policy mask
and `env_mask` the env tokens (`wire.batch.pack_rollouts`): the learner attends to every
token and computes its loss, ratios, M2PO's second moment and mask, and the mismatch
metrics over policy tokens only. `versions`: the policy version that sampled each policy
token (the engine's labels), an env token carrying its turn's last; with weights loaded
between rounds every token of an episode has one, with loads mid-sequence
(`inflight_weight_updates`) an episode may span several, and its row's `policy_version` is
its oldest.

Budgets, each a defined outcome: a turn cap (`max_turns`; the env's own, or the runner's
`max_episode_turns` if lower) and a token cap on everything after the prompt
(`max_episode_tokens`): an episode that reaches either before it ends is truncated with
reward 0 (its tokens are kept; what passes the token cap is cut). An env that breaks the
protocol (a reply without `inserted_token_ids`, a reward that is not a number) raises a
TypeError naming the env.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Episode:
    prompt_ids: list[int]
    env: Any
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_mask: list[int] = field(default_factory=list)
    versions: list[int] | None = field(default_factory=list)  # None once a turn came unlabelled
    reward: float = 0.0
    correct: bool = False
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    dropped_chars: int = 0  # characters the env inserted that the tokenizer has no token for
    done: bool = False
    truncated: bool = False
    played: list = field(default_factory=list)  # its policy turns' Completions, as played (a snapshot's replay)

    def append(self, ids: Sequence[int], logprobs: Sequence[float] | None, policy: bool,
               versions: Sequence[int] | None = None) -> None:
        """A policy turn's tokens (`logprobs`, and `versions` as the engine labelled them) or
        the env's reply (`policy` False: no log-probs; each token its turn's last version)."""
        ids = [int(t) for t in ids]
        self.token_ids += ids
        self.logprobs += [float(x) for x in logprobs] if policy else [0.0] * len(ids)
        self.policy_mask += [int(policy)] * len(ids)
        if self.versions is not None:
            if policy:
                self.versions = None if versions is None else self.versions + [int(v) for v in versions]
            elif self.versions:
                self.versions += [self.versions[-1]] * len(ids)

    @property
    def policy_tokens(self) -> int:
        return sum(self.policy_mask)

    @property
    def env_tokens(self) -> int:
        return len(self.policy_mask) - self.policy_tokens

    def finish(self, reward: float = 0.0, correct: bool = False, truncated: bool = False) -> None:
        self.reward, self.correct, self.truncated, self.done = float(reward), bool(correct), truncated, True


def new_episodes(envs, prompt_ids: list[list[int]]) -> list[Episode]:
    """One episode per env (each reset; `prompt_ids` its first observation's tokens)."""
    return [Episode(list(ids), env.unwrapped) for ids, env in zip(prompt_ids, envs)]


def _env_name(env) -> str:
    spec = getattr(env, "spec", None)
    return getattr(spec, "id", None) or type(getattr(env, "unwrapped", env)).__name__


def run_episodes(
    engine,
    episodes: list[Episode],
    sampling: Callable[[int], Any],
    *,
    max_turns: int,
    max_tokens: int | None = None,
) -> None:
    """Plays `episodes` (each reset, `prompt_ids` its first observation's tokens) to the end
    in place. `sampling(turn)` is the turn's `SamplingConfig` (n=1)."""
    for turn in range(max_turns):
        active = [e for e in episodes if not e.done]
        if not active:
            return
        groups = engine.generate([e.prompt_ids + e.token_ids for e in active], sampling(turn))
        for episode, group in zip(active, groups):
            play_turn(episode, group[0], max_tokens, last_turn=turn == max_turns - 1)


def play_turn(episode: Episode, completion, max_tokens: int | None, last_turn: bool) -> None:
    """Plays the policy's turn `completion` in `episode`: appends it, steps the env, and
    appends the env's reply or ends the episode (`max_tokens`: the cap on everything after
    the prompt, None for none; `last_turn`: no policy turn may follow). The next turn's
    context is `episode.prompt_ids + episode.token_ids`; `episode.turns` turns were played."""
    episode.played.append(completion)
    budget = math.inf if max_tokens is None else int(max_tokens)
    room = budget - len(episode.token_ids)
    ids, logprobs, versions = list(completion.token_ids), list(completion.logprobs), completion.token_versions()
    if len(ids) > room:  # the token budget ends the episode mid-turn
        episode.append(ids[: int(room)], logprobs[: int(room)], policy=True,
                       versions=None if versions is None else versions[: int(room)])
        episode.finish(truncated=True)
        return
    episode.append(ids, logprobs, policy=True, versions=versions)
    obs, reward, terminated, truncated, info = episode.env.step(completion.text)
    episode.turns += 1
    episode.tool_calls += int(bool(info.get("tool_call", False)))
    episode.tool_errors += int(bool(info.get("tool_error", False)))
    episode.dropped_chars += int(info.get("dropped_chars", 0))
    if not isinstance(reward, (int, float, np.floating, np.integer)) or isinstance(reward, bool):
        raise TypeError(f"env {_env_name(episode.env)!r} returned reward {reward!r}; a float is expected")
    if terminated or truncated:
        episode.finish(reward, info.get("correct", reward > 0), truncated=bool(truncated))
        return
    inserted = obs.get("inserted_token_ids") if isinstance(obs, dict) else None
    if inserted is None:
        raise TypeError(
            f"env {_env_name(episode.env)!r} went on after a turn without obs['inserted_token_ids'] (the tokens it "
            "appends after the policy's turn); multi-turn envs return them (see envs.text_env.MathTextEnv._continue)"
        )
    inserted = np.asarray(inserted).reshape(-1).tolist()
    if last_turn or len(episode.token_ids) + len(inserted) >= budget:
        episode.finish(truncated=True)  # no turn, or no room, left for the policy's next one
        return
    episode.append(inserted, None, policy=False)


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Means per episode, by `keys` name."""
    from m2po_rllib.common import keys

    n = max(1, len(episodes))
    return {
        keys.EPISODE_TURNS: sum(e.turns for e in episodes) / n,
        keys.EPISODE_POLICY_TOKENS: sum(e.policy_tokens for e in episodes) / n,
        keys.EPISODE_ENV_TOKENS: sum(e.env_tokens for e in episodes) / n,
        keys.EPISODE_TRUNCATED: sum(e.truncated for e in episodes) / n,
        keys.EPISODE_TOOL_CALLS: sum(e.tool_calls for e in episodes) / n,
        keys.EPISODE_TOOL_ERRORS: sum(e.tool_errors for e in episodes) / n,
        keys.EPISODE_DROPPED_CHARS: sum(e.dropped_chars for e in episodes) / n,
    }
