"""Falls that recover: held-out accuracy that drops well below a run's best and comes back.

The collapse rule (`m2po_rllib.jobs.collapse`) asks for half the best lost and records only
the first such result; a run that loses 45% of its best and then recovers past it (the
4096-update probe of the repro issue: 0.341 -> 0.188 -> 0.38) is an instability it does not
count. The report counts these per arm, beside collapses, by this rule:

- a **fall** starts at an evaluation below (1 - `FALL_DROP`) x the run's best evaluation so
  far, once that best reached `MIN_BEST`, and only where the drop also exceeds `Z_FALL`
  binomial standard errors of the difference of two evaluations, sqrt(2 p (1 - p) / n) at
  p = the best and n = the held-out problems evaluated, when n is known (with 1000 problems
  a quarter of 0.34 is ~4 of them; with 50 problems it is not a fall but noise);
- it **recovers** at the first later evaluation back at (1 - `FALL_DROP` / 2) x that best
  (half the drop: a bounce on the threshold does not end it);
- a fall still open at the run's last evaluation did not recover (the collapse rule judges
  it when it is deep enough).
No Ray import.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

FALL_DROP = 0.25  # a fall: below 3/4 of the best so far
MIN_BEST = 0.05  # the rule applies once the best reached this (noise near 0), as the collapse rule's
Z_FALL = 3.0  # and the drop exceeds this many standard errors of a difference, when n is known


@dataclass(frozen=True)
class Fall:
    best: float
    best_update: int | None
    low: float  # the lowest evaluation of the fall
    low_update: int | None
    recovered: float | None = None  # the evaluation that ended it, None if it did not recover
    recovered_update: int | None = None

    def describe(self) -> str:
        end = (f"recovered to {self.recovered:.3f} at update {self.recovered_update}" if self.recovered is not None
               else "not recovered by the last evaluation")
        return (f"held-out {self.best:.3f} (best, update {self.best_update}) fell to {self.low:.3f} at update "
                f"{self.low_update}, {end}")

    def to_json(self) -> dict:
        return asdict(self)


def falls(evaluations: Sequence, heldout_size: int | None = None, drop: float = FALL_DROP,
          min_best: float = MIN_BEST) -> list[Fall]:
    """Every fall of a run (module docstring), from its evaluations in order (objects with
    `.accuracy` and `.update`, `m2po_rllib.jobs.runs.Evaluation`)."""
    if not 0 < drop < 1:
        raise ValueError(f"drop ({drop}) must be in (0, 1): the fraction of the best lost")
    out: list[Fall] = []
    best = best_update = None
    open_fall: dict | None = None
    for e in evaluations:
        acc = e.accuracy
        if open_fall is not None:
            if acc < open_fall["low"]:
                open_fall.update(low=acc, low_update=e.update)
            if acc >= (1 - drop / 2) * open_fall["best"]:
                out.append(Fall(**open_fall, recovered=acc, recovered_update=e.update))
                open_fall = None
        elif best is not None and best >= min_best and acc < (1 - drop) * best and _beyond_noise(best, acc, heldout_size):
            open_fall = {"best": best, "best_update": best_update, "low": acc, "low_update": e.update}
        if best is None or acc > best:
            best, best_update = acc, e.update
    if open_fall is not None:
        out.append(Fall(**open_fall))
    return out


def _beyond_noise(best: float, acc: float, n: int | None) -> bool:
    if not n:
        return True
    return best - acc > Z_FALL * math.sqrt(2 * best * (1 - best) / n)
