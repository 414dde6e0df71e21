"""`m2po plan`: resources, parameter counts and the learner memory estimate of the paper configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from m2po_rllib.cli import main
from m2po_rllib.plan import GiB, HEADROOM, estimate_learner_memory, model_shape, plan

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


def test_memory_estimate_equals_the_hand_computation(plans):
    p = plans[QWEN25]
    # bf16 compute (b = 2) on float32 master weights, gradients and moments; 64 sequences
    # per learner in one micro-batch, 1024 + 3072 tokens, gradient checkpointing, chunk 256,
    # 8 learners
    b, P, T = 2, 7_615_616_512, 64 * 4096
    H, I, kv, V, L = 3584, 18944, 4 * 128, 152064, 28
    layer_params = (H * H + H) + 2 * (H * kv + kv) + H * H + 3 * H * I + 2 * H  # q, k, v (biases), o, MLP, norms
    per_layer_activations = b * (6 * H + 2 * kv + 4 * I) + 8 * H
    activations = T * (L * b * H + per_layer_activations) + T * H * (4 + 3 * b)
    logp = 3 * 256 * V * 4 + 4 * V * H + b * V * H
    ddp = 4 * P + 4 * P + 8 * P + 4 * P + activations + logp
    fsdp = (4 * P + 4 * P + 8 * P) / 8 + 2 * b * (2 * layer_params + 2 * V * H) + activations + logp
    assert sum(p["memory"]["ddp"].values()) == ddp
    assert sum(p["memory"]["fsdp"].values()) == pytest.approx(fsdp, rel=1e-12)
    # 7B fp32 weights + grads + AdamW moments alone are > 80 GB: no full replica fits
    assert (4 * P + 4 * P + 8 * P) > 80e9
    assert p["largest_micro_batch"]["ddp"] == 0 and not p["fits"]["ddp"]


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
    from m2po_rllib.plan import recommendation

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
