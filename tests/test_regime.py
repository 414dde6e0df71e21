"""The regime of a variant (m2po_rllib/jobs/regime.py): M2 of the data trained once it is as
old as the staleness, against tau, from the runs' histories."""

from __future__ import annotations

import pytest

from m2po_rllib.jobs import regime


def _history(m2_ramp: float, m2_stale: float, staleness: int, updates: int, frac: float, kind: str) -> list[dict]:
    """One record per 4 updates: M2 `m2_ramp` while the base-model ramp trains, `m2_stale` after."""
    return [
        {"iteration": i + 1, "policy_version": 4 * i, "m2_before": m2_ramp if 4 * i < staleness else m2_stale,
         f"{kind}_frac": 0.5 if 4 * i < staleness else frac}
        for i in range(updates // 4)
    ]


def test_steady_state_is_the_records_past_the_ramp():
    history = _history(0.0, 1.0, staleness=8, updates=20, frac=0.0, kind="masked")
    assert [h["policy_version"] for h in regime.steady_state(history, 8)] == [8, 12, 16]
    assert [h["policy_version"] for h in regime.steady_state(history, 0)] == [4, 8, 12, 16]  # trained records


@pytest.mark.parametrize("m2, inside", [(0.02, True), (0.2, False)])
def test_m2po_variant_is_placed_by_its_stale_m2_against_its_tau(m2, inside):
    settings = {"policy_loss": "m2po", "staleness": 16, "m2_threshold": 0.04, "lr": 1e-5}
    runs = [_history(9.0, m2, 16, 64, frac=0.001, kind="masked"), _history(9.0, m2 * 1.5, 16, 64, 0.003, "masked")]
    r = regime.regime("m2po", settings, runs)
    # the ramp's 9.0 never enters; the median of 12 + 12 steady records, half at m2, half at 1.5 m2
    assert r.m2_median == pytest.approx(m2 * 1.25) and r.records == 24
    assert r.ratio == pytest.approx(m2 * 1.25 / 0.04)
    assert r.token_kind == "masked" and r.token_frac == pytest.approx(0.002)
    assert r.verdict.startswith("the paper's regime" if inside else "outside the paper's regime")


def test_a_clip_loss_is_measured_against_the_papers_tau():
    settings = {"policy_loss": "grpo", "staleness": 16, "m2_threshold": None, "lr": 3e-5}
    r = regime.regime("grpo", settings, [_history(0.0, 0.12, 16, 64, frac=0.01, kind="clipped")])
    assert r.tau == regime.PAPER_TAU and r.ratio == pytest.approx(3.0) and r.token_kind == "clipped"
    table = regime.markdown([r])
    assert "| grpo | 3e-05 | 16 | 0.1200, 0.1200 | 3.00 | clipped 1.000% | outside the paper's regime (M2 3.0x tau) |" in table


def test_the_plot_is_written_for_variants_with_an_lr(tmp_path):
    rows = [regime.regime("m2po", {"policy_loss": "m2po", "staleness": 16, "m2_threshold": 0.04, "lr": lr},
                          [_history(0.0, m2, 16, 64, 0.0, "masked")]) for lr, m2 in ((1e-5, 0.01), (3e-5, 0.09))]
    path = regime.plot(rows, tmp_path / "regime.png")
    assert path and (tmp_path / "regime.png").stat().st_size > 1000
    assert regime.plot([], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()
