"""The report's rules on runs whose answers are known (no training, no Ray cluster): variants
by engine numerics, the staleness x lr map, a synthetic experiment's final values, claims and
collapses, and the collapse rule at a run's last result."""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path

import pytest

from _reports import run_report, table_row, trial_results


def test_engine_numerics_make_their_own_variants(tmp_path):
    """Runs that differ in the engine's dtype, recomputed log-probs or a correction are
    different variants, labelled by what differs; seeds still pool."""
    from m2po_rllib.jobs.runs import Run, group_variants

    base = {"policy_loss": "m2po", "staleness": 64, "m2_threshold": 0.04, "lr": 3e-5}
    numerics = [{}, {"engine_kwargs": {"dtype": "bfloat16"}},
                {"engine_kwargs": {"dtype": "bfloat16"}, "recompute_behavior_logp": True, "rollout_correction": "tis_token"}]
    runs = [Run(tmp_path / f"{i}-{seed}", {**base, **n, "seed": seed}, [{"iteration": 1}])
            for i, n in enumerate(numerics) for seed in (0, 1)]
    variants = group_variants(runs)
    assert [len(v.runs) for v in variants] == [2, 2, 2]
    assert sorted(v.label() for v in variants) == [
        "m2po, stale 64, tau 0.04, lr 3e-05",
        "m2po, stale 64, tau 0.04, lr 3e-05, engine bf16",
        "m2po, stale 64, tau 0.04, lr 3e-05, engine bf16, recomputed, tis_token",
    ]


def test_phase_map_cells_shared_on_policy_runs_and_collapses(tmp_path):
    """The staleness x lr map: a cell's final/best are its runs' mean and std; a loss with no
    on-policy run borrows the one loss's that has them (marked); collapsed runs are counted;
    a single learning rate is no map."""
    from m2po_rllib.jobs.phase_map import phase_map, phase_markdown
    from m2po_rllib.jobs.report_plots import _phase_map
    from m2po_rllib.jobs.runs import Run, group_variants

    def run(loss, staleness, lr, seed, accs, collapse=None):
        history = [{"iteration": i + 1, "policy_version": 10 * (i + 1), "heldout_accuracy": a} for i, a in enumerate(accs)]
        settings = {"policy_loss": loss, "staleness": staleness, "m2_threshold": 0.04, "lr": lr, "seed": seed}
        # last_k 1: a run's final value is its last evaluation, to keep this test's numbers plain
        return Run(tmp_path / f"{loss}-{staleness}-{lr}-{seed}", settings, history,
                   collapse={"reason": collapse} if collapse else None, last_k=1)

    runs = [
        run("m2po", 0, 1e-5, 0, [0.2, 0.4]), run("m2po", 0, 1e-5, 1, [0.2, 0.5]),
        run("m2po", 0, 3e-5, 0, [0.2, 0.6, 0.1], "held-out accuracy 0.100 fell below"),
        run("m2po", 256, 1e-5, 0, [0.2, 0.3]), run("m2po", 256, 3e-5, 0, [0.2, 0.35]),
        run("grpo_no_tr", 256, 1e-5, 0, [0.2, 0.5, 0.05], "held-out accuracy 0.050 fell below"),
        run("grpo_no_tr", 256, 1e-5, 1, [0.2, 0.45]),
    ]
    pm = phase_map(group_variants(runs))
    assert pm.staleness == [0, 256] and pm.lrs == [1e-5, 3e-5]
    assert list(pm.panels) == ["grpo_no_tr", "m2po, tau 0.04"]
    own = pm.panels["m2po, tau 0.04"][(0, 1e-5)]
    assert own.shared_from is None and own.final == pytest.approx((0.45, statistics.stdev([0.4, 0.5])))
    borrowed = pm.panels["grpo_no_tr"][(0, 1e-5)]
    assert borrowed.shared_from == "m2po, tau 0.04" and borrowed.runs == own.runs
    no_tr = pm.panels["grpo_no_tr"][(256, 1e-5)]
    assert no_tr.collapsed == 1 and no_tr.final[0] == pytest.approx((0.05 + 0.45) / 2) and no_tr.best[0] == pytest.approx(0.475)
    assert (256, 3e-5) not in pm.panels["grpo_no_tr"]
    md = phase_markdown(pm)
    assert "| 256 | 0.250 ± 0.283 (best 0.475), **collapsed 1/2** | - |" in md
    assert "| 0 | 0.450 ± 0.071 (best 0.450) [on-policy runs of m2po, tau 0.04] |" in md
    assert "0.100 (best 0.600), **collapsed 1/1** [on-policy runs of m2po, tau 0.04]" in md
    path = _phase_map(group_variants(runs), tmp_path)
    assert path.name == "phase_map.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert phase_map(group_variants([r for r in runs if r.settings["lr"] == 1e-5])) is None


