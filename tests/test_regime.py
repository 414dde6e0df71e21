"""The regime of a variant (m2po_rllib/jobs/regime.py): condition 1, M2 of the data trained once
it is as old as the staleness against tau (median and tail), and condition 2, the on-policy
arm's held-out change within one staleness window; the steady state and its one masked /
clipped fraction (m2po_rllib/jobs/steady.py)."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from m2po_rllib.jobs import regime, steady
from m2po_rllib.jobs.runs import Evaluation, Run


def _history(m2_ramp: float, m2_stale: float, staleness: int, updates: int, frac: float, kind: str) -> list[dict]:
    """One record per 4 updates: M2 `m2_ramp` while the base-model ramp trains (the version
    before the iteration below the staleness), `m2_stale` after."""
    return [
        {"iteration": i + 1, "policy_version": 4 * i, "m2_before": m2_ramp if 4 * (i - 1) < staleness else m2_stale,
         f"{kind}_frac": 0.5 if 4 * (i - 1) < staleness else frac}
        for i in range(updates // 4)
    ]


def _run(history, seed=0, **settings) -> Run:
    return Run(Path(f"/runs/s{seed}"), {"seed": seed, **settings}, history)


def test_steady_state_is_the_records_trained_on_data_as_old_as_the_staleness():
    history = _history(0.0, 1.0, staleness=8, updates=20, frac=0.0, kind="masked")
    # the version before each record: 0 (none), 0, 4, 8, 12 -> steady from the record after version 8
    assert [h["policy_version"] for h in steady.steady_state(history, 8)] == [12, 16]
    assert [h["policy_version"] for h in steady.steady_state(history, 0)] == [0, 4, 8, 12, 16]
    assert steady.steady_state(history, "auto", "async") == history, "an async 'auto' bound: no ramp"
    assert steady.steady_state(history, 8, "async") == history, "an async bound is not an age: no ramp"
    assert steady.start(True) == 0 and steady.start(256) == 256 and steady.start(256, "async") == 0


def test_the_steady_fraction_is_a_mean_over_records_then_seeds():
    # seed 0 has two runs (0.001 and 0.003: its value 0.002), seed 1 one run at 0.008
    runs = [_run(_history(0.0, 0.01, 16, 64, f, "masked"), seed) for f, seed in ((0.001, 0), (0.003, 0), (0.008, 1))]
    f = steady.fraction(runs, 16)
    assert f.kind == "masked" and f.seeds == pytest.approx({0: 0.002, 1: 0.008}) and f.mean == pytest.approx(0.005)
    # pooled over records it would be (0.001 + 0.003 + 0.008) / 3: not the rule
    assert f.mean != pytest.approx(0.004)
    assert steady.fraction([_run([{"iteration": 1, "policy_version": 0}])], 16) is None


@pytest.mark.parametrize("m2, tail, condition", [(0.02, 0.03, "holds"), (0.02, 0.2, regime.MEDIAN_ONLY),
                                                  (0.2, 0.3, "does not hold")])
def test_condition_one_places_a_variant_by_its_stale_m2_median_and_tail(m2, tail, condition):
    settings = {"policy_loss": "m2po", "staleness": 16, "m2_threshold": 0.04, "lr": 1e-5}
    # 11 steady records per full run (versions before 16..56); seed 2 is the tail: M2 `tail` on its 3
    runs = [_run(_history(9.0, m2, 16, 64, frac=0.001, kind="masked")),
            _run(_history(9.0, m2, 16, 64, frac=0.003, kind="masked"), 1),
            _run(_history(9.0, tail, 16, 64, 0.003, "masked")[:8], 2)]  # 3 steady records at `tail`
    r = regime.regime("m2po", settings, runs)
    steady_records = 11 + 11 + 3
    assert r.records == steady_records, "the ramp's 9.0 never enters"
    assert r.m2_median == pytest.approx(m2) and r.m2_q90 == pytest.approx(tail)  # 22 at m2, the top 3 at tail
    assert r.ratio == pytest.approx(m2 / 0.04) and r.tail_ratio == pytest.approx(tail / 0.04)
    assert r.token.kind == "masked" and r.token.mean == pytest.approx(statistics.fmean([0.001, 0.003, 0.003]))
    assert r.condition == condition


def test_a_clip_loss_is_measured_against_the_papers_tau():
    settings = {"policy_loss": "grpo", "staleness": 16, "m2_threshold": None, "lr": 3e-5}
    r = regime.regime("grpo", settings, [_run(_history(0.0, 0.12, 16, 64, frac=0.01, kind="clipped"))])
    assert r.tau == regime.PAPER_TAU and r.ratio == pytest.approx(3.0) and r.token.kind == "clipped"
    table = regime.markdown([r])
    assert "| grpo | 3e-05 | 16 | 0.1200, 0.1200 | 3.00, 3.00 | clipped 1.000% | does not hold |" in table


def test_the_plot_is_written_for_variants_with_an_lr(tmp_path):
    rows = [regime.regime("m2po", {"policy_loss": "m2po", "staleness": 16, "m2_threshold": 0.04, "lr": lr},
                          [_run(_history(0.0, m2, 16, 64, 0.0, "masked"))]) for lr, m2 in ((1e-5, 0.01), (3e-5, 0.09))]
    path = regime.plot(rows, tmp_path / "regime.png")
    assert path and (tmp_path / "regime.png").stat().st_size > 1000
    assert regime.plot([], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


# -- condition 2 ------------------------------------------------------------------------------
def _evaluated(seed: int, slope_per_update: float, noise: float, every: int = 64, end: int = 1024) -> Run:
    """An on-policy run whose held-out accuracy rises `slope_per_update` per update, evaluated
    every `every` updates, with Gaussian noise."""
    rng = random.Random(seed)
    history = [{"iteration": u // 4, "policy_version": u, "heldout_accuracy": 0.2 + slope_per_update * u + rng.gauss(0, noise)}
               for u in range(every, end + 1, every)]
    return Run(Path(f"/runs/on{seed}"), {"seed": seed, "evaluation_interval": every // 4}, history)


def test_the_window_change_is_the_slope_over_the_last_two_windows_or_quarter_times_the_window():
    evals = [Evaluation(0, 0, 0.0), Evaluation(1, 256, 0.5), Evaluation(2, 512, 0.30), Evaluation(3, 768, 0.32),
             Evaluation(4, 1024, 0.34)]
    # updates 512, 768, 1024 (the last 2 x 256): 0.02 per 256; the early jump to 0.5 is outside
    assert regime.window_change(evals, 256) == pytest.approx(0.02)
    assert regime.window_change(evals, 128) == pytest.approx(0.01)  # 768, 1024 only: 0.02 per 256 = 0.01 per 128
    # a short window: the last quarter of the run (256 updates: 768, 1024), not two windows (one evaluation)
    assert regime.window_change(evals, 32) == pytest.approx(0.0025)
    assert regime.window_change(evals[:1], 256) is None


@pytest.mark.parametrize("per_window, condition", [(0.0, "holds"), (0.05, "does not hold")])
def test_condition_two_judges_the_on_policy_change_per_window(per_window, condition):
    runs = [_evaluated(s, per_window / 256, noise=0.004) for s in range(4)]
    d = regime.drift("m2po, stale 0", runs, 256, margin=0.02)
    assert d.limit == pytest.approx(0.01) and d.horizon == (1024, 1024) and set(d.changes) == {0, 1, 2, 3}
    # each seed's change is its own least-squares slope over updates 512..1024, times 256
    for s, run in enumerate(runs):
        points = [(e.update, e.accuracy) for e in run.evaluations if e.update >= 512]
        mu = statistics.fmean(u for u, _ in points)
        slope = sum((u - mu) * a for u, a in points) / sum((u - mu) ** 2 for u, _ in points)
        assert d.changes[s] == pytest.approx(256 * slope)
    assert d.comparison.test == "paired t" and d.condition == condition
    row = regime.drift_markdown([d])
    assert f"| m2po, stale 0 | 256 | 1024 |" in row and f"| ±1.0 points | {condition} |" in row


def test_condition_two_with_one_seed_or_a_wide_spread_is_not_resolved():
    one = regime.drift("on", [_evaluated(0, 0.0, 0.004)], 256, margin=0.02)
    assert one.comparison is None and one.condition == "not resolved"
    assert "no interval (one seed)" in regime.drift_markdown([one])
    noisy = regime.drift("on", [_evaluated(s, 0.008 / 256, noise=0.03) for s in range(3)], 256, margin=0.02)
    assert noisy.condition == "not resolved" and noisy.comparison.seeds_needed > 3
    assert regime.drift("on", [Run(Path("/r"), {"seed": 0}, [])], 256, margin=0.02) is None


def test_both_conditions_in_words():
    runs = [_run(_history(0.0, 0.01, 16, 64, 0.0, "masked"), s) for s in range(2)]
    inside = regime.regime("m2po", {"policy_loss": "m2po", "staleness": 16, "m2_threshold": 0.04}, runs)
    flat = regime.drift("on", [_evaluated(s, 0.0, 0.004) for s in range(4)], 256, margin=0.02)
    rising = regime.drift("on", [_evaluated(s, 0.05 / 256, 0.004) for s in range(4)], 256, margin=0.02)
    assert regime.both(inside, flat) == "both hold: the paper's regime"
    assert regime.both(inside, rising) == "the window change does not hold"
    assert regime.both(inside, None).startswith("the window change not measured")
