"""`m2po report` and `m2po lab` on real short runs: two 3-iteration `m2po train` runs (seeds 0
and 1) and a 2-trial Tune search; the table's numbers are recomputed here from the runs' own
history.json / result.json.

The built-in model (`builtin:arith-tiny`, warm-started to ~25% on addition) is used rather
than the random tiny model: its held-out accuracy is not 0, so the equalities mean something.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
from pathlib import Path

import pytest
import yaml

from _reports import run_report, table_row, trial_results

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


def _m2po_in_process(*args) -> tuple[int, str]:
    """`m2po ARGS` in this process, in the test session's Ray (`ray_session`): exit code and
    what it printed. (`test_cli` runs the console script as a user's shell does.)"""
    from m2po_rllib.jobs.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(args))
    return code, out.getvalue()


@pytest.fixture(scope="module")
def train_runs(tmp_path_factory, ray_session) -> list[Path]:
    """Seeds 0 and 1, one after the other."""
    root = tmp_path_factory.mktemp("train")
    runs = [root / f"seed{seed}" for seed in (0, 1)]
    for seed, out in enumerate(runs):
        code, printed = _m2po_in_process("train", "--stop-iters", "3", "--output", str(out), "--no-progress",
                                         "--checkpoint-every", "0", *SMALL, "run.stop_minutes=null",
                                         f"debugging.seed={seed}")
        assert code == 0, printed[-3000:]
    return runs


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


def test_report_table_equals_the_histories(train_runs, tmp_path, capsys):
    out = tmp_path / "report"
    code, _, err = run_report(capsys, *map(str, train_runs), "--out", str(out))
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
    cells = table_row(md, "m2po, stale 2, tau 0.04, lr 0.0001")
    assert cells[1] == "2 (0, 1)"
    assert cells[2] == f"{statistics.fmean(final):.3f} ± {statistics.stdev(final):.3f}"
    assert cells[3] == f"{statistics.fmean(best):.3f} ± {statistics.stdev(best):.3f}"
    assert cells[4] == f"masked {100 * statistics.fmean(masked):.3f}%"
    for name in FIGURES:
        assert f"]({name}.png)" in md


def test_report_defaults_to_dir_report(train_runs, capsys):
    code, out, err = run_report(capsys, str(train_runs[0]))
    assert code == 0, err[-3000:]
    assert (train_runs[0] / "report" / "report.md").exists() and "report written to" in out


def test_report_over_a_directory_without_runs_says_so(tmp_path, capsys):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    code, _, err = run_report(capsys, str(tmp_path / "empty"))
    assert code == 2
    assert "no runs found in" in err and "history.json" in err
    assert not (tmp_path / "empty" / "report").exists()


# -- a real Tune search: `m2po lab` -----------------------------------------------------------
@pytest.fixture(scope="module")
def lab_experiment(tmp_path_factory, ray_session) -> Path:
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
    code, printed = _m2po_in_process("lab", "--space", str(root / "space.yaml"), "--out", str(root / "exp"))
    assert code == 0, printed[-3000:]
    assert "2 trials" in printed and "collapsed: 001_policy_loss=grpo" in printed
    return root / "exp"


def test_lab_trials_hold_their_resources_and_record_collapse(lab_experiment):
    from ray.tune import ExperimentAnalysis

    m2po_dir, grpo_dir = lab_experiment / "000_policy_loss=m2po", lab_experiment / "001_policy_loss=grpo"
    analysis = ExperimentAnalysis(str(lab_experiment))
    assert sorted(t.config["policy_loss"] for t in analysis.trials) == ["grpo", "m2po"]
    for trial in analysis.trials:  # the trial's placement group: its one process (local runner + learner)
        assert trial.placement_group_factory.bundles == [{"CPU": 1.0}]

    m2po = trial_results(m2po_dir)
    assert [r["policy_version"] for r in m2po] == [0, 2, 4] and not (m2po_dir / "collapse.json").exists()
    assert all(r["heldout_accuracy"] is not None for r in m2po), "evaluated from iteration 1 on"
    grpo = trial_results(grpo_dir)
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
        results = trial_results(lab_experiment / name)
        acc = [r["heldout_accuracy"] for r in results]  # evaluation_interval 1: each result evaluated
        final = statistics.fmean(acc[-3:])
        assert rows[loss]["final_mean"] == pytest.approx(final) and rows[loss]["final_std"] is None
        assert rows[loss]["best_mean"] == pytest.approx(max(acc))
        assert rows[loss]["updates"] == [results[-1]["policy_version"]] * 2
        label = "m2po, stale 2, tau 0.04, lr 0.0001" if loss == "m2po" else "grpo, stale 2, lr 0.0001"
        assert table_row(md, label)[2] == f"{final:.3f}"
    # steady state at staleness 2: the iterations after version 2; GRPO, stopped at its first trained step, has none
    masked = trial_results(lab_experiment / "000_policy_loss=m2po")[2]["learners"]["default_policy"]["m2po/masked_frac"]
    assert rows["m2po"]["token_kind"] == "masked" and rows["m2po"]["token_frac_steady_mean"] == pytest.approx(masked)
    assert rows["grpo"]["token_kind"] is None and table_row(md, "grpo, stale 2, lr 0.0001")[4] == "-"
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
    code, _, err = run_report(capsys, str(run), "--out", str(tmp_path / "report"))
    assert code == 0, err
    md = (tmp_path / "report" / "report.md").read_text()
    assert "filling: not trained yet: its 1 iteration(s) only filled the stale queue (staleness 2 updates)" in md
    assert (tmp_path / "report" / "m2.png").exists()
    full = run_report(capsys, *map(str, train_runs), "--out", str(tmp_path / "trained"))
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
    code, _, err = run_report(capsys, str(train_runs[0]), str(copy), "--out", str(tmp_path / "report"))
    assert code == 0, err
    md = (tmp_path / "report" / "report.md").read_text()
    assert table_row(md, "m2po, stale 2, tau 0.04, lr 0.0001")[1] == "1 (0), 2 runs"
    assert str(tmp_path) not in md  # paths relative to the report, so it can move
