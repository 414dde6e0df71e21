"""m2po_rllib.jobs.stats (Student's t without scipy, two-arm comparisons, seed counts) and
the windows of the report's claims, on synthetic results whose answers are known."""

from __future__ import annotations

import math
import random
import statistics
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from m2po_rllib.jobs.stats import betainc, compare, headline, seeds_needed, t_cdf, t_quantile, z

# t_{0.975, df} and t_{0.95, df} from a printed table (e.g. NIST/SEMATECH e-Handbook 1.3.6.7.2)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 5: 2.571, 10: 2.228, 20: 2.086, 30: 2.042, 100: 1.984}
T95 = {1: 6.314, 2: 2.920, 5: 2.015, 10: 1.812, 30: 1.697}


@pytest.mark.parametrize("df", sorted(T975))
def test_t_quantiles_equal_the_tables(df):
    assert t_quantile(0.975, df) == pytest.approx(T975[df], abs=5e-4)
    if df in T95:
        assert t_quantile(0.95, df) == pytest.approx(T95[df], abs=5e-4)
    assert t_quantile(0.025, df) == -t_quantile(0.975, df) and t_quantile(0.5, df) == 0.0


def test_t_approaches_the_normal_and_df_need_not_be_whole():
    assert t_quantile(0.975, 1e6) == pytest.approx(z(0.975), abs=1e-5)
    assert t_quantile(0.975, 1e9) == pytest.approx(1.959964, abs=1e-6)
    assert T975[2] > t_quantile(0.975, 2.5) > T975[3]  # Welch's degrees of freedom are fractional


