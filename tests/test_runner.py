"""The LLM EnvRunner on its own (no Ray): weight syncs by version, the async scorer's numerics,
prompts tokenized once by the env, seeds per runner, and the policy module it builds."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from m2po_rllib.wire.batch import to_train_batch

from _configs import tiny_config


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
