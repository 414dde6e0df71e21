"""`max_staleness="auto"`: the controller (pure bookkeeping) steering the admission rule in a
discrete-event simulation of runners, a learner and a synthetic M2(age) that changes over
training; its state through a checkpoint."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from m2po_rllib.rollout.admission import AsyncRollouts
from m2po_rllib.rollout.staleness import StalenessController, age_bucket

TARGET = 0.04
TOKENS = 32  # per round


def simulate(ctrl: StalenessController, m2_of, steps: int, seed: int, *, runners=2, updates_per_step=1,
             max_in_flight=64, round_s=0.25, train_s=1.0):
    """Runners generate rounds (log-normal times, as many in flight as admission allows),
    the learner trains a step (`train_s`) once its rounds are in, measures each trained
    token's squared log-ratio from a normal with variance `m2_of(age, version)`, and the
    controller sets the bound for the next requests. Returns per trained round (version,
    age of its oldest token, bound it was admitted under) and the bound after each step."""
    U = updates_per_step
    pipe = AsyncRollouts(rounds_per_step=runners, updates_per_step=U, max_staleness=ctrl, rows_per_round=1)
    rng, np_rng = random.Random(seed), np.random.default_rng(seed)
    version = dispatched = 0  # the learner's version; the version once every dispatched step is trained
    clock, pending, training = 0.0, [], None
    trained, bounds, admitted_under = [], [], {}
    while version < steps * U:
        for r in range(runners):
            while pipe.num_in_flight(r) < max_in_flight:
                n = pipe.next_request(version, dispatched)  # the newest weights are the learner's
                if n is None:
                    break
                pipe.sent(r, n)
                admitted_under[n] = pipe.max_staleness
                last = max([t for t, rr, _, _ in pending if rr == r], default=clock)
                pending.append((last + round_s * rng.lognormvariate(0, 0.5), r, n, version))
        if training is None:
            batches = pipe.pop_step(dispatched)
            if batches is not None:
                training = (clock + train_s, dispatched, batches)
                dispatched += U
        pending.sort()
        if training is not None and (not pending or training[0] <= pending[0][0]):
            clock, start, batches = training
            training = None
            by_age: dict[int, list[float]] = {}
            for b in batches:
                n = int(b["sample_id"][0])
                for k in range(U):  # the step's minibatches, one update each
                    age = start + k - int(b["policy_version"][0])
                    sq = float((np_rng.normal(0, math.sqrt(m2_of(age, start + k)), TOKENS) ** 2).sum())
                    acc = by_age.setdefault(age, [0.0, 0.0])
                    acc[0] += sq
                    acc[1] += TOKENS
                trained.append((start, start + U - 1 - int(b["policy_version"][0]), admitted_under[n]))
            version = start + U
            ctrl.observe({a: tuple(v) for a, v in by_age.items()}, version)
            bounds.append(pipe.max_staleness)  # the admission rule reads the controller's bound
        else:
            clock, r, n, v = pending.pop(0)
            pipe.received(r, {"sample_id": np.array([n]), "policy_version": np.array([v])})
    return trained, bounds


def test_age_buckets_double():
    assert [age_bucket(a) for a in (0, 1, 2, 3, 4, 7, 8, 300)] == [0, 1, 2, 2, 4, 4, 8, 256]


def test_the_bound_tracks_a_moving_m2_and_never_leaves_floor_and_ceiling():
    # M2 grows linearly in age; the policy slows down 4x halfway (e.g. a learning-rate decay):
    # the age where M2 meets the target goes from 10 to 40 updates.
    def m2_of(age, version):
        speed = TARGET / 10 if version < 400 else TARGET / 40
        return 1e-4 + speed * age

    ctrl = StalenessController(target_m2=TARGET, floor=1, ceiling=64, half_life=16)
    trained, bounds = simulate(ctrl, m2_of, steps=800, seed=0)
    assert all(age <= under <= 64 for _, age, under in trained)  # never beyond the bound or the ceiling
    assert min(bounds) >= 1
    first, second = bounds[300:400], bounds[700:800]  # settled, in each phase
    assert 6 <= np.median(first) <= 14
    assert 28 <= np.median(second) <= 56
    # and the data reached the bound: the runners were held back by it, not idle
    late = [age for v, age, _ in trained if v >= 700]
    assert np.median(late) >= 0.6 * np.median(second)


def test_the_bound_comes_down_when_the_policy_speeds_up():
    def m2_of(age, version):
        return 1e-4 + (TARGET / 40 if version < 300 else TARGET / 8) * age

    ctrl = StalenessController(target_m2=TARGET, floor=1, ceiling=256, half_life=16)
    trained, bounds = simulate(ctrl, m2_of, steps=500, seed=1)
    assert np.median(bounds[200:300]) >= 28
    assert np.median(bounds[400:500]) <= 12
    # the measured M2 of data trained after the change settles back under ~the target
    assert all(age <= under for _, age, under in trained)


def test_a_policy_too_fast_for_any_bound_stays_at_the_floor():
    ctrl = StalenessController(target_m2=TARGET, floor=3, ceiling=128, half_life=16)
    trained, bounds = simulate(ctrl, lambda age, v: 0.2 + 0.1 * age, steps=200, seed=2)
    assert bounds[-100:] == [3] * 100
    assert max(age for _, age, _ in trained) <= 128


def test_state_round_trip_and_forgetting():
    ctrl = StalenessController(target_m2=TARGET, floor=1, ceiling=64, half_life=10, min_tokens=100)
    ctrl.observe({0: (0.001 * 200, 200), 1: (0.002 * 200, 200)}, version=5)
    assert ctrl.m2_by_bucket() == pytest.approx({0: 0.001, 1: 0.002})
    assert ctrl.bound == 2  # every measured age under the target and the data reaches the bound: doubled
    clone = StalenessController(target_m2=TARGET, floor=1, ceiling=64, half_life=10, min_tokens=100)
    clone.set_state(ctrl.get_state())
    assert clone.get_state() == ctrl.get_state()
    # ten updates later with no new data at age 1: its 200 tokens weigh 100, still measured;
    # twenty updates later, 50: forgotten
    clone.observe({0: (0.0, 0)}, version=15)
    assert 1 in clone.m2_by_bucket()
    clone.observe({0: (0.0, 0)}, version=25)
    assert 1 not in clone.m2_by_bucket() and 0 not in clone.m2_by_bucket()


def test_a_bucket_no_longer_fed_expires_whatever_its_token_count():
    """After a lowering, the ages above the bound get no more data: their measurement must
    stop blocking a raise after two half-lives, however many tokens it was made of."""
    ctrl = StalenessController(target_m2=TARGET, floor=1, ceiling=64, half_life=8)
    ctrl.observe({2: (0.01 * 1e6, 1e6), 8: (0.2 * 1e6, 1e6)}, version=100)
    assert ctrl.bound == 1  # age 8 is far over the target
    for v in range(101, 116):  # only young data from now on
        ctrl.observe({1: (0.005 * 1000, 1000)}, version=v)
        assert 8 in ctrl.m2_by_bucket()
    ctrl.observe({1: (0.005 * 1000, 1000)}, version=117)
    assert 8 not in ctrl.m2_by_bucket() and 2 not in ctrl.m2_by_bucket()
    assert ctrl.bound == 2  # probing upwards again from the young data


def test_non_finite_measurements_are_ignored():
    ctrl = StalenessController(target_m2=TARGET, floor=1, ceiling=64, half_life=8, min_tokens=10)
    ctrl.observe({0: (float("nan"), 100), 1: (float("inf"), 100), 2: (0.01 * 100, 100)}, version=3)
    assert ctrl.m2_by_bucket() == pytest.approx({2: 0.01})


@pytest.mark.parametrize("kwargs", [dict(half_life=0), dict(target_m2=0.0), dict(target_m2=float("nan")), dict(floor=5, ceiling=4)])
def test_bad_settings_are_refused(kwargs):
    args = dict(target_m2=TARGET, floor=1, ceiling=8) | kwargs
    with pytest.raises(ValueError):
        StalenessController(**args)
