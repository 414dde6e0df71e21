"""Throughput of the verifier reward, and the worst case of one hostile sample.

Run: `python bench/bench_reward.py` (about a minute; `--quick` for shorter runs).
Prints the figures and writes bench/results/reward.json.

- fast path: GSM8K-style completions ("... #### 42") with integer golds, scored one by one
  with `MathVerifier.score` and in batches with `score_batch`, in this process (one core).
- slow path: MATH-style LaTeX answers that the fast path cannot decide (\\sqrt, \\pi,
  sets, expressions), scored with `score_batch` on `--workers` math-verify children;
  the per-core figure divides by the number of children. Child start-up is excluded.
- hostile: each sample of `HOSTILE` once on a warm verifier with the default settings;
  the worst wall time is the bound a rollout worker can see for one sample.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from envs import MathVerifier

MATH_PAIRS = [
    (r"so $\boxed{\sqrt{8}}$", r"2\sqrt{2}"),
    (r"\boxed{\frac{\pi}{2}}", r"\pi/2"),
    (r"\boxed{x^2 + 2x + 1}", r"(x+1)^2"),
    (r"\boxed{\{2, -2\}}", r"\{-2, 2\}"),
    (r"\boxed{9\pi}", r"9\pi"),
    (r"\boxed{(1, 3]}", r"(1,3]"),
    (r"\boxed{\dfrac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}"),
    (r"\boxed{5\sqrt{2}}", r"\sqrt{50}"),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{2}"),
    (r"\boxed{\frac{7}{3}\pi}", r"\frac{7\pi}{3}"),
]
HOSTILE = {
    "power tower": r"\boxed{9^{9^{9^{9}}}}",
    "factorial": r"\boxed{(10^{10})!}",
    "huge product": r"\boxed{99999999^{99999999} \cdot 88888888^{88888888}}",
    "12-deep parens": r"\boxed{" + "(" * 12 + "1" + ")" * 12 + "}",
    "10k nested braces": r"\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}",
    "1 MB text": "7" * 1_000_000,
    "python payload": r"\boxed{__import__('os').system('true')}",
}


def rate(fn, items: int, seconds: float) -> float:
    fn()  # warm-up
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        done += items
    return done / (time.perf_counter() - start)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def gsm8k_pairs(n: int) -> list[tuple[str, str]]:
    rng = random.Random(0)
    pairs = []
    for _ in range(n):
        a, b = rng.randint(1, 500), rng.randint(1, 500)
        answer = a * b
        completion = (
            f"Each box holds {a} pens and there are {b} boxes, so there are "
            f"{a} * {b} = {answer} pens in total.\n#### {answer:,}"
        )
        pairs.append((completion, str(answer + rng.choice([0, 0, 1]))))
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter timing windows")
    parser.add_argument("--workers", type=int, default=2, help="math-verify children for the slow path")
    args = parser.parse_args()
    window = 1.0 if args.quick else 3.0
    results: dict = {"cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}

    fast = MathVerifier()
    pairs = gsm8k_pairs(2000)
    results["fast_score_per_s_per_core"] = rate(lambda: [fast.score(c, g) for c, g in pairs], len(pairs), window)
    results["fast_batch_per_s_per_core"] = rate(lambda: fast.score_batch(pairs), len(pairs), window)
    assert fast.metrics()["reward/slow_path"] == 0, "GSM8K-style answers must stay on the fast path"

    with MathVerifier(num_workers=args.workers) as slow:
        batch = MATH_PAIRS * 4
        rewards = slow.score_batch(batch)  # also starts the children
        assert rewards[: len(MATH_PAIRS)] == [1.0] * 8 + [0.0, 1.0], rewards
        per_s = rate(lambda: slow.score_batch(batch), len(batch), 3 * window)
        results["slow_batch_per_s"] = per_s
        results["slow_batch_per_s_per_core"] = per_s / args.workers
        results["slow_workers"] = args.workers
        results["slow_child_rss_mb"] = max(rss_mb(pid) for pid in slow.child_pids())

    with MathVerifier() as hostile:
        hostile.score(r"\boxed{\sqrt 2}", r"\sqrt{2}")
        results["hostile_deadline_s"] = hostile.deadline_s
        times = {}
        for name, text in HOSTILE.items():
            hostile.score(r"\boxed{\sqrt 2}", r"\sqrt{2}")  # a warm child, as in steady state
            start = time.perf_counter()
            verdict = hostile.check(text, r"\sqrt{2}")
            times[name] = {"seconds": time.perf_counter() - start, "verifier": verdict.verifier}
        results["hostile"] = times
        results["hostile_worst_s"] = max(t["seconds"] for t in times.values())

    print(f"fast path, score():       {results['fast_score_per_s_per_core']:>10,.0f} /s/core")
    print(f"fast path, score_batch(): {results['fast_batch_per_s_per_core']:>10,.0f} /s/core")
    print(
        f"slow path, {args.workers} children:    {results['slow_batch_per_s']:>10,.0f} /s "
        f"({results['slow_batch_per_s_per_core']:,.0f} /s/core), child RSS {results['slow_child_rss_mb']:.0f} MB"
    )
    for name, t in times.items():
        print(f"hostile {name:<18} {t['seconds']:6.2f} s  ({t['verifier']})")
    print(f"hostile worst case:       {results['hostile_worst_s']:.2f} s (hard deadline {hostile.deadline_s:.0f} s)")
    out = Path(__file__).parent / "results" / "reward.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
