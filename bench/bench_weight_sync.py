"""Seconds and bytes per weight sync into a vLLM engine on CPU, through the object-store
path (safetensors chunks over `collective_rpc`, what training uses today) and vLLM's native
weight-transfer API over gloo (`NativeWeightSender`, rank 0 in this process, the vLLM worker
receiving in its own), for the built-in model (0.8M parameters) and a 150M-parameter
stand-in (random weights, Qwen2 layout), and the native path's `only_changed` rounds (nothing
changed, one decoder layer changed, every weight moved). Prints a table and writes
bench/results/weight_sync.json.

    python bench/bench_weight_sync.py [--repeats 3] [--skip-150m]

The object-store figure starts from tensors already in the runner's process (the Ray
object-store hop before it is not included); the native figure is the whole broadcast from
the learner's tensors. Run with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from m2po_rllib.common.net import free_port

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULTS = Path(__file__).parent / "results" / "weight_sync.json"
STANDIN_150M = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                    num_key_value_heads=8)


def bench_model(name: str, model_dir: str, repeats: int, bucket_bytes: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from m2po_rllib.rollout.engine import make_engine
    from m2po_rllib.sync.sender import EngineTarget, NativeWeightSender, RunnerGroupClient

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    engine = make_engine("vllm", model_dir, kv_cache_space_gb=1, weight_transport="gloo")
    try:
        version = engine.version
        store_s = []
        for _ in range(repeats):
            version += 1
            start = time.perf_counter()
            engine.update_weights(model.state_dict(), version)
            store_s.append(time.perf_counter() - start)
        store_bytes = engine.last_sync_stats["bytes"]

        sender = NativeWeightSender(RunnerGroupClient([EngineTarget(engine)]), model.state_dict, engine.dtype,
                                    backend="gloo", master_address="127.0.0.1", master_port=free_port(),
                                    bucket_bytes=bucket_bytes)
        start = time.perf_counter()
        sender.connect()
        connect_s = time.perf_counter() - start
        native_s = []
        try:
            for _ in range(repeats):
                version += 1
                start = time.perf_counter()
                sender.send(version)
                native_s.append(time.perf_counter() - start)
            native_bytes = engine.last_sync_stats["bytes"]
        finally:
            sender.close()
        delta = bench_delta(engine, model, version, bucket_bytes)
    finally:
        engine.shutdown()
    return {
        "model": name, "params": params,
        "object_store": {"seconds": statistics.median(store_s), "bytes": store_bytes, "all_s": store_s},
        "gloo_native": {"seconds": statistics.median(native_s), "bytes": native_bytes, "connect_s": connect_s,
                        "bucket_bytes": bucket_bytes, "all_s": native_s},
        "gloo_only_changed": delta,
    }


def bench_delta(engine, model, version: int, bucket_bytes: int) -> dict:
    """`only_changed` rounds after a whole one: nothing changed, one decoder layer changed
    (a frozen trunk, or a layer-wise schedule), and every weight moved by a small step (a
    full fine-tuning update: the comparison is paid and everything is sent anyway)."""
    import torch

    from m2po_rllib.sync.sender import EngineTarget, NativeWeightSender, RunnerGroupClient

    sender = NativeWeightSender(RunnerGroupClient([EngineTarget(engine)]), model.state_dict, engine.dtype,
                                backend="gloo", master_address="127.0.0.1", master_port=free_port(),
                                bucket_bytes=bucket_bytes, only_changed=True)
    out = {}
    try:
        sender.connect()
        version += 1
        sender.send(version)  # the reference round (whole)

        def timed(label):
            nonlocal version
            version += 1
            start = time.perf_counter()
            sender.send(version)
            out[label] = {"seconds": time.perf_counter() - start, "bytes": engine.last_sync_stats["bytes"],
                          "tensors": engine.last_sync_stats["tensors"]}

        timed("unchanged")
        with torch.no_grad():
            model.model.layers[-1].mlp.down_proj.weight.mul_(1.001)
        timed("one_layer")
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.001)
        timed("all")
    finally:
        sender.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-bytes", type=int, default=64 * 2**20)
    parser.add_argument("--skip-150m", action="store_true")
    args = parser.parse_args()

    import torch

    from m2po_rllib.models.builtin import resolve_model_path
    from m2po_rllib.models.tiny import build_tiny_model

    torch.set_num_threads(1)
    models = [("builtin:arith-tiny", resolve_model_path("builtin:arith-tiny"))]
    tmp = tempfile.mkdtemp(prefix="bench-sync-")
    try:
        if not args.skip_150m:
            models.append(("150M stand-in", build_tiny_model(Path(tmp) / "standin-150m", seed=0, **STANDIN_150M)))
        results = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "repeats": args.repeats,
                   "models": [bench_model(name, path, args.repeats, args.bucket_bytes) for name, path in models]}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{'model':20s} {'params':>8s} | {'object store':>22s} | {'native (gloo)':>22s} | connect")
    for r in results["models"]:
        s, n = r["object_store"], r["gloo_native"]
        print(f"{r['model']:20s} {r['params'] / 1e6:7.1f}M | {s['seconds']:7.3f} s {s['bytes'] / 1e6:9.1f} MB | "
              f"{n['seconds']:7.3f} s {n['bytes'] / 1e6:9.1f} MB | {n['connect_s']:.2f} s")
    print(f"{'only_changed':20s} {'':8s} | {'unchanged':>22s} | {'one layer':>22s} | {'all moved':>22s}")
    for r in results["models"]:
        d = r["gloo_only_changed"]
        print(f"{r['model']:20s} {'':8s} | " + " | ".join(
            f"{d[k]['seconds']:7.3f} s {d[k]['bytes'] / 1e6:9.1f} MB" for k in ("unchanged", "one_layer", "all")))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
