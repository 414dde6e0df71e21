"""Comparisons of two arms of per-seed results, as the report's claims need them: the
difference of means with a t interval, a verdict in words, and the seeds per arm that
would resolve it. Pure Python (no Ray, no scipy): Student's t comes from the regularized
incomplete beta function, the normal quantile from `statistics.NormalDist`.

An arm is a list of per-seed values, or a {seed: value} mapping. Two mappings with the same
seeds (at least two) are paired: the paired t test on the per-seed differences. Otherwise
Welch's t (unequal variances, Welch-Satterthwaite degrees of freedom).

Claims and their verdicts (diff = mean(A) - mean(B); CI95 the two-sided 95% interval):
- "greater" (A - B > threshold): "holds" when CI95 lies above the threshold, "does not
  hold" when it lies below, else "not resolved";
- "less" (A - B < threshold): the mirror image;
- "not_lower" (A >= B - margin, non-inferiority): "holds" when CI95's lower end is above
  -margin, "does not hold" when its upper end is below -margin, else "not resolved";
- "equivalent" (|A - B| < margin, TOST: two one-sided t tests at 5%, i.e. the 90% interval
  CI90): "equivalent within ±margin" when CI90 lies inside (-margin, +margin), "not
  equivalent" when CI90 lies entirely outside [-margin, +margin], else "not resolved".
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

CLAIMS = ("greater", "less", "not_lower", "equivalent")
HOLDS, DOES_NOT_HOLD, NOT_RESOLVED = "holds", "does not hold", "not resolved"
NOT_EQUIVALENT = "not equivalent"
ALPHA = 0.05  # the intervals are 95% (90% for the TOST: two one-sided tests at 5%)
POWER = 0.8  # of the seed counts


def headline(values: Sequence[float], k: int) -> float | None:
    """A run's final value: the mean of its last `k` values (all of them when it has fewer)."""
    if k < 1:
        raise ValueError(f"k ({k}) must be >= 1: the number of last evaluations averaged")
    return statistics.fmean(values[-k:]) if values else None


def per_seed(runs: Iterable, value: Callable[[Any], float | None]) -> dict[Any, float]:
    """An arm: {seed: value} over `runs` (objects with `.settings["seed"]` and `.path`), the
    runs of one seed averaged; a run without a seed is its own member; runs with no value
    (None) left out."""
    by_seed: dict[Any, list[float]] = {}
    for r in runs:
        v = value(r)
        if v is not None:
            seed = r.settings.get("seed")
            by_seed.setdefault(seed if seed is not None else f"run {r.path.name}", []).append(v)
    return {s: statistics.fmean(vs) for s, vs in by_seed.items()}


