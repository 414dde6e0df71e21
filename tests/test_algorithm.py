"""M2PO as an RLlib algorithm, end to end on CPU with a tiny model the tests build."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

from m2po_rllib.wire.batch import concat_rollouts, learner_order, pack_rollouts, to_train_batch  # noqa: E402

from _configs import tiny_config  # noqa: E402


# -- batches -------------------------------------------------------------------------------
def test_concat_rollouts_repads_prompts_left_and_responses_right():
    a = pack_rollouts([[5, 6]], [[7]], [[-0.5]], [1.0], policy_version=3, sample_ids=[10])
    b = pack_rollouts([[9]], [[1, 2, 3]], [[-1.0, -2.0, -3.0]], [0.0], policy_version=4)
    c = concat_rollouts([a, b])
    assert c["prompt_ids"].tolist() == [[5, 6], [0, 9]]
    assert c["response_ids"].tolist() == [[7, 0, 0], [1, 2, 3]]
    assert c["response_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert c["policy_version"].tolist() == [3, 4]
    assert c["sample_id"].tolist() == [10, 0]
    t = to_train_batch(c, np.array([0.5, -0.5]))
    assert t["input_ids"].tolist() == [[5, 6, 7, 0, 0], [0, 9, 1, 2, 3]]
    assert t["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]]


def test_a_rows_version_is_its_oldest_tokens_and_no_token_predates_its_round():
    """`token_versions` (a row's None: all the round's version): the batch's `token_version`
    column, each row's `policy_version` its oldest token's (its age counts from it), how many
    versions each row spans; a token older than its round refused."""
    from m2po_rllib.wire.batch import versions_spanned

    b = pack_rollouts([[5], [6], [7]], [[1, 2, 3], [4], [8, 9]], [[-1.0] * 3, [-1.0], [-1.0] * 2], [1.0, 0.0, 1.0],
                      policy_version=3, token_versions=[[3, 4, 4], None, [5, 6]])
    assert b["token_version"].tolist() == [[3, 4, 4], [3, 0, 0], [5, 6, 0]]
    assert b["policy_version"].tolist() == [3, 3, 5]
    assert versions_spanned(b).tolist() == [2, 1, 2]
    with pytest.raises(ValueError, match="row 0: a token of version 2, older than its round's 3"):
        pack_rollouts([[5]], [[1, 2]], [[-1.0, -1.0]], [0.0], policy_version=3, token_versions=[[2, 3]])
    with pytest.raises(ValueError, match="row 0: 2 response tokens but 1 token versions"):
        pack_rollouts([[5]], [[1, 2]], [[-1.0, -1.0]], [0.0], policy_version=3, token_versions=[[3]])


def test_learner_order_reproduces_global_minibatches():
    # 2 minibatches of 4 rows over 2 learners: learner 0 gets [0,1 | 4,5], learner 1 [2,3 | 6,7].
    assert learner_order(8, 4, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert learner_order(6, 3, 1).tolist() == list(range(6))


# -- the training loop ---------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("policy_loss", ["m2po", "m2po_official", "grpo", "grpo_no_tr", "gspo"])
def test_each_policy_loss_trains(ray_session, tiny_model_dir, policy_loss):
    algo = tiny_config(tiny_model_dir, policy_loss=policy_loss).build_algo()
    try:
        before = {k: v.clone() for k, v in algo.learner_group._learner.module["default_policy"].model.state_dict().items()}
        for _ in range(2):
            result = algo.train()
        learner = result["learners"]["default_policy"]
        assert np.isfinite(learner["policy/loss"])
        assert "m2po/m2_before" in learner and "policy/log_ratio_abs_max" in learner
        assert algo.policy_version == 4  # 2 steps x 2 minibatches
        after = algo.learner_group._learner.module["default_policy"].model.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before), "weights did not change"
        runners = result["env_runners"]
        # the test env rewards 1 exactly where the completion is correct
        assert runners["rollout/accuracy"] == pytest.approx(runners["rollout/reward_mean"])
        assert runners["rollout/engine_policy_version"] == 2  # synced after step 1
        # the learner recomputes the HF engine's log-probs on the same weights
        assert result["rollout/logp_mismatch_max"] < 1e-3
    finally:
        algo.stop()


@pytest.mark.slow
def test_rollout_rewards_and_accuracy_match_the_completions(ray_session, tiny_model_dir):
    """The runner's rewards and `rollout/accuracy`, recomputed from the sampled tokens."""
    algo = tiny_config(tiny_model_dir).build_algo()
    try:
        runner = algo.env_runner_group.local_env_runner
        batch = runner.sample(num_prompts=4, seed=1234)
        texts = [
            runner.tokenizer.decode(ids[mask > 0], skip_special_tokens=True)
            for ids, mask in zip(batch["response_ids"], batch["response_mask"])
        ]
        has_digit = [float(any(ch.isdigit() for ch in t)) for t in texts]  # the test env's reward
        assert batch["rewards"].tolist() == has_digit and 0 < sum(has_digit) < len(texts)
        assert float(runner.get_metrics()["rollout/accuracy"]) == pytest.approx(np.mean(has_digit))
    finally:
        algo.stop()


