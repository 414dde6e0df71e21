"""`colocate=True`: the rollout engine beside the learner in one process (one GPU), asleep while
the learner updates. On this CPU machine neither engine has a sleep mode: the setting trains end
to end with the sleep step skipped and said once, and the synchronous protocol is unchanged."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from m2po_rllib.common import keys
from m2po_rllib.common.errors import ConfigError

from _configs import tiny_config

SKIPPED = "colocate: the rollout engine stays awake during the learner's updates"


@pytest.mark.parametrize(
    "change, needle, at_fault",
    [
        (lambda c: c.env_runners(num_env_runners=1, num_cpus_per_env_runner=0.5).training(
            staleness=0, async_rollouts=True, max_staleness=8),
         "`colocate=True` has the engine sleep while the learner updates on the same GPU", {"async_rollouts"}),
        (lambda c: c.env_runners(num_env_runners=1), "`num_env_runners` is 1 and `num_learners` 0: set both to 0",
         {"num_env_runners", "num_learners"}),
        (lambda c: c.learners(num_learners=1), "`num_env_runners` is 0 and `num_learners` 1", {"num_learners"}),
    ],
)
def test_colocate_is_one_process_and_synchronous(tiny_model_dir, change, needle, at_fault):
    config = change(tiny_config(tiny_model_dir).env_runners(colocate=True))
    with pytest.raises(ConfigError, match="Invalid M2POConfig") as err:
        config.validate()
    assert needle in str(err.value)
    assert at_fault <= set(err.value.settings) and "colocate" in err.value.settings
    tiny_config(tiny_model_dir).env_runners(colocate=True).validate()  # one process, sync: fine


def test_colocate_must_be_a_bool(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"`colocate` \('yes'\) must be true or false"):
        tiny_config(tiny_model_dir).env_runners(colocate="yes").validate()


def _run(config, iterations: int) -> list[dict]:
    algo = config.build_algo()
    try:
        return [algo.train() for _ in range(iterations)]
    finally:
        algo.stop()


@pytest.mark.slow
def test_colocated_stale_k_trains_exactly_as_the_plain_run(ray_session, tiny_model_dir, caplog):
    """HF engine: the same losses and versions as colocate=False (the sleep only frees memory),
    the sleep and wake timed around each update and only then, the skipped sleep said once."""
    plain = _run(tiny_config(tiny_model_dir, staleness=2), 4)
    with caplog.at_level(logging.WARNING):
        colocated = _run(tiny_config(tiny_model_dir, staleness=2).env_runners(colocate=True), 4)
    loss = lambda results: [r.get("learners", {}).get("default_policy", {}).get("policy/loss") for r in results]  # noqa: E731
    assert loss(colocated) == loss(plain) and loss(plain)[0] is None and None not in loss(plain)[1:]
    assert [r[keys.POLICY_VERSION] for r in colocated] == [r[keys.POLICY_VERSION] for r in plain] == [0, 2, 4, 6]
    # timed around the updates only: none while the queue fills (iteration 1)
    assert [keys.ENGINE_SLEEP_S in r and keys.ENGINE_WAKE_S in r for r in colocated] == [False, True, True, True]
    assert not any(keys.ENGINE_SLEEP_S in r for r in plain)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(SKIPPED)]
    assert said == [f"{SKIPPED} (the HF engine has no sleep mode; rollout_engine='vllm' on a GPU has one); "
                    "the sleep step is skipped"]


@pytest.mark.slow
def test_colocated_vllm_on_cpu_trains_with_the_sleep_step_skipped(ray_session, tiny_model_dir, caplog):
    """vLLM in the learner's process, built with its sleep mode asked for: on CPU vLLM has none,
    so training runs end to end awake, and the log says why once. (With the LM head in fp32 on
    both sides, `model_config["head_dtype"]`: vLLM's own config carries it.)"""
    pytest.importorskip("vllm")
    import torch

    config = tiny_config(tiny_model_dir, staleness=2).env_runners(
        colocate=True, rollout_engine="vllm", engine_kwargs={"kv_cache_space_gb": 1, "max_model_len": 64}
    ).rl_module(model_config={"model": tiny_model_dir, "head_dtype": "float32"})
    with caplog.at_level(logging.WARNING):
        algo = config.build_algo()
        try:
            results = [algo.train() for _ in range(3)]
            assert algo.env_runner.engine.llm.llm_engine.model_config.head_dtype == torch.float32
            assert algo.get_module().head_dtype == torch.float32
        finally:
            algo.stop()
    assert [r[keys.POLICY_VERSION] for r in results] == [0, 2, 4]
    assert np.isfinite(results[-1]["learners"]["default_policy"]["policy/loss"])
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(SKIPPED)]
    assert said == [f"{SKIPPED} (vLLM has no sleep mode on cpu (CUDA, ROCm and XPU have one)); the sleep step is skipped"]
