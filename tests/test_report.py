"""`m2po report` and `m2po lab` on real short runs: two 3-iteration `m2po train` runs (seeds 0
and 1) and a 2-trial Tune search; the table's numbers are recomputed here from the runs' own
history.json / result.json.

The built-in model (`builtin:arith-tiny`, warm-started to ~25% on addition) is used rather
than the random tiny model: its held-out accuracy is not 0, so the equalities mean something.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
FIGURES = ("heldout_accuracy", "reward", "final_vs_staleness", "token_fraction", "entropy", "m2")
SMALL = [  # configs/default.yaml's task (3-digit addition), smaller steps
    "training.group_size=4",
    "training.prompts_per_step=8",
    "training.minibatch_prompts=4",  # 2 updates per step
    "training.staleness=2",
    "training.lr=1e-4",
    "evaluation.evaluation_interval=1",
    "evaluation.evaluation_duration=24",
]


def _m2po(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "m2po_rllib.jobs.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=900,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def ray_tmp():
    """Ray's temp root for the subprocesses (short: Ray's socket paths must stay < 108 chars)."""
    d = tempfile.mkdtemp(prefix="m2po-ray-", dir="/tmp")
    yield {"RAY_TMPDIR": d}
    import shutil

    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def train_runs(tmp_path_factory, ray_tmp) -> list[Path]:
    """Seeds 0 and 1 side by side (each its own local Ray on random ports)."""
    root = tmp_path_factory.mktemp("train")
    runs = [root / f"seed{seed}" for seed in (0, 1)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "m2po_rllib.jobs.cli", "train", "--stop-iters", "3", "--output", str(out),
             "--no-progress", "--checkpoint-every", "0", *SMALL, "run.stop_minutes=null", f"debugging.seed={seed}"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **ray_tmp},
        )
        for seed, out in enumerate(runs)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-3000:]
    return runs


def _row(md: str, variant: str) -> list[str]:
    line = next(line for line in md.splitlines() if line.startswith(f"| {variant} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_history_records_carry_the_report_fields(train_runs):
    from m2po_rllib.jobs.history import RECORD_FIELDS

    history = json.loads((train_runs[0] / "history.json").read_text())
    assert [h["iteration"] for h in history] == [1, 2, 3]
    for h in history:
        assert list(h) == list(RECORD_FIELDS)
    # iteration 1 fills the stale queue (staleness 2 = 1 step); 2 trains on base-model data
    assert history[0]["m2_before"] is None and history[0]["policy_version"] == 0
    assert [h["staleness_mean"] for h in history] == [None, 0, 2]
    for h in history[1:]:
        assert h["m2_before"] >= h["m2_after"] >= 0 and h["entropy_all"] > 0
        assert 0 <= h["masked_frac"] <= 1 and h["clipped_frac"] is None and h["entropy_clipped"] is None
        assert h["heldout_accuracy"] is not None and h["trained_staleness_max"] is not None


def _report(capsys, *args) -> tuple[int, str, str]:
    """`m2po report ARGS` in this process (the console script's `main`)."""
    from m2po_rllib.jobs.cli import main

    code = main(["report", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_report_table_equals_the_histories(train_runs, tmp_path, capsys):
    out = tmp_path / "report"
    code, _, err = _report(capsys, *map(str, train_runs), "--out", str(out))
    assert code == 0, err[-3000:]
    for name in FIGURES:
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    report = json.loads((out / "report.json").read_text())
    rows = report["variants"]
    assert len(rows) == 1, "two seeds of one setting are one variant"
    row = rows[0]
    assert row["seeds"] == [0, 1] and row["policy_loss"] == "m2po" and row["staleness"] == 2

    histories = [json.loads((r / "history.json").read_text()) for r in train_runs]
    summaries = [json.loads((r / "summary.json").read_text()) for r in train_runs]
    # evaluation_interval 1: every iteration evaluated, after the evaluation before training
    acc = [[s["start_heldout_accuracy"]] + [h["heldout_accuracy"] for h in hist] for hist, s in zip(histories, summaries)]
    final, best = [statistics.fmean(a[-3:]) for a in acc], [max(a) for a in acc]
    assert [[e["accuracy"] for e in r["evaluations"]] for r in report["runs"]] == acc
    # one definition: summary.json's final value is the report's
    assert [s["final_heldout_accuracy"] for s in summaries] == pytest.approx([r["final"] for r in report["runs"]])
    # steady state (staleness 2): the iterations after the policy reached version 2 (the third)
    masked = [statistics.fmean(h["masked_frac"] for before, h in zip(hist, hist[1:]) if before["policy_version"] >= 2)
              for hist in histories]
    assert all(b > 0 for b in best), "the built-in model answers some held-out problems"
    assert row["final_mean"] == pytest.approx(statistics.fmean(final))
    assert row["final_std"] == pytest.approx(statistics.stdev(final))
    assert row["best_mean"] == pytest.approx(statistics.fmean(best))
    assert row["best_std"] == pytest.approx(statistics.stdev(best))
    assert row["token_kind"] == "masked" and row["token_frac_steady_mean"] == pytest.approx(statistics.fmean(masked))
    assert row["collapsed"] == 0 and row["fell_and_recovered"] == sum(bool(r["falls"]) for r in report["runs"])
    assert [r["path"] for r in report["runs"]] == [os.path.relpath(r, out) for r in train_runs]
    assert row["updates"] == [histories[0][-1]["policy_version"]] * 2

    md = (out / "report.md").read_text()
    cells = _row(md, "m2po, stale 2, tau 0.04, lr 0.0001")
    assert cells[1] == "2 (0, 1)"
    assert cells[2] == f"{statistics.fmean(final):.3f} ± {statistics.stdev(final):.3f}"
    assert cells[3] == f"{statistics.fmean(best):.3f} ± {statistics.stdev(best):.3f}"
    assert cells[4] == f"masked {100 * statistics.fmean(masked):.3f}%"
    for name in FIGURES:
        assert f"]({name}.png)" in md


def test_report_defaults_to_dir_report(train_runs, capsys):
    code, out, err = _report(capsys, str(train_runs[0]))
    assert code == 0, err[-3000:]
    assert (train_runs[0] / "report" / "report.md").exists() and "report written to" in out


def test_report_over_a_directory_without_runs_says_so(tmp_path, capsys):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    code, _, err = _report(capsys, str(tmp_path / "empty"))
    assert code == 2
    assert "no runs found in" in err and "history.json" in err
    assert not (tmp_path / "empty" / "report").exists()


# -- a real Tune search: `m2po lab` -----------------------------------------------------------
@pytest.fixture(scope="module")
def lab_experiment(tmp_path_factory, ray_tmp) -> Path:
    from m2po_rllib.config.from_yaml import apply_overrides, load_spec

    root = tmp_path_factory.mktemp("lab")
    base = apply_overrides(load_spec(str(REPO / "configs" / "default.yaml")), SMALL)
    base.pop("run")
    (root / "base.yaml").write_text(yaml.safe_dump(base))
    space = {
        "name": "tiny",
        "base": "base.yaml",
        "overrides": {"resources.num_cpus_for_main_process": 1},
        "grid": {"training.policy_loss": ["m2po", "grpo"]},
        "stop": {"policy_version": 4},  # 2 updates per step after 1 filling step: 3 iterations
        # A limit only GRPO can break (M2PO has no clipped fraction): the recorder's path, deterministically.
        "collapse": {"grace": 1, "limits": {"clipped_frac": {"min": 1.0}}},
    }
    (root / "space.yaml").write_text(yaml.safe_dump(space, sort_keys=False))
    proc = _m2po("lab", "--space", str(root / "space.yaml"), "--out", str(root / "exp"), env=ray_tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 trials" in proc.stdout and "collapsed: 001_policy_loss=grpo" in proc.stdout
    return root / "exp"


def _results(trial_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (trial_dir / "result.json").read_text().splitlines()]


def test_lab_trials_hold_their_resources_and_record_collapse(lab_experiment):
    from ray.tune import ExperimentAnalysis

    m2po_dir, grpo_dir = lab_experiment / "000_policy_loss=m2po", lab_experiment / "001_policy_loss=grpo"
    analysis = ExperimentAnalysis(str(lab_experiment))
    assert sorted(t.config["policy_loss"] for t in analysis.trials) == ["grpo", "m2po"]
    for trial in analysis.trials:  # the trial's placement group: its one process (local runner + learner)
        assert trial.placement_group_factory.bundles == [{"CPU": 1.0}]

    m2po = _results(m2po_dir)
    assert [r["policy_version"] for r in m2po] == [0, 2, 4] and not (m2po_dir / "collapse.json").exists()
    assert all(r["heldout_accuracy"] is not None for r in m2po), "evaluated from iteration 1 on"
    grpo = _results(grpo_dir)
    assert len(grpo) == 2 and "collapse_reason" not in grpo[0]  # grace 1: stopped at its first trained step
    assert grpo[-1]["collapse_reason"].startswith("clipped_frac ") and "below its limit 1" in grpo[-1]["collapse_reason"]
    reason = json.loads((grpo_dir / "collapse.json").read_text())
    assert reason["criterion"] == "clipped_frac" and reason["training_iteration"] == 2
    assert reason["value"] == grpo[-1]["learners"]["default_policy"]["grpo/clipped_frac"]


def test_lab_report_equals_the_trials_results(lab_experiment):
    out = lab_experiment / "report"  # written by `m2po lab`
    rows = {r["policy_loss"]: r for r in json.loads((out / "report.json").read_text())["variants"]}
    assert set(rows) == {"m2po", "grpo"}
    md = (out / "report.md").read_text()
    for loss, name in (("m2po", "000_policy_loss=m2po"), ("grpo", "001_policy_loss=grpo")):
        results = _results(lab_experiment / name)
        acc = [r["heldout_accuracy"] for r in results]  # evaluation_interval 1: each result evaluated
        final = statistics.fmean(acc[-3:])
        assert rows[loss]["final_mean"] == pytest.approx(final) and rows[loss]["final_std"] is None
        assert rows[loss]["best_mean"] == pytest.approx(max(acc))
        assert rows[loss]["updates"] == [results[-1]["policy_version"]] * 2
        label = "m2po, stale 2, tau 0.04, lr 0.0001" if loss == "m2po" else "grpo, stale 2, lr 0.0001"
        assert _row(md, label)[2] == f"{final:.3f}"
    # steady state at staleness 2: the iterations after version 2; GRPO, stopped at its first trained step, has none
    masked = _results(lab_experiment / "000_policy_loss=m2po")[2]["learners"]["default_policy"]["m2po/masked_frac"]
    assert rows["m2po"]["token_kind"] == "masked" and rows["m2po"]["token_frac_steady_mean"] == pytest.approx(masked)
    assert rows["grpo"]["token_kind"] is None and _row(md, "grpo, stale 2, lr 0.0001")[4] == "-"
    assert "001_policy_loss=grpo: collapsed: clipped_frac" in md
    for name in FIGURES:
        assert (out / f"{name}.png").stat().st_size > 1000


def test_a_run_that_has_not_trained_yet_says_so(train_runs, tmp_path, capsys):
    """A stale-k run stopped while its queue fills has no update: the report says so (and
    draws the empty diagnostics with that note) instead of an empty row without a word."""
    import shutil

    run = tmp_path / "filling"
    shutil.copytree(train_runs[0], run, ignore=shutil.ignore_patterns("report", "checkpoint", "tensorboard"))
    history = json.loads((run / "history.json").read_text())
    (run / "history.json").write_text(json.dumps(history[:1]))  # iteration 1 only filled the queue
    assert history[0]["policy_version"] == 0
    code, _, err = _report(capsys, str(run), "--out", str(tmp_path / "report"))
    assert code == 0, err
    md = (tmp_path / "report" / "report.md").read_text()
    assert "filling: not trained yet: its 1 iteration(s) only filled the stale queue (staleness 2 updates)" in md
    assert (tmp_path / "report" / "m2.png").exists()
    full = _report(capsys, *map(str, train_runs), "--out", str(tmp_path / "trained"))
    assert full[0] == 0 and "not trained yet" not in (tmp_path / "trained" / "report.md").read_text()


def test_tensorboard_names_every_readme_metric_as_the_result_does(train_runs):
    """`m2po train` writes each metric the metrics guide names, under its path in the
    result, by default (run.tensorboard: default)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(train_runs[0] / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    metrics = (REPO / "docs" / "guide" / "metrics.md").read_text()
    documented = {"heldout_accuracy", "policy_version", "staleness/mean", "staleness/max", "staleness/queue_len",
                  "staleness/filling", "rollout/logp_mismatch_max", "learners/default_policy/policy/grad_norm",
                  "learners/default_policy/policy/micro_batches", "learners/default_policy/staleness/trained_max",
                  "learners/default_policy/m2po/m2_before", "learners/default_policy/m2po/masked_frac",
                  "learners/default_policy/m2po/entropy_all", "learners/default_policy/policy/log_ratio_abs_max"}
    for tag in documented:  # each named in README (its last part at least) and written
        name = tag.split("/", 2)[-1]  # README lists learner keys as e.g. `staleness/trained_min|mean|max`
        assert name in metrics or f"{name.rsplit('_', 1)[0]}_min|mean|max" in metrics, tag
        assert tag in tags, (tag, sorted(tags))
    assert not [t for t in tags if t.startswith("history/")]


def test_two_runs_of_one_seed_are_one_seed(train_runs, tmp_path, capsys):
    import shutil

    copy = tmp_path / "again"
    shutil.copytree(train_runs[0], copy, ignore=shutil.ignore_patterns("report", "checkpoint", "tensorboard"))
    code, _, err = _report(capsys, str(train_runs[0]), str(copy), "--out", str(tmp_path / "report"))
    assert code == 0, err
    md = (tmp_path / "report" / "report.md").read_text()
    assert _row(md, "m2po, stale 2, tau 0.04, lr 0.0001")[1] == "1 (0), 2 runs"
    assert str(tmp_path) not in md  # paths relative to the report, so it can move


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
    code, _, err = _report(capsys, str(synthetic_experiment), "--out", str(out), "--last-k", "3")
    assert code == 0, err[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["definitions"]["last_k"] == 3 and report["definitions"]["margin"] == 0.02

    # every evaluation kept (20 per run: iterations 10, 20, ..., 200, plus the one before training)
    run = next(r for r in report["runs"] if r["path"].endswith("001_m2po_0_1"))
    results = _results(synthetic_experiment / "001_m2po_0_1")
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
    assert _row(md, "m2po, stale 0, tau 0.04, lr 3e-05")[2] == f"{statistics.fmean(finals):.3f} ± {statistics.stdev(finals):.3f}"

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
            masked = [x["learners"]["default_policy"]["m2po/masked_frac"] for x in _results(synthetic_experiment / Path(r["path"]).name)]
            steady[r["seed"]] = statistics.fmean(masked[64:])  # the version before iteration 65 is 256
    assert rows[("m2po", 256)]["token_frac_steady_mean"] == pytest.approx(statistics.fmean(steady.values()))
    assert claims[("d", "grpo, stale 256")]["values"][0] == pytest.approx({str(s): v for s, v in steady.items()})
    regime = {r["label"]: r for r in report["regime"]}
    assert regime["m2po, stale 256, tau 0.04, lr 3e-05"]["token"]["mean"] == pytest.approx(statistics.fmean(steady.values()))
    assert f"masked {100 * statistics.fmean(steady.values()):.3f}%" in _row(md, "m2po, stale 256, tau 0.04, lr 3e-05")[4]
    assert all(Path(r["path"]).parent == Path(os.path.relpath(synthetic_experiment, out)) for r in report["runs"])

    # the two regime conditions: M2 ~0.01 (below tau, the tail too); the on-policy arm flat after update 240
    stale = regime["m2po, stale 256, tau 0.04, lr 3e-05"]
    assert stale["condition"] == "holds" and stale["tail_ratio"] < 1
    window = stale["window"]
    assert window["reference"] == "m2po, stale 0, tau 0.04, lr 3e-05" and window["window"] == 256
    assert window["horizon"] == [800, 800] and window["condition"] == "holds" and stale["both"].startswith("both hold")
    assert "## Regime: the two conditions" in md and "| m2po, stale 0, tau 0.04, lr 3e-05 | 256 | 800 |" in md
    # instability: every no-trust-region run collapsed; none fell and recovered
    assert _row(md, "grpo_no_tr, stale 256, lr 3e-05")[5] == "3/3, 0/3"


def test_report_omits_claims_without_their_variants(synthetic_experiment, tmp_path, capsys):
    """Only M2PO runs: (a) alone; a single run: no claims section; --last-k 0 is refused."""
    code, _, err = _report(capsys, *map(str, sorted(synthetic_experiment.glob("*_m2po_*"))), "--out", str(tmp_path / "m"))
    assert code == 0, err
    report = json.loads((tmp_path / "m" / "report.json").read_text())
    assert [c["id"] for c in report["claims"]] == ["a"]
    code, _, err = _report(capsys, str(synthetic_experiment / "000_m2po_0_0"), "--out", str(tmp_path / "one"))
    assert code == 0, err
    assert json.loads((tmp_path / "one" / "report.json").read_text())["claims"] == []
    assert "## Claims" not in (tmp_path / "one" / "report.md").read_text()
    assert _report(capsys, str(synthetic_experiment), "--out", str(tmp_path / "x"), "--last-k", "0")[0] == 2


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
