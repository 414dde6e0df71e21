"""The learner's first GPU check: micro-batched bf16 updates with chunked log-probs.

    python bench/gpu_learner_check.py --out /tmp/gpu_learner.json          # cuda, Qwen2-0.5B shape
    python bench/gpu_learner_check.py --device cpu --tiny --out /tmp/x.json  # the same code on CPU

Builds a random-weight model locally from a config dict (no hub): Qwen2-0.5B's shape
(24 layers, hidden 896, vocab 151,936, tied embeddings) or, with --tiny, a very small one.
Each update is one optimizer minibatch of `--sequences` random sequences (prompt
`--prompt-len` + response `--response-len`, prompts left-padded and responses right-padded
to random lengths), split into micro-batches of `--micro-batch`: per micro-batch the
decoder, `chunked_logp_entropy` and the token-mean "grpo_no_tr" loss over the whole
minibatch's token count, then backward; one AdamW step per minibatch.

Prints and writes (`--out`, JSON): peak memory (cuda: torch.cuda.max_memory_allocated;
cpu: the process's peak RSS) and the memory before the updates (weights, AdamW state; cpu:
RSS), tokens/s, seconds per update, the plan's estimate for the
same shape (m2po_rllib/jobs/plan.py), and, unless --no-compare-old, the same updates through the
full-logits path (`torch.logp.response_logp_and_entropy`) per micro-batch and the max
relative gradient difference between the two paths on one micro-batch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's packages, installed or not

QWEN2_0_5B = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
)
TINY = dict(
    vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
)
DTYPES = ("bfloat16", "float32")


def build_model(args):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**(TINY if args.tiny else QWEN2_0_5B))
    with torch.device(args.device):
        model = Qwen2ForCausalLM(config).to(getattr(torch, args.dtype))
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    return model, config


def make_minibatch(args, vocab: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    B, P, R = args.sequences, args.prompt_len, args.response_len
    prompt_lens = torch.randint(P // 2, P + 1, (B,), generator=g)
    response_lens = torch.randint(R // 2, R + 1, (B,), generator=g)
    pos = torch.arange(P + R)
    attn = ((pos >= P - prompt_lens[:, None]) & (pos < P + response_lens[:, None])).long()
    batch = {
        "input_ids": torch.randint(1, vocab, (B, P + R), generator=g).masked_fill(attn == 0, 0),
        "attention_mask": attn,
        "response_mask": (torch.arange(R) < response_lens[:, None]).float(),
        "behavior_logp": -torch.log(torch.tensor(float(vocab))) + 0.1 * torch.randn(B, R, generator=g),
        "advantages": torch.randn(B, generator=g),
    }
    return {k: v.to(args.device) for k, v in batch.items()}


def micro_batch_loss(model, micro, num_tokens, args, path: str):
    from m2po_rllib.losses import compute_policy_loss
    from m2po_rllib.torch.logp import response_logp
    from m2po_rllib.torch.logp import response_logp_and_entropy

    if path == "chunked":
        logp, entropy = response_logp(model, micro, args.temperature, args.chunk)
    else:
        logp, entropy = response_logp_and_entropy(
            model, micro["input_ids"], micro["attention_mask"], micro["response_mask"].shape[1], args.temperature
        )
    loss, _ = compute_policy_loss(
        "grpo_no_tr", logp, micro["behavior_logp"], micro["advantages"], micro["response_mask"] > 0,
        entropy=entropy, loss_agg_mode="token-mean", num_global_tokens=num_tokens, mask_scope="local",
    )
    return loss


def update(model, optimizer, batch, args, path: str) -> None:
    """One optimizer minibatch: gradient accumulation over micro-batches, one step."""
    optimizer.zero_grad(set_to_none=True)
    num_tokens = batch["response_mask"].sum()
    for start in range(0, args.sequences, args.micro_batch):
        micro = {k: v[start : start + args.micro_batch] for k, v in batch.items()}
        micro_batch_loss(model, micro, num_tokens, args, path).backward()
    optimizer.step()


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_bytes_reset(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS
            f.write("5")


def _peak_bytes(device: str) -> int:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated()
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _current_bytes(device: str) -> int:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.memory_allocated()
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def measure(model, args, path: str) -> dict:
    """Peak memory and speed of `args.steps` updates (after one warm-up) through `path`."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    update(model, optimizer, make_minibatch(args, model.config.vocab_size, seed=0), args, path)  # warm-up
    _sync(args.device)
    _peak_bytes_reset(args.device)
    base = _current_bytes(args.device)
    # On CPU the kernel updates VmHWM lazily (at unmaps), so a reading can trail the RSS it
    # has already seen: the peak is at least every RSS reading taken, the first one included.
    seen = base
    times, tokens, response_tokens = [], 0, 0
    for step in range(args.steps):
        batch = make_minibatch(args, model.config.vocab_size, seed=1 + step)
        _sync(args.device)
        t0 = time.perf_counter()
        update(model, optimizer, batch, args, path)
        _sync(args.device)
        times.append(time.perf_counter() - t0)
        tokens += int(batch["attention_mask"].sum())
        response_tokens += int(batch["response_mask"].sum())
        seen = max(seen, _current_bytes(args.device))
    peak = max(_peak_bytes(args.device), seen)
    del optimizer
    return {
        "path": path, "peak_memory_gib": peak / 2**30, "memory_before_updates_gib": base / 2**30,
        "seconds_per_update": sum(times) / len(times), "tokens_per_s": tokens / sum(times),
        "response_tokens_per_s": response_tokens / sum(times),
    }


