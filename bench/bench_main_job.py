"""Stale-k on a laptop: the main job's config under several losses and staleness levels.

Runs `m2po train` (configs/default.yaml, built-in model, 3-digit addition) once per variant,
for the same number of iterations, and reports held-out accuracy before/after, the best
held-out accuracy seen, masked/clipped fractions and wall-clock time. Figures go to stdout
and to bench/results/main_job.json.

    python bench/bench_main_job.py                       # the default set of variants
    python bench/bench_main_job.py --iters 200 --variants m2po-s256 grpo-s256
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "m2po-s0": ["training.policy_loss=m2po", "training.staleness=0"],
    "m2po-s64": ["training.policy_loss=m2po", "training.staleness=64"],
    "m2po-s256": ["training.policy_loss=m2po", "training.staleness=256"],
    "grpo-s256": ["training.policy_loss=grpo", "training.staleness=256"],
    "grpo_no_tr-s256": ["training.policy_loss=grpo_no_tr", "training.staleness=256"],
}


def run_variant(name: str, iters: int, out_root: Path, extra: list[str]) -> dict:
    out = out_root / name
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "m2po_rllib.jobs.cli", "train", "--config", "configs/default.yaml",
           "--stop-iters", str(iters), "--output", str(out), "--no-progress",
           "run.stop_minutes=null", *VARIANTS[name], *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"variant": name, "error": proc.stderr[-2000:]}
    summary = json.loads((out / "summary.json").read_text())
    history = json.loads((out / "history.json").read_text())
    evals = [(h["iteration"], h["heldout_accuracy"]) for h in history if h["heldout_accuracy"] is not None]
    masked = [
        h["masked_frac"] if h.get("masked_frac") is not None else h.get("clipped_frac")
        for h in history
        if h.get("masked_frac") is not None or h.get("clipped_frac") is not None
    ]
    return {
        "variant": name,
        "start": summary.get("start_heldout_accuracy"),
        "end": summary.get("end_heldout_accuracy"),
        "best": max((a for _, a in evals), default=None),
        "curve": evals,
        "mean_masked_frac": sum(masked) / len(masked) if masked else None,
        "train_seconds": summary["train_seconds"],
        "wall_seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=400)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out", default="/tmp/m2po-bench-main-job")
    p.add_argument("overrides", nargs="*", help="extra section.key=value for every variant")
    args = p.parse_args()
    rows = []
    for name in args.variants:
        row = run_variant(name, args.iters, Path(args.out), args.overrides)
        rows.append(row)
        if "error" in row:
            print(f"{name}: FAILED\n{row['error']}", flush=True)
            continue
        print(
            f"{name:<16} held-out {row['start']:.3f} -> {row['end']:.3f} (best {row['best']:.3f}) "
            f"masked/clipped {100 * (row['mean_masked_frac'] or 0):.2f}%  {row['train_seconds'] / 60:.1f} min",
            flush=True,
        )
    results = REPO / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "main_job.json").write_text(json.dumps({"iters": args.iters, "rows": rows}, indent=1))
    print(f"wrote {results / 'main_job.json'}")


if __name__ == "__main__":
    main()
