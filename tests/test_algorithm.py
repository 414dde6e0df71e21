"""M2PO as an RLlib algorithm, end to end on CPU with a tiny model the tests build."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

import _test_envs  # noqa: E402
from m2po_rllib import M2POConfig  # noqa: E402
from m2po_rllib.common.errors import ConfigError  # noqa: E402
from m2po_rllib.wire.batch import learner_order  # noqa: E402
from m2po_rllib.wire.batch import concat_rollouts, pack_rollouts, to_train_batch  # noqa: E402


def tiny_config(model_dir: str, **training) -> M2POConfig:
    params = dict(
        policy_loss="m2po",
        group_size=4,
        prompts_per_step=4,
        minibatch_prompts=2,
        staleness=0,
        lr=1e-3,
        logp_mismatch_interval=1,
    )
    params.update(training)
    return (
        M2POConfig()
        .environment(_test_envs.ENV_ID, env_config={"digits": 1})
        .env_runners(num_env_runners=0, rollout_engine="hf", max_new_tokens=6, temperature=1.0)
        .learners(num_learners=0)
        .rl_module(model_config={"model": model_dir})
        .training(**params)
        .debugging(seed=0)
    )


# -- config validation (no Ray needed) -----------------------------------------------------
@pytest.mark.parametrize(
    "training, needle, at_fault",
    [
        (dict(group_size=1), "`group_size` (1)", {"group_size"}),
        (dict(staleness=3), "`staleness` (3) must be a non-negative multiple", {"staleness"}),
        (dict(minibatch_prompts=8), "`minibatch_prompts` (8) must be <= `prompts_per_step` (4)",
         {"minibatch_prompts", "prompts_per_step"}),
        (dict(policy_loss="ppo"), "`policy_loss` ('ppo') must be one of", {"policy_loss"}),
        (dict(m2_threshold=0.0), "`m2_threshold` (0.0) must be > 0", {"m2_threshold"}),
        (dict(loss_agg_mode="sum"), "`loss_agg_mode` ('sum')", {"loss_agg_mode"}),
        (dict(policy_loss_kwargs={"eps_lo": 0.1}, policy_loss="grpo"), "does not take", {"policy_loss_kwargs"}),
        (dict(async_rollouts=True, max_staleness=8), "`async_rollouts` needs remote EnvRunners",
         {"async_rollouts", "num_env_runners"}),
        (dict(rollout_correction="tis"), "`rollout_correction` ('tis') must be None or one of ['icepop', 'mis_seq'",
         {"rollout_correction"}),
        (dict(rollout_correction="tis_token"), "needs the behaviour log-probs in the learner's numerics: set "
         "recompute_behavior_logp=True", {"rollout_correction", "recompute_behavior_logp"}),
        (dict(rollout_correction="icepop", recompute_behavior_logp=True, rollout_correction_high=0.9),
         "`rollout_correction_high` (0.9) must be > 1", {"rollout_correction_high"}),
        (dict(rollout_correction="tis_seq", recompute_behavior_logp=True, rollout_correction_low=0.5),
         "`rollout_correction_low` (0.5) means nothing for 'tis_seq'", {"rollout_correction_low", "rollout_correction"}),
        (dict(rollout_correction="mis_token", recompute_behavior_logp=True, rollout_correction_low=1.5),
         "`rollout_correction_low` (1.5) must be in [0, 1)", {"rollout_correction_low"}),
        (dict(rollout_correction_high=3.0), "`rollout_correction_high` bound a rollout correction, which is off",
         {"rollout_correction_high", "rollout_correction"}),
        (dict(recompute_behavior_logp=True, broadcast_interval=2), "`broadcast_interval` is 2: set broadcast_interval=1",
         {"recompute_behavior_logp", "broadcast_interval"}),
        (dict(max_staleness="fast"), "`max_staleness` ('fast') must be an int (the bound, in optimizer updates), 'auto'",
         {"max_staleness"}),
        (dict(max_staleness="auto"), "`max_staleness` (auto) bounds asynchronous rollouts, which are off; set "
         "async_rollouts=True", {"max_staleness", "async_rollouts"}),
        (dict(staleness_floor=4), "`staleness_floor` (4) steers max_staleness='auto', but max_staleness is None: set "
         "max_staleness='auto'", {"staleness_floor", "max_staleness"}),
    ],
)
def test_validate_names_setting_value_and_fix(tiny_model_dir, training, needle, at_fault):
    """A ConfigError (a ValueError) whose message names the value and the fix, and whose
    `settings` name the settings at fault (what the lab blames, without reading the text)."""
    with pytest.raises(ConfigError) as err:
        tiny_config(tiny_model_dir, **training).validate()
    assert needle in str(err.value)
    assert set(err.value.settings) == at_fault


@pytest.mark.parametrize(
    "settings, needle, at_fault",
    [
        (dict(staleness_floor=1), "`staleness_floor` (1) must be >= 3, the smallest bound", {"staleness_floor", "broadcast_interval"}),
        (dict(staleness_ceiling=2), "`staleness_ceiling` (2) must be >= the floor (3)", {"staleness_ceiling", "staleness_floor"}),
        (dict(staleness_target_m2=0.0), "`staleness_target_m2` (0.0) must be a positive second moment", {"staleness_target_m2"}),
        (dict(staleness_half_life=0), "`staleness_half_life` (0) must be > 0 optimizer updates", {"staleness_half_life"}),
        (dict(round_delay={"median_s": 1, "sigma": -1}), "`round_delay` ({'median_s': 1, 'sigma': -1}) must be None or",
         {"round_delay"}),
    ],
)
def test_validate_auto_staleness_and_round_delay(tiny_model_dir, settings, needle, at_fault):
    delay = settings.pop("round_delay", None)
    cfg = tiny_config(tiny_model_dir, async_rollouts=True, max_staleness="auto", logp_mismatch_interval=0, **settings)
    cfg = cfg.env_runners(num_env_runners=1, round_delay=delay)
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert needle in str(err.value)
    assert set(err.value.settings) == at_fault


@pytest.mark.parametrize(
    "runners, training, needle, at_fault",
    [
        (dict(weight_sync="nccl"), {}, "`weight_sync` ('nccl') must be one of ('object_store', 'native')", {"weight_sync"}),
        (dict(weight_sync="native", weight_sync_backend="ipc"), {}, "`weight_sync_backend` ('ipc') must be one of",
         {"weight_sync_backend"}),
        (dict(weight_sync="native", weight_sync_bucket_bytes=0), {}, "`weight_sync_bucket_bytes` (0) must be an int >= 1",
         {"weight_sync_bucket_bytes"}),
        (dict(weight_sync="native", weight_sync_only_changed="yes"), {}, "`weight_sync_only_changed` ('yes') must be True",
         {"weight_sync_only_changed"}),
        (dict(weight_sync="native", rollout_engine="hf"), {}, "the rollout engine is 'hf': set rollout_engine='vllm', "
         "or weight_sync='object_store'", {"weight_sync", "rollout_engine"}),
        (dict(weight_sync="native", num_env_runners=0), {}, "`num_env_runners` is 0 (the runner shares the learner's "
         "process", {"weight_sync", "num_env_runners"}),
        (dict(weight_sync="native"), dict(async_rollouts=True, max_staleness=3, recompute_behavior_logp=True),
         "a native sync (into vLLM only) does not update: set recompute_behavior_logp=False",
         {"weight_sync", "recompute_behavior_logp"}),
        (dict(weight_sync="native", weight_sync_backend="nccl"), {}, "weight_sync_backend='nccl' needs GPUs on both "
         "sides (CUDA here: False", {"weight_sync_backend"}),
        (dict(weight_sync="native", engine_kwargs={"dtype": "auto"}), {}, "engine_kwargs dtype 'auto' names none",
         {"weight_sync", "engine_kwargs"}),
    ],
)
def test_validate_weight_sync(tiny_model_dir, runners, training, needle, at_fault):
    """weight_sync="native": bad values, and the setups the learner cannot broadcast to, are
    refused before anything starts, each naming the fix."""
    cfg = tiny_config(tiny_model_dir, **training)
    cfg.env_runners(**{"num_env_runners": 1, "rollout_engine": "vllm", **runners})
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert needle in str(err.value)
    assert set(err.value.settings) == at_fault


def test_native_weight_sync_picks_gloo_without_whole_gpus_and_sends_the_served_dtype(tiny_model_dir):
    cfg = tiny_config(tiny_model_dir).env_runners(num_env_runners=1, rollout_engine="vllm", weight_sync="native")
    cfg.validate()
    assert cfg.resolved_weight_sync_backend() == "gloo"  # no CUDA here
    assert cfg.served_dtype() == torch.float32  # the learner's dtype, which the runners serve
    cfg.env_runners(engine_kwargs={"dtype": "bfloat16"})
    assert cfg.served_dtype() == torch.bfloat16


@pytest.mark.parametrize(
    "training, needle",
    [
        (dict(m2_threshold=-1), "`m2_threshold` (-1) must be > 0"),
        (dict(staleness=-1), "`staleness` (-1) must be a non-negative multiple"),
        (dict(group_size=-1), "`group_size` (-1) must be an int >= 2"),
        (dict(lr=-1), "`lr` (-1) must be > 0"),
        (dict(logp_mismatch_interval=-1), "`logp_mismatch_interval` (-1) must be >= 0"),
    ],
)
def test_build_algo_rejects_minus_one_as_validate_does(tiny_model_dir, training, needle):
    """RLlib's config copy drops every -1 (its DEPRECATED_VALUE); M2PO's keeps them, so
    `build_algo()` fails with validate()'s message instead of training on a default."""
    cfg = tiny_config(tiny_model_dir, **training)
    with pytest.raises(ValueError) as validated:
        cfg.validate()
    assert needle in str(validated.value)
    with pytest.raises(ValueError) as built:
        cfg.build_algo()
    assert str(built.value) == str(validated.value)


