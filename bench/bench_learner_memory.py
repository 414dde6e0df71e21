"""Peak memory and time of one optimizer minibatch: the full-logits update vs the
micro-batched update with chunked log-probs (issue 12).

Run: `python bench/bench_learner_memory.py` (about 15 min on 2 CPU cores, a quiet machine:
the old path takes up to the whole memory cap). Prints a table and writes
bench/results/learner_memory.json. By default it first finds the largest minibatch the
old path fits (doubling the sequences from `--find-from` until an update fails under the
memory cap), then measures that size and 4x it; `--sizes 8,32` skips the search.

Model: a random Qwen2 built locally with Qwen2's vocabulary (151,936) and a small body
(hidden 64, 2 layers, tied embeddings as Qwen2-0.5B), float32 on CPU, so the LM head and
the softmax over the vocabulary dominate, as they do at paper scale.

Variants, each in a fresh child process (peak RSS = the process's high-water mark during
the measured updates minus its RSS before them, after one warm-up update; a watchdog thread
ends the child as "oom" once its RSS grows `--mem-cap-gb` past its size after set-up, so an
update that does not fit stops before the machine's OOM killer wakes):
- old: `torch.logp.response_logp_and_entropy` on the whole minibatch (float32 logits for
  every position, log-softmax, entropy), the loss, one backward.
- new: micro-batches of `--micro-batch` sequences, each `logp.response_logp` (decoder only,
  `chunked_logp_entropy` over `--chunk` positions), the same loss with the minibatch's
  token count, backward per micro-batch (gradient accumulation).
Loss: the library's token-mean "grpo_no_tr" policy loss (a policy gradient on the ratio,
no trust region), entropy computed for the metrics, as the learner does. The gradients of
old and new are compared (max over parameters of max|g_new - g_old| / max|g_old|).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

QWEN2_VOCAB = 151_936
RESULTS = Path(__file__).resolve().parent / "results" / "learner_memory.json"


# ---------------------------------------------------------------------------------- child
def _rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _start_watchdog(limit_mb: float, out: dict) -> None:
    """Ends the process as "oom" when its RSS passes `limit_mb`. (An address-space rlimit
    would not do: torch maps far more virtual memory than it touches.)"""

    def watch():
        while True:
            if _rss_mb("VmRSS") > limit_mb:
                print(json.dumps({**out, "status": "oom", "error": f"RSS passed {limit_mb:.0f} MB"}), flush=True)
                os._exit(0)
            time.sleep(0.005)

    threading.Thread(target=watch, daemon=True).start()


def build(args):
    import torch
    from transformers import Qwen2ForCausalLM

    from m2po_rllib.models.tiny import tiny_qwen2_config

    torch.manual_seed(0)
    config = tiny_qwen2_config(
        QWEN2_VOCAB, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, max_position_embeddings=args.prompt_len + args.response_len,
    )
    model = Qwen2ForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    B, P, R = args.sequences, args.prompt_len, args.response_len
    prompt_lens = torch.randint(P // 2, P + 1, (B,), generator=g)
    response_lens = torch.randint(R // 2, R + 1, (B,), generator=g)
    pos = torch.arange(P + R)
    attn = ((pos >= P - prompt_lens[:, None]) & (pos < P + response_lens[:, None])).long()
    ids = torch.randint(1, QWEN2_VOCAB, (B, P + R), generator=g).masked_fill(attn == 0, 0)
    batch = {
        "input_ids": ids,
        "attention_mask": attn,
        "response_mask": (torch.arange(R) < response_lens[:, None]).float(),
        # near the log-prob of a random model (-log V), so ratios are O(1)
        "behavior_logp": -11.93 + 0.1 * torch.randn(B, R, generator=g),
        "advantages": torch.randn(B, generator=g),
    }
    return model, batch


def loss_fn(logp, entropy, batch, num_tokens):
    from m2po_rllib.losses import compute_policy_loss

    loss, _ = compute_policy_loss(
        "grpo_no_tr", logp, batch["behavior_logp"], batch["advantages"], batch["response_mask"] > 0,
        entropy=entropy, loss_agg_mode="token-mean", num_global_tokens=num_tokens, mask_scope="local",
    )
    return loss


def update(model, batch, args):
    from m2po_rllib.torch.logp import response_logp
    from m2po_rllib.torch.logp import response_logp_and_entropy

    model.zero_grad(set_to_none=True)
    num_tokens = batch["response_mask"].sum()
    R = batch["response_mask"].shape[1]
    if args.variant == "old":
        logp, entropy = response_logp_and_entropy(model, batch["input_ids"], batch["attention_mask"], R, temperature=args.temperature)
        loss_fn(logp, entropy, batch, num_tokens).backward()
        return
    for start in range(0, args.sequences, args.micro_batch):
        micro = {k: v[start : start + args.micro_batch] for k, v in batch.items()}
        logp, entropy = response_logp(model, micro, args.temperature, args.chunk)
        loss_fn(logp, entropy, micro, num_tokens).backward()


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    model, batch = build(args)
    out = {"variant": args.variant, "sequences": args.sequences, "response_len": args.response_len}
    _start_watchdog(_rss_mb("VmRSS") + args.mem_cap_gb * 1024, out)
    times = []
    try:
        update(model, batch, args)  # warm-up: torch's lazy set-up stays out of the figure
        model.zero_grad(set_to_none=True)  # the measured updates allocate the gradients again
        before_mb = _rss_mb("VmRSS")
        reset = _reset_peak_rss()
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            update(model, batch, args)
            times.append(time.perf_counter() - t0)
    except (RuntimeError, MemoryError) as e:
        out.update(status="oom", error=str(e).splitlines()[0][:200])
    else:
        peak = _rss_mb("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out.update(status="ok", time_s=min(times), peak_mb=peak - before_mb, peak_from="VmHWM" if reset else "ru_maxrss")
        if args.grad_out:
            torch.save({n: p.grad for n, p in model.named_parameters()}, args.grad_out)
    print(json.dumps(out))


# --------------------------------------------------------------------------------- parent
def run_variant(args, variant: str, sequences: int, grad_out: str | None) -> dict:
    cmd = [sys.executable, __file__, "--child", "--variant", variant, "--sequences", str(sequences)]
    for name in ("response_len", "prompt_len", "hidden", "layers", "micro_batch", "chunk", "temperature", "repeats", "threads", "mem_cap_gb"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if grad_out:
        cmd += ["--grad-out", grad_out]
    # glibc keeps freed blocks below its (dynamic) mmap threshold in the heap; a fixed small
    # threshold returns them to the OS, so RSS follows the live tensors.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        return {"variant": variant, "status": f"failed (exit {proc.returncode})", "error": tail[0][:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def grad_max_rel_diff(path_new: str, path_old: str) -> float:
    import torch

    new, old = torch.load(path_new), torch.load(path_old)
    return max(((new[n] - old[n]).abs().max() / old[n].abs().max()).item() for n in old)


def measure_size(args, sequences: int, tmp: str) -> dict:
    paths = {v: os.path.join(tmp, f"{v}-{sequences}.pt") for v in ("old", "new")}
    row = {"sequences": sequences, "response_len": args.response_len}
    for variant in ("old", "new"):
        row[variant] = run_variant(args, variant, sequences, paths[variant])
    old, new = row["old"], row["new"]
    if old["status"] == new["status"] == "ok":
        row["peak_memory_ratio"] = old["peak_mb"] / new["peak_mb"]
        row["time_ratio_new_over_old"] = new["time_s"] / old["time_s"]
        row["grad_max_rel_diff"] = grad_max_rel_diff(paths["new"], paths["old"])
    return row


def find_max_old(args) -> int:
    """Largest `find_from` x 2^k sequences whose old update fits the memory cap (0: none)."""
    best, n = 0, args.find_from
    search = argparse.Namespace(**{**vars(args), "repeats": 1})
    while True:
        res = run_variant(search, "old", n, None)
        print(f"  old path, {n} x {args.response_len}: {res['status']}" + (f", peak {res['peak_mb']:.0f} MB" if res["status"] == "ok" else ""), flush=True)
        if res["status"] != "ok":
            return best
        best, n = n, 2 * n


def fmt(res: dict) -> str:
    if res["status"] != "ok":
        return f"{res['status']:>22}"
    return f"{res['peak_mb']:>9.0f} MB {res['time_s']:>7.2f} s"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="auto", help="sequences per minibatch, comma-separated; auto: the largest the old path fits, and 4x")
    p.add_argument("--find-from", type=int, default=4, help="first size tried by the auto search")
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per forward/backward (new path)")
    p.add_argument("--chunk", type=int, default=128, help="positions per log-prob chunk (new path)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=2, help="timed updates after one warm-up; the fastest counts")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mem-cap-gb", type=float, default=None, help="per-child cap (default: available RAM - 1 GB)")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=["old", "new"], help=argparse.SUPPRESS)
    p.add_argument("--sequences", type=int, help=argparse.SUPPRESS)
    p.add_argument("--grad-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    if args.mem_cap_gb is None:
        import psutil

        args.mem_cap_gb = round(psutil.virtual_memory().available / 2**30 - 1, 1)
    load = os.getloadavg()
    print(f"stand-in Qwen2: vocab {QWEN2_VOCAB}, hidden {args.hidden}, {args.layers} layers; prompt {args.prompt_len}, "
          f"response {args.response_len}; new path: micro-batch {args.micro_batch}, chunk {args.chunk}; "
          f"memory cap {args.mem_cap_gb} GB per child; load average {load[0]:.2f}, {os.cpu_count()} CPUs", flush=True)
    result = {"config": {k: v for k, v in vars(args).items() if k not in ("child", "variant", "sequences", "grad_out")},
              "vocab_size": QWEN2_VOCAB, "load_average_at_start": load, "cpus": os.cpu_count()}
    if args.sizes == "auto":
        fits = find_max_old(args)
        if not fits:
            raise SystemExit(f"the old path does not fit {args.find_from} x {args.response_len} under {args.mem_cap_gb} GB; lower --find-from")
        result["old_max_sequences_fitting"] = fits
        print(f"largest minibatch the old path fits (of {args.find_from} x 2^k): {fits} x {args.response_len}", flush=True)
        sizes = [fits, 4 * fits]
    else:
        sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            rows.append(measure_size(args, size, tmp))
            print(f"  measured {size} x {args.response_len}", flush=True)
    result["sizes"] = rows
    fitting = [r for r in rows if "peak_memory_ratio" in r]
    if fitting:  # the headline: the largest size where the old path fits
        top = max(fitting, key=lambda r: r["sequences"])
        result.update(peak_memory_ratio=top["peak_memory_ratio"], time_ratio_new_over_old=top["time_ratio_new_over_old"],
                      grad_max_rel_diff=top["grad_max_rel_diff"], headline_size=f"{top['sequences']}x{args.response_len}")
    print(f"\n{'minibatch':>10} | {'old: peak, time':>22} | {'new: peak, time':>22} | {'peak old/new':>12} | {'time new/old':>12} | {'grad rel diff':>13}")
    for r in rows:
        extra = (f"{r['peak_memory_ratio']:>11.1f}x | {r['time_ratio_new_over_old']:>12.2f} | {r['grad_max_rel_diff']:>13.1e}"
                 if "peak_memory_ratio" in r else f"{'-':>12} | {'-':>12} | {'-':>13}")
        print(f"{r['sequences']:>4} x {r['response_len']:<4} | {fmt(r['old'])} | {fmt(r['new'])} | {extra}")
    result["load_average_at_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
