"""`m2po plan`: resources, parameter counts and the learner memory estimate of the paper configs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from m2po_rllib.jobs.cli import main
from m2po_rllib.jobs.plan import GiB, HEADROOM, estimate_learner_memory, model_shape, plan

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PAPER_CONFIGS = sorted(str(p) for p in CONFIGS.glob("paper_*.yaml"))
QWEN3, QWEN3_STALE0, QWEN25 = (
    str(CONFIGS / f"paper_{n}.yaml") for n in ("qwen3_1.7b_stale256", "qwen3_1.7b_stale0", "qwen2.5_math_7b_stale256")
)


@pytest.fixture(scope="module")
def plans():
    """The paper configs without micro-batching (the whole 64-sequence learner minibatch in
    one forward/backward), the case the estimate and the recommendations are checked on."""
    assert len(PAPER_CONFIGS) == 3, PAPER_CONFIGS
    return {path: plan(path, gpu_memory_gb=80, overrides=["training.micro_batch_size=64"]) for path in PAPER_CONFIGS}


def test_the_shipped_configs_fit_80_gb_as_written():
    for path in (QWEN3, QWEN3_STALE0):
        p = plan(path, gpu_memory_gb=80)
        assert p["sharding"] == "ddp" and p["micro_batch_size"] == 16 and p["fits"]["ddp"], path
    p = plan(QWEN25, gpu_memory_gb=80)  # 7B: no replica fits; sharded over the 8 learners it does
    assert p["sharding"] == "fsdp" and p["micro_batch_size"] == 8 and p["fits"]["fsdp"] and not p["fits"]["ddp"]
    assert recommend_text(p) == "fits as configured (FSDP over 8 learners, micro_batch_size=8)"
    as_ddp = plan(QWEN25, gpu_memory_gb=80, overrides=["training.learner_sharding=ddp"])
    assert "set training.learner_sharding=fsdp" in recommend_text(as_ddp)


def test_gpu_counts_of_the_paper_configs(plans):
    for path, p in plans.items():
        runners, learners = p["groups"]["EnvRunners"], p["groups"]["learners"]
        assert len(runners) == 8 and all(b["GPU"] == 1 for b in runners), path
        assert len(learners) == 8 and all(b["GPU"] == 1 for b in learners), path
        assert p["groups"]["main process"][0].get("GPU", 0) == 0
        assert sum(b.get("GPU", 0) for b in p["bundles"]) == 16


def test_parameter_counts_match_the_published_sizes(plans):
    qwen3 = plans[QWEN3]["model"]
    # Qwen3-1.7B: 28 layers, hidden 2048, MLP 6144, 16 q / 8 kv heads of 128, q/k norms, tied
    H, I, L, V, q, kv, hd = 2048, 6144, 28, 151936, 16 * 128, 8 * 128, 128
    layer = H * q + 2 * H * kv + q * H + 3 * H * I + 2 * H + 2 * hd
    assert qwen3.num_params == L * layer + V * H + H  # + final norm; the head is the embedding
    assert qwen3.tied and qwen3.embedding_params == V * H
    # model card: 1.7B parameters, 1.4B non-embedding (both rounded to 0.1B)
    assert round(qwen3.num_params / 1e9, 1) == 1.7
    assert abs(qwen3.num_params - qwen3.embedding_params - 1.4e9) / 1.4e9 < 0.01

    qwen25 = plans[QWEN25]["model"]
    # Qwen2.5-7B: 7.61B parameters, 6.53B non-embedding (model card)
    assert abs(qwen25.num_params - 7.61e9) / 7.61e9 < 0.01
    assert abs(qwen25.num_params - qwen25.embedding_params - 6.53e9) / 6.53e9 < 0.01
    assert not qwen25.tied and qwen25.embedding_params == 2 * 152064 * 3584


def test_memory_estimate_shards_states_and_scales_activations_with_tokens(plans):
    """What the estimate must get right whatever its constants: FSDP holds 1/learners of the
    fp32 states a DDP replica holds, activations grow linearly with the micro-batch while the
    states do not, and a 7B replica's states alone exceed an 80 GB GPU."""
    p = plans[QWEN25]
    shape = p["model"]
    P = shape.num_params
    states = ("weights (fp32 master)", "gradients (fp32)", "AdamW moments (fp32)")
    ddp, fsdp = p["memory"]["ddp"], p["memory"]["fsdp"]
    assert sum(ddp[k] for k in states) == 16 * P  # fp32 weights + gradients + two AdamW moments
    assert sum(fsdp[k] for k in states) == pytest.approx(16 * P / 8)  # sharded over 8 learners
    assert 16 * P > 80e9 and p["largest_micro_batch"]["ddp"] == 0 and not p["fits"]["ddp"]

    def estimate(micro):
        return estimate_learner_memory(shape, dtype_bytes=2, micro_batch_size=micro, seq_len=4096, chunk_size=256,
                                       gradient_checkpointing=True, num_learners=8)["fsdp"]

    one, two, four = estimate(8), estimate(16), estimate(32)
    act = "activations (one micro-batch)"
    assert two[act] == 2 * one[act] and four[act] == 4 * one[act]
    assert all(one[k] == four[k] for k in one if k != act)