def gradient_difference(model, args) -> float:
    """max over parameters of max|g_chunked - g_full| / max|g_full| on one micro-batch."""
    batch = make_minibatch(args, model.config.vocab_size, seed=99)
    micro = {k: v[: args.micro_batch] for k, v in batch.items()}
    grads = {}
    for path in ("chunked", "full"):
        model.zero_grad(set_to_none=True)
        micro_batch_loss(model, micro, micro["response_mask"].sum(), args, path).backward()
        grads[path] = {n: p.grad.float() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return max(
        ((grads["chunked"][n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
        for n, g in grads["full"].items()
    )


def plan_estimate(config, args) -> dict:
    """m2po plan's estimate for this shape on one learner (no DDP), in GiB."""
    from m2po_rllib.jobs.plan import ModelShape, estimate_learner_memory

    H, heads = config.hidden_size, config.num_attention_heads
    model_shape = ModelShape(
        name="stand-in", source="config dict", model_type="qwen2", num_params=args.num_params,
        embedding_params=config.vocab_size * H, layer_params=args.layer_params, hidden=H,
        intermediate=config.intermediate_size, kv_dim=config.num_key_value_heads * (H // heads),
        layers=config.num_hidden_layers, vocab=config.vocab_size, tied=True, max_positions=config.max_position_embeddings,
    )
    parts = estimate_learner_memory(
        model_shape, dtype_bytes=2 if args.dtype == "bfloat16" else 4, micro_batch_size=args.micro_batch,
        seq_len=args.prompt_len + args.response_len, chunk_size=args.chunk,
        gradient_checkpointing=args.gradient_checkpointing, num_learners=1, ddp_bucket_copy=False,
    )["ddp"]
    return {k: v / 2**30 for k, v in parts.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a very small model (CPU smoke run)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--sequences", type=int, default=None, help="per minibatch (default 32; --tiny 4)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per forward/backward (default 8; --tiny 2)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 512; --tiny 16")
    p.add_argument("--response-len", type=int, default=None, help="default 2048; --tiny 48")
    p.add_argument("--chunk", type=int, default=256, help="positions per log-prob chunk")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=3, help="timed updates after one warm-up")
    p.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false")
    p.add_argument("--no-compare-old", dest="compare_old", action="store_false", help="skip the full-logits path")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--out", required=True, help="JSON file to write")
    args = p.parse_args(argv)
    defaults = dict(sequences=4, micro_batch=2, prompt_len=16, response_len=48) if args.tiny else dict(
        sequences=32, micro_batch=8, prompt_len=512, response_len=2048)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu --tiny")
    model, config = build_model(args)
    args.num_params = sum(p.numel() for p in model.parameters())
    args.layer_params = sum(p.numel() for p in model.model.layers[0].parameters())
    result = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "model": {**(TINY if args.tiny else QWEN2_0_5B), "parameters": args.num_params},
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "num_params", "layer_params")},
        "torch": torch.__version__,
    }
    if args.compare_old:
        result["grad_max_rel_diff_chunked_vs_full"] = gradient_difference(model, args)
    result["chunked"] = measure(model, args, "chunked")
    if args.compare_old:
        result["full_logits"] = measure(model, args, "full")
    result["plan_estimate_gib"] = plan_estimate(config, args)

    print(f"device {result['device']}, {args.num_params / 1e6:.1f} M parameters, {args.dtype}, minibatch {args.sequences} x "
          f"({args.prompt_len} + {args.response_len}) tokens, micro-batch {args.micro_batch}, chunk {args.chunk}")
    for key in ("chunked", "full_logits"):
        if key in result:
            r = result[key]
            extra = r["peak_memory_gib"] - r["memory_before_updates_gib"]
            print(f"  {key:<12} peak {r['peak_memory_gib']:7.2f} GiB (+{extra:.2f} over the {r['memory_before_updates_gib']:.2f} "
                  f"before the updates)  {r['seconds_per_update']:7.3f} s/update  "
                  f"{r['tokens_per_s']:10.0f} tokens/s ({r['response_tokens_per_s']:.0f} response tokens/s)")
    if "grad_max_rel_diff_chunked_vs_full" in result:
        print(f"  gradient max relative difference, chunked vs full logits: {result['grad_max_rel_diff_chunked_vs_full']:.2e}")
    print(f"  plan estimate (one learner, no DDP): {sum(result['plan_estimate_gib'].values()):.2f} GiB "
          f"(AdamW moments counted in fp32; torch keeps them in the parameters' dtype)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
