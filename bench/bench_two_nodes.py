"""A worker node lost mid-run and replaced, timed: async M2PO on a two-node cluster on this
machine (jobs/local_cluster.py), a vLLM runner on the worker node, a remote learner on the
head and native weight broadcasts (gloo) across the node boundary. The worker node's raylet is
SIGKILLed after a few iterations and a new worker node started; the run goes on.

Prints, per repeat: seconds from the loss to the runner serving again and to the native group
formed again, the native connects and failures, whether every sample id was trained exactly
once and every row within the bound; writes bench/results/two_nodes.json.

    python bench/bench_two_nodes.py [--engine vllm|hf] [--repeats 1]

The node's death is noticed in ~2 s here (FAST_NODE_DEATH; Ray's default is ~15 s), and a
vLLM engine's start on this CPU is most of the rest. Run with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from two_node_driver import DriverProcess

from m2po_rllib.jobs.local_cluster import FAST_NODE_DEATH, LocalCluster

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
RESULTS = Path(__file__).parent / "results" / "two_nodes.json"
WORKER = dict(num_cpus=2, resources={"rollout_node": 2})
BOUND = 3


def one_run(engine: str, model: str, log_dir: Path) -> dict:
    with LocalCluster(head_resources={"learner_node": 1}, system_config=FAST_NODE_DEATH) as cluster:
        cluster.add_worker(**WORKER)
        runners = 1 if engine == "vllm" else 2
        t0 = time.monotonic()
        driver = DriverProcess(dict(address=cluster.address, model=model, engine=engine, runners=runners, learners=1,
                                    max_staleness=BOUND, before=3, after=3, deadline_s=300), log_dir / "driver.log",
                               cluster.driver_env())
        try:
            placed = driver.event("placed")
            built_s = time.monotonic() - t0
            driver.event("lose-node")
            t_lost = time.monotonic()
            survivors = cluster.lose_worker(cluster.workers[0])
            dead_s = time.monotonic() - t_lost
            new = cluster.add_worker(**WORKER).node_id()
            done = driver.event("done")
        finally:
            driver.close()
    ids = sorted(i for step in done["trained"] for i in step["ids"])
    native = [n for n in done["native"] if isinstance(c := n["weights/native_connects"], (int, float)) and c == c]
    return {
        "engine": engine, "runners": runners, "build_s": round(built_s, 1), "loss_noticed_s": round(dead_s, 1),
        "runners_back_s": done["back_s"] and round(done["back_s"], 1),
        "group_formed_again_s": done["regrouped_s"] and round(done["regrouped_s"], 1),
        "native_last": native[-1] if native else None,
        "ids_exactly_once": ids == list(range(len(ids))), "rows": len(ids), "max_age": max(done["ages"]),
        "bound": BOUND, "runners_moved": set(done["placement"]["env_runners"].values()) == {new}
        and set(placed["env_runners"].values()) != {new}, "survivors": survivors, "notices": done["notices"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    from m2po_rllib.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="m2po-2n-") as tmp:
        model = build_tiny_model(Path(tmp) / "tiny", seed=0)
        runs = [one_run(args.engine, model, Path(tmp)) for _ in range(args.repeats)]
    print(f"{'engine':6} {'build s':>8} {'noticed s':>9} {'back s':>7} {'regroup s':>9} {'native c/f':>10} "
          f"{'ids once':>8} {'max age':>7}")
    for r in runs:
        n = r["native_last"] or {}
        cf = f"{n.get('weights/native_connects', 0):g}/{n.get('weights/native_failures', 0):g}" if n else "-"
        print(f"{r['engine']:6} {r['build_s']:8.1f} {r['loss_noticed_s']:9.1f} {r['runners_back_s'] or float('nan'):7.1f} "
              f"{r['group_formed_again_s'] or float('nan'):9.1f} {cf:>10} {str(r['ids_exactly_once']):>8} "
              f"{r['max_age']:>4g}/{r['bound']}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": platform.node(), "cpus": os.cpu_count(),
                                   "date": time.strftime("%Y-%m-%d"), "runs": runs}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
