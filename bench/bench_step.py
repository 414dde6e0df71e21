"""One training step of `m2po train` against a minimal hand-written loop on the same model
and workload. Writes bench/results/step.json.

    python bench/bench_step.py [--reps 5 --steps 30]

Workload (the main job's): `builtin:arith-tiny`, the project's own prompts in the same order
(each round's prompts are drawn exactly as the EnvRunner draws them), 32 prompts x 8
samples x up to 8 tokens at temperature 1, GRPO advantages, the M2PO mask (tau 0.04), 4
AdamW updates of 64 sequences at lr 3e-5 with gradient clipping at 1, 2 torch threads.

- hand loop: plain torch and transformers in one process: KV-cache sampling that keeps each
  token's log-prob, the answer checked in process, advantages, a sort-based M2PO mask over
  each minibatch, the full-logits log-probs, 4 updates.
- project: `configs/default.yaml` through the RLlib algorithm (staleness 64, evaluation
  every 10 iterations, the log-prob mismatch check at its default interval), plus what `m2po
  train` does each iteration (history record and TensorBoard scalars). Per-step breakdown:
  generate, score, learner update, weight publish, mismatch check, other.

Repetitions are interleaved (hand, project, hand, project, ...), each in a fresh process;
steps 0..warm-1 are not timed (the project's also skip the 16 iterations that fill the
stale queue, which train nothing); the project's medians exclude nothing else (an evaluation
iteration in 10 barely moves a median). Peak RSS sums every process of the run (the
project's Ray processes included), sampled every 0.1 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "step.json"
PROMPTS, GROUP, MAX_TOKENS, MINIBATCH, LR, TAU = 32, 8, 8, 8, 3e-5, 0.04


def hand_loop(steps: int, warm: int) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from envs.reward import shared_verifier
    from m2po_rllib.models.builtin import resolve_model_path
    from m2po_rllib.rollout.env_runner import make_text_env
    from m2po_rllib.rollout.rounds import round_seed

    torch.set_num_threads(2)
    torch.manual_seed(0)
    path = resolve_model_path("builtin:arith-tiny")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    env = make_text_env("m2po/Arithmetic-v0", {"digits": 3, "num_operands": 2, "operators": "+", "template": "compact"})
    eos = tok.eos_token_id
    times, rewards = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        seed = round_seed(0, step)
        prompts, answers = [], []
        for p in range(PROMPTS):
            obs, info = env.reset(seed=int(np.random.SeedSequence([seed, 0, 0, p]).generate_state(1)[0]))
            prompts.append(tok(obs["prompt"], add_special_tokens=False)["input_ids"])
            answers.append(info["answer"])
        rows = [p for p in prompts for _ in range(GROUP)]
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        attn = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        # sampling with a KV cache, the log-prob of each sampled token kept
        with torch.no_grad():
            pos = (attn.cumsum(-1) - 1).clamp(min=0)
            out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
            tokens, logps, done = [], [], torch.zeros(len(rows), dtype=torch.bool)
            for _ in range(MAX_TOKENS):
                lp = out.logits[:, -1].float().log_softmax(-1)
                nxt = torch.multinomial(lp.exp(), 1).squeeze(-1)
                tokens.append(torch.where(done, 0, nxt))
                logps.append(torch.where(done, 0.0, lp.gather(-1, nxt[:, None]).squeeze(-1)))
                done = done | (nxt == eos)
                if done.all():
                    break
                attn = torch.cat([attn, attn.new_ones(len(rows), 1)], -1)  # finished rows decode don't-care tokens
                pos = pos[:, -1:] + 1
                out = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=pos,
                            past_key_values=out.past_key_values, use_cache=True)
        resp = torch.stack(tokens, 1)  # (B, R)
        behav = torch.stack(logps, 1)
        # valid: tokens up to and including the first EOS
        after_eos = (resp == eos).long().cumsum(1) - (resp == eos).long()
        valid = after_eos == 0
        texts = tok.batch_decode([r[v].tolist() for r, v in zip(resp, valid)], skip_special_tokens=True)
        reward = torch.tensor([v.reward for v in shared_verifier().check_batch(
            [(t, answers[i // GROUP]) for i, t in enumerate(texts)])])
        rewards.append(float(reward.mean()))
        g = reward.view(-1, GROUP)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).view(-1)
        full = torch.cat([ids, resp], 1)
        full_attn = torch.cat([torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows]), valid.long()], 1)
        n = MINIBATCH * GROUP
        for start in range(0, len(rows), n):
            sl = slice(start, start + n)
            pos = (full_attn[sl].cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=full[sl], attention_mask=full_attn[sl], position_ids=pos).logits
            logp = logits[:, width - 1 : -1].float().log_softmax(-1).gather(-1, resp[sl, :, None]).squeeze(-1)
            log_ratio = torch.where(valid[sl], logp - behav[sl], 0.0)
            with torch.no_grad():  # M2PO mask: drop the largest squared log-ratios until M2 <= tau
                d = torch.where(valid[sl], log_ratio.detach() ** 2, -1.0).flatten()
                srt, order = d.sort(descending=True)
                cnt = int(valid[sl].sum())
                suffix = srt[:cnt].flip(0).cumsum(0).flip(0) / torch.arange(cnt, 0, -1)
                k = int((suffix > TAU).sum())  # suffix means decrease: the first k exceed tau
                keep = valid[sl].flatten().clone()
                keep[order[:k]] = False
                keep = keep.view_as(valid[sl])
            loss = -(torch.where(keep, log_ratio.exp() * adv[sl, None], 0.0)).sum() / valid[sl].sum()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        times.append(time.perf_counter() - t0)
    return {"step_s": times[warm:], "reward": rewards}


def project(steps: int, warm: int) -> dict:
    import ray
    from torch.utils.tensorboard import SummaryWriter

    from m2po_rllib.config.algorithm_config import M2POConfig
    from m2po_rllib.config.from_yaml import load_spec
    from m2po_rllib.jobs.history import history_record, tensorboard_scalars

    spec = load_spec(str(REPO / "configs" / "default.yaml"))
    spec.pop("run", None)
    config = M2POConfig.from_spec(spec)
    from m2po_rllib.jobs.local_ray import init_ray

    init_ray(worker_logs=False)  # the Ray `m2po train` starts for the main job
    warm += config.queue_lag_steps  # while the stale queue fills, nothing is trained
    steps += config.queue_lag_steps
    algo = config.build_algo()
    tb = SummaryWriter(tempfile.mkdtemp(prefix="m2po-tb-"))
    parts = {k: [] for k in ("generate", "score", "update", "publish", "mismatch", "other")}
    times, rewards = [], []
    try:
        algo.evaluate()  # as m2po train does before training
        for step in range(steps):
            t0 = time.perf_counter()
            result = algo.train()
            history_record(result, algo.iteration, 0.0)  # what m2po train records each iteration
            for key, value in tensorboard_scalars(result).items():
                tb.add_scalar(key, value, algo.iteration)
            dt = time.perf_counter() - t0
            rewards.append(result["env_runners"]["rollout/reward_mean"])
            if step < warm:
                continue
            timers, runners = result.get("timers", {}), result["env_runners"]
            got = {
                "generate": runners.get("rollout/generate_s", 0.0),
                "score": runners.get("rollout/score_s", 0.0),
                "update": timers.get("learner_update_timer", 0.0),
                "publish": timers.get("synch_weights", 0.0),
                "mismatch": timers.get("logp_mismatch_timer", 0.0),
            }
            got = {k: (v if v == v else 0.0) for k, v in got.items()}  # NaN: not this iteration
            got["other"] = dt - sum(got.values())
            for k, v in got.items():
                parts[k].append(v)
            times.append(dt)
    finally:
        algo.stop()
        ray.shutdown()
    return {"step_s": times, "reward": rewards, "parts": parts}


def measure(kind: str, steps: int, warm: int) -> dict:
    """Runs one repetition in a fresh process; adds the peak RSS of its process tree."""
    import psutil

    out = tempfile.mktemp(suffix=".json")
    proc = subprocess.Popen([sys.executable, __file__, "--child", kind, "--steps", str(steps), "--warm", str(warm),
                             "--out", out], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    root, peak, peak_root = psutil.Process(proc.pid), 0, 0
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
            peak_root = max(peak_root, root.memory_info().rss)
        except psutil.Error:
            pass
        time.sleep(0.1)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{proc.stderr.read()[-3000:]}")
    result = json.loads(Path(out).read_text())
    result["peak_rss_gb"] = peak / 1e9
    result["peak_rss_main_process_gb"] = peak_root / 1e9  # the process that samples and trains
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=30, help="timed steps per repetition")
    p.add_argument("--warm", type=int, default=3, help="untimed first steps")
    p.add_argument("--child", choices=["hand", "project"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        fn = hand_loop if args.child == "hand" else project
        Path(args.out).write_text(json.dumps(fn(args.steps + args.warm, args.warm)))
        return

    load = os.getloadavg()[0]
    runs = {"hand": [], "project": []}
    for rep in range(args.reps):
        for kind in ("hand", "project"):
            r = measure(kind, args.steps, args.warm)
            runs[kind].append(r)
            print(f"rep {rep} {kind:>7}: median {statistics.median(r['step_s']):.3f} s/step, "
                  f"peak RSS {r['peak_rss_gb']:.2f} GB", flush=True)
    report = {"load_avg_1min_at_start": load, "reps": args.reps, "steps": args.steps}
    for kind, rs in runs.items():
        meds = [statistics.median(r["step_s"]) for r in rs]
        report[kind] = {"median_s": statistics.median(meds), "min_s": min(min(r["step_s"]) for r in rs),
                        "rep_medians_s": meds, "peak_rss_gb": max(r["peak_rss_gb"] for r in rs),
                        "peak_rss_main_process_gb": max(r["peak_rss_main_process_gb"] for r in rs)}
    ratios = [statistics.median(p["step_s"]) / statistics.median(h["step_s"]) for h, p in zip(runs["hand"], runs["project"])]
    report["ratio_per_rep"] = ratios
    report["ratio_median"] = statistics.median(ratios)
    report["rss_ratio"] = report["project"]["peak_rss_gb"] / report["hand"]["peak_rss_gb"]
    report["breakdown_s"] = {k: statistics.median(v for r in runs["project"] for v in r["parts"][k])
                             for k in runs["project"][0]["parts"]}
    report["load_avg_1min_at_end"] = os.getloadavg()[0]
    print(f"hand loop {report['hand']['median_s']:.3f} s/step, project {report['project']['median_s']:.3f} s/step: "
          f"{report['ratio_median']:.2f}x (per rep: {', '.join(f'{r:.2f}' for r in ratios)})")
    print(f"peak RSS: hand {report['hand']['peak_rss_gb']:.2f} GB, project {report['project']['peak_rss_gb']:.2f} GB "
          f"({report['rss_ratio']:.2f}x); the main process alone: hand {report['hand']['peak_rss_main_process_gb']:.2f} GB, "
          f"project {report['project']['peak_rss_main_process_gb']:.2f} GB")
    print("project breakdown (median s/step): " + ", ".join(f"{k} {v:.3f}" for k, v in report["breakdown_s"].items()))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
