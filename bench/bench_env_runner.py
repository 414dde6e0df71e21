"""EnvRunner overhead: `LLMEnvRunner.sample()` against the engine's raw generate on the same
prompts (the goal: <= 10% overhead), for the transformers and vLLM engines, on the main
job's config (built-in model, 32 prompts x 8 samples). Prints the figures and writes them to
bench/results/env_runner.json.

    python bench/bench_env_runner.py [--engines hf vllm] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(engine: str, rounds: int) -> dict:
    from m2po_rllib.config.algorithm_config import M2POConfig
    from m2po_rllib.rollout.env_runner import LLMEnvRunner
    from m2po_rllib.rollout.rounds import sampling_config

    config = M2POConfig.from_yaml(str(REPO / "configs" / "default.yaml"), overrides=[f"env_runners.rollout_engine={engine}"])
    runner = LLMEnvRunner(config=config)
    try:
        runner.sample(seed=0)  # starts the engine, warms up
        runner.get_metrics()
        sample_s, raw_s, tokens = 0.0, 0.0, 0
        for r in range(1, rounds + 1):
            t0 = time.perf_counter()
            batch = runner.sample(seed=r)
            sample_s += time.perf_counter() - t0
            tokens += int(batch["response_mask"].sum())
            # the same prompts through the bare engine
            g = config.group_size
            prompts = [
                [int(t) for t in row[mask > 0]]
                for row, mask in zip(batch["prompt_ids"][::g], batch["prompt_mask"][::g])
            ]
            t0 = time.perf_counter()
            runner.engine.generate(prompts, sampling_config(config, runner.env, n=g, greedy=False, seed=r))
            raw_s += time.perf_counter() - t0
    finally:
        runner.stop()
    return {
        "engine": engine,
        "rounds": rounds,
        "tokens_per_round": tokens / rounds,
        "runner_sample_s": sample_s / rounds,
        "raw_generate_s": raw_s / rounds,
        "overhead_frac": sample_s / raw_s - 1.0,
        "runner_tokens_per_s": tokens / sample_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", nargs="+", default=["hf", "vllm"])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    rows = [measure(e, args.rounds) for e in args.engines]
    for r in rows:
        print(
            f"{r['engine']:<5} runner.sample {r['runner_sample_s']:.3f} s  raw generate {r['raw_generate_s']:.3f} s  "
            f"overhead {100 * r['overhead_frac']:+.1f}%  {r['runner_tokens_per_s']:.0f} tokens/s"
        )
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "env_runner.json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {out / 'env_runner.json'}")


if __name__ == "__main__":
    main()
