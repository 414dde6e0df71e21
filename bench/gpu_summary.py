"""The GPU check's table: reads what bench/gpu_check.sh's steps wrote under OUT (vllm.json,
learner.json, train.json), prints one table and writes bench/results/gpu.json.

    python bench/gpu_summary.py bench/results/gpu [--out bench/results/gpu.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


# The issue's goals on one H100/H200, beside what was measured.
GOALS = {"weight_load_s": "< 1 s", "mfu": ">= 0.30", "peak_vs_plan": "within 10% of 1.0"}


def train_rows(train: dict) -> list[tuple[str, str]]:
    """bench/gpu_train_check.py's figures (train.json)."""
    if not train:
        return []
    s = train.get("summary", {})

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    out = [
        ("train: config", f"{train.get('config')} ({train.get('mode')}, {train.get('device', {}).get('name')})"),
        ("train: iterations, updates", f"{s.get('iterations', 0)}, {s.get('updates', 0)}"),
        ("train: updates/s", fmt(s.get("updates_per_s"), ".3f")),
        ("train: rollout tokens/s", fmt(s.get("rollout_tokens_per_s"), ".0f")),
        ("train: weight load s", f"{fmt(s.get('weight_load_s'), '.3f')} (goal {GOALS['weight_load_s']})"),
        ("train: engine sleep / wake s", f"{fmt(s.get('engine_sleep_s'), '.2f')} / {fmt(s.get('engine_wake_s'), '.2f')}"),
        ("train: learner MFU", f"{fmt(s.get('mfu'), '.3f')} (goal {GOALS['mfu']})"),
        ("train: peak GPU memory GiB", f"{fmt(train.get('peak_gpu_memory_gib'), '.1f')} against the plan's "
                                       f"{fmt(train.get('plan', {}).get('peak_gib'), '.1f')} (ratio "
                                       f"{fmt(train.get('peak_vs_plan'), '.2f')}, goal {GOALS['peak_vs_plan']})"),
        ("train: log-prob mismatch mean / max", f"{fmt(s.get('logp_mismatch_mean'), '.2e')} / "
                                                f"{fmt(s.get('logp_mismatch_max'), '.2e')}"),
    ]
    return out


def rows(vllm: dict, learner: dict) -> list[tuple[str, str]]:
    out = []
    model = vllm.get("model", {})
    if model:
        n = model.get("params", 0)
        out.append(("model", f"{n / 1e9:.2f}B params" if n >= 1e8 else f"{n / 1e6:.2f}M params" + f", {model.get('dtype')}"))
    gen = vllm.get("generate", {})
    if gen:
        out.append(("raw vLLM generate", f"{gen['raw_tokens_per_s']:.0f} tok/s"))
        out.append(("runner engine generate", f"{gen['runner_tokens_per_s']:.0f} tok/s ({gen['runner_vs_raw']:.2f}x raw)"))
    for path, stats in vllm.get("sync", {}).items():
        if "median_s" in stats:
            out.append((f"sync {path}", f"{stats['median_s']:.3f} s median, {stats.get('bytes', 0) / 2**20:.0f} MiB"))
        elif "seconds" in stats:
            out.append((f"sync {path}", f"{stats['seconds']:.3f} s, {stats.get('bytes', 0) / 2**20:.0f} MiB"))
        else:
            out.append((f"sync {path}", stats.get("error") or stats.get("skipped", "?")))
    for key, value in vllm.get("agree", {}).items():
        out.append((f"check {key}", str(value)))
    for key, value in learner.items():
        if isinstance(value, (int, float, str)):
            out.append((f"learner {key}", str(value)))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", help="the directory gpu_check.sh wrote (OUT)")
    p.add_argument("--out", default="bench/results/gpu.json")
    args = p.parse_args()
    results = Path(args.results)
    vllm, learner, train = _load(results / "vllm.json"), _load(results / "learner.json"), _load(results / "train.json")
    table = rows(vllm, learner) + train_rows(train)
    width = max((len(k) for k, _ in table), default=0)
    for key, value in table:
        print(f"{key:<{width}}  {value}")
    Path(args.out).write_text(json.dumps({"vllm": vllm, "learner": learner, "train": train, "table": dict(table)},
                                         indent=2) + "\n")
    print(f"[gpu_summary] wrote {args.out}")
    return 0 if vllm else 1


if __name__ == "__main__":
    raise SystemExit(main())
