"""GPU check of a whole training run: the one-GPU config (configs/qwen3_1.7b_1gpu_colocated.yaml:
vLLM colocated with the learner, asleep during updates) trained for a few minutes through the
RLlib API, on a random model of Qwen3-1.7B's layout built here (the GPU machine reaches no hub)
with the project's char tokenizer, on the built-in arithmetic task (no dataset there).

    python bench/gpu_train_check.py --out bench/results/gpu/train.json [--minutes 1.5]
    python bench/gpu_train_check.py --dry-run --out /tmp/train.json   # CPU: a tiny Qwen3, the HF engine

Measured per iteration and summed up (the JSON is rewritten after every iteration, so a run cut
short still reports what it measured): optimizer updates/s once training runs (the stale queue
filled), rollout tokens/s (the engine's, per round), weight-load seconds into the engine, the
engine's sleep and wake seconds, the learner's trained tokens/s and its model FLOPs utilization
(6 x parameters a token, against the GPU's dense bf16 peak), the peak memory of the whole GPU
(nvidia-smi, both processes: the learner's and vLLM's engine core) against `m2po plan`'s figure
for the same settings, and the engine/learner log-prob mismatch of each step (the config
recomputes the behaviour log-probs in the learner).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CONFIG = REPO / "configs" / "qwen3_1.7b_1gpu_colocated.yaml"
SHIPPED = REPO / "m2po_rllib" / "assets" / "model_configs" / "Qwen" / "Qwen3-1.7B-Base"
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512)  # fmt: skip
# Dense bf16 peak (no sparsity), by the name torch reports.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}
MAX_ITERATIONS = 12


def overrides(model: str, dry_run: bool) -> list[str]:
    """The config's settings, shortened to minutes on the built-in task (and to seconds on CPU)."""
    common = [
        f"rl_module.model_config.model={model}",
        "environment.env=m2po/Arithmetic-v0",
        "environment.env_config={digits: 3, template: compact}",
        "evaluation.evaluation_interval=null",
    ]
    if dry_run:
        return common + [
            "env_runners.rollout_engine=hf", "env_runners.engine_kwargs={}", "env_runners.max_new_tokens=8",
            "learners.num_gpus_per_learner=0", "resources.num_cpus_for_main_process=1",
            "rl_module.model_config.dtype=float32", "rl_module.model_config.gradient_checkpointing=false",
            "training.group_size=4", "training.prompts_per_step=4", "training.minibatch_prompts=2",
            "training.staleness=2", "training.micro_batch_size=null",
        ]
    return common + [
        "env_runners.max_new_tokens=256",
        "env_runners.engine_kwargs={dtype: bfloat16, gpu_memory_utilization: 0.5, max_model_len: 1024}",
        "training.prompts_per_step=64", "training.minibatch_prompts=16", "training.staleness=4",
        "training.micro_batch_size=16",
    ]


def build_model(path: Path, device: str, dry_run: bool) -> int:
    """A random model of Qwen3-1.7B-Base's layout (its shipped config.json; tiny on a dry run)
    with the char tokenizer, saved to `path` (bf16 on a GPU); returns its parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from m2po_rllib.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    shapes = json.loads((SHIPPED / "config.json").read_text())
    if dry_run:
        shapes.update(TINY, vocab_size=len(tokenizer))
        shapes.pop("layer_types", None)  # one per layer: derived again for the tiny depth
    shapes["vocab_size"] = max(shapes["vocab_size"], len(tokenizer))
    config = AutoConfig.for_model(shapes.pop("model_type"), **shapes)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    dtype = torch.float32 if dry_run else torch.bfloat16
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    del model
    return params


class GpuMemory:
    """The whole GPU's used memory (every process on it), sampled by nvidia-smi; None off GPU."""

    def __init__(self, every_s: float = 0.5):
        self.peak_mib: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)

    def _run(self, every_s: float) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                      "--id=0"], capture_output=True, text=True, timeout=5).stdout
                used = float(out.strip().splitlines()[0])
                self.peak_mib = used if self.peak_mib is None else max(self.peak_mib, used)
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                return
            self._stop.wait(every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=6)


def _get(result: dict, *path):
    for key in path:
        if not isinstance(result, dict) or key not in result:
            return None
        result = result[key]
    return result


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(records: list[dict], params: int, peak_flops: float | None) -> dict:
    """The run's figures from its iterations' records (see the module docstring)."""
    from m2po_rllib.common import keys

    training = [r for r in records if r["updates"] > 0]  # the queue has filled
    out: dict = {"iterations": len(records), "updates": records[-1]["policy_version"] if records else 0}
    if len(training) >= 2:
        first, last = training[0], training[-1]
        out["updates_per_s"] = (last["policy_version"] - first["policy_version"]) / (last["t"] - first["t"])
    for name, key in (("rollout_tokens_per_s", keys.TOKENS_PER_S), ("weight_load_s", keys.WEIGHT_SYNC_S),
                      ("engine_sleep_s", keys.ENGINE_SLEEP_S), ("engine_wake_s", keys.ENGINE_WAKE_S),
                      ("learner_tokens_per_s", keys.TOKENS_TRAINED_PER_S),
                      ("logp_mismatch_mean", keys.LOGP_MISMATCH_MEAN), ("logp_mismatch_max", keys.LOGP_MISMATCH_MAX),
                      ("logp_mismatch_kl", keys.LOGP_MISMATCH_KL)):
        out[name] = _mean(r.get(key) for r in records)
    if out.get("learner_tokens_per_s") and peak_flops:
        out["mfu"] = 6 * params * out["learner_tokens_per_s"] / peak_flops
    return out