@pytest.mark.slow
def test_stale_k_trains_on_data_exactly_k_updates_old(ray_session, tiny_model_dir):
    # 2 updates per step; staleness 4 -> a lag of 2 steps.
    algo = tiny_config(tiny_model_dir, staleness=4).build_algo()
    try:
        seen = []
        for step in range(6):
            result = algo.train()
            seen.append(
                (result["staleness/filling"], result.get("staleness/max"), result.get("staleness/mean"))
            )
            # every queued round is tagged with the version of the weights that generated it
            queued = [int(b["policy_version"][0]) for b in algo.stale_queue]
            assert all(np.all(b["policy_version"] == b["policy_version"][0]) for b in algo.stale_queue)
            assert queued == sorted(queued)
        assert [s[0] for s in seen] == [1, 1, 0, 0, 0, 0]  # the queue fills for 2 steps
        # staleness ramps while the queue holds base-model rounds, then stays at exactly k
        assert [s[1] for s in seen[2:]] == [0.0, 2.0, 4.0, 4.0]
        assert seen[-1][2] == 4.0
        assert algo.policy_version == 8
    finally:
        algo.stop()


@pytest.mark.slow
def test_checkpoint_resume_matches_uninterrupted_run(ray_session, tiny_model_dir, tmp_path, monkeypatch):
    def losses(algo, n):
        return [algo.train()["learners"]["default_policy"]["policy/loss"] for _ in range(n)]

    monkeypatch.chdir(tmp_path)  # a relative path, as README's example writes it
    cfg = tiny_config(tiny_model_dir, staleness=2)
    algo = cfg.build_algo()
    try:
        algo.train()  # fills the queue (lag 1 step)
        losses(algo, 1)
        ckpt = algo.save_to_path("ckpt")
        assert ckpt == str(tmp_path / "ckpt")
        queue_before = [b["policy_version"].tolist() for b in algo.stale_queue]
        expected = losses(algo, 2)
    finally:
        algo.stop()

    from m2po_rllib import M2PO

    resumed = M2PO.from_checkpoint("ckpt")
    try:
        assert [b["policy_version"].tolist() for b in resumed.stale_queue] == queue_before
        assert resumed.policy_version == 2 and len(resumed.stale_queue) == 1
        got = losses(resumed, 2)
    finally:
        resumed.stop()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_heldout_evaluation_through_rllib(ray_session):
    from envs import ArithmeticTasks, math_reward, render_prompt
    from m2po_rllib.models.builtin import greedy_completions, resolve_model_path

    # The built-in model on its own task: its held-out accuracy is not 0.
    cfg = tiny_config("builtin:arith-tiny", lr=3e-5).evaluation(evaluation_interval=1, evaluation_duration=24, eval_samples=2)
    cfg.environment("m2po/Arithmetic-v0", env_config={"digits": 3, "template": "compact"}).env_runners(max_new_tokens=8)
    algo = cfg.build_algo()
    try:
        result = algo.train()
        runners = result["env_runners"]
        # every completion went through the verifier, and its counters reach the results
        assert runners["reward/fast_path"] + runners["reward/slow_path"] >= 16
        assert runners["reward/timeouts"] == 0
        ev = result["evaluation"]["env_runners"]
        assert ev["num_problems"] == 24
        # Evaluated after the step's weight sync: recompute with the learner's weights, by a
        # plain greedy loop outside the env, engine and RLlib.
        from transformers import AutoTokenizer

        model = algo.learner_group._learner.module["default_policy"].model
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("builtin:arith-tiny"))
        problems = ArithmeticTasks(digits=3).heldout()[:24]
        completions = greedy_completions(model, tokenizer, [render_prompt(p.question, "compact") for p in problems], 8)
        expected = sum(math_reward(c, p.answer) for c, p in zip(completions, problems)) / 24
        assert ev["eval/accuracy"] == expected and expected > 0
        # mean@2 is a count over the 48 sampled completions
        assert ev["eval/mean_at_k"] * 48 == pytest.approx(round(ev["eval/mean_at_k"] * 48))
        assert ev["eval/response_len_mean"] > 0
    finally:
        algo.stop()


