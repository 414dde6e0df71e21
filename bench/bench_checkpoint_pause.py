"""How long a checkpoint holds the run up with streaming runners: reading the rounds in flight
as far as they got (today's checkpoint) against waiting for them to finish (the drain it
replaced), on the long-tailed task (`configs/column_mixed_async.yaml`, `streaming=true`: answers
of 14-118 tokens, two HF runners, each engine step slowed by `--step-delay-ms` so that an answer
takes seconds, as long answers do on a GPU). One run, one process; the two kinds of save alternate
(snapshot, drain, snapshot, ...), each after 2 training iterations, into a temp dir. Prints the
seconds of each `save_to_path` (the call the training loop waits for) and writes
bench/results/checkpoint_pause[_vllm].json.

    python bench/bench_checkpoint_pause.py [--pairs 5] [--engine vllm]

`--engine vllm`: the two runners serve vLLM (on CPU here), whose groups in flight are read from
its output processor (`rollout/vllm_stream.py`). The drain is forced by making the snapshot
unavailable (`M2PO._snapshot_rounds` returning None, as it does for a multi-turn round
generating). Run with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
CONFIG = REPO / "configs" / "column_mixed_async.yaml"
OVERRIDES = ["env_runners.streaming=true", "evaluation.evaluation_interval=0", "training.logp_mismatch_interval=0"]
ENGINES = {"hf": ["env_runners.rollout_engine=hf"],
           "vllm": ["env_runners.rollout_engine=vllm", "env_runners.engine_kwargs={kv_cache_space_gb: 1, max_model_len: 256}"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--warm", type=int, default=4, help="training iterations before the first save")
    p.add_argument("--step-delay-ms", type=float, default=20.0,
                   help="added to every engine step: answers that take seconds, as long answers on a GPU do "
                        "(the tiny model makes a token in well under a millisecond here); 0: as it is")
    p.add_argument("--engine", choices=sorted(ENGINES), default="hf")
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray

    from m2po_rllib.config.algorithm_config import M2POConfig
    from m2po_rllib.config.from_yaml import apply_overrides, load_spec

    spec = apply_overrides(load_spec(str(CONFIG)), OVERRIDES + ENGINES[args.engine])
    spec.pop("run", None)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=tempfile.mkdtemp(prefix="m2po-ray-", dir="/tmp"))
    algo = M2POConfig.from_spec(spec).build_algo()
    delay_s = args.step_delay_ms / 1000

    def slow_steps(runner):
        engine = runner.host.engine
        step = engine.step
        engine.step = lambda: (time.sleep(delay_s), step())[1]

    if delay_s:
        algo.env_runner_group.foreach_env_runner(slow_steps, local_env_runner=False)
    snapshot = algo._snapshot_rounds
    seconds: dict[str, list[float]] = {"snapshot": [], "drain": []}
    try:
        for _ in range(args.warm):
            algo.train()
        with tempfile.TemporaryDirectory(prefix="m2po-ckpt-") as tmp:
            for i in range(2 * args.pairs):
                kind = "snapshot" if i % 2 == 0 else "drain"
                algo._snapshot_rounds = snapshot if kind == "snapshot" else (lambda: None)
                for _ in range(2):
                    algo.train()
                in_flight = algo.sampler.num_in_flight()
                t0 = time.perf_counter()
                algo.save_to_path(str(Path(tmp) / f"ckpt{i}"))
                seconds[kind].append(time.perf_counter() - t0)
                print(f"save {i} ({kind}): {seconds[kind][-1]:.2f} s, {in_flight} rounds in flight before it",
                      flush=True)
    finally:
        algo.stop()
        ray.shutdown()
    out = {k: {"seconds": [round(s, 3) for s in v], "median_s": round(statistics.median(v), 3)}
           for k, v in seconds.items()}
    ratios = sorted(d / s for s, d in zip(seconds["snapshot"], seconds["drain"]))
    out["drain_over_snapshot_per_pair"] = [round(r, 2) for r in ratios]
    out["date"], out["cpus"], out["step_delay_ms"] = time.strftime("%Y-%m-%d"), os.cpu_count(), args.step_delay_ms
    out["engine"] = args.engine
    print(f"snapshot: median {out['snapshot']['median_s']:.2f} s ({min(seconds['snapshot']):.2f}-"
          f"{max(seconds['snapshot']):.2f}); drain: median {out['drain']['median_s']:.2f} s "
          f"({min(seconds['drain']):.2f}-{max(seconds['drain']):.2f}); drain / snapshot per pair "
          f"{statistics.median(ratios):.1f}x ({ratios[0]:.1f}-{ratios[-1]:.1f})")
    path = RESULTS / ("checkpoint_pause.json" if args.engine == "hf" else f"checkpoint_pause_{args.engine}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
