"""Generation throughput of HFEngine vs VLLMEngine on the tiny model, the wrapper's overhead
over a raw `LLM.generate`, and weight-sync time. Prints a table and writes
bench/results/engines.json.

    python bench/bench_engines.py [--prompts 64 --n 8 --max-tokens 16 --repeats 3]

Tokens/s counts generated tokens (a sample may end early on EOS).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULTS = Path(__file__).parent / "results" / "engines.json"


def timed(fn, repeats):
    """(median seconds, last result) over `repeats` calls."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def count_tokens(groups) -> int:
    return sum(len(c.token_ids) for g in groups for c in g)


def bench_engine(engine, prompts, sampling, other_weights, repeats) -> dict:
    engine.generate(prompts[:2], sampling)  # warm-up
    seconds, groups = timed(lambda: engine.generate(prompts, sampling), repeats)
    tokens = count_tokens(groups)
    version = engine.version
    sync_times = []
    for _ in range(repeats):
        version += 1
        start = time.perf_counter()
        engine.update_weights(other_weights, version)
        sync_times.append(time.perf_counter() - start)
    return {
        "generate_s": seconds,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "sync_s": statistics.median(sync_times),
    }


def bench_vllm_overhead(engine, prompts, sampling, repeats) -> dict:
    """Raw `LLM.generate` with the same requests `VLLMEngine.generate` makes, and the wrapper's
    own work (building SamplingParams, converting outputs) timed alone: end-to-end differences
    drown in the run-to-run noise of a shared CPU."""
    from m2po_rllib.rollout.vllm_outputs import completions

    requests = [{"prompt_token_ids": p} for p in prompts]

    def build_params():
        return [engine._sampling_params(sampling, sampling.request_seed(i, 0)) for i in range(len(prompts))]

    def run_raw():
        return engine.llm.generate(requests, build_params(), use_tqdm=False)

    raw_times, wrapped_times = [], []
    for i in range(2 * repeats):  # interleaved in alternating order: load and position hit both
        for which in ((0, 1), (1, 0))[i % 2]:
            start = time.perf_counter()
            if which == 0:
                raw = run_raw()
            else:
                engine.generate(prompts, sampling)
            (raw_times, wrapped_times)[which].append(time.perf_counter() - start)
    params_s, _ = timed(build_params, repeats)
    convert_s, _ = timed(lambda: [completions(out, sampling.n) for out in raw], repeats)
    tokens = sum(len(c.token_ids) for out in raw for c in out.outputs)
    raw_s = statistics.median(raw_times)
    return {
        "raw_generate_s": raw_s,
        "raw_tokens_per_s": tokens / raw_s,
        "wrapper_generate_s": statistics.median(wrapped_times),
        "wrapper_params_s": params_s,
        "wrapper_convert_s": convert_s,
        "wrapper_overhead_frac": (params_s + convert_s) / raw_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--torch-threads", type=int, default=1,
        help="torch threads of this process (HFEngine); 0 keeps torch's default",
    )
    parser.add_argument("--skip-vllm", action="store_true")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from m2po_rllib.models.tiny import build_tiny_model
    from m2po_rllib.rollout.engine import SamplingConfig, make_engine

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    model_dir = build_tiny_model(tmp / "seed0", seed=0)
    other = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp / "seed1", seed=1))
    other_weights = other.state_dict()
    sampling = SamplingConfig(n=args.n, max_tokens=args.max_tokens, temperature=1.0, seed=0)

    results = {
        "workload": {"prompts": args.prompts, "n": args.n, "max_tokens": args.max_tokens},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "torch_threads": torch.get_num_threads(),
        "num_params": sum(p.numel() for p in other.parameters()),
    }

    start = time.perf_counter()
    hf = make_engine("hf", model_dir)
    results["hf"] = {"startup_s": time.perf_counter() - start}
    prompts = [hf.tokenizer.encode(f"{i}+{i % 7}=") for i in range(args.prompts)]
    results["hf"].update(bench_engine(hf, prompts, sampling, other_weights, args.repeats))
    hf.shutdown()

    if not args.skip_vllm:
        vllm = make_engine("vllm", model_dir)
        results["vllm"] = {"startup_s": vllm.startup_seconds}
        results["vllm"].update(bench_engine(vllm, prompts, sampling, other_weights, args.repeats))
        results["vllm"]["sync_bytes"] = vllm.last_sync_stats["bytes"]
        results["vllm"].update(bench_vllm_overhead(vllm, prompts, sampling, args.repeats))
        vllm.shutdown()

    print(f"workload: {args.prompts} prompts x {args.n} samples x {args.max_tokens} tokens, "
          f"{results['num_params'] / 1e6:.2f}M params, {results['torch_threads']} torch threads")
    for kind in ("hf", "vllm"):
        if kind in results:
            r = results[kind]
            print(f"{kind:5s} start {r['startup_s']:6.1f} s | generate {r['generate_s']:6.3f} s "
                  f"= {r['tokens_per_s']:8.0f} tok/s | sync {r['sync_s'] * 1e3:6.1f} ms")
    if "vllm" in results:
        r = results["vllm"]
        print(f"vllm raw LLM.generate {r['raw_generate_s']:.3f} s = {r['raw_tokens_per_s']:.0f} tok/s "
              f"(wrapper end to end {r['wrapper_generate_s']:.3f} s); wrapper's own work: params "
              f"{r['wrapper_params_s'] * 1e3:.1f} ms + outputs {r['wrapper_convert_s'] * 1e3:.1f} ms "
              f"= {r['wrapper_overhead_frac']:.1%} of raw")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
