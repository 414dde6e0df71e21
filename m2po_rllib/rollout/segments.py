"""Behaviour log-probs scored segment by segment: a runner's rows that cross weight loads.

A runner that scores its own rounds (`recompute_behavior_logp` in async mode: the
`BehaviorScorer` beside its engine) scores a round when it ends, with the weights it serves
then. A row whose first tokens were sampled by older weights (loaded mid-sequence:
`inflight_weight_updates`; or a round resumed from a checkpoint's partial sequences) needs
those tokens' log-probs under the older weights, which the runner no longer holds at the end.

`SegmentScores` keeps, for each row of the rounds generating, its behaviour log-probs scored
so far. Before the runner's weights change under rows in flight, and when a checkpoint reads
the rounds, `settle` scores every row that grew since its last settle up to where it is, with
the weights about to be replaced, and keeps the new tokens' values (the earlier ones were
scored under the weights before). When the round ends the runner scores it whole with its
current weights (the last segment's) and `splice` puts the kept prefixes in front: each token's
log-prob is then the one of the weights that sampled it, in the learner's numerics. A settle is
one no-grad forward over the rows that grew (the scorer's `rows_per_forward` at a time).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from m2po_rllib.rollout.stream_snapshot import handed_rows


def rows_so_far(r, partials: dict) -> Iterator[tuple[int, list[int], list[int]]]:
    """(row, prompt, response so far) for each row of a streaming round generating (`_Round`),
    in the order its rows are packed: single-turn, group by group (a finished group's
    completions, or the engine's `partials` of one in flight); multi-turn, episode by episode
    (its tokens so far and the turn in flight)."""
    first = r.first_sample_id
    if r.episodes is not None:
        for e, episode in enumerate(r.episodes):
            turn = None if episode.done else partials.get((first, e), [None])[0]
            yield e, episode.prompt_ids, list(episode.token_ids) + (list(turn.token_ids) if turn is not None else [])
        return
    row = 0
    for i, prompt in enumerate(r.plan.prompt_ids):
        for sample in r.groups[i] if i in r.groups else partials[(first, i)]:
            yield row, prompt, list(sample.token_ids)
            row += 1


class SegmentScores:
    """Rows' behaviour log-probs scored so far, by (first sample id, row)."""

    def __init__(self) -> None:
        self._kept: dict[tuple[int, int], np.ndarray] = {}

    def settle(self, scorer, rounds, partials: dict) -> int:
        """Scores, with `scorer`'s weights now (a `BehaviorScorer`), every row of `rounds`
        (streaming rounds generating) that grew since its last settle, and keeps its new
        tokens' log-probs. Returns the rows scored."""
        grown = [(r.first_sample_id, row, prompt, response)
                 for r in rounds for row, prompt, response in rows_so_far(r, partials)
                 if len(response) > len(self._kept.get((r.first_sample_id, row), ()))]
        if not grown:
            return 0
        scores = scorer.score_rows([g[2] for g in grown], [g[3] for g in grown])
        for (first, row, _, response), logp in zip(grown, scores):
            kept = self._kept.get((first, row), np.zeros(0, np.float32))
            self._kept[(first, row)] = np.concatenate([kept, logp[len(kept):len(response)]])
        return len(grown)

    def kept(self, first: int, row: int) -> list[float] | None:
        """Row `row` of the round from sample `first`: its log-probs kept so far (None: none)."""
        kept = self._kept.get((first, row))
        return None if kept is None else kept.tolist()

    def seed(self, first: int, resume: dict) -> None:
        """A resumed round's handed-over tokens keep the log-probs their runner scored
        (`Partial.scored`, `EpisodeSoFar.scored`) under the weights that sampled them."""
        for row, (_, scored, n) in enumerate(handed_rows(resume)):
            if n and scored is None:
                raise ValueError(
                    f"the round from sample {first} was saved without its runner's behaviour log-probs "
                    "(recompute_behavior_logp was off when its checkpoint was taken): resume it with "
                    "recompute_behavior_logp=False, as it was saved"
                )
            if scored is not None:
                if len(scored) != n:
                    raise ValueError(f"row {row} of the round from sample {first} was handed over with {n} tokens "
                                     f"and {len(scored)} scored log-probs")
                self._kept[(first, row)] = np.asarray(scored, np.float32)

    def take(self, first: int, n_rows: int) -> list[list[float] | None]:
        """The kept prefixes of the round from sample `first` (its `n_rows` rows), forgotten here."""
        return [None if (k := self._kept.pop((first, row), None)) is None else k.tolist() for row in range(n_rows)]


def splice(logp: np.ndarray, prefixes: list[list[float] | None] | None, mask: np.ndarray) -> np.ndarray:
    """A round's `(B, R)` log-probs scored whole with the last segment's weights, each row's
    kept prefix (`SegmentScores.take`) in front; 0 where `mask` is 0."""
    if not prefixes:
        return logp
    out = np.array(logp, np.float32)
    for row, prefix in enumerate(prefixes):
        if prefix:
            n = min(len(prefix), out.shape[1])
            out[row, :n] = prefix[:n]
    return np.where(mask > 0, out, 0.0).astype(np.float32)