@pytest.mark.parametrize("x", [0.0, 1e-6, 0.1, 0.37, 0.5, 0.9, 0.999, 1.0])
def test_incomplete_beta_against_closed_forms(x):
    assert betainc(1, 1, x) == pytest.approx(x, abs=1e-14)
    assert betainc(3.5, 1, x) == pytest.approx(x**3.5, abs=1e-13)
    assert betainc(1, 2.5, x) == pytest.approx(1 - (1 - x) ** 2.5, abs=1e-13)
    assert betainc(0.5, 0.5, x) == pytest.approx(2 / math.pi * math.asin(math.sqrt(x)), abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(p=st.floats(0.001, 0.999), df=st.floats(0.5, 500))
@example(p=0.5000000000000001, df=0.5000000000000001)  # t ~ 1e-16: df / (df + t^2) rounds to 1
def test_t_cdf_inverts_t_quantile(p, df):
    assert t_cdf(t_quantile(p, df), df) == pytest.approx(p, abs=1e-10)


def test_t_against_scipy_where_installed():
    scipy_t = pytest.importorskip("scipy.stats").t
    for df in (1, 1.5, 2, 3.7, 7, 30, 250, 5000):
        for p in (0.6, 0.9, 0.95, 0.975, 0.995, 0.9995):
            assert t_quantile(p, df) == pytest.approx(scipy_t.ppf(p, df), rel=1e-8)


def test_headline_is_the_mean_of_the_last_k():
    assert headline([0.1, 0.2, 0.3, 0.4], 3) == pytest.approx(0.3)
    assert headline([0.5], 3) == 0.5 and headline([], 3) is None
    with pytest.raises(ValueError, match="k \\(0\\) must be >= 1"):
        headline([0.1], 0)


# -- comparisons on arms whose answer is known ---------------------------------------------------
def _arm(mean, sd, n, rng) -> list[float]:
    return [rng.gauss(mean, sd) for _ in range(n)]


def test_a_large_known_difference_holds_and_its_opposite_does_not():
    rng = random.Random(0)
    a, b = _arm(0.50, 0.01, 5, rng), _arm(0.40, 0.01, 5, rng)
    up = compare(a, b, "greater")
    assert up.test == "Welch t" and up.verdict == "holds" and up.ci95[0] > 0.07 and up.ci95[1] < 0.13
    assert compare(a, b, "less").verdict == "does not hold"
    assert compare(b, a, "less").verdict == "holds"
    assert compare(a, b, "equivalent", margin=0.02).verdict == "not equivalent"


def test_welch_interval_against_its_formula_written_out():
    a, b = [0.51, 0.47, 0.55, 0.49], [0.40, 0.46, 0.38]
    c = compare(a, b, "greater")
    va, vb = statistics.variance(a) / 4, statistics.variance(b) / 3
    df = (va + vb) ** 2 / (va**2 / 3 + vb**2 / 2)
    half = t_quantile(0.975, df) * math.sqrt(va + vb)
    assert c.df == pytest.approx(df) and c.ci95 == pytest.approx((c.diff - half, c.diff + half))
    assert c.diff == pytest.approx(statistics.fmean(a) - statistics.fmean(b))


def test_arms_over_the_same_seeds_are_paired():
    """A seed effect shared by both arms cancels in the paired test: a small difference
    that Welch's t cannot see is resolved."""
    rng = random.Random(1)
    seed_effect = {s: rng.gauss(0, 0.05) for s in range(4)}
    a = {s: 0.50 + e + rng.gauss(0, 0.002) for s, e in seed_effect.items()}
    b = {s: 0.48 + e + rng.gauss(0, 0.002) for s, e in seed_effect.items()}
    paired = compare(a, b, "greater")
    assert paired.test == "paired t" and paired.df == 3 and paired.verdict == "holds"
    d = [a[s] - b[s] for s in a]
    assert paired.sd == pytest.approx(statistics.stdev(d))
    welch = compare(list(a.values()), list(b.values()), "greater")
    assert welch.test == "Welch t" and welch.verdict == "not resolved"
    assert compare(a, {**b, 9: 0.5}, "greater").test == "Welch t", "a seed in one arm only: unpaired"


def test_identical_distributions_with_tiny_sd_are_equivalent():
    rng = random.Random(2)
    a, b = _arm(0.50, 0.002, 4, rng), _arm(0.50, 0.002, 4, rng)
    c = compare(a, b, "equivalent", margin=0.02)
    assert c.verdict == "equivalent within ±0.02" and -0.02 < c.ci90[0] < c.ci90[1] < 0.02
    assert t_quantile(0.95, c.df) * c.se == pytest.approx((c.ci90[1] - c.ci90[0]) / 2)
    assert compare(a, b, "greater").verdict == "not resolved"


def test_two_seeds_with_a_huge_sd_resolve_nothing_and_say_how_many_would():
    rng = random.Random(3)
    a, b = _arm(0.50, 0.2, 2, rng), _arm(0.45, 0.2, 2, rng)
    for claim in ("greater", "less", "not_lower"):
        assert compare(a, b, claim, margin=0.02).verdict == "not resolved"
    eq = compare(a, b, "equivalent", margin=0.02)
    assert eq.verdict == "not resolved" and eq.seeds_needed > 2
    assert eq.seeds_needed == seeds_needed(eq.sd, eq.diff, paired=False, claim="equivalent", margin=0.02)
    assert compare(a, b, "greater").seeds_needed > 2


def test_one_seed_in_an_arm_has_no_interval():
    c = compare([0.5], [0.4, 0.42, 0.41], "greater")
    assert c.ci95 is None and c.verdict == "not resolved" and c.test.startswith("none: an arm has one seed")
    assert c.seeds_needed == seeds_needed(statistics.stdev([0.4, 0.42, 0.41]), 0.09, paired=False, claim="greater")
    lone = compare([0.5], [0.4], "greater")
    assert lone.sd is None and lone.seeds_needed is None


def test_not_lower_and_a_threshold():
    assert compare([0.500, 0.502, 0.498], [0.503, 0.501, 0.505], "not_lower", margin=0.02).verdict == "holds"
    assert compare([0.40, 0.41, 0.39], [0.50, 0.51, 0.49], "not_lower", margin=0.02).verdict == "does not hold"
    # log fractions: 1e-4 vs 1e-2 is 100x fewer, at least 10x: holds; at least 1000x: does not hold
    masked, clipped = [math.log(1e-4 * f) for f in (1.0, 1.1, 0.9)], [math.log(1e-2 * f) for f in (1.0, 0.95, 1.05)]
    assert compare(masked, clipped, "less", threshold=math.log(0.1)).verdict == "holds"
    assert compare(masked, clipped, "less", threshold=math.log(0.001)).verdict == "does not hold"


def _satisfies(n, sd, gap, qa, qb, paired):
    """n >= f ((t_qa + t_qb) sd / gap)^2 at n's degrees of freedom."""
    f, df = (1, n - 1) if paired else (2, 2 * n - 2)
    return n >= f * ((t_quantile(qa, df) + t_quantile(qb, df)) * sd / gap) ** 2


def test_seed_counts_are_the_smallest_that_reach_their_t_formulas():
    z975, z8, z95, z9 = z(0.975), z(0.8), z(0.95), z(0.9)
    cases = [  # (sd, delta, paired, claim, margin), (qa, qb, gap), the normal count
        ((0.1, 0.1, False, "greater", None), (0.975, 0.8, 0.1), math.ceil(2 * (z975 + z8) ** 2)),
        ((0.1, -0.1, True, "less", None), (0.975, 0.8, 0.1), math.ceil((z975 + z8) ** 2)),
        ((0.02, 0.0, False, "equivalent", 0.02), (0.95, 0.9, 0.02), math.ceil(2 * (z95 + z9) ** 2)),
        ((0.02, 0.01, False, "equivalent", 0.02), (0.95, 0.8, 0.01), math.ceil(2 * (2 * (z95 + z8)) ** 2)),
        ((0.02, 0.03, False, "equivalent", 0.02), (0.95, 0.8, 0.01), math.ceil(2 * (2 * (z95 + z8)) ** 2)),
        ((0.01, 0.02, True, "greater", None), (0.975, 0.8, 0.02), 2),
    ]
    for (sd, delta, paired, claim, margin), (qa, qb, gap), normal in cases:
        n = seeds_needed(sd, delta, paired=paired, claim=claim, margin=margin)
        assert _satisfies(n, sd, gap, qa, qb, paired) and (n == 2 or not _satisfies(n - 1, sd, gap, qa, qb, paired))
        assert n >= normal, "t's quantiles are wider than the normal's"
    # at 16 seeds a side the t count is one or two above the normal one; at 3 the gap is wide
    assert seeds_needed(0.1, 0.1, paired=False, claim="greater") in (17, 18)
    assert seeds_needed(0.0, 0.1, paired=False, claim="greater") == 2
    assert seeds_needed(0.1, 0.0, paired=False, claim="greater") is None


def test_the_seed_count_gives_about_80_percent_power():
    """Simulated: with the seeds it asks for, a true difference of 1 sd holds ~80% of the
    time (the count uses t's quantiles, as the test does)."""
    rng = random.Random(4)
    n = seeds_needed(1.0, 1.0, paired=False, claim="greater")
    wins = sum(compare(_arm(1.0, 1.0, n, rng), _arm(0.0, 1.0, n, rng), "greater").verdict == "holds"
               for _ in range(400))
    assert 0.68 <= wins / 400 <= 0.9, (n, wins)


def test_bad_claims_are_refused():
    with pytest.raises(ValueError, match="must be one of"):
        compare([1.0], [2.0], "bigger")
    with pytest.raises(ValueError, match="needs a margin"):
        compare([1.0, 2.0], [2.0, 3.0], "equivalent")


# -- the claims' windows -----------------------------------------------------------------------
def _run(history, **extra):
    from m2po_rllib.jobs.runs import Run

    return Run(Path("/runs/x"), {"policy_loss": "m2po", "seed": 0, **extra}, history)


def test_steady_state_starts_when_the_data_is_as_old_as_the_staleness():
    from m2po_rllib.jobs.steady import run_value, steady_state

    # staleness 4, 2 updates per iteration: iteration 1 fills, 2-3 train younger base-model data
    history = [{"iteration": i, "policy_version": v, "masked_frac": f}
               for i, (v, f) in enumerate([(0, None), (2, 0.0), (4, 0.0), (6, 0.1), (8, 0.3)], 1)]
    assert [h["iteration"] for h in steady_state(history, 4)] == [4, 5]
    assert run_value(history, "masked_frac", 4) == pytest.approx(0.2)
    assert [h["iteration"] for h in steady_state(history, 0)] == [1, 2, 3, 4, 5]
    assert run_value(history[:3], "masked_frac", 4) is None


def test_an_arm_is_one_value_per_seed():
    from m2po_rllib.jobs.stats import per_seed

    runs = [_run([], seed=0), _run([], seed=0), _run([], seed=1), _run([], seed=None), _run([], seed=2)]
    values = iter([0.1, 0.3, 0.5, 0.7, None])
    arm = per_seed(runs, lambda r: next(values))
    assert arm == pytest.approx({0: 0.2, 1: 0.5, "run x": 0.7}), "seed 0 averaged; no seed: its own; None left out"


def test_evaluations_are_the_evaluated_iterations_not_the_carried_values():
    from m2po_rllib.jobs.runs import Evaluation

    # evaluation_interval 2: iteration 1 carries the evaluation before training
    history = [{"iteration": i, "policy_version": 4 * i, "heldout_accuracy": a}
               for i, a in enumerate([0.2, 0.3, 0.3, 0.5, 0.5, 0.4], 1)]
    run = _run(history, evaluation_interval=2)
    assert run.evaluations == [Evaluation(0, 0, 0.2), Evaluation(2, 8, 0.3), Evaluation(4, 16, 0.5),
                               Evaluation(6, 24, 0.4)]
    assert run.final == pytest.approx(0.4) and run.best == 0.5
    run.last_k = 2
    assert run.final == pytest.approx(0.45)
    # m2po train's evaluation after the loop counts when it is at later weights, not twice
    assert _run(history, evaluation_interval=2).evaluations[-1].iteration == 6
    later = _run(history[:5], evaluation_interval=2)
    later.end = Evaluation(5, 20, 0.1)
    assert later.evaluations[-1] == Evaluation(5, 20, 0.1)
    same = _run(history, evaluation_interval=2)
    same.end = Evaluation(6, 24, 0.41)
    assert same.evaluations[-1] == Evaluation(6, 24, 0.4)
    # without a known interval every record with a value is an evaluation (runs built by hand)
    assert len(_run(history).evaluations) == 6


def test_early_window_is_a_third_of_the_longest_run():
    from m2po_rllib.jobs.claims import early_accuracy, early_window

    long = _run([{"iteration": i, "policy_version": 10 * i, "heldout_accuracy": 0.1 * i} for i in range(1, 10)])
    short = _run([{"iteration": i, "policy_version": 10 * i, "heldout_accuracy": 0.5} for i in range(1, 4)])
    until = early_window([long, short])
    assert until == 30
    assert early_accuracy(long, until) == pytest.approx(0.2) and early_accuracy(short, until) == 0.5
    assert early_accuracy(_run([{"iteration": 1, "policy_version": 0, "heldout_accuracy": 0.2}]), until) is None
