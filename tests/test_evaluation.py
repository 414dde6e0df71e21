"""Held-out evaluation's sizing (m2po_rllib/driver/evaluation.py), without Ray actors."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest


@pytest.mark.parametrize("size, said", [
    (1, "the held-out split has 1 problem, fewer than evaluation_duration=50: evaluating it"),
    (7, "the held-out split has 7 problems, fewer than evaluation_duration=50: evaluating all 7"),
])
def test_a_short_heldout_split_is_evaluated_whole_and_said_in_good_english(caplog, monkeypatch, size, said):
    from m2po_rllib.driver import evaluation

    monkeypatch.setattr(evaluation, "_warned", set())
    runner = SimpleNamespace(num_problems=lambda split: size)
    group = SimpleNamespace(num_remote_env_runners=lambda: 0, local_env_runner=runner)
    with caplog.at_level(logging.WARNING, logger=evaluation.__name__):
        assert evaluation.heldout_problems(group, 50) == size
    assert [r.getMessage() for r in caplog.records] == [said]
