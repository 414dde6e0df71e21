"""Streaming against round-based runners on the long-tailed task (`configs/column_mixed_async.yaml`:
column additions of 2-12 digits, answers 14-118 tokens), same `max_staleness`, same number of
updates. Writes bench/results/streaming.json (each run filed as it ends; a rerun adds to it).

    python bench/bench_streaming.py --only speed --iters 30 --repeats 3
    python bench/bench_streaming.py --only accuracy --seeds 0 --acc-iters 60

Variants (each in a fresh process, one at a time; nothing else should run beside it):
- `rounds`: the config as it is: each runner generates a round in one batched call;
- `streaming`: the same with `env_runners.streaming=true`;
- `rounds-even`: round-based on 7-digit problems only, answers of about the same mean
  length without the spread: the throughput a runner has with no tail to wait for;
- `rounds-1runner`, `streaming-1runner`: one runner (0.5 CPU) instead of two, so that
  generation, not the learner, is what the run waits for;
- `inflight`: streaming with `env_runners.inflight_weight_updates=true` (weights loaded
  mid-sequence, at every publish);
- `scored-streaming`, `scored-inflight`: `streaming` and `inflight` with
  `training.recompute_behavior_logp=true` (each runner scores its rounds in the learner's
  numerics; with loads mid-sequence, the rows in flight are scored before each load:
  `rollout/segments.py`): the cost of scoring segment by segment (`segment_s_mean`, the
  runner's seconds per settle, and the updates/s against scoring without mid-sequence loads);
- `native-rounds`, `native-inflight`: vLLM runners with native weight sync (the learner
  broadcasts each update), round-based against streaming with weights loaded mid-sequence:
  the learner's wait per broadcast (`weights/native_send_s`: a round-based runner receives
  after its round in flight, a streaming one between two decoding steps).
Figures per run, over the iterations after the warm-up: optimizer updates per second;
generated (trained) response tokens per second per runner, over the wall time and over the
runner's busy time (what the engine makes while it works: the tail shows here); the runners' and the learner's
idle fractions (`async/runner_idle_frac`: the share of wall time a runner was not
generating, scoring or packing; `async/learner_idle_frac`); the mean response length and
the trained data's age; with --acc-iters, held-out greedy accuracy after the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from _child import add_child_arguments, answer_child, run_child

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "streaming.json"
CONFIG = REPO / "configs" / "column_mixed_async.yaml"

BASE = ["evaluation.evaluation_interval=0", "training.logp_mismatch_interval=0"]
ONE_RUNNER = ["env_runners.num_env_runners=1"]  # half the generation: the run waits for it
# vLLM runners with the learner's broadcasts (gloo here): the learner's wait per broadcast
NATIVE = ["env_runners.rollout_engine=vllm", "env_runners.weight_sync=native",
          "env_runners.engine_kwargs={kv_cache_space_gb: 1, max_model_len: 256}"]
VARIANTS = {
    "rounds": [],
    "streaming": ["env_runners.streaming=true"],
    "rounds-even": ["environment.env_config.digits=7"],
    "rounds-1runner": ONE_RUNNER,
    "streaming-1runner": ONE_RUNNER + ["env_runners.streaming=true"],
    "inflight": ["env_runners.streaming=true", "env_runners.inflight_weight_updates=true"],
    "scored-streaming": ["env_runners.streaming=true", "training.recompute_behavior_logp=true"],
    "scored-inflight": ["env_runners.streaming=true", "env_runners.inflight_weight_updates=true",
                        "training.recompute_behavior_logp=true"],
    "native-rounds": NATIVE,
    "native-inflight": NATIVE + ["env_runners.streaming=true", "env_runners.inflight_weight_updates=true"],
}
ACCURACY_VARIANTS = ("rounds", "streaming")


def child(variant: str, iters: int, seed: int, eval_problems: int) -> dict:
    """Runs one variant in this process; returns its figures."""
    import numpy as np
    import ray

    from m2po_rllib.common import keys
    from m2po_rllib.config.algorithm_config import M2POConfig
    from m2po_rllib.config.from_yaml import apply_overrides, load_spec

    spec = apply_overrides(load_spec(str(CONFIG)), BASE + VARIANTS[variant] + [f"debugging.seed={seed}"])
    spec.pop("run", None)
    config = M2POConfig.from_spec(spec)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=tempfile.mkdtemp(prefix="m2po-ray-", dir="/tmp"))
    algo = config.build_algo()
    tokens: list[float] = []
    update = algo.learner_group.update

    def counting(*args, **kwargs):  # the response tokens of every trained step
        tokens.append(float(np.asarray(kwargs["batch"].policy_batches["default_policy"]["response_mask"]).sum()))
        return update(*args, **kwargs)

    algo.learner_group.update = counting
    try:
        rows = []
        for _ in range(iters):
            t0 = time.perf_counter()
            result = algo.train()
            learner = result["learners"]["default_policy"]
            rows.append(dict(
                seconds=time.perf_counter() - t0, version=result["policy_version"], tokens=sum(tokens),
                runner_idle=result.get("async/runner_idle_frac"), learner_idle=result.get("async/learner_idle_frac"),
                response_len=result["env_runners"].get("rollout/response_len_mean"),
                trained_max=learner.get("staleness/trained_max"), staleness_mean=result.get("staleness/mean"),
                token_age=result.get("staleness/token_mean"), spanned=result.get("staleness/versions_spanned_max"),
                update_s=result.get("timers", {}).get("learner_update_timer"),
                native_send_s=result.get(keys.NATIVE_SYNC_S),  # the iteration's last broadcast
                behavior_s=result["env_runners"].get(keys.BEHAVIOR_LOGP_S),  # a runner's scoring of a round
                segment_s=result["env_runners"].get(keys.SEGMENT_SCORE_S),  # of the rows in flight, per load
            ))
        warm = max(3, iters // 5)  # start-up and the first steps
        seconds = sum(r["seconds"] for r in rows[warm:])
        runners = config.num_env_runners

        def mean(key):
            values = [r[key] for r in rows[warm:] if r[key] is not None and not np.isnan(r[key])]
            return statistics.fmean(values) if values else None

        out = {
            "variant": variant, "seed": seed, "iterations": iters, "warm_up_iterations": warm,
            "updates_per_s": (rows[-1]["version"] - rows[warm - 1]["version"]) / seconds,
            "tokens_per_s_per_runner": (rows[-1]["tokens"] - rows[warm - 1]["tokens"]) / seconds / runners,
            "runner_idle_frac": mean("runner_idle"), "learner_idle_frac": mean("learner_idle"),
            "tokens_per_busy_s_per_runner": None,
            "response_len": mean("response_len"), "staleness_mean": mean("staleness_mean"),
            "token_age_mean": mean("token_age"), "versions_spanned_max": max(
                (r["spanned"] for r in rows if r["spanned"] is not None), default=None),
            "update_s_mean": mean("update_s"),  # the learner's seconds per step (it pads to the longest row)
            "native_send_s_mean": mean("native_send_s"),  # the learner's wait per broadcast (native sync)
            "behavior_s_mean": mean("behavior_s"), "segment_s_mean": mean("segment_s"),
            "trained_max_staleness": max(r["trained_max"] for r in rows if r["trained_max"] is not None),
            "policy_version": rows[-1]["version"],
        }
        if out["runner_idle_frac"] is not None and out["runner_idle_frac"] < 1:
            out["tokens_per_busy_s_per_runner"] = out["tokens_per_s_per_runner"] / (1 - out["runner_idle_frac"])
        if eval_problems:
            out["heldout_accuracy"] = algo.evaluate()["env_runners"]["eval/accuracy"]
        return out
    finally:
        algo.stop()
        ray.shutdown()


def file_run(kind: str, result: dict) -> None:
    """Adds one run to the results file (written beside and renamed: a kill loses no run)."""
    report = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"config": str(CONFIG.relative_to(REPO)),
                                                                       "variants": VARIANTS, "base": BASE}
    report.setdefault(kind, []).append({**result, "load_avg_1min": os.getloadavg()[0],
                                        "date": time.strftime("%Y-%m-%d %H:%M")})
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, RESULTS)


def summarize(report: dict) -> list[str]:
    """The figures against the issue's goals, with intervals (m2po_rllib.jobs.stats: t
    intervals; speed runs paired by repeat, accuracy by seed; ratios on log values)."""
    import math

    from m2po_rllib.jobs.stats import compare

    def by(kind, variant, key, index):
        return {r[index]: r[key] for r in report.get(kind, []) if r["variant"] == variant and r.get(key) is not None}

    def speed(variant, key):
        runs = [r for r in report.get("speed", []) if r["variant"] == variant]
        return {i: math.log(r[key]) for i, r in enumerate(runs)}

    lines = []

    def ratio(a, b, key, claim, said, **kw):
        va, vb = speed(a, key), speed(b, key)
        if len(va) < 2 or len(vb) < 2:
            return
        c = compare(va, vb, claim, **kw)
        lo, hi = c.ci95 if c.ci95 else (float("nan"), float("nan"))
        lines.append(f"{key}: {a} / {b} = {math.exp(c.diff):.2f}x (95% CI {math.exp(lo):.2f}-{math.exp(hi):.2f}, "
                     f"{c.n_a} vs {c.n_b} runs, {c.test}); {said}: {c.verdict}")

    ratio("streaming", "rounds", "updates_per_s", "greater", ">= 1.3x", threshold=math.log(1.3))
    ratio("streaming", "rounds", "updates_per_s", "greater", "> 1x")
    ratio("streaming-1runner", "rounds-1runner", "updates_per_s", "greater", ">= 1.3x", threshold=math.log(1.3))
    ratio("streaming", "rounds", "tokens_per_busy_s_per_runner", "greater", "> 1x")
    ratio("inflight", "streaming", "updates_per_s", "greater", "> 1x")
    ratio("inflight", "streaming", "token_age_mean", "less", "< 1x")
    ratio("scored-inflight", "scored-streaming", "updates_per_s", "greater", "> 1x")
    ratio("scored-inflight", "inflight", "updates_per_s", "greater", "> 1x")
    ratio("scored-inflight", "scored-streaming", "token_age_mean", "less", "< 1x")
    ratio("native-inflight", "native-rounds", "native_send_s_mean", "less", "< 1x")
    ratio("native-inflight", "native-rounds", "updates_per_s", "greater", "> 1x")
    ratio("streaming", "rounds-even", "tokens_per_busy_s_per_runner", "not_lower", ">= 0.9x",
          margin=-math.log(0.9))
    ratio("rounds", "rounds-even", "update_s_mean", "greater", "> 1x")
    acc_s, acc_r = by("accuracy", "streaming", "heldout_accuracy", "seed"), by("accuracy", "rounds", "heldout_accuracy", "seed")
    if len(acc_s) >= 2 and acc_s.keys() == acc_r.keys():
        c = compare(acc_s, acc_r, "equivalent", margin=0.03)
        lines.append(f"held-out accuracy: streaming {c.mean_a:.3f}, rounds {c.mean_b:.3f} over seeds {sorted(acc_s)}: "
                     f"difference {c.diff:+.3f} (95% CI {c.ci95[0]:+.3f} to {c.ci95[1]:+.3f}, {c.test}); "
                     f"{c.verdict} (3-point margin)"
                     + (f"; {c.seeds_needed} seeds per arm would resolve it" if c.verdict == "not resolved" else ""))
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=30, help="iterations per speed run")
    p.add_argument("--acc-iters", type=int, default=60, help="iterations per accuracy run")
    p.add_argument("--repeats", type=int, default=1, help="speed runs per variant")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--only", choices=["speed", "accuracy", "summary"], default=None)
    add_child_arguments(p)
    args = p.parse_args()
    if answer_child(args, child):
        return
    if args.only in (None, "speed"):
        # repeats interleaved (A B A B ...): a machine's drift spreads over every variant
        for v in [v for _ in range(args.repeats) for v in args.variants]:
            r = run_child(__file__, v, args.iters, 0, 0)
            file_run("speed", r)
            print(f"{v:>14}: {r['updates_per_s']:.3f} updates/s  {r['tokens_per_s_per_runner']:.0f} tokens/s/runner "
                  f"({r['tokens_per_busy_s_per_runner']:.0f} while busy)  "
                  f"runner idle {r['runner_idle_frac']:.2f}  learner idle {r['learner_idle_frac']:.2f} "
                  f"(update {r['update_s_mean']:.2f} s)  "
                  f"answer {r['response_len']:.1f} tokens  age mean {r['staleness_mean']:.1f} max "
                  f"{r['trained_max_staleness']:.0f}  token age {r['token_age_mean']:.2f}"
                  f"  versions per row <= {r['versions_spanned_max'] or 1:.0f}"
                  + (f"  broadcast {r['native_send_s_mean']:.3f} s" if r["native_send_s_mean"] is not None else "")
                  + (f"  scoring {r['behavior_s_mean']:.3f} s/round" if r.get("behavior_s_mean") is not None else "")
                  + (f"  {r['segment_s_mean']:.3f} s/load" if r.get("segment_s_mean") is not None else ""),
                  flush=True)
    if args.only in (None, "accuracy"):
        for seed in args.seeds:
            for v in [v for v in args.variants if v in ACCURACY_VARIANTS]:
                r = run_child(__file__, v, args.acc_iters, seed, 200)
                file_run("accuracy", r)
                print(f"{v:>12} seed {seed}: held-out {r['heldout_accuracy']:.3f} after {r['policy_version']} updates",
                      flush=True)
    for line in summarize(json.loads(RESULTS.read_text())):
        print(line)
    print(f"filed in {RESULTS}")


if __name__ == "__main__":
    main()
