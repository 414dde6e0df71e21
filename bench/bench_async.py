"""Synchronous vs asynchronous M2PO on this machine: optimizer updates per second, their
ratio against the ideal (Tg + Tt) / max(Tg, Tt), and held-out accuracy after the same
number of updates over several seeds. Writes bench/results/async.json.

    python bench/bench_async.py                      # speed + accuracy, 3 seeds
    python bench/bench_async.py --only speed --iters 40

Variants (each in a fresh process, one at a time; nothing else should run beside it):
- `sync`: one remote EnvRunner (1 CPU, 1 torch thread) and the learner in the driver
  (`num_cpus_for_main_process: 1`), sampling and training one after the other;
- `async`: the same processes, rounds generated while the learner trains
  (`async_rollouts`, `max_staleness` = the smallest bound: one round in flight);
- `async-2threads`: `async` with both processes set to 2 torch threads on 2 cores, to show
  the oversubscription cliff that per-process CPU allocation avoids;
- `inprocess`: the default main job's layout (everything in the driver, 2 threads).
Tg and Tt are the sync run's median generation and update seconds per step.
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
RESULTS = REPO / "bench" / "results" / "async.json"

# The main job's task and model, with a step whose generation and update take about as
# long on 2 cores: 2 updates per step (minibatch 16 prompts of 32).
BASE = [
    "training.staleness=0",
    "training.minibatch_prompts=16",
    "training.logp_mismatch_interval=0",
    "env_runners.max_new_tokens=8",
]
VARIANTS = {
    "sync": ["env_runners.num_env_runners=1", "resources.num_cpus_for_main_process=1"],
    "async": ["env_runners.num_env_runners=1", "resources.num_cpus_for_main_process=1",
              "training.async_rollouts=true", "training.max_staleness=3"],
    "async-2threads": ["env_runners.num_env_runners=1", "env_runners.num_cpus_per_env_runner=2",
                       "resources.num_cpus_for_main_process=2", "training.async_rollouts=true",
                       "training.max_staleness=3"],
    "inprocess": ["env_runners.num_env_runners=0", "resources.num_cpus_for_main_process=2"],
}


def child(variant: str, iters: int, seed: int, eval_problems: int) -> dict:
    """Runs one variant in this process; returns its figures."""
    import ray

    from m2po_rllib.config.algorithm_config import M2POConfig
    from m2po_rllib.config.from_yaml import apply_overrides, load_spec

    spec = apply_overrides(load_spec(str(REPO / "configs" / "default.yaml")), BASE + VARIANTS[variant] + [
        f"debugging.seed={seed}", "evaluation.evaluation_interval=0"])
    spec.pop("run", None)
    config = M2POConfig.from_spec(spec)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=tempfile.mkdtemp(prefix="m2po-ray-", dir="/tmp"))
    algo = config.build_algo()
    try:
        times, gen, upd, versions, trained_max = [], [], [], [], []
        for _ in range(iters):
            t0 = time.perf_counter()
            result = algo.train()
            times.append(time.perf_counter() - t0)
            gen.append(result["env_runners"].get("rollout/generate_s"))
            upd.append(result.get("timers", {}).get("learner_update_timer"))
            versions.append(result["policy_version"])
            trained_max.append(result["learners"]["default_policy"].get("staleness/trained_max"))
        warm = max(3, iters // 5)  # skip start-up and the first steps
        updates = versions[-1] - versions[warm - 1]
        seconds = sum(times[warm:])
        out = {
            "variant": variant, "seed": seed, "iterations": iters,
            "updates_per_s": updates / seconds,
            "step_s_median": statistics.median(times[warm:]),
            "generate_s_median": statistics.median(g for g in gen[warm:] if g is not None),
            "update_s_median": statistics.median(u for u in upd[warm:] if u is not None),
            "trained_max_staleness": max(t for t in trained_max if t is not None),
            "policy_version": versions[-1],
        }
        if eval_problems:
            out["heldout_accuracy"] = algo.evaluate()["env_runners"]["eval/accuracy"]
        return out
    finally:
        algo.stop()
        ray.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=60, help="iterations per speed run")
    p.add_argument("--acc-iters", type=int, default=150, help="iterations per accuracy run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--only", choices=["speed", "accuracy"], default=None)
    add_child_arguments(p)
    args = p.parse_args()
    if answer_child(args, child):
        return

    load = os.getloadavg()[0]
    # --only updates its part of an earlier report
    report: dict = json.loads(RESULTS.read_text()) if args.only and RESULTS.exists() else {}
    report.update({"load_avg_1min_at_start": load, "base_overrides": BASE, "variants": VARIANTS})
    if args.only in (None, "speed"):
        speed = {v: run_child(__file__, v, args.iters, 0, 0) for v in VARIANTS}
        tg, tt = speed["sync"]["generate_s_median"], speed["sync"]["update_s_median"]
        ideal = (tg + tt) / max(tg, tt)
        ratio = speed["async"]["updates_per_s"] / speed["sync"]["updates_per_s"]
        report["speed"] = speed
        report["Tg_s"], report["Tt_s"], report["ideal_ratio"] = tg, tt, ideal
        report["async_over_sync"] = ratio
        report["fraction_of_ideal"] = ratio / ideal
        print(f"Tg {tg:.3f} s  Tt {tt:.3f} s  ideal (Tg+Tt)/max = {ideal:.2f}")
        for v, r in speed.items():
            print(f"{v:>15}: {r['updates_per_s']:.2f} updates/s  step {r['step_s_median']:.3f} s  "
                  f"max trained age {r['trained_max_staleness']:.0f}")
        print(f"async / sync = {ratio:.2f} = {ratio / ideal:.2f} of the ideal")
    if args.only in (None, "accuracy"):
        acc = {v: [run_child(__file__, v, args.acc_iters, s, 200) for s in args.seeds] for v in ("sync", "async")}
        report["accuracy"] = {}
        for v, runs in acc.items():
            vals = [r["heldout_accuracy"] for r in runs]
            report["accuracy"][v] = {
                "seeds": args.seeds, "heldout_accuracy": vals, "mean": statistics.mean(vals),
                "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                "updates": runs[0]["policy_version"], "trained_max_staleness": max(r["trained_max_staleness"] for r in runs),
            }
            a = report["accuracy"][v]
            print(f"{v:>6}: held-out {a['mean']:.3f} +- {a['std']:.3f} over seeds {args.seeds} "
                  f"after {a['updates']} updates ({vals})")
    report["load_avg_1min_at_end"] = os.getloadavg()[0]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