@pytest.mark.slow
def test_remote_runner_starts_without_a_restart(ray_session, tiny_model_dir):
    """The first weight sync reaches a remote runner as a nested ObjectRef; it must load it,
    not crash and be restarted by RLlib (which cost ~60 s per start-up)."""
    cfg = tiny_config(tiny_model_dir).env_runners(num_env_runners=1)
    cfg.environment("m2po/Arithmetic-v0", env_config={"digits": 1})  # the test env is not registered in actors
    algo = cfg.build_algo()
    try:
        pid = algo.env_runner_group.foreach_env_runner(lambda r: os.getpid(), local_env_runner=False)
        for _ in range(2):
            result = algo.train()
        assert result["fault_tolerance"]["num_remote_worker_restarts"] == 0
        assert algo.env_runner_group.foreach_env_runner(lambda r: os.getpid(), local_env_runner=False) == pid
        # the remote runner sampled round 2 with the weights synced after step 1
        assert result["env_runners"]["rollout/engine_policy_version"] == 2
    finally:
        algo.stop()


def _weights(algo):
    state = algo.learner_group.get_state(components="learner/rl_module")
    return state["learner"]["rl_module"]["default_policy"]["weights"]


@pytest.mark.slow
def test_two_learners_global_mask_equals_one_learner(ray_session, tiny_model_dir):
    """Sharding the minibatch over 2 gloo learners gives the 1-learner mask and update."""
    # A tight tau and a large lr make the second minibatch of the step mask tokens.
    common = dict(m2_threshold=1e-6, lr=3e-2, minibatch_prompts=2, prompts_per_step=4)
    results, weights = [], []
    for num_learners in (0, 2):
        cfg = tiny_config(tiny_model_dir, **common).learners(num_learners=num_learners)
        algo = cfg.build_algo()
        try:
            results.append(algo.train()["learners"]["default_policy"])
            weights.append({k: torch.as_tensor(v) for k, v in _weights(algo).items()})
            # RLlib's way to the trained policy: the local learner's module itself, or (remote
            # learners) a module holding their weights and version
            module = algo.get_module()
            assert module.policy_version == algo.policy_version > 0
            local = algo.learner_group._learner  # None with remote learners
            assert (local is not None and module is local.module["default_policy"]) == (num_learners == 0)
            for k, v in module.get_state()["weights"].items():
                torch.testing.assert_close(v, weights[-1][k], rtol=0, atol=0)
            assert algo.get_module("no_such_module") is None
        finally:
            algo.stop()
    one, two = results
    assert one["m2po/masked_tokens"] > 0, "the test needs a step that masks tokens"
    assert two["m2po/masked_tokens"] == pytest.approx(one["m2po/masked_tokens"])
    assert two["m2po/m2_before"] == pytest.approx(one["m2po/m2_before"], rel=1e-4)
    assert two["policy/loss"] == pytest.approx(one["policy/loss"], rel=1e-4, abs=1e-7)
    # Adam's first steps are ~lr * sign(g): gradients that differ only by float summation
    # order can move a near-zero-gradient weight by a few 1e-6; lr is 3e-2.
    for k in weights[0]:
        torch.testing.assert_close(weights[1][k], weights[0][k], rtol=1e-3, atol=1e-4)


