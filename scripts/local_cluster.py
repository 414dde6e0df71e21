"""A Ray cluster of several nodes on this machine, for trying a multi-node config before
renting nodes: a head and worker nodes, each a `ray start --block` of its own (own raylet,
object store, CPUs, custom resources, ports and temp dir). Prints the addresses, then holds
the cluster until Ctrl-C (or SIGTERM), and ends exactly its own processes (never `ray stop`).

    .venv/bin/python scripts/local_cluster.py --workers 1 \\
        --head-resources '{"learner_node": 1}' --worker-resources '{"rollout_node": 2}'
    # in another terminal, with the address it printed:
    RAY_ADDRESS=127.0.0.1:PORT RAY_AUTH_MODE=disabled m2po train --config configs/default.yaml \\
        'env_runners.num_env_runners=2' 'env_runners.custom_resources_per_env_runner={rollout_node: 1}'
    ray job submit --address http://127.0.0.1:PORT --working-dir . -- m2po train ...

The nodes' logs are under the printed root (`n0` the head, `n1`... the workers).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from m2po_rllib.jobs.local_cluster import LocalCluster


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=1, help="worker nodes besides the head (default 1)")
    p.add_argument("--head-cpus", type=int, default=2)
    p.add_argument("--worker-cpus", type=int, default=2)
    p.add_argument("--head-resources", type=json.loads, default={}, help='JSON, e.g. \'{"learner_node": 1}\'')
    p.add_argument("--worker-resources", type=json.loads, default={"rollout_node": 2},
                   help='JSON, each worker node\'s (default \'{"rollout_node": 2}\')')
    args = p.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster = LocalCluster(head_cpus=args.head_cpus, head_resources=args.head_resources)
    try:
        cluster.start()
        for _ in range(args.workers):
            cluster.add_worker(num_cpus=args.worker_cpus, resources=args.worker_resources)
        print(f"head + {args.workers} worker node(s) up; logs under {cluster.root}")
        print(f"  export RAY_ADDRESS={cluster.address} RAY_AUTH_MODE=disabled   # a driver here joins with these")
        print(f"  job API:    {cluster.dashboard_address}")
        print("Ctrl-C ends them.", flush=True)
        stop.wait()
    finally:
        survivors = cluster.stop()
        print("stopped" + (f"; still alive: {survivors}" if survivors else ""), flush=True)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
