"""How `m2po report` reads a Tune trial that was retried from a checkpoint (Tune's
`max_failures`, e.g. after its node was lost; the real case is in test_two_nodes.py): the
iterations after the checkpoint are in result.json twice, and the failed attempt's error.txt
stays in the trial directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from m2po_rllib.jobs.runs import find_runs, latest_attempt


def _row(it: int, attempt: int) -> dict:
    return {"training_iteration": it, "time_total_s": float(it), "policy_version": 2 * it, "heldout_accuracy": 0.1 * it,
            "attempt": attempt, "learners": {"default_policy": {}}}


def _retried_trial(exp: Path, status: str | None) -> Path:
    """Iterations 1-6, a failure, then 5-9 again from the checkpoint at 4; Tune's experiment
    state saying `status` (None: no experiment state, trial directories copied elsewhere)."""
    trial = exp / "000_seed=0"
    trial.mkdir(parents=True)
    (trial / "params.json").write_text(json.dumps({"policy_loss": "m2po", "staleness": 2, "seed": 0}))
    rows = [_row(i, 1) for i in range(1, 7)] + [_row(i, 2) for i in range(5, 10)]
    (trial / "result.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (trial / "error.txt").write_text("Failure # 1 (occurred at 2026-12-07_04-55-53)\nThe actor died\n")
    if status is not None:
        state = {"trial_data": [[json.dumps({"relative_logdir": trial.name, "status": status}),
                                 json.dumps({"num_failures": 1})]], "runner_data": {}, "stats": {}}
        (exp / "experiment_state-2026-12-07_04-55-38.json").write_text(json.dumps(state))
    return trial


def test_a_retried_trial_keeps_its_last_attempts_iterations():
    rows = [_row(i, 1) for i in range(1, 7)] + [_row(i, 2) for i in range(5, 10)] + [_row(3, 3), _row(4, 3)]
    kept = latest_attempt(rows)
    assert [r["training_iteration"] for r in kept] == [1, 2, 3, 4]
    assert [r["attempt"] for r in kept] == [1, 1, 3, 3]
    kept = latest_attempt(rows[:11])
    assert [(r["training_iteration"], r["attempt"]) for r in kept] == [(1, 1), (2, 1), (3, 1), (4, 1), (5, 2),
                                                                      (6, 2), (7, 2), (8, 2), (9, 2)]


@pytest.mark.parametrize("status, note", [("TERMINATED", ""), ("ERROR", "failed (error.txt)"),
                                          (None, "failed (error.txt)")])
def test_a_trial_retried_and_finished_is_not_reported_failed(tmp_path, status, note):
    _retried_trial(tmp_path / "exp", status)
    (run,) = find_runs([str(tmp_path / "exp")])
    assert run.note == note
    assert [h["iteration"] for h in run.history] == list(range(1, 10))
    assert [h["policy_version"] for h in run.history] == [2 * i for i in range(1, 10)]
