"""How many tokens ties at the M2PO mask's cut add, on the main job's batches.

Run: `python bench/bench_mask_ties.py` (~30 s on 2 idle CPU cores; `--held-out-rounds 4
--train-rounds 4` for more minibatches, ~1 min). Prints a table and writes
bench/results/mask_ties.json.

Completions of one group share prefixes, and a token with the same context has the same
log-ratio, so equal (log r)^2 are common. Alg. 1 drops one token at a time, so of the tokens
tied at the cut it drops only as many as the bound needs; the mask breaks those ties by
(sample id, position). This measures what dropping every tied token instead (the rule the
mask had before) costs on real batches: the main job's (configs/default.yaml: the built-in
model, 3-digit addition, 32 prompts x 8 completions, minibatches of 64 rows, tau 0.04).

Rounds are sampled with the initial weights by the transformers engine; the learner then
trains (lr 3e-5, 4 updates per round) on other rounds of the same weights, and the held-back
rounds are masked, per minibatch, with the learner's current weights: data `age` updates
stale. Behaviour log-probs: the engine's (the main job's default) and the learner's own at
the initial weights (`recompute_behavior_logp`, the official code's setting), where equal
contexts give bit-equal log-probs most reliably.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]


def minibatch_counts(log_ratio, valid, ids, tau: float) -> dict[str, int]:
    """One minibatch: valid tokens, tokens Alg. 1 drops, tokens dropping every tie at the cut
    drops, tokens above tau, and those of them whose squared log-ratio equals another's."""
    from m2po_rllib.losses import m2po_keep_mask

    finite = valid & torch.isfinite(log_ratio)
    keep = m2po_keep_mask(log_ratio, valid, tau, sample_id=ids)
    d = torch.where(finite, log_ratio * log_ratio, -1.0)
    dropped = finite & ~keep
    every_tie = dropped.clone()
    if dropped.any():
        every_tie |= finite & (d == d[dropped].min())
    _, inverse, counts = torch.unique(d[finite], return_inverse=True, return_counts=True)
    above = d[finite] > tau
    return {
        "valid": int(valid.sum()),
        "dropped": int((valid & ~keep).sum()),
        "dropped_every_tie": int((valid & (every_tie | ~finite)).sum()),  # non-finite: dropped by both
        "above_tau": int(above.sum()),
        "above_tau_tied": int((above & (counts[inverse] > 1)).sum()),
        "split_tie": int(bool((every_tie & keep).any())),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--held-out-rounds", type=int, default=2)  # 4 minibatches each
    p.add_argument("--train-rounds", type=int, default=3)
    p.add_argument("--ages", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    p.add_argument("--tau", type=float, nargs="+", default=[0.04, 0.01])
    args = p.parse_args()

    from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

    from m2po_rllib.config.algorithm_config import M2POConfig
    from m2po_rllib.losses import compute_advantages
    from m2po_rllib.rollout.env_runner import LLMEnvRunner, make_text_env
    from m2po_rllib.wire.batch import to_train_batch

    t0 = time.perf_counter()
    cfg = M2POConfig.from_yaml(str(REPO / "configs" / "default.yaml"), overrides=["env_runners.rollout_engine=hf"])
    rows = cfg.prompts_per_step * cfg.group_size
    minibatch = cfg.minibatch_prompts * cfg.group_size
    runner = LLMEnvRunner(config=cfg)
    try:
        rounds = [
            runner.sample(seed=1000 + r, first_sample_id=r * rows)
            for r in range(args.held_out_rounds + args.train_rounds)
        ]
    finally:
        runner.stop()
    sample_s = time.perf_counter() - t0
    print(f"sampled {len(rounds)} rounds in {sample_s:.0f} s", flush=True)

    def train_batch(rollout):
        adv = compute_advantages(torch.as_tensor(rollout["rewards"]), cfg.group_size, cfg.advantage_estimator)
        return to_train_batch(rollout, adv.numpy())

    learner = cfg.build_learner(env=make_text_env(cfg.env, cfg.env_config))
    held_out = [train_batch(r) for r in rounds[: args.held_out_rounds]]
    training = [train_batch(r) for r in rounds[args.held_out_rounds :]]
    behavior = {"engine": [b["behavior_logp"] for b in held_out], "learner": [learner.response_logp(b) for b in held_out]}

    results, age, i = [], 0, 0
    for target in sorted(args.ages):
        while age < target:
            b = training[i % len(training)]
            i += 1
            learner.update(
                batch=MultiAgentBatch({"default_policy": SampleBatch(dict(b))}, env_steps=rows),
                minibatch_size=minibatch, num_epochs=1, shuffle_batch_per_epoch=False,
            )
            age += rows // minibatch
        print(f"age {age}: {time.perf_counter() - t0:.0f} s", flush=True)
        for source, logps in behavior.items():
            for tau in args.tau:
                total: dict[str, int] = {}
                m2 = []
                for b, behav in zip(held_out, logps):
                    logp = learner.response_logp(b)
                    for start in range(0, rows, minibatch):
                        sl = slice(start, start + minibatch)
                        valid = torch.as_tensor(b["response_mask"][sl]) > 0
                        log_ratio = torch.as_tensor(logp[sl] - np.asarray(behav)[sl]).float()
                        ids = torch.as_tensor(b["sample_id"][sl])
                        m2.append(float((log_ratio[valid] ** 2).mean()))
                        for k, v in minibatch_counts(log_ratio, valid, ids, tau).items():
                            total[k] = total.get(k, 0) + v
                extra = total["dropped_every_tie"] - total["dropped"]
                results.append(
                    {
                        "age": age, "behavior": source, "tau": tau, "minibatches": len(m2),
                        "m2_mean": float(np.mean(m2)), "m2_max": float(np.max(m2)), **total,
                        "extra_dropped": extra,
                        "extra_frac_of_valid": extra / total["valid"],
                        "extra_frac_of_dropped": extra / total["dropped"] if total["dropped"] else float("nan"),
                    }
                )

    header = (
        f"{'age':>4} {'behaviour':>9} {'tau':>5} {'M2 mean/max':>15} {'valid':>6} {'>tau':>5} {'tied':>6} "
        f"{'dropped':>7} {'+ties':>5} {'+ties/valid':>11} {'+ties/dropped':>13} {'split mbs':>9}"
    )
    print(f"{rows} rows per round, minibatches of {minibatch} rows, {args.held_out_rounds} held-out rounds; sampling {sample_s:.0f} s")
    print(header)
    for r in results:
        print(
            f"{r['age']:>4} {r['behavior']:>9} {r['tau']:>5} {r['m2_mean']:>7.4f}/{r['m2_max']:<7.4f} "
            f"{r['valid']:>6} {r['above_tau']:>5} {r['above_tau_tied'] / max(r['above_tau'], 1):>6.1%} "
            f"{r['dropped']:>7} {r['extra_dropped']:>5} {r['extra_frac_of_valid']:>11.3%} "
            f"{r['extra_frac_of_dropped']:>13.2%} {r['split_tie']:>5}/{r['minibatches']}"
        )
    out = REPO / "bench" / "results" / "mask_ties.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"config": "configs/default.yaml", "results": results}, indent=1))
    print(f"total {time.perf_counter() - t0:.0f} s; wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