def test_config_state_keeps_minus_one_and_drops_only_rllib_deprecated(tiny_model_dir):
    from ray.rllib.algorithms.algorithm_config import AlgorithmConfig

    state = tiny_config(tiny_model_dir, staleness=-1, m2_threshold=-1.0).get_state()
    assert (state["staleness"], state["m2_threshold"]) == (-1, -1.0)
    rllib = AlgorithmConfig().get_state()
    assert set(AlgorithmConfig().__dict__) - set(rllib) - {"algo_class", "_is_frozen"} == (
        set(M2POConfig().__dict__) - set(M2POConfig().get_state()) - {"algo_class", "_is_frozen"}
    )


@pytest.mark.parametrize(
    "training, needle",
    [
        (dict(staleness="abc"), "`staleness` ('abc') must be an int"),
        (dict(group_size=8.0), "`group_size` (8.0) must be an int"),
        (dict(lr="fast"), "`lr` ('fast') must be a number"),
        (dict(m2_threshold=None), "`m2_threshold` (None) must be a number"),
        (dict(recompute_behavior_logp="yes"), "`recompute_behavior_logp` ('yes') must be true or false"),
        (dict(rollout_correction_high="2"), "`rollout_correction_high` ('2') must be a number"),
    ],
)
def test_wrong_types_are_one_clear_line(tiny_model_dir, training, needle):
    with pytest.raises(ValueError) as err:
        tiny_config(tiny_model_dir, **training).validate()
    assert str(err.value).startswith(f"Invalid M2POConfig: {needle}") and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "model, needle",
    [
        ("/no/such/model", "model_config['model'] ('/no/such/model'): no such directory, and it is not a hub name"),
        ("./relative/missing", "('./relative/missing'): no such directory, and it is not a hub name"),
        ("no/such/model", "('no/such/model'): no such directory, and it is not a hub name"),
        ("builtin:arith-huge", "('builtin:arith-huge') is not a built-in model; the built-in models are: builtin:arith-tiny"),
    ],
)
def test_a_model_that_cannot_load_is_one_clear_line(tiny_model_dir, monkeypatch, model, needle):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = tiny_config(tiny_model_dir).rl_module(model_config={"model": model})
    with pytest.raises(ValueError) as err:
        cfg.validate()
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_model_without_a_tokenizer_is_refused_before_anything_starts(tiny_model_dir, tmp_path):
    import shutil

    bare = tmp_path / "weights-only"
    shutil.copytree(tiny_model_dir, bare, ignore=shutil.ignore_patterns("tokenizer*", "vocab*", "merges*", "special*"))
    with pytest.raises(ConfigError) as err:
        tiny_config(str(bare)).validate()
    assert f"model_config['model'] ('{bare}') has no tokenizer" in str(err.value)
    assert err.value.settings == ("model_config",)