def test_recommendations(plans):
    p7 = plans[QWEN25]  # FSDP, all 64 sequences in one micro-batch: too many
    best7 = p7["largest_micro_batch"]["fsdp"]
    assert not p7["fits"]["fsdp"] and 8 <= best7 < 64
    assert recommend_text(p7) == f"set training.micro_batch_size={best7} (or lower); FSDP then fits"
    p17 = plans[QWEN3]
    best = p17["largest_micro_batch"]["ddp"]
    assert not p17["fits"]["ddp"] and 1 <= best < 64 and 64 % best == 0
    assert f"micro_batch_size={best}" in recommend_text(p17)
    shape, limit = p17["model"], HEADROOM * 80 * GiB

    def ddp_total(micro):
        return sum(estimate_learner_memory(
            shape, dtype_bytes=2, micro_batch_size=micro, seq_len=5120, chunk_size=256,
            gradient_checkpointing=True, num_learners=8)["ddp"].values())

    assert ddp_total(best) <= limit < ddp_total(2 * best)  # the next divisor of 64 does not fit


def recommend_text(p):
    from m2po_rllib.jobs.plan import recommendation

    return recommendation(p)


def test_cli_prints_resources_size_and_fit(capsys):
    assert main(["plan", "--config", QWEN3_STALE0, "--gpu-memory-gb", "141"]) == 0
    out = capsys.readouterr().out
    assert "8 x {CPU: 1, GPU: 1}" in out  # EnvRunners
    assert "16 GPUs (8 EnvRunner GPUs + 8 learner GPUs)" in out
    assert "1.72 B parameters" in out
    assert "shipped copy" in out and "HF_HUB_OFFLINE" in out  # tests run offline (conftest)
    assert "Device 141 GiB" in out and "Recommendation:" in out


