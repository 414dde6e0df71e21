"""M2POConfig's checks and its YAML form: every bad value one clear error naming the setting,
the value and the fix, before anything starts (no Ray needed)."""

from __future__ import annotations

import pytest
import torch

from m2po_rllib import M2POConfig
from m2po_rllib.common.errors import ConfigError

from _configs import tiny_config


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


@pytest.mark.parametrize(
    "runners, needle, at_fault",
    [
        (dict(engine_kwargs={"core": "thread"}), "engine_kwargs core ('thread') must be one of ('process', 'inline', "
         "'auto')", {"engine_kwargs"}),
        (dict(engine_kwargs={"core": "inline"}, num_env_runners=0), "engine_kwargs core='inline' runs vLLM's worker "
         "inline, in the algorithm's own process (num_env_runners is 0)", {"engine_kwargs", "num_env_runners"}),
        (dict(engine_kwargs={"core": "auto"}, num_env_runners=0), "set core='process', or num_env_runners >= 1",
         {"engine_kwargs", "num_env_runners"}),
    ],
)
def test_validate_engine_core(tiny_model_dir, runners, needle, at_fault):
    """Where vLLM's engine core runs: one of its values, inline only in a runner's own process."""
    cfg = tiny_config(tiny_model_dir).env_runners(**{"num_env_runners": 1, "rollout_engine": "vllm", **runners})
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert needle in str(err.value)
    assert set(err.value.settings) == at_fault


@pytest.mark.parametrize("core, runners", [("process", 0), ("inline", 1), ("auto", 1)])
def test_the_engine_core_may_run_inline_in_a_runner_of_its_own(tiny_model_dir, core, runners):
    cfg = tiny_config(tiny_model_dir).env_runners(num_env_runners=runners, rollout_engine="vllm",
                                                  engine_kwargs={"core": core})
    cfg.validate()


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
