"""The driver's one polling loop (`m2po_rllib.driver.learners.wait_until`): it returns once done,
keeps waiting while there is progress, and names what is stuck when there is none."""

from __future__ import annotations

import pytest

from m2po_rllib.driver.learners import wait_until


def test_it_waits_through_slow_progress_and_returns_when_done():
    state = {"steps": 0}

    def step() -> bool:
        state["steps"] += 1
        return state["steps"] % 3 == 0  # progress every third poll

    wait_until(lambda: state["steps"] >= 30, step, timeout_s=5.0, what=lambda: "never")
    assert state["steps"] == 30


def test_no_progress_is_an_error_that_names_what_is_stuck():
    calls = []
    with pytest.raises(RuntimeError, match=r"^2 updates still in flight after 0.05 s without progress$"):
        wait_until(lambda: False, lambda: calls.append(1) or False, timeout_s=0.05,
                   what=lambda: "2 updates still in flight")
    assert len(calls) > 1  # it polled until the deadline, not once


def test_done_at_once_polls_nothing():
    wait_until(lambda: True, lambda: pytest.fail("polled"), timeout_s=1.0, what=lambda: "x")