def test_local_model_directory_count_matches_the_loaded_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    shape = model_shape(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert tiny_model_dir in shape.source


def test_unknown_hub_model_is_a_clear_error():
    with pytest.raises(ValueError, match="no-such-org/no-such-model.*local model directory"):
        model_shape("no-such-org/no-such-model")


def test_the_builtin_job_plan_reads_as_its_size(capsys):
    """`m2po plan` on the main job: the 0.8M-parameter model is not "0.00 B", and its short
    sequences (bounded by the model's positions) raise no length warning."""
    config = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
    assert main(["plan", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"arith-tiny \(qwen2\): [1-9][\d.]* [KM] parameters", out), out
    assert "0.00 B" not in out and "exceed the model's max_position_embeddings" not in out


def test_plan_compares_the_actors_with_this_machine(capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert main(["plan", "--config", QWEN3_STALE0]) == 0  # 8 runners at 1 CPU (the learners take GPUs)
    out = capsys.readouterr().out
    assert "warning: the actors need 8 CPUs (the main process 1 more) and this machine has 2" in out
    assert "total: 9 CPUs (8 for the actors + 1 for the main process), 16 GPUs" in out
    config = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
    assert main(["plan", "--config", str(config)]) == 0  # one process: no actors
    assert "the actors need" not in capsys.readouterr().out


def test_plan_compares_the_gpus_with_the_node(capsys):
    """The GPUs a config asks for against `--gpus` (the node planned for), or by default this
    machine's real GPUs (none here)."""
    from m2po_rllib.driver.resources import visible_gpus

    assert main(["plan", "--config", QWEN3_STALE0, "--gpus", "8"]) == 0  # 8 runners + 8 learners
    out = capsys.readouterr().out
    assert ("warning: the config needs 16 GPUs and the node planned for (--gpus) has 8: Ray would never place it "
            "there. Lower num_gpus_per_env_runner / num_gpus_per_learner") in out
    assert main(["plan", "--config", QWEN3_STALE0, "--gpus", "16"]) == 0
    assert "GPUs: 16 needed, 16 on the node planned for (--gpus): enough" in capsys.readouterr().out
    assert main(["plan", "--config", QWEN3_STALE0]) == 0
    here = visible_gpus()
    assert f"the config needs 16 GPUs and this machine has {here}" in capsys.readouterr().out
    config = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
    assert main(["plan", "--config", str(config), "--gpus", "0"]) == 0  # CPU only
    assert "GPUs: 0 needed, 0 on the node planned for (--gpus): enough" in capsys.readouterr().out


def test_a_micro_batch_of_one_is_not_offered_lower():
    p = {"micro_batch_size": 4, "largest_micro_batch": {"ddp": 1, "fsdp": 1}, "num_learners": 1, "sharding": "ddp",
         "fits": {"ddp": False, "fsdp": False}, "gradient_checkpointing": True}
    assert recommend_text(p) == "set training.micro_batch_size=1; DDP then fits"
    p["largest_micro_batch"] = {"ddp": 2, "fsdp": 2}
    assert recommend_text(p) == "set training.micro_batch_size=2 (or lower); DDP then fits"


# -- configs sized for one GPU and one node of 8 ---------------------------------------------------
SIZED = {  # config: the GPUs it was sized for (its header says so)
    "qwen3_1.7b_1gpu_colocated": 1, "qwen3_1.7b_node8_async": 8, "qwen2.5_math_7b_node8": 8,
}


@pytest.mark.parametrize("name, gpus", SIZED.items())
def test_the_configs_sized_for_one_gpu_or_one_node_fit_it(name, gpus):
    path = str(CONFIGS / f"{name}.yaml")
    assert f"Sized for: ONE {'80 GB GPU' if gpus == 1 else 'NODE of 8 x 80 GB GPUs'}" in Path(path).read_text()
    p = plan(path, gpu_memory_gb=80, gpus=gpus)
    assert p["gpus_needed"] == gpus and p["fits"][p["sharding"]], path
    assert recommend_text(p).startswith("fits as configured"), recommend_text(p)
    assert (p["colocated"] is not None) == (gpus == 1) and (p["colocated"] is None or p["colocated"]["fits"])
    fewer = plan(path, gpu_memory_gb=80, gpus=gpus - 1)
    assert "Ray would never place it there" in format_text(fewer)


def format_text(p):
    from m2po_rllib.jobs.plan import format_plan

    return format_plan(p)


def test_the_colocated_gpu_holds_the_learner_states_beside_vllm_and_says_what_to_lower():
    path = str(CONFIGS / "qwen3_1.7b_1gpu_colocated.yaml")
    p = plan(path, gpu_memory_gb=80, gpus=1)
    c, shape = p["colocated"], p["model"]
    # rollouts: fp32 weights, gradients and AdamW moments (16 bytes a parameter) + vLLM's share
    assert c["learner_states"] == 16 * shape.num_params and c["engine"] == 0.5 * 80 * GiB
    assert c["rollouts"] == c["learner_states"] + c["engine"]
    assert c["updates"] == sum(p["memory"]["ddp"].values())  # vLLM asleep: the learner's peak alone
    # bf16 KV cache of Qwen3-1.7B: 2 (K, V) x 28 layers x 8 heads x 128 x 2 bytes a token
    assert c["kv_tokens"] == (c["engine"] - 2 * shape.num_params) / (2 * 28 * 8 * 128 * 2)
    assert c["max_utilization"] == pytest.approx((HEADROOM * 80 * GiB - c["learner_states"]) / (80 * GiB))
    text = format_text(p)
    assert "rollouts: learner states 25.6 + vLLM 0.5 x 80 = 40.0 GiB" in text and "(vLLM asleep): fits" in text
    # vLLM asking for more than the learner leaves: the arithmetic and the setting to lower
    greedy = plan(path, gpu_memory_gb=80, gpus=1, overrides=["env_runners.engine_kwargs.gpu_memory_utilization=0.8"])
    assert not greedy["colocated"]["fits"] and "-> 89.6 GiB: does not fit" in format_text(greedy)
    assert recommend_text(greedy) == (
        f"set env_runners.engine_kwargs.gpu_memory_utilization={c['max_utilization'] - 0.005:.2f} (or lower): "
        "the learner's states stay on the GPU while vLLM serves")
    # At micro-batch 1 the update (28.9 GiB) fits 32.6 GB (29.3 usable), but beside the states
    # (25.6) vLLM would have 3.7 GiB, less than its weights (3.2) and one sequence's KV cache
    # (0.56); at 33 GB (4.1 GiB left) it has room, at a utilization the plan names
    small = plan(path, gpu_memory_gb=32.6, gpus=1, overrides=["training.micro_batch_size=1"])
    assert small["fits"]["ddp"] and not small["colocated"]["fits"]
    assert recommend_text(small).startswith("the learner's states leave the engine no room")
    roomy = plan(path, gpu_memory_gb=33, gpus=1, overrides=["training.micro_batch_size=1"])
    most = (0.9 * 33 * GiB - roomy["colocated"]["learner_states"]) / (33 * GiB)
    assert recommend_text(roomy).startswith(f"set env_runners.engine_kwargs.gpu_memory_utilization={most - 0.005:.2f} ")
