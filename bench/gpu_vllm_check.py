"""First GPU check of the rollout side: vLLM on a random Qwen2-0.5B-shaped model (built here,
no hub), generation tokens/s, and weight-sync seconds by each path.

    python bench/gpu_vllm_check.py --out bench/results/gpu/vllm.json
    python bench/gpu_vllm_check.py --dry-run --out /tmp/vllm.json   # CPU: a tiny model, object store only

Sync paths timed (each a full model, the served dtype, 3 repeats, median):
- object_store: learner tensors copied to host (what `get_state` does) + `VLLMEngine.update_weights`
  (safetensors chunks through `collective_rpc`); the Ray object-store hop is not included.
- nccl (2+ GPUs: learner on cuda:1, vLLM on cuda:0): `NativeWeightSender` (backend nccl) -> `RunnerGroupClient`
  -> `VLLMEngine` (the package's NCCL path). With one GPU it is skipped: NCCL refuses two
  ranks on one device.
- ipc (1 GPU): vLLM's CUDA-IPC backend for a learner on vLLM's own GPU, driven through the
  same start/update/finish RPCs (what a colocated learner could use; not wired into runs).
After each path's first sync the greedy outputs are compared with the object-store ones.
The JSON is rewritten after every stage, so a run cut short still reports what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, seed=0)
    requests = [{"prompt_token_ids": p} for p in prompts]
    engine.llm.generate(requests[:4], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = engine.llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"prompts": len(prompts), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def timed_syncs(sync, states, start_version, repeats=3):
    """Runs `sync(state, version)` alternating the two weight sets; median seconds."""
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        sync(states[i % 2], start_version + i)
        times.append(time.perf_counter() - t0)
    return {"seconds": times, "median_s": statistics.median(times)}


class EngineClient:
    """vLLM's weight-sync client protocol straight onto one local VLLMEngine (the ipc path)."""

    def __init__(self, engine):
        self.engine = engine

    def init_weight_transfer_engine(self, init_info):
        self.engine.rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def start_weight_update(self):
        self.engine.rpc("start_weight_update")

    def update_weights(self, update_info):
        from vllm.distributed.weight_transfer.clients import _json_safe_update_payload

        # IPC handles pickled to a string, as vLLM's HTTP client does (needs
        # VLLM_ALLOW_INSECURE_SERIALIZATION=1 in the engine, set before it starts).
        self.engine.rpc("update_weights", kwargs={"update_info": _json_safe_update_payload(update_info)})

    def finish_weight_update(self, weight_version=None):
        self.engine.rpc("finish_weight_update")
        self.engine.llm.reset_prefix_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/gpu/vllm.json")
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny model, object-store path only")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (faster start)")
    args = p.parse_args()

    import torch

    from m2po_rllib.rollout.vllm_engine import VLLMEngine
    from m2po_rllib.rollout.weight_transfer import (
        EngineTarget, NativeWeightSender, RunnerGroupClient, StateDictSource,
    )  # fmt: skip

    report = Report(Path(args.out))
    cuda = torch.cuda.is_available() and not args.dry_run
    gpus = torch.cuda.device_count() if cuda else 0
    if not cuda and not args.dry_run:
        report.set("error", "no CUDA device; run with --dry-run on CPU")
        return 2
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = QWEN2_05B if cuda else TINY
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

    gpu_path = "nccl" if gpus > 1 else ("ipc" if cuda else None)
    llm_kwargs = {}
    if gpu_path == "ipc":
        llm_kwargs["weight_transfer_config"] = {"backend": "ipc"}
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    engine = VLLMEngine(
        str(tmp / "a"), dtype="bfloat16" if cuda else "float32", max_model_len=min(1024, shapes["max_position_embeddings"]),
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=True if args.enforce_eager else None,
        weight_transport="auto" if gpu_path == "nccl" else "object_store", **llm_kwargs,
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

    if gpu_path is None:
        sync["gpu_path"] = {"skipped": "no CUDA (dry run)"}
    else:
        try:
            torch.cuda.set_device(torch.device(trainer_device))
            if gpu_path == "nccl":
                client = RunnerGroupClient([EngineTarget(engine)])
                holder = {"state": states[0]}
                sender = NativeWeightSender(client, lambda: holder["state"], dtype, backend="nccl",
                                          master_address="127.0.0.1", master_port=free_port())  # fmt: skip
                t0 = time.perf_counter()
                sender.connect()
                connect_s = time.perf_counter() - t0

                def gpu_sync(state, version):
                    holder["state"] = state
                    sender.send(version)
            else:
                from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
                from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

                holder = {"state": states[0]}
                source = StateDictSource(lambda: holder["state"], dtype)
                t0 = time.perf_counter()
                trainer = WeightTransferTrainerFactory.trainer_init(
                    IPCTrainerInitInfo(rank=0), client=EngineClient(engine), source=source
                )
                connect_s = time.perf_counter() - t0

                def gpu_sync(state, version):
                    holder["state"] = state
                    trainer.send_weights()

            gpu_sync(states[0], 20)
            agree[f"{gpu_path}_matches_object_store"] = greedy_tokens(engine, probe, 16) == object_store_b
            sync[gpu_path] = {"connect_s": connect_s, **timed_syncs(gpu_sync, states, 21)}
            gpu_sync(states[1], 30)
            agree[f"{gpu_path}_round_trip_restores_output"] = greedy_tokens(engine, probe, 16) == before
        except Exception as e:  # a figure, not a test: record what failed and keep the rest
            sync[gpu_path] = {"error": f"{type(e).__name__}: {e}"}
        if gpus < 2:
            sync["nccl"] = {"skipped": f"{gpus} GPU: NCCL refuses two ranks on one device"}
    report.set("sync", sync)
    report.set("agree", agree)
    engine.shutdown()
    print(f"[gpu_vllm_check] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
