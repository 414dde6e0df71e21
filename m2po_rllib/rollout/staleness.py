"""The staleness bound steered by the measured second moment (`max_staleness="auto"`).

Every asynchronous RL system asks for a fixed bound on the age of trained data; the right
one depends on how fast the policy moves, which changes during training. M2PO already
measures what matters: the second moment M2 = mean(log(pi_now / pi_behaviour)^2) of the
trained tokens. The learners report it per age (in optimizer updates, `M2_BY_AGE_KEY`: per
age, the sum of squared log-ratios and the token count, over the step's usable tokens), and
`StalenessController` keeps an exponentially forgotten estimate of M2 per age bucket
(0, 1, 2-3, 4-7, ...; half-life `half_life` updates) and sets the bound that
`admission.AsyncRollouts` admits rounds under:

- lower: when a bucket's M2 exceeds `target_m2`, the bound goes to the age where M2 crosses
  the target, interpolated in log-log between that bucket and the next younger one (with
  M2 ~ age + 1 below it if none younger is measured);
- raise: when every measured bucket is under the target and the data reaches the bound
  (the oldest measured bucket holds ages >= bound / 2: the bound is what holds data back),
  the bound goes to the age where M2 is predicted to reach the target, extrapolated from
  the two oldest buckets' measured growth (M2 ~ age^p, p clipped to [0.5, 4]; p = 1 while
  only one bucket is measured), at most doubling per step;
- always within [floor, ceiling].

A bucket is measured while its forgotten token count is at least `min_tokens` and it was
fed data in the last `EXPIRY_HALF_LIVES` half-lives: a bound lowered because old data was
too far off gets no more data at those ages, so it is probed again (raised) two half-lives
later, whatever the batch size. Pure bookkeeping (no Ray, no torch): `tests/test_staleness.py` drives it with a
synthetic M2(age) that changes over time.
"""

from __future__ import annotations

import math
from typing import Any

AUTO = "auto"  # the `max_staleness` that turns this on
DEFAULT_CEILING = 256  # the paper's largest staleness
DEFAULT_HALF_LIFE = 32.0  # optimizer updates
EXPIRY_HALF_LIVES = 2.0  # a bucket fed no data for this many half-lives is no longer measured
P_RANGE = (0.5, 4.0)  # the measured growth exponent of M2 in age, clipped
P_ONE_BUCKET = 1.0  # while only one bucket is measured (a random walk's growth)
RAISE_MIN = 1.1  # raise only to a bound at least this factor higher (no jitter)


def age_bucket(age: int) -> int:
    """The lower edge of `age`'s bucket: 0, 1, 2, 4, 8, ... (bucket b holds [b, 2b))."""
    age = int(age)
    return 0 if age <= 0 else 1 << (age.bit_length() - 1)


