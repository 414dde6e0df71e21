"""What each config asks Ray for, built without GPUs and without loading a model.

`M2PO.default_resource_request(config)` is the placement group a Tune trial (or `m2po
train` under a cluster's scheduler) reserves: one bundle for the driver, then one per
EnvRunner, then one per learner (RLlib's order). The paper configs put 8 vLLM runners and 8
learners on 16 separate GPUs: every GPU bundle holds exactly one GPU, so no two actors share
one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from m2po_rllib.config import M2POConfig
from m2po_rllib.config_io import load_spec
from m2po_rllib.m2po import M2PO

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PAPER_CONFIGS = sorted(p.stem for p in CONFIGS.glob("paper_*.yaml"))


def resource_request(name: str):
    spec = load_spec(str(CONFIGS / f"{name}.yaml"))
    spec.pop("run", None)
    config = M2POConfig.from_spec(spec)
    return config, M2PO.default_resource_request(config)


def test_there_are_paper_configs():
    assert len(PAPER_CONFIGS) == 3, PAPER_CONFIGS


@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_paper_config_places_8_runners_and_8_learners_on_separate_gpus(name):
    config, pgf = resource_request(name)
    bundles = pgf.bundles
    assert len(bundles) == 1 + 8 + 8
    driver, runners, learners = bundles[0], bundles[1:9], bundles[9:]

    # The driver runs the algorithm loop only: CPU, no GPU.
    assert driver == {"CPU": config.num_cpus_for_main_process}
    # Each vLLM EnvRunner: its own GPU and the CPUs the config gives it.
    assert runners == [{"CPU": float(config.num_cpus_per_env_runner), "GPU": 1.0}] * 8
    # Each learner: its own GPU (RLlib's "auto" CPUs are 0 next to a GPU).
    cpus = config.num_cpus_per_learner if config.num_cpus_per_learner != "auto" else 0
    expected_learner = {"GPU": 1.0, **({"CPU": float(cpus)} if cpus else {})}
    assert learners == [expected_learner] * 8

    assert sum(b.get("GPU", 0) for b in bundles) == 16
    assert all(b.get("GPU", 0) in (0, 1) for b in bundles)
    # Evaluation runs on the training runners: no extra bundles for it.
    assert config.evaluation_num_env_runners == 0
    assert pgf.strategy == config.placement_strategy


def test_default_config_is_one_process_with_both_laptop_cpus():
    _, pgf = resource_request("default")  # it samples and trains in the driver, 2 torch threads
    assert pgf.bundles == [{"CPU": 2.0}]
    assert pgf.required_resources == {"CPU": 2.0}


def test_gpu_counts_follow_the_config():
    """Changing the counts changes the request: 2 runners x 1 GPU, 4 learners x 0.5 GPU."""
    spec = load_spec(str(CONFIGS / "paper_qwen3_1.7b_stale256.yaml"))
    spec.pop("run", None)
    spec["env_runners"].update(num_env_runners=2, num_cpus_per_env_runner=4)
    spec["learners"].update(num_learners=4, num_gpus_per_learner=0.5, num_cpus_per_learner=2)
    pgf = M2PO.default_resource_request(M2POConfig.from_spec(spec))
    assert pgf.bundles[1:] == [{"CPU": 4.0, "GPU": 1.0}] * 2 + [{"CPU": 2.0, "GPU": 0.5}] * 4
    assert pgf.required_resources == {"CPU": 1.0 + 8 + 8, "GPU": 4.0}
