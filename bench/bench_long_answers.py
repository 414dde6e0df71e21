"""Generation for reasoning-length answers on CPU: the runner's engine (`HFEngine`: batched,
KV-cached, per-sample seeded sampling with behaviour log-probs) on 48-token worked solutions
(`builtin:column-add-tiny`, 5-digit column additions) against the main job's 8-token answers
(`builtin:arith-tiny`, 3-digit additions), and against plain `transformers.generate` on the
same prompts, with and without its KV cache. Prints a table and writes
bench/results/long_answers.json.

    python bench/bench_long_answers.py [--prompts 32 --n 8 --repeats 3 --torch-threads 1]

Tokens/s counts generated tokens up to and including EOS (a sample may end early); both
engines sample at temperature 1 with no truncation. Run with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULTS = Path(__file__).parent / "results" / "long_answers.json"

WORKLOADS = {  # name: (built-in model, task, max new tokens)
    "8-token answers": ("builtin:arith-tiny", "arithmetic", 8),
    "48-token answers": ("builtin:column-add-tiny", "column-add", 48),
}


def prompts_for(task: str, count: int, tokenizer) -> list[list[int]]:
    from envs.arithmetic import ArithmeticTasks
    from envs.column_addition import ColumnAdditionTasks
    from envs.templates import render_prompt

    tasks = ArithmeticTasks(digits=3, operators="+") if task == "arithmetic" else ColumnAdditionTasks()
    return [tokenizer.encode(render_prompt(tasks.problem(i).question, "compact")) for i in range(count)]


def median_time(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def bench_hf_engine(model_dir: str, prompts, n: int, max_tokens: int, repeats: int) -> dict:
    from m2po_rllib.rollout.engine import SamplingConfig, make_engine

    engine = make_engine("hf", model_dir)
    sampling = SamplingConfig(n=n, max_tokens=max_tokens, temperature=1.0, seed=0)
    engine.generate(prompts[:2], sampling)  # warm-up
    seconds, groups = median_time(lambda: engine.generate(prompts, sampling), repeats)
    lengths = [len(c.token_ids) for g in groups for c in g]
    engine.shutdown()
    return {"generate_s": seconds, "tokens": sum(lengths), "tokens_per_s": sum(lengths) / seconds,
            "mean_answer_tokens": statistics.fmean(lengths), "hit_max_frac": sum(x == max_tokens for x in lengths) / len(lengths)}


def bench_transformers_generate(model_dir: str, prompts, n: int, max_tokens: int, repeats: int, use_cache: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run():
        with torch.no_grad():
            return model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=max_tokens, num_return_sequences=n, use_cache=use_cache, pad_token_id=pad,
                eos_token_id=tokenizer.eos_token_id,
            )

    torch.manual_seed(0)
    run()  # warm-up
    seconds, out = median_time(run, repeats)
    new = out[:, width:]
    lengths = []
    for row in new.tolist():  # generated tokens up to and including EOS
        lengths.append(row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row))
    return {"generate_s": seconds, "tokens": sum(lengths), "tokens_per_s": sum(lengths) / seconds,
            "mean_answer_tokens": statistics.fmean(lengths)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32, help="prompts per batch (the main job's step: 32)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch-threads", type=int, default=1, help="1: a lab trial's engine; 2: the main job's")
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from m2po_rllib.models.builtin import resolve_model_path

    torch.set_num_threads(args.torch_threads)
    results = {"batch": {"prompts": args.prompts, "n": args.n}, "torch_threads": args.torch_threads,
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "workloads": {}}
    for name, (model, task, max_tokens) in WORKLOADS.items():
        model_dir = resolve_model_path(model)
        prompts = prompts_for(task, args.prompts, AutoTokenizer.from_pretrained(model_dir))
        results["workloads"][name] = {
            "model": model, "max_new_tokens": max_tokens,
            "hf_engine": bench_hf_engine(model_dir, prompts, args.n, max_tokens, args.repeats),
            "transformers_generate": bench_transformers_generate(model_dir, prompts, args.n, max_tokens,
                                                                 args.repeats, use_cache=True),
            "transformers_generate_no_cache": bench_transformers_generate(model_dir, prompts, args.n, max_tokens,
                                                                          args.repeats, use_cache=False),
        }

    print(f"{args.prompts} prompts x {args.n} samples per batch, {args.torch_threads} torch thread(s); "
          "tokens/s (seconds per batch, mean answer tokens)")
    print(f"{'workload':18s} | {'HFEngine (runner)':>26s} | {'transformers.generate':>26s} | {'generate, no KV cache':>26s}")
    for name, w in results["workloads"].items():
        cells = [f"{r['tokens_per_s']:7.0f} ({r['generate_s']:5.2f} s, {r['mean_answer_tokens']:4.1f})"
                 for r in (w["hf_engine"], w["transformers_generate"], w["transformers_generate_no_cache"])]
        print(f"{name:18s} | " + " | ".join(f"{c:>26s}" for c in cells))
    short, long = (results["workloads"][k]["hf_engine"] for k in WORKLOADS)
    results["long_vs_short_tokens_per_s"] = long["tokens_per_s"] / short["tokens_per_s"]
    hf_long = results["workloads"]["48-token answers"]
    results["long_hf_engine_vs_generate"] = hf_long["hf_engine"]["tokens_per_s"] / hf_long["transformers_generate"]["tokens_per_s"]
    print(f"HFEngine: 48-token answers at {results['long_vs_short_tokens_per_s']:.2f}x the 8-token tokens/s; "
          f"{results['long_hf_engine_vs_generate']:.2f}x transformers.generate's on them")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