def record(result: dict, t: float, previous_version: int) -> dict:
    from m2po_rllib.common import keys

    version = int(result[keys.POLICY_VERSION])
    row = {"t": t, "policy_version": version, "updates": version - previous_version}
    for key in (keys.TOKENS_PER_S, keys.WEIGHT_SYNC_S):
        row[key] = _get(result, *keys.RUNNERS, key)
    for key in (keys.ENGINE_SLEEP_S, keys.ENGINE_WAKE_S, keys.TOKENS_TRAINED_PER_S, keys.LOGP_MISMATCH_MEAN,
                keys.LOGP_MISMATCH_MAX, keys.LOGP_MISMATCH_KL):
        row[key] = result.get(key)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, default=1.5, help="training time after the build (default 1.5)")
    p.add_argument("--dry-run", action="store_true", help="CPU: a tiny Qwen3 and the HF engine, 3 iterations")
    args = p.parse_args()
    import torch

    from m2po_rllib.common.durable import write_json
    from m2po_rllib.config.algorithm_config import M2POConfig
    from m2po_rllib.jobs.plan import GiB, plan

    on_gpu = torch.cuda.is_available() and not args.dry_run
    if not on_gpu and not args.dry_run:
        print("[gpu_train_check] no CUDA device: run with --dry-run on CPU", file=sys.stderr)
        return 2
    report: dict = {"mode": "gpu" if on_gpu else "dry-run", "config": str(CONFIG.relative_to(REPO))}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        write_json(out, report, default=str)

    device_name = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    peak_flops = next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_name), None) if on_gpu else None
    report["device"] = {"name": device_name, "peak_bf16_flops": peak_flops}
    with tempfile.TemporaryDirectory(prefix="m2po-gpu-train-") as tmp:
        model_dir = Path(tmp) / "qwen3-1.7b-layout-random"
        t0 = time.perf_counter()
        params = build_model(model_dir, "cuda" if on_gpu else "cpu", args.dry_run)
        report["model"] = {"layout": "Qwen3-1.7B-Base" + (" (tiny dimensions)" if args.dry_run else ""),
                           "params": params, "build_s": time.perf_counter() - t0}
        settings = overrides(str(model_dir), args.dry_run)
        report["overrides"] = settings
        planned = plan(str(CONFIG), gpu_memory_gb=(torch.cuda.get_device_properties(0).total_memory / GiB
                                                     if on_gpu else 80.0), overrides=settings, gpus=1)
        colocated = planned["colocated"] or {}
        report["plan"] = {"gpu_memory_gb": planned["gpu_memory_gb"],
                          "peak_gib": max(colocated.get("rollouts", 0.0), colocated.get("updates", 0.0)) / GiB,
                          "fits": bool(colocated.get("fits"))}
        save()
        config = M2POConfig.from_yaml(str(CONFIG), overrides=settings)
        from m2po_rllib.jobs.local_ray import init_ray

        init_ray(worker_logs=False)  # as `m2po train`: a lean local Ray of its own (or RAY_ADDRESS's)
        records: list[dict] = []
        with GpuMemory() as memory:
            t0 = time.perf_counter()
            algo = config.build_algo()
            report["build_s"] = time.perf_counter() - t0
            try:
                version, t0 = 0, time.perf_counter()
                limit = 3 if args.dry_run else MAX_ITERATIONS
                while len(records) < limit and (args.dry_run or time.perf_counter() - t0 < 60 * args.minutes):
                    result = algo.train()
                    records.append(record(result, time.perf_counter() - t0, version))
                    version = records[-1]["policy_version"]
                    report["records"] = records
                    report["summary"] = summarize(records, params, peak_flops)
                    report["peak_gpu_memory_gib"] = None if memory.peak_mib is None else memory.peak_mib / 1024
                    save()
                    print(f"[gpu_train_check] iteration {len(records)}: {json.dumps(records[-1], default=str)}",
                          flush=True)
            finally:
                algo.stop()
        peak = None if memory.peak_mib is None else memory.peak_mib / 1024
        report["peak_gpu_memory_gib"] = peak
        if peak is not None and report["plan"]["peak_gib"]:
            report["peak_vs_plan"] = peak / report["plan"]["peak_gib"]
        save()
    summary = report.get("summary", {})
    print(f"[gpu_train_check] {json.dumps(summary, default=str)}; peak GPU memory {peak} GiB against the plan's "
          f"{report['plan']['peak_gib']:.1f}")
    return 0 if summary.get("updates") else 1


if __name__ == "__main__":
    raise SystemExit(main())