# -- Student's t ------------------------------------------------------------------------------
def _beta_cf(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b), modified Lentz (Numerical Recipes 6.4)."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 100_000):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    raise ArithmeticError(f"the incomplete beta continued fraction did not converge (a={a}, b={b}, x={x})")


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), a, b > 0, 0 <= x <= 1."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x ({x}) must be in [0, 1]")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):  # where the fraction converges fast; else use the symmetry
        return math.exp(log_front) * _beta_cf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_cf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` (> 0, not necessarily whole) degrees of freedom:
    the upper tail is I_{df/(df+t^2)}(df/2, 1/2) / 2. Near t = 0 that x rounds to 1 and loses
    t's digits, so there it is 1/2 - I_{t^2/(df+t^2)}(1/2, df/2) / 2 (the same, by symmetry)."""
    if df <= 0:
        raise ValueError(f"df ({df}) must be > 0")
    t2 = t * t
    if t2 < df:
        tail = 0.5 - 0.5 * betainc(0.5, df / 2.0, t2 / (df + t2))
    else:
        tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t2))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p (bisection on `t_cdf` to machine precision; the normal
    quantile beyond df = 1e7)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p ({p}) must be in (0, 1)")
    if df > 1e7:
        return statistics.NormalDist().inv_cdf(p)
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


def z(p: float) -> float:
    return statistics.NormalDist().inv_cdf(p)


# -- comparing two arms -------------------------------------------------------------------------
@dataclass
class Comparison:
    """The comparison of arm A with arm B; intervals are of mean(A) - mean(B)."""

    claim: str  # one of CLAIMS
    test: str  # "paired t", "Welch t", or why there is none
    n_a: int
    n_b: int
    mean_a: float
    mean_b: float
    diff: float
    se: float | None  # standard error of diff
    df: float | None  # degrees of freedom of the t interval
    sd: float | None  # the sd in the seed count: of the per-seed differences (paired) or pooled
    ci95: tuple[float, float] | None
    ci90: tuple[float, float] | None
    verdict: str
    seeds_needed: int | None  # per arm, for 80% power at the observed effect (see `seeds_needed`)
    threshold: float = 0.0
    margin: float | None = None


def _values(arm) -> list[float]:
    return [float(v) for v in (arm.values() if isinstance(arm, Mapping) else arm)]


def is_paired(a, b) -> bool:
    """Both arms are {seed: value} mappings over the same (known) seeds, at least two."""
    return (isinstance(a, Mapping) and isinstance(b, Mapping) and set(a) == set(b) and len(a) >= 2
            and None not in a)


def seeds_needed(sd: float | None, delta: float, *, paired: bool, claim: str,
                 margin: float | None = None) -> int | None:
    """Seeds per arm for 80% power (Chow, Shao & Wang, "Sample Size Calculations in Clinical
    Research", ch. 3), with f = 1 paired (sd of the per-seed differences) and f = 2 unpaired
    (pooled sd): the smallest n with n >= f ((q_a + q_b) sd / gap)^2, where q_a and q_b are
    quantiles of Student's t at the test's degrees of freedom for n seeds (n - 1 paired,
    2 n - 2 unpaired): the t refinement of the normal count, which at 3-6 seeds asks for too
    few (it would call 3 seeds enough where a t interval on 2 degrees of freedom is not):

    - a difference ("greater", "less", "not_lower"): q_a = t_0.975, q_b = t_0.8, gap the
      observed distance of the difference from the claim's bound (the threshold, or -margin
      for "not_lower");
    - "equivalent" (TOST at 5% per side), delta the observed difference: when |delta| <
      margin, q_a = t_0.95 and q_b = t_0.9 for delta = 0, t_0.8 otherwise, gap = margin -
      |delta|; when |delta| > margin (to show it lies outside), q_b = t_0.8 and gap = |delta| -
      margin.

    At least 2 (a t interval needs two); None without an sd or when the effect is exactly
    at the bound (no number of seeds resolves it)."""
    if sd is None:
        return None
    f = 1.0 if paired else 2.0
    if claim == "equivalent":
        gap = margin - abs(delta) if abs(delta) < margin else abs(delta) - margin
        qa, qb = 1 - ALPHA, (1 - (1 - POWER) / 2 if delta == 0 else POWER)
    else:
        gap, qa, qb = abs(delta), 1 - ALPHA / 2, POWER
    if gap == 0:
        return None
    if sd == 0:
        return 2
    n = max(2, math.ceil(f * ((z(qa) + z(qb)) * sd / gap) ** 2))  # the normal count: never more
    while True:
        df = n - 1 if paired else 2 * n - 2
        if n >= f * ((t_quantile(qa, df) + t_quantile(qb, df)) * sd / gap) ** 2:
            return n
        n += 1


def compare(a, b, claim: str, *, margin: float | None = None, threshold: float = 0.0) -> Comparison:
    """Arm A against arm B for `claim` (module docstring). `threshold` shifts the bound of
    "greater" / "less" (e.g. log(0.1) for "A at least 10x below B" on log values); `margin`
    is required for "equivalent" and "not_lower"."""
    if claim not in CLAIMS:
        raise ValueError(f"claim {claim!r} must be one of {CLAIMS}")
    if claim in ("equivalent", "not_lower") and (margin is None or margin <= 0):
        raise ValueError(f"claim {claim!r} needs a margin > 0, got {margin!r}")
    va, vb = _values(a), _values(b)
    if not va or not vb:
        raise ValueError(f"both arms need a value: got {len(va)} and {len(vb)}")
    mean_a, mean_b = statistics.fmean(va), statistics.fmean(vb)
    diff = mean_a - mean_b
    paired = is_paired(a, b)
    se = df = sd = None
    if paired:
        d = [a[s] - b[s] for s in a]
        sd = statistics.stdev(d)
        se, df, test = sd / math.sqrt(len(d)), len(d) - 1, "paired t"
    else:
        var_a = statistics.variance(va) if len(va) > 1 else None
        var_b = statistics.variance(vb) if len(vb) > 1 else None
        known = [v for v in (var_a, var_b) if v is not None]
        sd = math.sqrt(statistics.fmean(known)) if known else None
        if var_a is None or var_b is None:
            test = f"none: an arm has one seed ({len(va)} vs {len(vb)})"
        else:
            test = "Welch t"
            wa, wb = var_a / len(va), var_b / len(vb)
            se = math.sqrt(wa + wb)
            df = (wa + wb) ** 2 / (wa**2 / (len(va) - 1) + wb**2 / (len(vb) - 1)) if se > 0 else len(va) + len(vb) - 2

    def interval(level: float):
        if se is None:
            return None
        h = t_quantile(1 - (1 - level) / 2, df) * se if se > 0 else 0.0
        return diff - h, diff + h

    ci95, ci90 = interval(0.95), interval(0.90)
    verdict, bound = NOT_RESOLVED, threshold
    if claim == "equivalent":
        bound = 0.0
        if ci90 is not None and -margin < ci90[0] and ci90[1] < margin:
            verdict = f"equivalent within ±{margin:g}"
        elif ci90 is not None and (ci90[0] > margin or ci90[1] < -margin):
            verdict = NOT_EQUIVALENT
    elif ci95 is not None:
        bound = -margin if claim == "not_lower" else threshold
        above, below = ci95[0] > bound, ci95[1] < bound
        if claim == "less":
            above, below = below, above
        verdict = HOLDS if above else DOES_NOT_HOLD if below else NOT_RESOLVED
    return Comparison(
        claim=claim, test=test, n_a=len(va), n_b=len(vb), mean_a=mean_a, mean_b=mean_b, diff=diff, se=se, df=df,
        sd=sd, ci95=ci95, ci90=ci90 if claim == "equivalent" else None, verdict=verdict,
        seeds_needed=seeds_needed(sd, diff - bound, paired=paired, claim=claim, margin=margin),
        threshold=threshold, margin=margin,
    )