class StalenessController:
    def __init__(self, *, target_m2: float, floor: int, ceiling: int, half_life: float = DEFAULT_HALF_LIFE,
                 min_tokens: int = 256):
        if not (target_m2 > 0 and math.isfinite(target_m2)):
            raise ValueError(f"target_m2 ({target_m2}) must be a positive number")
        if not 0 <= floor <= ceiling:
            raise ValueError(f"need 0 <= floor ({floor}) <= ceiling ({ceiling})")
        if not half_life > 0:
            raise ValueError(f"half_life ({half_life}) must be > 0 updates")
        self.target_m2 = float(target_m2)
        self.floor = int(floor)
        self.ceiling = int(ceiling)
        self.half_life = float(half_life)
        self.min_tokens = float(min_tokens)
        self.bound = self.floor  # start where the policy's speed matters least
        self.version: int | None = None  # the learner version of the last observation
        # bucket -> [sum of squared log-ratios, tokens, sum of ages x tokens (these three
        # forgotten), oldest age, the version it was last fed at]
        self.stats: dict[int, list[float]] = {}
        self.changes = 0  # how many times the bound moved

    # -- measurements --------------------------------------------------------------------
    def observe(self, by_age: dict[int, tuple[float, float]], version: int) -> int:
        """Files one step's M2 by age ({age: (sum of squared log-ratios, tokens)}) measured
        when the learner reached `version`; returns the bound now in force."""
        if self.version is not None and version > self.version:
            decay = 0.5 ** ((version - self.version) / self.half_life)
            for s in self.stats.values():
                s[0] *= decay
                s[1] *= decay
                s[2] *= decay
        self.version = version if self.version is None else max(self.version, version)
        for age, (sum_sq, tokens) in by_age.items():
            if not (tokens > 0 and math.isfinite(tokens) and 0 <= sum_sq < math.inf):
                continue  # nothing measured (or not a measurement: NaN never enters the state)
            s = self.stats.setdefault(age_bucket(age), [0.0, 0.0, 0.0, 0.0, 0.0])
            s[0] += float(sum_sq)
            s[1] += float(tokens)
            s[2] += float(age) * float(tokens)
            s[3] = max(s[3], float(age))
            s[4] = float(self.version)
        expired = self.version - EXPIRY_HALF_LIVES * self.half_life
        for bucket in [b for b, s in self.stats.items() if s[1] < 1e-3 or s[4] < expired]:
            del self.stats[bucket]
        bound = self._next_bound()
        if bound != self.bound:
            self.changes += 1
            self.bound = bound
        return self.bound

    def measured(self) -> list[tuple[int, float, float, float]]:
        """(bucket, mean age, M2, oldest age) of every bucket measured on at least
        `min_tokens` (forgotten) tokens, youngest first."""
        return [
            (b, s[2] / s[1], s[0] / s[1], s[3])
            for b, s in sorted(self.stats.items())
            if s[1] >= self.min_tokens
        ]

    # -- the rule ------------------------------------------------------------------------
    def _next_bound(self) -> int:
        points = self.measured()
        if not points:
            return self.bound
        target = self.target_m2
        over = next((i for i, p in enumerate(points) if p[2] > target), None)
        if over is not None:  # lower: to where M2 crosses the target
            _, a1, m1, _ = points[over]
            if over > 0:
                _, a0, m0, _ = points[over - 1]
                cross = _crossing(a0, m0, a1, m1, target)
            else:  # no younger age measured: M2 ~ (age + 1)^p below it
                cross = (a1 + 1) * (target / m1) ** (1 / P_ONE_BUCKET) - 1
            return self._clip(min(self.bound, math.floor(cross)))
        _, a_old, m_old, oldest = points[-1]
        if oldest < self.bound / 2:
            return self.bound  # the data does not reach the bound: it is not what holds it back
        if len(points) >= 2:
            _, a_prev, m_prev, _ = points[-2]
            p = _growth(a_prev, m_prev, a_old, m_old)
        else:
            p = P_ONE_BUCKET
        predicted = (a_old + 1) * (target / max(m_old, 1e-12)) ** (1 / p) - 1
        candidate = math.floor(min(predicted, 2 * max(self.bound, 1)))
        if candidate < RAISE_MIN * self.bound:
            return self.bound
        return self._clip(candidate)

    def _clip(self, bound: int) -> int:
        return int(min(self.ceiling, max(self.floor, bound)))

    # -- metrics and checkpoints -----------------------------------------------------------
    def m2_by_bucket(self) -> dict[int, float]:
        return {b: m2 for b, _, m2, _ in self.measured()}

    def get_state(self) -> dict[str, Any]:
        return {"bound": self.bound, "version": self.version, "stats": {b: list(s) for b, s in self.stats.items()},
                "changes": self.changes}

    def set_state(self, state: dict[str, Any]) -> None:
        self.bound = self._clip(int(state["bound"]))
        self.version = state["version"]
        self.stats = {int(b): list(s) for b, s in state["stats"].items()}
        self.changes = int(state["changes"])


def _growth(a0: float, m0: float, a1: float, m1: float) -> float:
    """The exponent p of M2 ~ (age + 1)^p through two measured points, clipped."""
    if m0 <= 0 or m1 <= 0 or a1 <= a0:
        return P_ONE_BUCKET
    p = math.log(m1 / m0) / math.log((a1 + 1) / (a0 + 1))
    return min(P_RANGE[1], max(P_RANGE[0], p))


def _crossing(a0: float, m0: float, a1: float, m1: float, target: float) -> float:
    """The age between a0 (M2 m0 <= target) and a1 (m1 > target) where M2 = target, in log-log."""
    if m0 <= 0:
        return a0
    p = _growth(a0, m0, a1, m1)
    return max(a0, min(a1, (a0 + 1) * (target / m0) ** (1 / p) - 1))
