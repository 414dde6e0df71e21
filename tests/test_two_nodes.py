"""Two Ray nodes on this machine (jobs/local_cluster.py): a head with the learner's custom
resource and a worker node with the runners', each a `ray start --block` of its own (own
raylet, object store, CPUs, ports and temp dir), as on two machines. `ray job submit` of
`m2po train` to the head, its runner on the worker node; async M2PO across the node boundary
with the worker node lost mid-run and replaced.

Each run is a driver process of its own (a submitted job; tests/_two_node_driver.py) joining
the cluster: the test session's own Ray stays as it is. Every node is ended by its own PIDs
(`ray stop` is never used: it kills every Ray on the machine).
"""

from __future__ import annotations

import json
import os
import queue
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from m2po_rllib.jobs.local_cluster import FAST_NODE_DEATH, LocalCluster

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
WORKER = dict(num_cpus=2, resources={"rollout_node": 2})
EVENT_TIMEOUT_S = 240
JOB_TIMEOUT_S = 420


@pytest.fixture(scope="module")
def two_nodes():
    cluster = LocalCluster(head_cpus=2, head_resources={"learner_node": 1}, system_config=FAST_NODE_DEATH)
    try:
        cluster.start()
        cluster.add_worker(**WORKER)
        yield cluster
    finally:
        survivors = cluster.stop()
        assert not survivors, f"processes of the test's Ray nodes survived their stop: {survivors}"


