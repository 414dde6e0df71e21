"""Cost of the M2PO mask and policy losses against one learner forward+backward.

Run: `python bench/bench_losses.py` (a few minutes on CPU; `--quick` for 1M tokens only).
Prints a table and writes bench/results/losses.json.

What is timed, per batch of N response tokens (B rows of T = 2048, ~75% valid):
Each figure is the fastest of a few runs (the least disturbed one on shared CPUs).
- `mask`: `m2po_keep_mask` alone;
- each loss: `compute_policy_loss` forward + its backward to a leaf `logp` (B, T);
- the learner: one forward+backward of a small random Qwen2 causal LM (hidden 256,
  4 layers, vocab 1024) measured on a few thousand tokens and scaled linearly to N,
  and one no-grad forward (the extra pass a global mask needs under gradient
  accumulation, to get the minibatch's current log-ratios before the first backward).
A real policy model costs far more per token than this toy (a 7B model ~ 6 * 7e9 FLOP
per token for forward+backward against ~2e7 here), so the loss shares printed are a
loose upper bound of the share in a real run.

Two log-ratio regimes, both above the threshold so the mask search runs: "paper"
(about 0.03% of tokens masked, the order the paper reports) and "heavy" (a few percent
masked, several widening rounds of the top-k search).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from m2po_rllib.losses import compute_policy_loss, m2po_keep_mask

T = 2048
LOSSES = ("m2po", "m2po_official", "grpo")
REGIMES = {"paper": (0.18, 0.002, 3.0), "heavy": (0.2, 0.02, 1.5)}  # (std, tail frac, tail std)


def timeit(fn, reps: int, warm_up: bool = True) -> float:
    """Fastest of `reps` runs: on shared CPUs, the least disturbed one."""
    if warm_up:
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def make_batch(n_tokens: int, regime: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B = n_tokens // T
    std, tail_frac, tail_std = REGIMES[regime]
    lr = torch.randn(B, T, generator=g) * std
    tail = torch.rand(B, T, generator=g) < tail_frac
    lr = torch.where(tail, torch.randn(B, T, generator=g) * tail_std, lr)
    lengths = torch.randint(T // 2, T + 1, (B, 1), generator=g)
    valid = torch.arange(T)[None] < lengths
    behavior = -torch.rand(B, T, generator=g) * 2
    adv = torch.randn(B, generator=g)
    return behavior + lr, behavior, adv, valid


def bench_losses(n_tokens: int, reps: int, warm_up: bool) -> dict:
    out = {}
    for regime in REGIMES:
        logp, behavior, adv, valid = make_batch(n_tokens, regime)
        lr = logp - behavior
        keep = m2po_keep_mask(lr, valid, 0.04)
        row = {
            "m2_before": float((lr * lr)[valid].mean()),
            "masked_frac": float((valid & ~keep).sum() / valid.sum()),
            "mask_s": timeit(lambda: m2po_keep_mask(lr, valid, 0.04), reps, warm_up),
        }
        for name in LOSSES:
            leaf = logp.clone().requires_grad_(True)

            def step():
                leaf.grad = None
                loss, _ = compute_policy_loss(name, leaf, behavior, adv, valid)
                loss.backward()

            row[f"{name}_s"] = timeit(step, reps, warm_up)
        out[regime] = row
    return out


def bench_learner(n_tokens: int, reps: int) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=T,
    )
    model = Qwen2ForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (n_tokens // 1024, 1024))

    def logp_of(out):
        logits = out.logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        logp_of(model(input_ids=ids)).sum().backward()

    def fwd_no_grad():
        with torch.no_grad():
            logp_of(model(input_ids=ids))

    return {
        "measured_tokens": ids.numel(),
        "params": sum(p.numel() for p in model.parameters()),
        "fwd_bwd_s_per_token": timeit(fwd_bwd, 2 * reps) / ids.numel(),
        "fwd_no_grad_s_per_token": timeit(fwd_no_grad, 2 * reps) / ids.numel(),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1M tokens only, fewer repeats")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "losses.json"))
    args = parser.parse_args()
    sizes = [2**20] if args.quick else [2**20, 2**23]
    reps = 2 if args.quick else 3

    learner = bench_learner(4096, reps)
    results = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": "cpu",
        "learner": learner,
        "note": "learner time measured on measured_tokens tokens and scaled linearly to each size",
        "sizes": {},
    }
    fb_tok, fwd_tok = learner["fwd_bwd_s_per_token"], learner["fwd_no_grad_s_per_token"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    print(
        f"learner (Qwen2 {learner['params'] / 1e6:.1f}M params), measured on "
        f"{learner['measured_tokens']} tokens and scaled linearly below: fwd+bwd "
        f"{fb_tok * 1e6:.1f} us/token; no-grad fwd {fwd_tok * 1e6:.1f} us/token = "
        f"{fwd_tok / fb_tok:.1%} of fwd+bwd (the extra pass of a global mask under "
        "gradient accumulation)"
    )
    cols = ("tokens", 8), ("regime", 6), ("masked", 7), ("what", 14), ("seconds", 9)
    header = " ".join(f"{c:>{w}}" for c, w in cols) + f" {'/ fwd+bwd':>10} {'/ grpo':>7}"
    print(header)
    print("-" * len(header))
    for n in sizes:
        # the 1M runs warm every code path up; 8M runs twice, without a warm-up
        per = bench_losses(n, reps if n <= 2**20 else 2, warm_up=n <= 2**20)
        fb = fb_tok * n
        for regime, row in per.items():
            row["learner_fwd_bwd_s"] = fb
            for what in ("mask", *LOSSES):
                t = row[f"{what}_s"]
                row[f"{what}_vs_fwd_bwd"] = t / fb
                row[f"{what}_vs_grpo"] = t / row["grpo_s"]
                print(
                    f"{n / 2**20:>7.0f}M {regime:>6} {row['masked_frac']:>7.3%} {what:>14} "
                    f"{t:>9.4f} {t / fb:>10.4%} {t / row['grpo_s']:>7.2f}"
                )
        results["sizes"][str(n)] = per
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
