"""A streaming runner's rounds as far as they got (`RoundStream.snapshot`), and what a resumed
round does with them: what a checkpoint that keeps partial sequences holds of a runner.

A snapshot is one entry per round the runner holds that the driver has not taken:
- a round not started: `{"request": ...}`;
- a round generating: `{"request": ..., "resume": {...}, "prompt_ids": {i: [...]}}`. Single-turn,
  `resume[i]` is group i's samples as far as they got (`[Partial, ...]`; a group already
  finished: its samples as ended `Partial`s); multi-turn, `resume[e]` is episode e as far as it
  got (`EpisodeSoFar`: its turns played, the turn in flight);
- a round finished and not yet taken: `{"request": ..., "batch": {...}}`, its packed rows.
Requests are `LLMEnvRunner.sample`'s keyword arguments without their weights (a resumed round
is requested again with the weights of its time). Handed back as a request with its `resume`,
a round is planned as before (the same envs, seeds and prompts: checked); its groups continue
from their partials (`GenerationEngine.submit(..., resume=...)`); an episode's played turns are
replayed into its env (reset on the same seed, so its state after them is the one saved; an env
that replies otherwise is refused) and its turn in flight continues; its rows count their age
from their oldest token, as with weights loaded mid-sequence. Where the runner scores its rounds
(`recompute_behavior_logp`), each row's log-probs so far go with it (`Partial.scored`,
`EpisodeSoFar.scored`: segments.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from m2po_rllib.rollout.engine import Completion, Partial, version_spans
from m2po_rllib.rollout.episodes import Episode, play_turn


@dataclass
class EpisodeSoFar:
    """A multi-turn episode as far as it got."""

    played: list[Partial]
    """Its policy turns played so far, each as an ended `Partial` (tokens, log-probs, versions,
    finish reason and the text its env was given)."""
    turn: Partial | None
    """The turn in flight as far as it got; None once the episode ended."""
    token_ids: list[int]
    """Its row after the prompt before the turn in flight (policy and env tokens): what a
    replay of `played` must give back."""
    scored: list[float] | None = None
    """Where its runner scores its rounds: the row's log-probs so far, the turn in flight's
    tokens included (`segments.SegmentScores`)."""

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids) + (len(self.turn.token_ids) if self.turn is not None else 0)


def ended(c: Completion, version: int) -> Partial:
    """A finished sample as a `Partial` (unlabelled tokens: `version`'s)."""
    versions = c.token_versions() or [version] * len(c.token_ids)
    return Partial(list(c.token_ids), list(c.logprobs), versions, c.finish_reason, c.text)


def request_only(request: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in request.items() if k not in ("weights", "resume")}


def round_entry(r, partials: dict, kept: Callable[[int, int], list[float] | None] | None = None) -> dict[str, Any]:
    """A round generating (`streaming._Round`) as far as it got (`partials`: the engine's, by
    (first sample id, group or episode)); `kept(first, row)`: a scoring runner's log-probs of
    each row so far (`SegmentScores.kept`), handed over with it."""
    first, plan = r.first_sample_id, r.plan
    if r.episodes is not None:
        resume = {}
        for e, episode in enumerate(r.episodes):
            turn = None if episode.done else (partials.get((first, e)) or [Partial([], [], [])])[0]
            resume[e] = EpisodeSoFar([ended(c, r.version) for c in episode.played], turn, list(episode.token_ids),
                                     kept(first, e) if kept is not None else None)
    else:
        resume = {i: [ended(c, r.version) for c in r.groups[i]] if i in r.groups else partials[(first, i)]
                  for i in range(len(plan.prompt_ids))}
        if kept is not None:  # copies: the engine's own partials are not written to
            row = 0
            for i in range(len(plan.prompt_ids)):
                resume[i] = [dataclasses.replace(p, scored=kept(first, row + j)) for j, p in enumerate(resume[i])]
                row += len(resume[i])
    return {"request": request_only(r.request), "resume": resume,
            "prompt_ids": {i: list(p) for i, p in enumerate(plan.prompt_ids)}}


def check_resumed_prompts(entry_prompts: dict[int, list[int]] | None, plan, first: int) -> None:
    """A resumed round must be planned as it was: the same prompt for every group or episode."""
    if entry_prompts is not None and len(entry_prompts) != len(plan.prompt_ids):
        raise ValueError(
            f"the round from sample {first} was saved with {len(entry_prompts)} groups or episodes and is planned "
            f"with {len(plan.prompt_ids)}: its env, group size or turns changed since the checkpoint; resume with "
            "the config it was saved with"
        )
    for i, prompt in (entry_prompts or {}).items():
        if list(plan.prompt_ids[int(i)]) != list(prompt):
            raise ValueError(
                f"the round from sample {first} resumed with other prompts than it was generated for (group {i}): "
                "its env or task changed since the checkpoint; resume with the config it was saved with"
            )


def handed_rows(resume: dict) -> list[tuple[list[int], list[float] | None, int]]:
    """A resumed round's rows as handed over, in the order they are packed: (each row's policy
    tokens' versions so far, its scored log-probs so far or None, its tokens so far)."""
    rows = []
    for key in sorted(resume):
        if isinstance(resume[key], EpisodeSoFar):
            so_far = resume[key]
            versions = [v for p in so_far.played for v in p.versions] + (so_far.turn.versions if so_far.turn else [])
            rows.append((versions, so_far.scored, so_far.n_tokens))
        else:
            rows += [(p.versions, p.scored, len(p.token_ids)) for p in resume[key]]
    return rows


def oldest_version(resume: dict, default: int) -> int:
    """The oldest version among a resumed round's handed-over tokens (`default` if none)."""
    return min([default, *(v for versions, _, _ in handed_rows(resume) for v in versions)])


def replay(episode: Episode, so_far: EpisodeSoFar, plan, e: int, first: int) -> Partial | None:
    """Plays episode e's saved turns into its env (reset as when it was saved) and returns its
    turn in flight to continue (None: it had ended, or its turn had no token yet). Refuses an
    env whose replies differ from the saved row: its state would not be the one saved."""
    for p in so_far.played:
        turn = Completion(list(p.token_ids), list(p.logprobs), p.text, p.finish_reason, version_spans(p.versions))
        play_turn(episode, turn, plan.max_tokens, last_turn=episode.turns == plan.max_turns - 1)
    if episode.token_ids != so_far.token_ids or episode.done != (so_far.turn is None):
        raise ValueError(
            f"episode {e} of the round from sample {first}: its env replied otherwise when its saved turns were "
            "replayed (its state is not a function of its reset seed and the policy's turns, or the env changed "
            "since the checkpoint); resume with the env it was saved with"
        )
    return so_far.turn if so_far.turn is not None and so_far.turn.token_ids else None
