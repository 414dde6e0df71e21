"""GPU check of the rollout side: vLLM on a random Qwen2.5-1.5B-shaped model (built here, no
hub; `--model 0.5b` for Qwen2-0.5B's shapes), generation tokens/s through the runner's engine
(`VLLMEngine.generate`) against raw `LLM.generate`, and weight-sync seconds by each path.

    python bench/gpu_vllm_check.py --out bench/results/gpu/vllm.json
    python bench/gpu_vllm_check.py --dry-run --out /tmp/vllm.json   # CPU: a tiny model, object store only

Sync paths timed (each a full model, the served dtype, 3 repeats, median):
- object_store: learner tensors copied to host (what `get_state` does) + `VLLMEngine.update_weights`
  (safetensors chunks through `collective_rpc`); the Ray object-store hop is not included.
- native, the path `weight_sync="native"` trains with: `NativeWeightSender` -> `RunnerGroupClient`
  -> `VLLMEngine`; backend nccl with 2+ GPUs (learner on cuda:1, vLLM on cuda:0), gloo with
  one (NCCL refuses two ranks on one device; what `weight_sync_backend="auto"` picks for a
  learner sharing vLLM's GPU) and on CPU (--dry-run). Timed whole, and as a delta round
  (`only_changed`) after a change to one decoder layer.
After each path's first sync the greedy outputs are compared with the object-store ones.
The JSON is rewritten after every stage, so a run cut short still reports what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Qwen2.5-1.5B's shapes (1.54B parameters, tied embeddings).
QWEN25_15B = dict(
    vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
    num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096,
    tie_word_embeddings=True, rope_theta=1_000_000.0,
)  # fmt: skip
# Qwen2-0.5B's shapes (494M parameters, tied embeddings).
QWEN2_05B = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
    tie_word_embeddings=True, rope_theta=1_000_000.0,
)  # fmt: skip
TINY = dict(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip


def build_model(path: Path, shapes: dict, seed: int, device: str, dtype):
    """A random Qwen2 with `shapes`, saved with the project's char tokenizer; returns the
    in-memory model too (the 'learner' copy)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from m2po_rllib.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(**{**shapes, "vocab_size": max(shapes["vocab_size"], len(tokenizer))})
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model


class Report:
    def __init__(self, path: Path):
        self.path, self.data = path, {}
        path.parent.mkdir(parents=True, exist_ok=True)

    def set(self, key, value):
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        print(f"[gpu_vllm_check] {key}: {json.dumps(value, default=str)}", flush=True)


