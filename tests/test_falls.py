"""Falls that recover (m2po_rllib/jobs/falls.py): held-out accuracy well below a run's best that
comes back, the instability the collapse rule does not count."""

from __future__ import annotations

from pathlib import Path

import pytest

from m2po_rllib.jobs.collapse import history_collapse
from m2po_rllib.jobs.falls import FALL_DROP, Fall, falls
from m2po_rllib.jobs.runs import Evaluation, Run


def _evals(*points) -> list[Evaluation]:
    return [Evaluation(i, u, a) for i, (u, a) in enumerate(points)]


# the repro issue's 4096-update probe: 0.341 at update 512, 0.188 at 768, 0.38 by 1280
PROBE = _evals((0, 0.206), (256, 0.30), (512, 0.341), (768, 0.188), (1024, 0.27), (1280, 0.38), (1536, 0.40))


def test_the_probes_fall_is_counted_and_the_collapse_rule_misses_it():
    assert falls(PROBE) == [Fall(best=0.341, best_update=512, low=0.188, low_update=768, recovered=0.38,
                                 recovered_update=1280)]
    history = [{"iteration": e.iteration, "policy_version": e.update, "heldout_accuracy": e.accuracy} for e in PROBE]
    assert history_collapse(history, {"accuracy_drop": 0.5, "grace": 0}) is None, "0.188 is above half of 0.341"


def test_a_fall_recovers_at_half_the_drop_not_at_the_threshold():
    best = 0.4
    just_below = (1 - FALL_DROP) * best - 0.01
    bounce = (1 - FALL_DROP) * best + 0.01  # back above the fall's threshold, not at (1 - drop/2) x best
    found = falls(_evals((0, 0.1), (100, best), (200, just_below), (300, bounce), (400, 0.2), (500, 0.36)))
    assert len(found) == 1 and found[0].low == 0.2 and found[0].low_update == 400
    assert found[0].recovered == 0.36 and found[0].recovered_update == 500
    assert (1 - FALL_DROP / 2) * best <= 0.36


def test_an_open_fall_and_two_falls_and_the_floor():
    open_fall = falls(_evals((0, 0.1), (100, 0.4), (200, 0.2)))
    assert open_fall == [Fall(0.4, 100, 0.2, 200)] and "not recovered" in open_fall[0].describe()
    two = falls(_evals((0, 0.4), (1, 0.2), (2, 0.4), (3, 0.5), (4, 0.3), (5, 0.5)))
    assert [(f.best, f.low, f.recovered) for f in two] == [(0.4, 0.2, 0.4), (0.5, 0.3, 0.5)]
    assert falls(_evals((0, 0.04), (1, 0.01), (2, 0.04))) == [], "below the best's floor: noise near 0"
    assert falls(_evals((0, 0.3), (1, 0.31), (2, 0.29))) == []
    with pytest.raises(ValueError, match="drop"):
        falls(PROBE, drop=1.5)


def test_with_a_small_heldout_set_a_quarter_of_the_best_is_noise():
    # 0.40 -> 0.28: a quarter+ lost; the sd of a difference of two evaluations is 0.098 at n=50, 0.022 at 1000
    points = ((0, 0.40), (1, 0.28), (2, 0.40))
    assert falls(_evals(*points), heldout_size=50) == []
    assert len(falls(_evals(*points), heldout_size=1000)) == 1
    assert len(falls(_evals(*points))) == 1, "without n the rule is the drop alone"


def test_a_run_counts_its_recovered_falls_and_says_so():
    history = [{"iteration": e.iteration, "policy_version": e.update, "heldout_accuracy": e.accuracy} for e in PROBE]
    run = Run(Path("/runs/probe"), {"seed": 0, "evaluation_duration": 1000}, history)
    assert [f.low for f in run.falls if f.recovered is not None] == [0.188]
    assert "fell and recovered: held-out 0.341 (best, update 512) fell to 0.188 at update 768, recovered to 0.380 " \
           "at update 1280" in run.describe()
