"""A streaming runner's rounds as far as they got (`RoundStream.snapshot`), and the check a
resumed round makes: what a checkpoint that keeps partial sequences holds of a runner.

A snapshot is one entry per round the runner holds that the driver has not taken:
- a round not started: `{"request": ...}`;
- a round generating: `{"request": ..., "resume": {i: [Partial, ...]}, "prompt_ids": {i: [...]}}`,
  group i's samples as far as they got (a group already finished: its samples as ended
  `Partial`s);
- a round finished and not yet taken: `{"request": ..., "batch": {...}}`, its packed rows.
Requests are `LLMEnvRunner.sample`'s keyword arguments without their weights (a resumed round
is requested again with the weights of its time). Handed back as a request with its `resume`,
a round is planned as before (the same envs, seeds and prompts: checked), its groups continue
from their partials (`GenerationEngine.submit(..., resume=...)`), and its rows count their age
from their oldest token, as with weights loaded mid-sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from m2po_rllib.rollout.engine import Completion, Partial


def ended(c: Completion, version: int) -> Partial:
    """A finished sample as a `Partial` (unlabelled tokens: `version`'s)."""
    versions = c.token_versions() or [version] * len(c.token_ids)
    return Partial(list(c.token_ids), list(c.logprobs), versions, c.finish_reason, c.text)


def request_only(request: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in request.items() if k not in ("weights", "resume")}


def round_entry(request: dict, plan, groups: dict[int, list[Completion]], partials: dict, first: int,
                version: int, kept: Callable[[int, int], list[float] | None] | None = None) -> dict[str, Any]:
    """A round generating: every group's samples as far as they got (`partials`: the engine's,
    by (first sample id, group)); `kept(first, row)`: a scoring runner's log-probs of each row so
    far (`SegmentScores.kept`), handed over as `Partial.scored`."""
    resume = {i: [ended(c, version) for c in groups[i]] if i in groups else partials[(first, i)]
              for i in range(len(plan.prompt_ids))}
    if kept is not None:
        samples = [p for i in range(len(plan.prompt_ids)) for p in resume[i]]
        for row, p in enumerate(samples):
            p.scored = kept(first, row)
    return {"request": request_only(request), "resume": resume,
            "prompt_ids": {i: list(p) for i, p in enumerate(plan.prompt_ids)}}


def check_resumed_prompts(entry_prompts: dict[int, list[int]] | None, plan, first: int) -> None:
    """A resumed round must be planned as it was: the same prompt for every group."""
    for i, prompt in (entry_prompts or {}).items():
        if list(plan.prompt_ids[int(i)]) != list(prompt):
            raise ValueError(
                f"the round from sample {first} resumed with other prompts than it was generated for (group {i}): "
                "its env or task changed since the checkpoint; resume with the config it was saved with"
            )


def oldest_version(resume: dict[int, list[Partial]], default: int) -> int:
    """The oldest version among a resumed round's handed-over tokens (`default` if none)."""
    versions = [v for group in resume.values() for p in group for v in p.versions]
    return min([default, *versions])
