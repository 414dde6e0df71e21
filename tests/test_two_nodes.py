"""Two Ray nodes on this machine (jobs/local_cluster.py): a head with the learner's custom
resource and a worker node with the runners', each a `ray start --block` of its own (own
raylet, object store, CPUs, ports, temp dir and loopback IP), as on two machines:
- `ray job submit` of `m2po train` to the head, its runner on the worker node;
- `m2po lab` with a trial on each node, the worker node lost: its trial retried from its
  checkpoint;
- async M2PO across the node boundary, the worker node lost mid-run and replaced.

Each run is a driver process of its own (a submitted job, `m2po lab`, bench/two_node_driver.py)
joining the cluster: the test session's own Ray stays as it is. Every node is ended by its own
PIDs (`ray stop` is never used: it kills every Ray on the machine).
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from m2po_rllib.jobs.local_cluster import FAST_NODE_DEATH, LocalCluster

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
DRIVER = REPO / "bench" / "two_node_driver.py"


def _driver_module():
    """bench/two_node_driver.py, whose `DriverProcess` runs it (the bench and this test share it)."""
    spec = importlib.util.spec_from_file_location("two_node_driver", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
WORKER = dict(num_cpus=2, resources={"rollout_node": 2})
EVENT_TIMEOUT_S = 240  # the lab's wait for its worker-node trial's checkpoint, and its end
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
        time.sleep(0.5)
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


LAB_BASE = {
    "environment": {"env": "m2po/Arithmetic-v0", "env_config": {"digits": 2}},
    "env_runners": {"num_env_runners": 0, "rollout_engine": "hf", "max_new_tokens": 4},
    "resources": {"num_cpus_for_main_process": 2},  # a trial fills a node: one per node
    "training": {"group_size": 4, "prompts_per_step": 4, "minibatch_prompts": 2, "staleness": 2},
    "evaluation": {"evaluation_interval": 0},
}


def _results(trial_dir: Path) -> list[dict]:
    path = trial_dir / "result.json"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_a_lab_runs_trials_on_both_nodes_and_retries_the_lost_nodes_trial_from_its_checkpoint(
        two_nodes, tiny_model_dir, tmp_path):
    """`m2po lab` on the two-node cluster: two trials of 2 CPUs, one per node (Tune's `node_ip`
    tells them apart). Once the worker node's trial has a checkpoint, the node is killed and a
    new one started: Tune retries that trial from its checkpoint (`max_failures`), and the lab
    ends with both trials done."""
    import yaml

    (tmp_path / "base.yaml").write_text(yaml.safe_dump(
        {**LAB_BASE, "rl_module": {"model_config": {"model": tiny_model_dir}}}))
    every = 4
    (tmp_path / "space.yaml").write_text(yaml.safe_dump({
        "name": "two-nodes", "base": "base.yaml", "grid": {"debugging.seed": [0, 1]},
        "stop": {"policy_version": 40}, "checkpoint_every": every, "max_failures": 2}))
    out = tmp_path / "lab"
    worker = two_nodes.workers[0]
    env = two_nodes.driver_env()
    log = tmp_path / "lab.log"
    with open(log, "wb") as f:
        lab = subprocess.Popen([sys.executable, "-m", "m2po_rllib.jobs.cli", "lab", "--space", str(tmp_path / "space.yaml"),
                                "--out", str(out), "--no-report"], stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        lost = None
        while lost is None and lab.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            for trial in out.glob("0*"):
                rows = _results(trial)
                if rows and rows[-1]["node_ip"] == worker.ip and any(trial.glob("checkpoint_*")):
                    lost = trial.name
                    break
        assert lost, f"no trial checkpointed on the worker node; the lab's log:\n{log.read_text()[-4000:]}"
        assert not two_nodes.lose_worker(worker)
        new = two_nodes.add_worker(**WORKER)
        lab.wait(timeout=EVENT_TIMEOUT_S)
    finally:
        if lab.poll() is None:
            lab.kill()
    assert lab.returncode == 0, log.read_text()[-4000:]
    trials = {t.name: _results(t) for t in out.glob("0*")}
    assert len(trials) == 2
    for rows in trials.values():
        assert rows[-1]["policy_version"] >= 40  # both trials ran to their stop
    (kept,) = [rows for name, rows in trials.items() if name != lost]
    assert {r["node_ip"] for r in kept} == {kept[0]["node_ip"]} != {worker.ip}  # the head's, throughout
    rows = trials[lost]
    retried = [r for r in rows if r["iterations_since_restore"] < r["training_iteration"]]
    assert rows[0]["node_ip"] == worker.ip and retried and retried[0]["node_ip"] in (new.ip, kept[0]["node_ip"])
    # it went on from a checkpoint, not from the start: the first iteration after the retry
    # follows a checkpointed one
    resumed_from = retried[0]["training_iteration"] - retried[0]["iterations_since_restore"]
    assert resumed_from > 0 and resumed_from % every == 0
    # `m2po report` reads it as finished, each iteration once (its last attempt's)
    from m2po_rllib.jobs.runs import find_runs

    (run,) = [r for r in find_runs([str(out)]) if r.path.name == lost]
    iterations = [h["iteration"] for h in run.history]
    assert run.note == "" and iterations == list(range(1, rows[-1]["training_iteration"] + 1))


def test_a_worker_node_lost_mid_run_loses_no_sample_and_its_runners_resume_on_a_new_node(
        two_nodes, tiny_model_dir, tmp_path):
    """Two HF runners on the worker node, a remote learner on the head. The worker node's
    raylet is killed with rounds in flight (its runners die with it) and a new worker node
    joins: Ray restarts the runners there, they get the current weights, the lost rounds are
    generated again, and every sample id is trained exactly once, within the bound. (The same
    with a vLLM runner and native broadcasts across the nodes: bench/bench_two_nodes.py.)"""
    head, worker = two_nodes.head.node_id(), two_nodes.workers[0].node_id()
    bound = 3
    driver = _driver_module().DriverProcess(dict(address=two_nodes.address, model=tiny_model_dir, engine="hf", runners=2, learners=1,
                         max_staleness=bound, before=3, after=4, deadline_s=180), tmp_path / "driver.log",
                                                    two_nodes.driver_env())
    try:
        placed = driver.event("placed")
        assert placed["env_runners"] == {"1": worker, "2": worker}  # the runners' resource is the worker's
        assert placed["learners"] == [head] and placed["driver"] == head
        driver.event("lose-node")
        assert not two_nodes.lose_worker(two_nodes.workers[0])  # nothing of the lost node lives on
        new = two_nodes.add_worker(**WORKER).node_id()
        done = driver.event("done")
    finally:
        driver.close()
    assert done["back_at"] is not None and done["restarts"] >= 2
    assert done["placement"]["env_runners"] == {"1": new, "2": new} and done["placement"]["learners"] == [head]
    ids = [i for step in done["trained"] for i in step["ids"]]
    assert sorted(ids) == list(range(len(ids)))  # none lost with the node, none trained twice
    assert max(done["ages"]) <= bound
    # the new runners were given the current weights (they start from the model's own)
    assert min(done["served"]) > done["lost_at"]
    # the wait was said, with what the runners need to come back
    assert any("down for" in n and "1 rollout_node" in n for n in done["notices"]), done["notices"]
    assert any("back after" in n for n in done["notices"])