def greedy_tokens(engine, prompts, max_tokens):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False)
    outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def bench_generate(engine, prompts, max_tokens):
    """Raw `LLM.generate` and the runner's `VLLMEngine.generate` (token ids, per-token
    behaviour log-probs, processed_logprobs) on the same requests."""
    from vllm import SamplingParams

    from m2po_rllib.rollout.engine import SamplingConfig

    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, detokenize=False, seed=0)
    requests = [{"prompt_token_ids": p} for p in prompts]
    engine.llm.generate(requests[:4], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = engine.llm.generate(requests, params, use_tqdm=False)
    raw_s = time.perf_counter() - t0
    raw_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    sampling = SamplingConfig(n=1, temperature=1.0, max_tokens=max_tokens, seed=0)
    engine.generate(prompts[:4], sampling)  # warm-up (the log-prob path)
    t0 = time.perf_counter()
    groups = engine.generate(prompts, sampling)
    runner_s = time.perf_counter() - t0
    runner_tokens = sum(len(g[0].token_ids) for g in groups)
    return {"prompts": len(prompts), "raw_tokens": raw_tokens, "raw_s": raw_s, "raw_tokens_per_s": raw_tokens / raw_s,
            "runner_tokens": runner_tokens, "runner_s": runner_s, "runner_tokens_per_s": runner_tokens / runner_s,
            "runner_vs_raw": (runner_tokens / runner_s) / (raw_tokens / raw_s)}


def timed_syncs(sync, states, start_version, repeats=3):
    """Runs `sync(state, version)` alternating the two weight sets; median seconds."""
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        sync(states[i % 2], start_version + i)
        times.append(time.perf_counter() - t0)
    return {"seconds": times, "median_s": statistics.median(times)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/gpu/vllm.json")
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny model, object store and gloo")
    p.add_argument("--model", choices=("1.5b", "0.5b"), default="1.5b", help="the random model's shapes (GPU)")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (faster start)")
    args = p.parse_args()

    import torch

    from m2po_rllib.common.net import free_port
    from m2po_rllib.rollout.vllm_engine import VLLMEngine
    from m2po_rllib.sync.sender import EngineTarget, NativeWeightSender, RunnerGroupClient

    report = Report(Path(args.out))
    cuda = torch.cuda.is_available() and not args.dry_run
    gpus = torch.cuda.device_count() if cuda else 0
    if not cuda and not args.dry_run:
        report.set("error", "no CUDA device; run with --dry-run on CPU")
        return 2
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = (QWEN25_15B if args.model == "1.5b" else QWEN2_05B) if cuda else TINY
    if args.dry_run:
        torch.set_num_threads(1)
        args.prompts, args.max_tokens = min(args.prompts, 8), min(args.max_tokens, 8)
    trainer_device = f"cuda:{1 if gpus > 1 else 0}" if cuda else "cpu"
    report.set("machine", {
        "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)], "torch": torch.__version__,
        "vllm": __import__("vllm").__version__, "trainer_device": trainer_device,
    })  # fmt: skip

    tmp = Path(tempfile.mkdtemp(prefix="gpu-vllm-check-"))
    t0 = time.perf_counter()
    learner_a = build_model(tmp / "a", shapes, 0, trainer_device, dtype)
    learner_b = build_model(tmp / "b", shapes, 1, trainer_device, dtype)
    states = [learner_b.state_dict(), learner_a.state_dict()]  # sync b first: the policy changes
    report.set("model", {"params": sum(p.numel() for p in learner_a.parameters()), "dtype": str(dtype),
                         "build_s": time.perf_counter() - t0})  # fmt: skip

    native = "nccl" if gpus > 1 else "gloo"
    engine = VLLMEngine(
        str(tmp / "a"), dtype="bfloat16" if cuda else "float32", max_model_len=min(1024, shapes["max_position_embeddings"]),
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=True if args.enforce_eager else None, weight_transport=native,
    )  # fmt: skip
    report.set("vllm_start_s", engine.startup_seconds)
    prompts = [[(7 * i + j) % 90 + 4 for j in range(32)] for i in range(args.prompts)]
    report.set("generate", bench_generate(engine, prompts, args.max_tokens))
    probe = prompts[:8]
    before = greedy_tokens(engine, probe, 16)

    def object_store_sync(state, version):
        host = {k: v.detach().to("cpu") for k, v in state.items()}  # the learner's get_state copy
        engine.update_weights(host, version)

    sync = {"object_store": timed_syncs(object_store_sync, states, 1)}
    sync["object_store"]["bytes"] = engine.last_sync_stats["bytes"]
    object_store_sync(states[0], 10)
    object_store_b = greedy_tokens(engine, probe, 16)
    agree = {"weights_change_output": object_store_b != before}
    report.set("sync", sync)

    try:
        if cuda:
            torch.cuda.set_device(torch.device(trainer_device))
        holder = {"state": states[0]}
        client = RunnerGroupClient([EngineTarget(engine)])
        sender = NativeWeightSender(client, lambda: holder["state"], dtype, backend=native,
                                    master_address="127.0.0.1", master_port=free_port())  # fmt: skip
        t0 = time.perf_counter()
        sender.connect()
        connect_s = time.perf_counter() - t0

        def native_sync(state, version):
            holder["state"] = state
            sender.send(version)

        native_sync(states[0], 20)
        agree[f"{native}_matches_object_store"] = greedy_tokens(engine, probe, 16) == object_store_b
        sync[native] = {"connect_s": connect_s, **timed_syncs(native_sync, states, 21),
                        "bytes": client.last_update["bytes"]}
        native_sync(states[1], 30)
        agree[f"{native}_round_trip_restores_output"] = greedy_tokens(engine, probe, 16) == before
        sender.close()
        # a delta round: one decoder layer changed since the last sync
        delta = NativeWeightSender(client, lambda: holder["state"], dtype, backend=native, only_changed=True,
                                   master_address="127.0.0.1", master_port=free_port())  # fmt: skip
        delta.connect()
        delta.send(40)  # whole: the reference
        changed = dict(states[1])
        layer = next(n for n in changed if ".layers.0." in n and n.endswith("weight"))
        changed[layer] = changed[layer] + 1
        holder["state"] = changed
        t0 = time.perf_counter()
        delta.send(41)
        sync[f"{native}_delta_one_layer"] = {"seconds": time.perf_counter() - t0, "bytes": client.last_update["bytes"]}
        delta.close()
    except Exception as e:  # a figure, not a test: record what failed and keep the rest
        sync[native] = {"error": f"{type(e).__name__}: {e}"}
    if gpus == 1:
        sync["nccl"] = {"skipped": "1 GPU: NCCL refuses two ranks on one device (gloo measured instead)"}
    report.set("sync", sync)
    report.set("agree", agree)
    engine.shutdown()
    print(f"[gpu_vllm_check] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
