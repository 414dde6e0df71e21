"""The tiny algorithm config the tests share: the HF engine in the driver, the test env whose
reward a random tiny model earns (`_test_envs`), 4 prompts x 4 samples a step."""

from __future__ import annotations

import _test_envs
from m2po_rllib import M2POConfig


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