# -- a synthetic experiment whose answers are known: the final value, the claims, collapse ----
def _trial(exp: Path, name: str, params: dict, results: list[dict], collapse: dict | None = None) -> Path:
    d = exp / name
    d.mkdir(parents=True)
    (d / "params.json").write_text(json.dumps(params))
    (d / "result.json").write_text("".join(json.dumps(r) + "\n" for r in results))
    if collapse:
        (d / "collapse.json").write_text(json.dumps(collapse))
    return d


def _curve(loss: str, staleness: int, seed: int, iterations: int = 200, interval: int = 10) -> list[dict]:
    """Tune results of one synthetic trial: 4 updates per iteration, held-out accuracy evaluated
    every `interval` iterations and carried between (0.2 before training), M2PO's masked fraction
    ~6e-5 and GRPO's clipped ~1.2e-2 once the data is `staleness` old, 0 before; no trust region
    prospers (0.55 by update 240) and then collapses (0.1 at the end)."""
    import random
    import zlib

    rng = random.Random(zlib.crc32(f"{loss}-{staleness}-{seed}".encode()))
    plateau = {"m2po": 0.515, "grpo": 0.45, "grpo_no_tr": 0.55}[loss]
    acc, out = 0.2, []
    for it in range(1, iterations + 1):
        version, before = 4 * it, 4 * (it - 1)
        if it % interval == 0:
            if loss == "grpo_no_tr" and version > 240:
                mean = 0.55 - 0.45 * (version - 240) / (4 * iterations - 240)
            else:
                mean = 0.2 + (plateau - 0.2) * min(1.0, version / 240)
            acc = mean + rng.gauss(0, 0.004)
        learner = {}
        old = before >= staleness
        if staleness and old:  # M2 of 256-stale data ~0.01, below tau (0.04) but for a rare record
            learner["m2po/m2_before"] = 0.01 * rng.lognormvariate(0, 0.3)
        if loss == "m2po":
            learner["m2po/masked_frac"] = 6e-5 * rng.lognormvariate(0, 0.1) if old and staleness else 0.0
        elif loss == "grpo":
            learner["grpo/clipped_frac"] = 1.2e-2 * rng.lognormvariate(0, 0.1) if old else 1e-3
        out.append({"training_iteration": it, "time_total_s": 2.0 * it, "heldout_accuracy": acc, "policy_version": version,
                    "learners": {"default_policy": learner}})
    return out


@pytest.fixture(scope="module")
def synthetic_experiment(tmp_path_factory) -> Path:
    exp = tmp_path_factory.mktemp("synthetic") / "exp"
    exp.mkdir()
    (exp / "lab.json").write_text(json.dumps({"space": "gone.yaml", "stop": {"policy_version": 800},
                                              "collapse": {"accuracy_drop": 0.5, "grace": 20, "stop": False}}))
    arms = [("m2po", 0), ("m2po", 256), ("grpo", 256), ("grpo_no_tr", 256)]
    for i, ((loss, staleness), seed) in enumerate((arm, seed) for arm in arms for seed in (0, 1, 2)):
        params = {"policy_loss": loss, "staleness": staleness, "m2_threshold": 0.04, "lr": 3e-5, "seed": seed,
                  "evaluation_interval": 10, "async_rollouts": False}
        results = _curve(loss, staleness, seed)
        recorded = None
        if loss == "grpo_no_tr" and seed == 0:  # one recorded by the lab, the others found by the report
            it = next(r["training_iteration"] for r in results[60:] if r["heldout_accuracy"] < 0.5 * 0.55)
            recorded = {"criterion": "heldout_accuracy", "reason": "held-out accuracy fell (recorded)",
                        "training_iteration": it}
        _trial(exp, f"{i:03d}_{loss}_{staleness}_{seed}", params, results, recorded)
    return exp


