"""The staleness lab without running trials: search spaces (every trial validated before any
starts, errors naming the file, the key and the fix), resources per trial, and the collapse
stopper on synthetic result sequences. The real Tune run is in test_report.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray")

from m2po_rllib.jobs.collapse import CollapseStopper  # noqa: E402
from m2po_rllib.jobs.lab import _points, fit_concurrency, load_space, trial_resources  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _space(tmp_path: Path, model_dir: str, **space) -> Path:
    base = {
        "environment": {"env": "m2po/Arithmetic-v0", "env_config": {"digits": 2}},
        "env_runners": {"num_env_runners": 0, "rollout_engine": "hf", "max_new_tokens": 4},
        "rl_module": {"model_config": {"model": model_dir}},
        "training": {"group_size": 4, "prompts_per_step": 4, "minibatch_prompts": 2, "staleness": 2},
        "evaluation": {"evaluation_interval": 2, "evaluation_duration": 8},
    }
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    spec = {"base": "base.yaml", "grid": {"training.policy_loss": ["m2po", "grpo"]}, "stop": {"policy_version": 4}}
    spec.update(space)
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_the_phase_map_space_is_the_cells_its_header_lists():
    """`make phase`: 1x / 3x / 10x of the task config's lr; staleness 0 once per lr (M2PO);
    every loss at 256 for every lr and at 64 for 1x / 3x; a second seed at 3x for 0 and 256;
    one update per step (so staleness-0 ratios are 1); 1 CPU and 320 updates per trial."""
    space = load_space(REPO / "tune" / "spaces" / "phase.yaml")
    base_lr = yaml.safe_load((REPO / "configs" / "column_add.yaml").read_text())["training"]["lr"]
    lrs = [round(base_lr * k, 12) for k in (1, 3, 10)]
    cells = {(t.config.seed, t.config.staleness, t.config.policy_loss, round(t.config.lr, 12)) for t in space.trials}
    losses = ("grpo_no_tr", "grpo", "m2po")
    expected = (
        {(0, 0, "m2po", lr) for lr in lrs}
        | {(0, 256, loss, lr) for loss in losses for lr in lrs}
        | {(0, 64, loss, lr) for loss in losses for lr in lrs[:2]}
        | {(1, 0, "m2po", lrs[1])} | {(1, 256, loss, lrs[1]) for loss in losses}
    )
    assert len(space.trials) == len(cells) == 22 and cells == expected
    assert {t.config.updates_per_step for t in space.trials} == {1} and space.stop == {"policy_version": 320}
    assert {trial_resources(t.config)["CPU"] for t in space.trials} == {1.0}
    assert {t.config.m2_threshold for t in space.trials} == {0.04}


def test_the_powered_repro_adds_seeds_to_the_repro():
    """`make repro-powered` reports its trials together with `make repro`'s: the same arms and
    settings but the seed, and seeds neither has twice."""
    base, more = (load_space(REPO / "tune" / "spaces" / n) for n in ("paper_mini.yaml", "paper_mini_powered.yaml"))

    def cells(space):
        return {(t.config.policy_loss, t.config.staleness, t.config.seed) for t in space.trials}

    def settings(space):
        return {(t.config.lr, t.config.prompts_per_step, t.config.minibatch_prompts, t.config.evaluation_interval,
                 t.config.evaluation_duration, t.config.env_config["heldout_size"]) for t in space.trials}

    assert settings(base) == settings(more) and len(settings(base)) == 1 and base.stop == more.stop
    assert not {c[2] for c in cells(base)} & {c[2] for c in cells(more)}
    assert len({c[2] for c in cells(base) | cells(more)}) >= 10


def test_the_powered_window_calibration_adds_seeds_of_the_same_arm():
    """calibrate_window_powered.yaml: calibrate_window.yaml's lr-1e-5 arm, every setting but the
    seed, and seeds that arm does not have (so the two report as one arm of 6 seeds)."""
    base, more = (load_space(REPO / "tune" / "spaces" / n) for n in ("calibrate_window.yaml",
                                                                    "calibrate_window_powered.yaml"))

    def settings(trials):
        return {(t.config.policy_loss, t.config.staleness, t.config.lr, t.config.prompts_per_step,
                 t.config.minibatch_prompts, t.config.evaluation_interval, t.config.evaluation_duration,
                 str(t.config.env_config)) for t in trials}

    arm = [t for t in base.trials if t.config.lr == 1e-5]
    assert settings(more.trials) == settings(arm) and len(settings(arm)) == 1 and base.stop == more.stop
    seeds = [t.config.seed for t in more.trials]
    assert len(seeds) >= 3 and not set(seeds) & {t.config.seed for t in arm}


@pytest.mark.parametrize("name", ["cpu.yaml", "gpu_cluster.yaml", "paper_mini.yaml", "paper_mini_powered.yaml",
                                  "calibrate.yaml", "calibrate_window.yaml", "paper_mini_s64.yaml",
                                  "paper_mini_8token.yaml", "paper_mini_8token_tau.yaml"])
def test_shipped_spaces_validate_every_trial(name):
    space = load_space(REPO / "tune" / "spaces" / name)
    losses = {t.config.policy_loss for t in space.trials}
    stale = {t.config.staleness for t in space.trials}
    arms = {(t.config.policy_loss, t.config.staleness) for t in space.trials}
    if name in ("paper_mini.yaml", "paper_mini_powered.yaml"):
        # the paper's four arms, the same seeds in each (paired), tau 0.04, equal updates, the
        # stale-k ramp <= 25% of a run, >= 1000 held-out problems, a trial a CPU
        assert arms == {("m2po", 0), ("m2po", 256), ("grpo", 256), ("grpo_no_tr", 256)}
        seeds = {arm: sorted(t.config.seed for t in space.trials if (t.config.policy_loss, t.config.staleness) == arm)
                 for arm in arms}
        assert len({tuple(s) for s in seeds.values()}) == 1 and len(seeds[("m2po", 0)]) >= 3
        assert {t.config.m2_threshold for t in space.trials} == {0.04}
        assert list(space.stop) == ["policy_version"] and 256 <= 0.25 * space.stop["policy_version"]
        assert {t.config.evaluation_duration for t in space.trials} == {1000}
        assert all(t.config.env_config["heldout_size"] >= 1000 for t in space.trials)
        assert {trial_resources(t.config)["CPU"] for t in space.trials} == {1.0}
    elif name == "paper_mini_s64.yaml":
        # paper_mini's comparison with the staleness scaled to 64: its four arms, paired seeds, task,
        # steps, held-out set and horizon; evaluated often enough for condition 2 at a window of 64
        mini = load_space(REPO / "tune" / "spaces" / "paper_mini.yaml")
        assert arms == {("m2po", 0), ("m2po", 64), ("grpo", 64), ("grpo_no_tr", 64)} and space.stop == mini.stop
        seeds = {arm: sorted(t.config.seed for t in space.trials if (t.config.policy_loss, t.config.staleness) == arm)
                 for arm in arms}
        assert len({tuple(s) for s in seeds.values()}) == 1 and len(seeds[("m2po", 0)]) >= 3
        ref = mini.trials[0].config
        for t in space.trials:
            c = t.config
            assert (c.lr, c.env_config, c.prompts_per_step, c.minibatch_prompts, c.evaluation_duration, c.m2_threshold) == (
                ref.lr, ref.env_config, ref.prompts_per_step, ref.minibatch_prompts, ref.evaluation_duration,
                ref.m2_threshold)
            updates_between = c.evaluation_interval * c.prompts_per_step // c.minibatch_prompts
            assert 0.25 * space.stop["policy_version"] / updates_between >= 2
    elif name.startswith("paper_mini_8token"):  # the history's spaces still validate
        assert stale and {t.config.seed for t in space.trials} == {0, 1, 2}
    elif name == "calibrate.yaml":  # stale runs of M2PO and GRPO at more than one lr, at 256 and a smaller window
        assert stale == {64, 256} and {"m2po", "grpo"} <= losses and len({t.config.lr for t in space.trials}) >= 2
    elif name == "calibrate_window.yaml":
        # paper_mini's on-policy arm (task, steps, held-out set, horizon) at >= 2 lrs, >= 3 seeds each (an
        # interval over seeds), evaluated often enough for a slope at the end: >= 3 evaluations in its last quarter
        mini = load_space(REPO / "tune" / "spaces" / "paper_mini.yaml")
        ref = next(t.config for t in mini.trials if t.config.staleness == 0)
        assert arms == {("m2po", 0)} and space.stop == mini.stop
        lrs = {t.config.lr for t in space.trials}
        assert ref.lr in lrs and len(lrs) >= 2
        assert all(sum(t.config.lr == lr for t in space.trials) >= 3 for lr in lrs)
        for t in space.trials:
            c = t.config
            assert (c.env_config, c.prompts_per_step, c.minibatch_prompts, c.group_size, c.evaluation_duration) == (
                ref.env_config, ref.prompts_per_step, ref.minibatch_prompts, ref.group_size, ref.evaluation_duration)
            updates_between = c.evaluation_interval * c.prompts_per_step // c.minibatch_prompts
            assert 0.25 * space.stop["policy_version"] / updates_between >= 2
    elif name == "cpu.yaml":  # fits this 2-CPU machine, one CPU a trial; every loss on- and off-policy
        assert losses == {"m2po", "grpo", "grpo_no_tr"} and stale == {0, 64}
        assert {(t.config.policy_loss, t.config.staleness) for t in space.trials} == {
            (loss, k) for loss in losses for k in stale}
        assert {trial_resources(t.config)["CPU"] for t in space.trials} == {1.0}
    else:
        assert losses == {"m2po", "m2po_official", "grpo", "grpo_no_tr", "gspo"} and stale == {0, 64, 256}
        # tau is swept for the M2PO losses only
        assert {t.config.m2_threshold for t in space.trials if t.config.policy_loss == "grpo"} == {0.04}
        assert {t.config.m2_threshold for t in space.trials if t.config.policy_loss == "m2po"} == {0.02, 0.04, 0.08}
        # 4 vLLM runners + 4 learners with a GPU each, in the trial's placement group
        assert trial_resources(space.trials[0].config) == {"CPU": 2 + 4 * 4 + 4 * 4, "GPU": 8.0}


@pytest.mark.parametrize(
    "grid, overrides, needles",
    [
        ({"training.policy_loss": ["m2po", "ppo"]}, {}, ["trial 1 (policy_loss=ppo)", "`training.policy_loss` (grid)", "must be one of"]),
        ({"training.m2_threshold": [0.04, -0.1]}, {}, ["`training.m2_threshold` (grid)", "`m2_threshold` (-0.1) must be > 0"]),
        ({"training.staleness": [0, 3]}, {}, ["`training.staleness` (grid)", "non-negative multiple", "staleness=4"]),
        ({"training.policy_loss": ["m2po"]}, {"training.max_staleness": 8}, ["`training.max_staleness` (overrides)", "async_rollouts=True"]),
    ],
)
def test_a_bad_trial_fails_before_any_starts_naming_file_key_and_fix(tmp_path, tiny_model_dir, grid, overrides, needles):
    path = _space(tmp_path, tiny_model_dir, grid=grid, overrides=overrides)
    with pytest.raises(ValueError) as err:
        load_space(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: ")
    for needle in needles:
        assert needle in msg, msg


@pytest.mark.parametrize(
    "space, needle",
    [
        ({"grid": {"training.policy_loss": "m2po"}}, "must list its values"),
        ({"grid": {"policy_loss": ["m2po"]}}, "must be section.key"),
        ({"stop": {}}, "`stop` is missing"),
        ({"scheduler": {"type": "pbt"}}, "must be one of ('fifo', 'asha')"),
        ({"collapse": {"limits": {"entropy": {"max": 3}}}}, "not a watched metric"),
        ({"base": "nope.yaml"}, "does not exist"),
        ({"grids": {}}, "unknown key(s) ['grids']"),
        ({"max_failures": -1}, "`max_failures` (-1) must be an int >= 0"),
        ({"checkpoint_every": 0}, "`checkpoint_every` (0) must be an int >= 1"),
    ],
)
def test_malformed_space_is_a_clear_error(tmp_path, tiny_model_dir, space, needle):
    with pytest.raises(ValueError) as err:
        load_space(_space(tmp_path, tiny_model_dir, **space))
    assert needle in str(err.value)


def test_asha_needs_held_out_evaluation(tmp_path, tiny_model_dir):
    path = _space(tmp_path, tiny_model_dir, scheduler={"type": "asha"}, overrides={"evaluation.evaluation_interval": 0})
    with pytest.raises(ValueError, match="never evaluate: set evaluation.evaluation_interval"):
        load_space(path)


def test_grid_union_dedupes_and_points_hold_only_differences(tmp_path, tiny_model_dir):
    grid = [
        {"training.policy_loss": ["m2po"], "training.m2_threshold": [0.02, 0.08]},
        {"training.policy_loss": ["grpo", "grpo"], "debugging.seed": [0, 1]},
    ]
    space = load_space(_space(tmp_path, tiny_model_dir, grid=grid))
    assert [t.label for t in space.trials] == [
        "policy_loss=m2po,m2_threshold=0.02",
        "policy_loss=m2po,m2_threshold=0.08",
        "policy_loss=grpo,seed=0",
        "policy_loss=grpo,seed=1",
    ]
    points = _points(space)
    assert points[0] == {} and points[1] == {"m2_threshold": 0.08}
    assert points[2] == {"policy_loss": "grpo", "m2_threshold": 0.04, "seed": 0}
    assert points[3] == {"policy_loss": "grpo", "m2_threshold": 0.04, "seed": 1}


def test_concurrency_fits_the_cluster(tmp_path, tiny_model_dir):
    one = load_space(_space(tmp_path, tiny_model_dir, overrides={"resources.num_cpus_for_main_process": 1}))
    assert fit_concurrency(one.trials, {"CPU": 2.0}) == 2
    # a remote EnvRunner adds its own bundle: 1 + 1 CPUs per trial
    two = load_space(_space(tmp_path, tiny_model_dir, overrides={"env_runners.num_env_runners": 1}))
    assert trial_resources(two.trials[0].config) == {"CPU": 2.0, "GPU": 0.0}
    assert fit_concurrency(two.trials, {"CPU": 5.0}) == 2
    with pytest.raises(ValueError, match="a trial needs 2 CPUs and this Ray cluster has 1"):
        fit_concurrency(two.trials, {"CPU": 1.0})


# -- the collapse stopper on synthetic results ---------------------------------------------
def _result(it, acc=None, **learner):
    r = {"training_iteration": it, "policy_version": 4 * it}
    if acc is not None:
        r["heldout_accuracy"] = acc
    if learner:
        r["learners"] = {"default_policy": learner}
    return r


def _run(stopper, results, trial="t"):
    """Iteration at which the stopper stops, or None."""
    return next((r["training_iteration"] for r in results if stopper(trial, r)), None)


def test_stopper_stops_when_accuracy_falls_below_a_fraction_of_its_best():
    accs = [0.2, 0.3, 0.4, 0.35, 0.25, 0.19, 0.5]
    stopper = CollapseStopper(accuracy_drop=0.5, grace=2)
    assert _run(stopper, [_result(i + 1, a) for i, a in enumerate(accs)]) == 6  # 0.19 < 0.5 x 0.4
    reason = stopper.reasons["t"]
    assert reason["criterion"] == "heldout_accuracy" and reason["best"] == 0.4 and reason["training_iteration"] == 6
    assert math.isclose(reason["threshold"], 0.2) and "0.190 fell below 0.5 x its best 0.400" in reason["reason"]
    assert stopper("t", _result(8, 0.5)), "a stopped trial stays stopped"


def test_stopper_that_only_records_lets_the_trial_train_on_and_keeps_the_first_collapse():
    accs = [0.2, 0.4, 0.15, 0.1, 0.45]
    stopper = CollapseStopper(accuracy_drop=0.5, grace=1, stop=False)
    assert _run(stopper, [_result(i + 1, a) for i, a in enumerate(accs)]) is None
    reason = stopper.reasons["t"]  # the first collapse (0.15 < 0.5 x 0.4), not overwritten by 0.1
    assert reason["training_iteration"] == 3 and reason["value"] == 0.15 and reason["best"] == 0.4
    with pytest.raises(ValueError, match="collapse stop"):
        CollapseStopper(stop="no")


def test_stopper_grace_and_min_best_keep_early_and_near_zero_noise():
    # drops inside the grace period, and drops from a best below min_best, are not collapses
    stopper = CollapseStopper(accuracy_drop=0.5, grace=3, min_best=0.05)
    assert _run(stopper, [_result(1, 0.4), _result(2, 0.1), _result(3, 0.1), _result(4, 0.5)], "a") is None
    assert _run(stopper, [_result(i, a) for i, a in enumerate([0.04, 0.04, 0.04, 0.0, 0.0], 1)], "b") is None
    assert stopper.reasons == {}
    # after the grace period the best seen during it counts: 0.2 < 0.5 x 0.5
    assert _run(stopper, [_result(5, 0.2)], "a") == 5 and stopper.reasons["a"]["best"] == 0.5


def test_stopper_limits_with_patience_and_per_trial_state():
    stopper = CollapseStopper(accuracy_drop=None, grace=0, patience=2,
                              limits={"m2_before": {"max": 1.0}, "entropy_all": {"min": 0.05}})
    spikes = [_result(1, **{"m2po/m2_before": 2.0}), _result(2, **{"m2po/m2_before": 0.1}),
              _result(3, **{"m2po/m2_before": 3.0}), _result(4, **{"m2po/m2_before": 4.0})]
    assert _run(stopper, spikes, "a") == 4  # one spike alone is forgiven
    assert stopper.reasons["a"]["criterion"] == "m2_before" and "for 2 results in a row" in stopper.reasons["a"]["reason"]
    low = [_result(i, **{"m2po/entropy_all": 0.01}) for i in (1, 2)]
    assert _run(stopper, low, "b") == 2 and "entropy_all 0.01 below its limit 0.05" in stopper.reasons["b"]["reason"]
    assert _run(stopper, [_result(1, **{"m2po/m2_before": 0.5})] * 3, "c") is None


def test_stopper_reads_clip_losses_and_flattened_results_and_a_nan_loss():
    stopper = CollapseStopper(accuracy_drop=None, grace=0, limits={"clipped_frac": {"max": 0.3}})
    assert _run(stopper, [_result(1, **{"gspo/clipped_frac": 0.2}), _result(2, **{"gspo/clipped_frac": 0.4})], "g") == 2
    flat = {"training_iteration": 1, "learners/default_policy/grpo/clipped_frac": 0.9}
    assert stopper("flat", flat) and stopper.reasons["flat"]["value"] == 0.9
    assert stopper("nan", _result(1, **{"policy/loss": float("nan")}))
    assert stopper.reasons["nan"]["criterion"] == "loss"
    assert not stopper("m2po", _result(1, **{"m2po/masked_frac": 0.9}))  # not the clipped fraction


@pytest.mark.parametrize(
    "spec, needle",
    [({"accuracy_drop": 1.5}, "accuracy_drop (1.5) must be in (0, 1)"), ({"limits": {"m2_before": 3}}, "'max' and/or 'min'"),
     ({"patience": 0}, "patience (0)"), ({"drop": 0.5}, "valid keys")],
)
def test_stopper_rejects_bad_settings(spec, needle):
    with pytest.raises(ValueError) as err:
        CollapseStopper.from_spec(spec)
    assert needle in str(err.value)


def test_stop_on_the_command_line_shortens_every_trial(tmp_path, tiny_model_dir, capsys):
    """`m2po lab --stop policy_version=8` replaces the space's stop rule (a quick try of a
    long space); the dry run prints the rule every trial would stop at."""
    from m2po_rllib.jobs.cli import main

    path = _space(tmp_path, tiny_model_dir)
    assert main(["lab", "--space", str(path), "--dry-run", "--stop", "policy_version=8"]) == 0
    assert "2 valid trials; stop at {'policy_version': 8}" in capsys.readouterr().out
    assert main(["lab", "--space", str(path), "--dry-run", "--stop", "policy_version"]) == 2
    assert "--stop 'policy_version' must look like key=value" in capsys.readouterr().err
    assert main(["lab", "--space", str(path), "--dry-run", "--stop", "policy_version=[8"]) == 2
    assert "--stop 'policy_version=[8': its value is not valid YAML" in capsys.readouterr().err
