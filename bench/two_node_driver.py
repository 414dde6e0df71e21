"""The driver of the lost-node case, in a process of its own (the caller's own Ray, if any,
stays as it is): tests/test_two_nodes.py runs it with HF runners, bench_two_nodes.py with a
vLLM runner and native weight sync. Joins the two-node cluster at `address`, builds async
M2PO with its EnvRunners pinned to the worker node (the custom resource `rollout_node`) and
its learner on the head (`learner_node`), and trains. After `before` iterations it says
"lose-node" (the caller then kills the worker node's raylet and starts a new worker node) and
trains on until every runner is back and `after` more iterations are trained, then says
"done" with its record (and the seconds from the loss to the runners back, and to the native
group formed again). Lines for the caller start with "@@ " and hold one JSON object.

    python bench/two_node_driver.py '{"address": ..., "model": ..., "engine": "vllm", ...}'
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
EVENT_TIMEOUT_S = 240


def say(event: str, **fields) -> None:
    print("@@ " + json.dumps({"event": event, **fields}), flush=True)


def config(args: dict):
    from m2po_rllib import M2POConfig

    engine = args["engine"]
    runners = dict(
        num_env_runners=args["runners"], rollout_engine=engine, max_new_tokens=6, num_cpus_per_env_runner=1,
        custom_resources_per_env_runner={"rollout_node": 1},
    )
    if engine == "vllm":
        runners.update(engine_kwargs={"kv_cache_space_gb": 1, "max_model_len": 64}, weight_sync="native")
    return (
        M2POConfig()
        .environment("m2po/Arithmetic-v0", env_config={"digits": 2, "template": "compact"})
        .env_runners(**runners)
        .learners(num_learners=args["learners"], num_cpus_per_learner=1,
                  custom_resources_per_learner={"learner_node": 1} if args["learners"] else {})
        .rl_module(model_config={"model": args["model"]})
        # weight decay moves every weight each update: a runner serving stale weights shows
        .training(group_size=4, prompts_per_step=4, minibatch_prompts=2, lr=1e-2, weight_decay=0.5,
                  async_rollouts=True, max_staleness=args["max_staleness"], logp_mismatch_interval=0)
        .fault_tolerance(restart_failed_env_runners=True, delay_between_env_runner_restarts_s=1)
        .debugging(seed=0)
    )


def main(args: dict) -> None:
    import ray

    ray.init(address=args["address"], log_to_driver=False)
    from m2po_rllib.common import keys
    from m2po_rllib.driver.resources import placement
    from m2po_rllib.rollout import runners_down

    notices: list[str] = []  # what the run said while its runners were down

    class Notices(logging.Handler):
        def emit(self, record):
            notices.append(record.getMessage())

    runners_down.logger.addHandler(Notices())

    algo = config(args).build_algo()
    trained: list[dict] = []  # per trained step: its sample ids and each row's policy version
    update = algo.learner_group.update

    def spy(*a, **kw):
        rows = kw["batch"].policy_batches["default_policy"]
        trained.append({"ids": np.asarray(rows["sample_id"]).tolist(),
                        "versions": np.asarray(rows["policy_version"]).tolist()})
        return update(*a, **kw)

    algo.learner_group.update = spy
    say("placed", **placement(algo))
    ages, native = [], []

    def train() -> dict:
        result = algo.train()
        # with a remote learner, an iteration may end before any update of its step reports
        learned = result.get("learners", {}).get("default_policy", {})
        if "staleness/trained_max" in learned:
            ages.append(learned["staleness/trained_max"])
        native.append({k: result.get(k) for k in (keys.NATIVE_SYNC_CONNECTS, "weights/native_failures")})
        return result

    for _ in range(args["before"]):
        train()
    lost_at = algo.policy_version
    say("lose-node", version=lost_at)
    t_lost = time.monotonic()
    deadline = t_lost + args["deadline_s"]
    back_at = back_s = regrouped_s = None
    while time.monotonic() < deadline:
        result = train()
        back = (result["fault_tolerance"]["num_remote_worker_restarts"] >= args["runners"]
                and len(algo.env_runner_group.healthy_env_runner_ids()) == args["runners"])
        if back and back_at is None:
            back_at, back_s = algo.iteration, time.monotonic() - t_lost
        if regrouped_s is None and (native[-1][keys.NATIVE_SYNC_CONNECTS] or 0) >= 2:
            regrouped_s = time.monotonic() - t_lost
        if back_at is not None and algo.iteration >= back_at + args["after"]:
            break
    served = algo.env_runner_group.foreach_env_runner(lambda r: r.host.served_version, local_env_runner=False)
    say("done", lost_at=lost_at, back_at=back_at, back_s=back_s, regrouped_s=regrouped_s, version=algo.policy_version, iteration=algo.iteration,
        trained=trained, ages=ages, native=native, served=served, notices=notices, placement=placement(algo),
        restarts=result["fault_tolerance"]["num_remote_worker_restarts"])
    algo.stop()
    ray.shutdown()


class DriverProcess:
    """This script in a process of its own (its stderr in `log_path`); `event(name)` waits for
    its line and returns it."""

    def __init__(self, args: dict, log_path: Path, env: dict[str, str]):
        """`env`: the driver's environment (`LocalCluster.driver_env()`)."""
        env = dict(env, PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}")
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, __file__, json.dumps(args)], stdout=subprocess.PIPE,
                                     stderr=self._log, env=env, text=True)
        self._events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self._events.put(json.loads(line[3:]))
        self._events.put({"event": "exit"})

    def event(self, name: str, timeout_s: float = EVENT_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                event = self._events.get(timeout=1)
            except queue.Empty:
                continue
            if event["event"] == name:
                return event
            if event["event"] == "exit":
                break
        self.proc.kill()
        raise RuntimeError(f"the driver did not say {name!r} (exit code {self.proc.poll()}); its log:\n"
                           f"{self.log_path.read_text(errors='replace')[-6000:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._log.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