def test_an_engine_in_another_dtype_without_recomputed_logp_is_announced_once(tiny_model_dir, caplog):
    """A bf16 engine beside an fp32 learner is valid, but its log-probs carry the engine's
    numerics into every ratio: validate() says so (once), and not when they are recomputed."""
    cfg = tiny_config(tiny_model_dir).env_runners(engine_kwargs={"dtype": "bfloat16"})
    with caplog.at_level("WARNING", logger="m2po_rllib.config.validation"):
        cfg.validate()
        cfg.validate()
        tiny_config(tiny_model_dir, recompute_behavior_logp=True).env_runners(engine_kwargs={"dtype": "bfloat16"}).validate()
    said = [r.getMessage() for r in caplog.records if "bfloat16" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("the rollout engine computes in bfloat16 (engine_kwargs), the learner in float32")


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


def test_an_unknown_env_id_suggests_the_close_one(tiny_model_dir):
    cfg = tiny_config(tiny_model_dir).environment("m2po/Arithmetc-v0")
    with pytest.raises(ValueError, match=r"`env` \('m2po/Arithmetc-v0'\) is not a registered gymnasium env id; did you mean 'm2po/Arithmetic-v0'"):
        cfg.validate()
    with pytest.raises(ValueError, match="cannot import module 'nosuchpkg'"):
        tiny_config(tiny_model_dir).environment("nosuchpkg:Env-v0").validate()
    tiny_config(tiny_model_dir).environment("envs:m2po/Arithmetic-v0").validate()  # gym.make's module:id form


def test_the_head_dtype_is_float32_or_the_models(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"model_config\['head_dtype'\] \('bfloat16'\) must be None"):
        tiny_config(tiny_model_dir).rl_module(model_config={"model": tiny_model_dir, "head_dtype": "bfloat16"}).validate()
    tiny_config(tiny_model_dir).rl_module(model_config={"model": tiny_model_dir, "head_dtype": "float32"}).validate()


def test_validate_requires_model_and_accepts_good_config(tiny_model_dir):
    cfg = tiny_config(tiny_model_dir)
    cfg.validate()  # a consistent config passes
    assert cfg.updates_per_step == 2 and cfg.queue_lag_steps == 0
    cfg = tiny_config(tiny_model_dir).rl_module(model_config={})
    with pytest.raises(ValueError, match="no model"):
        cfg.validate()


def test_yaml_config_round_trip(tmp_path, tiny_model_dir):
    path = tmp_path / "c.yaml"
    path.write_text(
        "environment: {env: m2po/Arithmetic-v0, env_config: {digits: 2}}\n"
        "env_runners: {rollout_engine: hf, max_new_tokens: 5}\n"
        f"rl_module: {{model_config: {{model: {tiny_model_dir}}}}}\n"
        "training: {policy_loss: grpo, eps_high: 0.28, staleness: 8, group_size: 4, prompts_per_step: 8, minibatch_prompts: 2}\n"
    )
    cfg = M2POConfig.from_yaml(str(path), overrides=["training.lr=2e-5", "env_runners.temperature=0.7"])
    cfg.validate()
    assert (cfg.policy_loss, cfg.eps_high, cfg.staleness, cfg.lr) == ("grpo", 0.28, 8, 2e-5)
    assert cfg.temperature == 0.7 and cfg.env_config == {"digits": 2}
    assert cfg.policy_loss_params() == {"eps_high": 0.28}
    with pytest.raises(ValueError, match="unknown config section"):
        M2POConfig.from_yaml(str(path), overrides=["train.lr=1"])


def test_yaml_typo_names_the_closest_setting(tmp_path, tiny_model_dir):
    path = tmp_path / "c.yaml"
    path.write_text(f"rl_module: {{model_config: {{model: {tiny_model_dir}}}}}\n")
    cases = {
        "training.stalenes=64": "unknown setting `training.stalenes`; did you mean `staleness`?",
        "env_runners.temprature=0.5": "unknown setting `env_runners.temprature`; did you mean `temperature`?",
        # RLlib's own settings count too
        "training.grad_clipp=1": "unknown setting `training.grad_clipp`; did you mean `grad_clip`?",
        "training.qwerty=1": "unknown setting `training.qwerty`; see `M2POConfig.training()`",
    }
    for override, message in cases.items():
        with pytest.raises(ValueError) as err:
            M2POConfig.from_yaml(str(path), overrides=[override])
        assert str(err.value).startswith(message), str(err.value)
    cfg = M2POConfig.from_yaml(str(path), overrides=["training.grad_clip=0.5", "env_runners.num_env_runners=0"])
    assert (cfg.grad_clip, cfg.num_env_runners) == (0.5, 0)


@pytest.mark.parametrize(
    "path", sorted(str(p) for p in (__import__("pathlib").Path(__file__).parents[1] / "configs").glob("*.yaml"))
)
def test_shipped_configs_load_and_validate(path):
    cfg = M2POConfig.from_yaml(path)
    cfg.validate()
    assert cfg.staleness % cfg.updates_per_step == 0
    assert cfg.model_config["model"]


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


def test_runner_ignores_stale_and_duplicate_weight_syncs(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from m2po_rllib.rollout.env_runner import LLMEnvRunner

    runner = LLMEnvRunner(config=tiny_config(tiny_model_dir))
    try:
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
        newer = {k: v + 0.01 for k, v in base.items()}

        def sync(weights, version):
            runner.set_state({"rl_module": {"default_policy": {"weights": weights, "policy_version": version}}})

        sync(newer, 2)  # before the engine starts: kept, loaded at start
        batch = runner.sample(num_prompts=2, seed=0)
        assert runner.engine.version == 2 and set(batch["policy_version"]) == {2}
        before = runner.sample(num_prompts=2, seed=1)
        sync(base, 1)  # older than what the engine serves: ignored
        sync(base, 2)  # duplicate version: ignored
        assert runner.engine.version == 2
        after = runner.sample(num_prompts=2, seed=1)
        np.testing.assert_array_equal(after["response_ids"], before["response_ids"])
        sync(base, 3)  # newer: loaded in place
        assert runner.engine.version == 3
        np.testing.assert_array_equal(runner.sample(num_prompts=2, seed=1)["policy_version"], 3)
    finally:
        runner.stop()


@pytest.mark.parametrize("engine_dtype", ["bfloat16", "float32"])
def test_an_async_runner_scores_its_rounds_in_the_learner_numerics(tiny_model_dir, engine_dtype):
    """`recompute_behavior_logp` with async rollouts: the runner scores each round with the
    weights that generated it, by the learner's log-prob function in float32 (truncation
    replayed), whatever the engine's dtype; the engine's own log-probs stay as `engine_logp`.
    Weights synced before the engine starts and after both reach the scorer."""
    from transformers import AutoModelForCausalLM

    from m2po_rllib.rollout.env_runner import LLMEnvRunner
    from m2po_rllib.torch.logp import response_logp

    cfg = (
        tiny_config(tiny_model_dir, async_rollouts=True, max_staleness=3, recompute_behavior_logp=True)
        .env_runners(engine_kwargs={"dtype": engine_dtype}, top_p=0.9, top_k=20)
    )
    runner = LLMEnvRunner(config=cfg)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    base = {k: v.clone() for k, v in model.state_dict().items()}

    def sync(weights, version):
        runner.set_state({"rl_module": {"default_policy": {"weights": weights, "policy_version": version}}})

    def learner_logp(weights, batch):
        model.load_state_dict(weights)
        train = {k: torch.as_tensor(v) for k, v in to_train_batch(batch, batch["rewards"]).items()}
        with torch.no_grad():
            return response_logp(model, train, 1.0, top_k=20, top_p=0.9)[0].numpy()

    try:
        for version, shift in ((2, 0.01), (3, -0.02)):  # before the engine starts, then in place
            weights = {k: v + shift for k, v in base.items()}
            sync(weights, version)
            batch = runner.sample(num_prompts=3, seed=version)
            mask = batch["response_mask"] > 0
            assert set(batch["policy_version"]) == {version}
            expected = learner_logp(weights, batch)
            assert np.abs(batch["behavior_logp"] - expected)[mask].max() < 1e-5
            engine_gap = np.abs(batch["engine_logp"] - expected)[mask].max()
            if engine_dtype == "bfloat16":
                assert engine_gap > 1e-3  # the engine's numbers are not the learner's
            else:
                assert engine_gap < 1e-4 and not runner.host.scorer.owns_model  # the engine's model is shared
    finally:
        runner.stop()


def test_prompts_are_tokenized_once_by_the_env_with_its_special_tokens(tiny_model_dir, tmp_path):
    """One place tokenizes a prompt: the text env, bound to the policy's tokenizer. With a
    tokenizer that adds a BOS to plain text (as Llama's does, and vLLM does to a text
    prompt), sampled and evaluated prompts both carry it, and equal the env's ids."""
    import shutil

    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    from m2po_rllib.rollout.env_runner import LLMEnvRunner, make_text_env

    model_dir = tmp_path / "with-bos"
    shutil.copytree(tiny_model_dir, model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok._tokenizer.post_processor = TemplateProcessing(
        single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, tok.bos_token_id)]
    )
    tok.save_pretrained(model_dir)
    cfg = tiny_config(str(model_dir)).environment("m2po/Arithmetic-v0", env_config={"digits": 2, "template": "compact"})
    runner = LLMEnvRunner(config=cfg)
    try:
        batch = runner.sample(num_prompts=3, seed=5)
        env = make_text_env(cfg.env, cfg.env_config, tokenizer=AutoTokenizer.from_pretrained(model_dir))
        for ids, mask in zip(batch["prompt_ids"], batch["prompt_mask"]):
            ids = ids[mask > 0].tolist()
            assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
            text = tok.decode(ids, skip_special_tokens=True)
            assert env.unwrapped.tokenizer(text)["input_ids"] == ids  # the env's rule, BOS included
        # held-out prompts come from the same kind of env, bound to the same tokenizer
        obs, _ = runner._split_env("heldout").reset(options={"index": 0})
        assert obs["prompt_token_ids"][0] == tok.bos_token_id
    finally:
        runner.stop()


def test_runners_sharing_a_round_seed_draw_different_prompts(tiny_model_dir):
    from m2po_rllib.rollout.env_runner import LLMEnvRunner

    cfg = tiny_config(tiny_model_dir).environment("m2po/Arithmetic-v0", env_config={"digits": 3, "template": "compact"})
    prompts = []
    for worker_index in (1, 2):
        runner = LLMEnvRunner(config=cfg, worker_index=worker_index)
        try:
            batch = runner.sample(num_prompts=4, seed=7)
            again = runner.sample(num_prompts=4, seed=7)
            np.testing.assert_array_equal(batch["prompt_ids"], again["prompt_ids"])  # seeded
            prompts.append(batch["prompt_ids"])
        finally:
            runner.stop()
    assert prompts[0].shape != prompts[1].shape or not np.array_equal(prompts[0], prompts[1])


@pytest.mark.slow
def test_building_the_module_logs_no_rlmodule_config_deprecation(tiny_model_dir):
    """RLlib's own RLModule.__init__ builds the deprecated RLModuleConfig; building the
    policy (a MultiRLModule holding the HF module, as each learner does) must not log it."""
    import subprocess
    import sys

    code = (
        "import sys, gymnasium as gym\n"
        "from ray.rllib.core.rl_module.multi_rl_module import MultiRLModuleSpec\n"
        "from m2po_rllib import M2POConfig\n"
        "config = M2POConfig().rl_module(model_config={'model': sys.argv[1]})\n"
        "spec = config.get_default_rl_module_spec()\n"
        "spec.model_config = config.model_config  # the user's keys and the config's (temperature, ...)\n"
        "spec.observation_space = spec.action_space = gym.spaces.Discrete(2)\n"
        "module = MultiRLModuleSpec(rl_module_specs={'default_policy': spec}).build()\n"
        "print(type(module['default_policy']).__name__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, tiny_model_dir], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "HFCausalLMModule"
    assert "RLModuleConfig" not in out.stderr + out.stdout, out.stderr[-3000:]


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