class Driver:
    """tests/_two_node_driver.py in a process of its own; `event(name)` waits for its line."""

    def __init__(self, args: dict, log_path: Path):
        env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(TESTS / "_two_node_driver.py"), json.dumps(args)],
            stdout=subprocess.PIPE, stderr=self._log, env=env, text=True,
        )
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
        pytest.fail(f"the driver did not say {name!r} (exit code {self.proc.poll()}); its log:\n"
                    f"{self.log_path.read_text(errors='replace')[-6000:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._log.close()


def _tiny_job_args(model_dir: str, output: Path) -> list[str]:
    from test_cli import _overrides  # the CLI tests' tiny run

    return [
        "train", "--stop-iters", "2", "--output", str(output), "--no-progress",
        # one runner, on the worker node (the resource only it offers); the learner in the driver
        "env_runners.num_env_runners=1", "env_runners.custom_resources_per_env_runner={rollout_node: 1}",
        "learners.num_learners=0", *_overrides(model_dir),
    ]


def test_a_train_job_submitted_to_the_head_runs_across_both_nodes(two_nodes, tiny_model_dir, tmp_path):
    """`ray job submit` for real (the README's cluster path): a tiny `m2po train` through the
    head's job API with the repository as `working_dir`; its runner lands on the worker node,
    its driver and learner on the head, as its summary.json and its header say."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    output = tmp_path / "run"
    train = shlex.join(["python", "-m", "m2po_rllib.jobs.cli", *_tiny_job_args(tiny_model_dir, output)])
    where = "python -c \"import m2po_rllib; print('m2po_rllib imported from', m2po_rllib.__file__)\""
    client = JobSubmissionClient(two_nodes.dashboard_address)
    job_id = client.submit_job(
        entrypoint=f"{where} && {train}",
        # The README's `--working-dir .`: the checkout, minus what .gitignore lists (.venv, runs).
        runtime_env={"working_dir": str(REPO), "env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
    )
    deadline = time.monotonic() + JOB_TIMEOUT_S
    status = client.get_job_status(job_id)
    while not status.is_terminal() and time.monotonic() < deadline:
        time.sleep(2)
        status = client.get_job_status(job_id)
    logs = client.get_job_logs(job_id)
    if status != JobStatus.SUCCEEDED:
        if not status.is_terminal():
            client.stop_job(job_id)
        info = client.get_job_info(job_id)
        pytest.fail(
            f"job {job_id} is {status} after {JOB_TIMEOUT_S} s at most (message: {info.message}); "
            f"job logs:\n{logs[-6000:]}\n`ray start` log:\n{two_nodes.head.log()}"
        )

    # `m2po train` joined this cluster (RAY_ADDRESS set by the job) rather than starting its own Ray.
    driver = client.get_job_info(job_id).driver_info
    assert driver is not None and driver.node_ip_address, f"no driver of job {job_id} connected to the head"
    # The job ran the uploaded working_dir, not an installed copy.
    imported = next(line for line in logs.splitlines() if line.startswith("m2po_rllib imported from"))
    assert f"{two_nodes.head.temp_dir}/" in imported and "working_dir_files" in imported, imported
    summary = json.loads((output / "summary.json").read_text())
    assert summary["iterations"] == 2
    # prompts 4 / minibatch 2 = 2 updates per step; staleness 2 = one step of queue lag, so
    # iteration 1 only fills the queue and iteration 2 trains.
    assert summary["policy_version"] == 2
    assert summary["run_dir"] == str(output)
    assert summary["interrupted"] is False
    assert summary["start_heldout_accuracy"] is not None and summary["end_heldout_accuracy"] is not None
    assert (output / "checkpoint").is_dir()
    assert "summary written to" in logs
    head, worker = two_nodes.head.node_id(), two_nodes.workers[0].node_id()
    assert summary["placement"] == {"driver": head, "env_runners": {"1": worker}, "learners": []}
    assert f"nodes: EnvRunner 1 on node {worker[:8]}" in logs and f"on node {head[:8]} (head" in logs


def _wait_dead(node, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while node.node_id() is not None:
        assert time.monotonic() < deadline, "the killed node was not marked dead"
        time.sleep(0.2)


def test_a_worker_node_lost_mid_run_loses_no_sample_and_its_runner_resumes_on_a_new_node(
        two_nodes, tiny_model_dir, tmp_path):
    """A vLLM runner on the worker node, a remote learner on the head, the weights broadcast
    natively (gloo) across the node boundary. The worker node's raylet is killed with rounds
    in flight (the runner and its engine die with it) and a new worker node joins: Ray
    restarts the runner there, the learner forms the group again with it and sends the
    current weights, the lost rounds are generated again, and every sample id is trained
    exactly once, within the bound."""
    head, worker = two_nodes.head.node_id(), two_nodes.workers[0].node_id()
    bound = 3
    driver = Driver(dict(address=two_nodes.address, model=tiny_model_dir, engine="vllm", runners=1, learners=1,
                         max_staleness=bound, before=3, after=3, deadline_s=180), tmp_path / "driver.log")
    try:
        placed = driver.event("placed")
        assert placed["env_runners"] == {"1": worker}  # the runner's resource is the worker node's
        assert placed["learners"] == [head] and placed["driver"] == head
        driver.event("lose-node")
        lost = two_nodes.workers[0]
        lost.kill_raylet()
        _wait_dead(lost)
        assert not two_nodes.remove_worker(lost)  # nothing of the lost node lives on
        new = two_nodes.add_worker(**WORKER).node_id()
        done = driver.event("done")
    finally:
        driver.close()
    assert done["back_at"] is not None and done["restarts"] >= 1
    assert done["placement"]["env_runners"] == {"1": new} and done["placement"]["learners"] == [head]
    ids = [i for step in done["trained"] for i in step["ids"]]
    assert sorted(ids) == list(range(len(ids)))  # none lost with the node, none trained twice
    assert max(done["ages"]) <= bound
    # native broadcasts crossed the node boundary before the loss, and a second group was
    # formed with the new runner, whose sends all went through
    native = [n for n in done["native"] if n["weights/native_connects"] == n["weights/native_connects"]]  # not NaN
    assert native[0] == {"weights/native_connects": 1, "weights/native_failures": 0}
    second = [n["weights/native_failures"] for n in native if n["weights/native_connects"] == 2]
    assert native[-1]["weights/native_connects"] == 2 and len(second) >= 2 and len(set(second)) == 1
    # the new runner was given the current weights (it starts from the model's own)
    assert min(done["served"]) > done["lost_at"]
    # the wait was said, with what the runner needs to come back
    assert any("down for" in n and "1 rollout_node" in n for n in done["notices"]), done["notices"]
    assert any("back after" in n for n in done["notices"])