def test_synthetic_report_final_value_evaluations_claims_and_collapse(synthetic_experiment, tmp_path, capsys):
    out = tmp_path / "report"
    code, _, err = run_report(capsys, str(synthetic_experiment), "--out", str(out), "--last-k", "3")
    assert code == 0, err[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["definitions"]["last_k"] == 3 and report["definitions"]["margin"] == 0.02

    # every evaluation kept (20 per run: iterations 10, 20, ..., 200, plus the one before training)
    run = next(r for r in report["runs"] if r["path"].endswith("001_m2po_0_1"))
    results = trial_results(synthetic_experiment / "001_m2po_0_1")
    evals = run["evaluations"]
    assert evals[0] == {"iteration": 0, "update": 0, "accuracy": 0.2}
    assert [e["iteration"] for e in evals[1:]] == list(range(10, 201, 10))
    assert [e["update"] for e in evals[1:]] == [4 * i for i in range(10, 201, 10)]
    assert [e["accuracy"] for e in evals[1:]] == [r["heldout_accuracy"] for r in results[9::10]]
    # one final value: the mean of the last 3 evaluations, in the run, the row and the table
    assert run["final"] == pytest.approx(statistics.fmean(r["heldout_accuracy"] for r in results[179::10]))
    rows = {(r["policy_loss"], r["staleness"]): r for r in report["variants"]}
    finals = [r["final"] for r in report["runs"] if r["variant"] == rows[("m2po", 0)]["variant"]]
    assert rows[("m2po", 0)]["final_mean"] == pytest.approx(statistics.fmean(finals))
    assert rows[("m2po", 0)]["final_evaluations"] == [3, 3, 3]
    md = (out / "report.md").read_text()
    assert "mean of its last 3 held-out evaluations" in md and "| final held-out (last 3) |" in md
    assert table_row(md, "m2po, stale 0, tau 0.04, lr 3e-05")[2] == f"{statistics.fmean(finals):.3f} ± {statistics.stdev(finals):.3f}"

    # collapse: recorded for seed 0, found in the history by the report for seeds 1 and 2
    no_tr = [r for r in report["runs"] if "grpo_no_tr" in r["path"]]
    assert [r["collapse"]["source"] for r in no_tr] == ["recorded", "report", "report"]
    assert rows[("grpo_no_tr", 256)]["collapsed"] == 3
    assert all(r["collapse"] is None for r in report["runs"] if "grpo_no_tr" not in r["path"])
    assert "collapsed: held-out accuracy" in md and "(found by the report in its history)" in md

    # the claims, with the answers the synthetic curves were built to give
    claims = {(c["id"], c["arms"][1]): c for c in report["claims"]}
    verdict = {k: c["comparison"]["verdict"] for k, c in claims.items()}
    assert verdict[("a", "m2po, stale 0, tau 0.04")] == "equivalent within ±0.02"
    assert verdict[("b", "m2po, stale 0, tau 0.04")] == "holds"  # no GRPO on-policy: M2PO's stands in
    assert verdict[("c", "grpo, stale 256")] == "holds"
    assert verdict[("d", "grpo, stale 256")] == "holds"
    assert claims[("d", "grpo, stale 256")]["comparison"]["test"] == "paired t"
    assert math.exp(claims[("d", "grpo, stale 256")]["comparison"]["diff"]) == pytest.approx(6e-5 / 1.2e-2, rel=0.2)
    assert verdict[("e", "m2po, stale 256, tau 0.04")] == "holds"  # prosperity: not below M2PO early on
    assert verdict[("e", "grpo_no_tr, stale 256 early")] == "holds"  # then collapse
    assert "## Claims" in md and "(a) M2PO at stale 256 matches on-policy" in md
    for c in report["claims"]:
        assert f"({c['id']}) {c['text']}" in md

    # one steady-state fraction (mean over each run's records past the ramp, then over seeds) in the
    # table, the Regime section and claim (d)
    steady = {}
    for r in report["runs"]:
        if r["variant"] == rows[("m2po", 256)]["variant"]:
            masked = [x["learners"]["default_policy"]["m2po/masked_frac"] for x in trial_results(synthetic_experiment / Path(r["path"]).name)]
            steady[r["seed"]] = statistics.fmean(masked[64:])  # the version before iteration 65 is 256
    assert rows[("m2po", 256)]["token_frac_steady_mean"] == pytest.approx(statistics.fmean(steady.values()))
    assert claims[("d", "grpo, stale 256")]["values"][0] == pytest.approx({str(s): v for s, v in steady.items()})
    regime = {r["label"]: r for r in report["regime"]}
    assert regime["m2po, stale 256, tau 0.04, lr 3e-05"]["token"]["mean"] == pytest.approx(statistics.fmean(steady.values()))
    assert f"masked {100 * statistics.fmean(steady.values()):.3f}%" in table_row(md, "m2po, stale 256, tau 0.04, lr 3e-05")[4]
    assert all(Path(r["path"]).parent == Path(os.path.relpath(synthetic_experiment, out)) for r in report["runs"])

    # the two regime conditions: M2 ~0.01 (below tau, the tail too); the on-policy arm flat after update 240
    stale = regime["m2po, stale 256, tau 0.04, lr 3e-05"]
    assert stale["condition"] == "holds" and stale["tail_ratio"] < 1
    window = stale["window"]
    assert window["reference"] == "m2po, stale 0, tau 0.04, lr 3e-05" and window["window"] == 256
    assert window["horizon"] == [800, 800] and window["condition"] == "holds" and stale["both"].startswith("both hold")
    assert "## Regime: the two conditions" in md and "| m2po, stale 0, tau 0.04, lr 3e-05 | 256 | 800 |" in md
    # instability: every no-trust-region run collapsed; none fell and recovered
    assert table_row(md, "grpo_no_tr, stale 256, lr 3e-05")[5] == "3/3, 0/3"


def test_report_omits_claims_without_their_variants(synthetic_experiment, tmp_path, capsys):
    """Only M2PO runs: (a) alone; a single run: no claims section; --last-k 0 is refused."""
    code, _, err = run_report(capsys, *map(str, sorted(synthetic_experiment.glob("*_m2po_*"))), "--out", str(tmp_path / "m"))
    assert code == 0, err
    report = json.loads((tmp_path / "m" / "report.json").read_text())
    assert [c["id"] for c in report["claims"]] == ["a"]
    code, _, err = run_report(capsys, str(synthetic_experiment / "000_m2po_0_0"), "--out", str(tmp_path / "one"))
    assert code == 0, err
    assert json.loads((tmp_path / "one" / "report.json").read_text())["claims"] == []
    assert "## Claims" not in (tmp_path / "one" / "report.md").read_text()
    assert run_report(capsys, str(synthetic_experiment), "--out", str(tmp_path / "x"), "--last-k", "0")[0] == 2


# -- the collapse rule at a run's last result ---------------------------------------------------
def test_a_fall_at_the_last_result_is_recorded_by_the_lab(tmp_path):
    """Tune's `CombinedStopper(reached, collapse)` stops asking at `reached`'s yes, so the
    collapse stopper never sees the result that ends the trial; the recorder puts it to it,
    writes the reason into that result and collapse.json."""
    from types import SimpleNamespace

    from ray.tune.stopper import CombinedStopper, FunctionStopper

    from m2po_rllib.jobs.collapse import COLLAPSE_FILE, CollapseStopper

    collapse = CollapseStopper.from_spec({"accuracy_drop": 0.5, "grace": 1, "time_attr": "policy_version"})
    recorder = collapse.recorder()
    stopper = CombinedStopper(FunctionStopper(lambda trial_id, r: r["policy_version"] >= 12), collapse)
    trial = SimpleNamespace(trial_id="t", local_path=str(tmp_path / "t"))
    results = [{"training_iteration": i, "policy_version": 4 * i, "heldout_accuracy": a}
               for i, a in enumerate([0.3, 0.4, 0.1], 1)]  # the fall is at the last result
    decisions = []
    for result in results:  # the order of tune_controller._process_trial_result: stopper, then callbacks
        decisions.append(stopper("t", result))
        recorder.on_trial_result(iteration=0, trials=[trial], trial=trial, result=result)
    assert decisions == [False, False, True]
    assert results[-1]["collapse_reason"] == "held-out accuracy 0.100 fell below 0.5 x its best 0.400"
    saved = json.loads((tmp_path / "t" / COLLAPSE_FILE).read_text())
    assert saved["training_iteration"] == 3 and saved["policy_version"] == 12
    assert "collapse_reason" not in results[1]


def test_the_report_applies_the_collapse_rule_to_the_history():
    from m2po_rllib.jobs.collapse import history_collapse

    def history(accs, **fields):
        return [{"iteration": i, "policy_version": 4 * i, "heldout_accuracy": a, **fields} for i, a in enumerate(accs, 1)]

    found = history_collapse(history([0.3, 0.4, 0.35, 0.1]), {"accuracy_drop": 0.5, "grace": 1})
    assert found["training_iteration"] == 4 and found["policy_version"] == 16 and found["best"] == 0.4
    assert found["reason"] == "held-out accuracy 0.100 fell below 0.5 x its best 0.400"
    assert history_collapse(history([0.3, 0.4, 0.35, 0.25]), {"accuracy_drop": 0.5, "grace": 1}) is None
    assert history_collapse(history([0.3, 0.1]), {"grace": 10}) is None, "inside the grace period"
    limit = history_collapse(history([0.3, 0.3, 0.3], clipped_frac=0.5), {"grace": 0, "limits": {"clipped_frac": {"max": 0.3}}})
    assert limit["criterion"] == "clipped_frac" and limit["training_iteration"] == 1