@pytest.mark.slow
def test_tune_searches_m2_threshold(ray_session, tiny_model_dir, tmp_path):
    """ASHA on held-out accuracy with evaluation every 2 iterations: every result carries
    `heldout_accuracy` (evaluated at iteration 1, then carried), so no trial aborts."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    cfg = tiny_config(tiny_model_dir, m2_threshold=tune.grid_search([0.02, 0.08]))
    cfg.environment("m2po/Arithmetic-v0", env_config={"digits": 2, "template": "compact"})
    cfg.evaluation(evaluation_interval=2, evaluation_duration=4)
    tuner = tune.Tuner(
        "M2PO",
        param_space=cfg,
        tune_config=tune.TuneConfig(
            scheduler=ASHAScheduler(metric="heldout_accuracy", mode="max", max_t=3, grace_period=1)
        ),
        run_config=tune.RunConfig(
            stop={"training_iteration": 3}, storage_path=str(tmp_path), verbose=0
        ),
    )
    grid = tuner.fit()
    assert grid.num_errors == 0
    thresholds = sorted(r.config["m2_threshold"] for r in grid)
    assert thresholds == [0.02, 0.08]
    for r in grid:
        history = r.metrics_dataframe
        assert "m2po/m2_before" in r.metrics["learners"]["default_policy"]
        assert history["heldout_accuracy"].notna().all() and len(history) >= 1
        # between evaluations the last held-out accuracy is carried
        evaluated = history.get("evaluation/env_runners/eval/accuracy")
        if evaluated is not None and len(history) >= 2:
            assert history["heldout_accuracy"].iloc[1] == history["heldout_accuracy"].iloc[0]
            assert history["heldout_accuracy"].iloc[1] == evaluated.iloc[1]


@pytest.mark.slow
def test_heldout_accuracy_is_in_every_result_and_survives_a_checkpoint(ray_session, tiny_model_dir, tmp_path,
                                                                          monkeypatch):
    from m2po_rllib import M2PO

    monkeypatch.setenv("HOME", str(tmp_path))  # a checkpoint path with ~

    cfg = tiny_config(tiny_model_dir).evaluation(evaluation_interval=4, evaluation_duration=4)
    cfg.environment("m2po/Arithmetic-v0", env_config={"digits": 2, "template": "compact"})
    algo = cfg.build_algo()
    try:
        results = [algo.train() for _ in range(2)]
        first = results[0]["evaluation"]["env_runners"]["eval/accuracy"]  # evaluated before iteration 1
        assert [r["heldout_accuracy"] for r in results] == [first, first]
        assert algo.save_to_path("~/ckpt") == str(tmp_path / "ckpt")
    finally:
        algo.stop()
    resumed = M2PO.from_checkpoint("~/ckpt")
    try:
        result = resumed.train()  # iteration 3: no evaluation, the restored value is carried
        assert result["heldout_accuracy"] == first
        # no evaluation this iteration (RLlib reports NaN for metrics not logged)
        assert np.isnan(result["evaluation"]["env_runners"]["eval/accuracy"])
    finally:
        resumed.stop()


@pytest.mark.slow
def test_the_mismatch_check_skips_rounds_of_weights_the_learner_has_left(ray_session, tiny_model_dir):
    """broadcast_interval=2: every other round comes from weights 2 updates old; checking it
    against the learner's current weights would report the update as engine mismatch."""
    cfg = tiny_config(tiny_model_dir, lr=1e-2, weight_decay=0.5, broadcast_interval=2)
    algo = cfg.build_algo()
    try:
        measured = []
        for _ in range(4):
            result = algo.train()
            measured.append(result["rollout/logp_mismatch_max"])
        assert result["env_runners"]["rollout/engine_policy_version"] == 4  # the last round: weights 4, learner at 6
        # rounds 1 and 3 came from the weights the learner held: checked; 2 and 4 did not: NaN (nothing measured)
        assert measured[0] < 1e-4 and measured[2] < 1e-4 and np.isnan(measured[1]) and np.isnan(measured[3])
    finally:
        algo.stop()


@pytest.mark.slow
def test_truncated_sampling_is_replayed_on_policy_through_the_api(ray_session, tiny_model_dir):
    """top_p=0.9 with top_k=20 on the HF engine, measured as the issue measured it (fp32,
    staleness 0, the mismatch check every step): the learner's log-probs equal the
    engine's (the unreplayed ratio was off by up to 0.1)."""
    algo = tiny_config(tiny_model_dir, lr=1e-2).env_runners(top_p=0.9, top_k=20, max_new_tokens=8).build_algo()
    try:
        for _ in range(2):  # the second round is sampled after an update
            result = algo.train()
        assert result["rollout/logp_mismatch_max"] < 1e-4
        assert result["rollout/logp_mismatch_kl"] < 1e-8 and result["rollout/logp_mismatch_large_frac"] == 0
    finally:
        algo.stop()


@pytest.mark.slow
def test_a_held_out_split_smaller_than_the_evaluation_is_evaluated_whole(ray_session, tiny_model_dir, tmp_path):
    """A user's small dataset holds out 3 problems while evaluation_duration asks for 200:
    all 3 are evaluated (and the log says so) instead of an IndexError."""
    data = os.path.join(os.path.dirname(__file__), "fixtures", "gsm8k_sample.jsonl")
    held = tmp_path / "held.jsonl"
    with open(data) as f:
        held.write_text("".join(f.readlines()[:3]))
    cfg = tiny_config(tiny_model_dir).environment("m2po/MathDataset-v0").evaluation(
        evaluation_interval=1, evaluation_duration=200)
    cfg.env_config = {"path": data, "heldout_path": str(held), "template": "compact"}  # not merged into the digits
    algo = cfg.build_algo()
    try:
        result = algo.evaluate()
        assert result["env_runners"]["num_problems"] == 3
    finally:
        algo.stop()
