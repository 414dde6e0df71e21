"""`ray job submit` for real: a Ray head of this test's own, a tiny `m2po train` job through the
job API with the repository as `working_dir` (the README's cluster path), its summary.json, and
a teardown that leaves no process of that head alive.

The head is what a user starts (`ray start --head --block`) with its own temp dir and its own
ports, the dashboard / job API on 127.0.0.1. It is stopped by its own PIDs: SIGTERM to the
`ray start --block` process (which then stops the raylet, GCS and dashboard it started), then
SIGKILL for anything of it still alive. `ray stop` is never used: it kills every Ray on the
machine.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PORT_BLOCK = 100  # 9 service ports + a worker-port range
START_TIMEOUT_S = 120
JOB_TIMEOUT_S = 420
STOP_GRACE_S = 30


def _bindable(port: int) -> bool:
    # GCS and raylet bind every interface, the dashboard 127.0.0.1: check both.
    for host in ("0.0.0.0", "127.0.0.1"):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def free_port_block(size: int = PORT_BLOCK) -> int:
    """The first port of `size` consecutive ports that are free now."""
    rng = random.SystemRandom()
    for _ in range(200):
        base = rng.randrange(20_000, 60_000 - size)
        if all(_bindable(p) for p in range(base, base + size)):
            return base
    raise RuntimeError(f"found no {size} consecutive free ports in 20000-60000")


class LocalHead:
    """`ray start --head --block` in a session of its own; `stop()` ends only its processes."""

    def __init__(self, temp_dir: str, base_port: int):
        self.temp_dir = temp_dir
        self.ports = {
            "port": base_port,  # GCS
            "dashboard-port": base_port + 1,
            "ray-client-server-port": base_port + 2,
            "node-manager-port": base_port + 3,
            "object-manager-port": base_port + 4,
            "dashboard-agent-listen-port": base_port + 5,
            "dashboard-agent-grpc-port": base_port + 6,
            "runtime-env-agent-port": base_port + 7,
            "metrics-export-port": base_port + 8,
            "min-worker-port": base_port + 20,
            "max-worker-port": base_port + PORT_BLOCK - 1,
        }
        self.address = f"http://127.0.0.1:{self.ports['dashboard-port']}"
        self.log_path = Path(temp_dir) / "ray-start.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        ray_cli = Path(sys.executable).with_name("ray")
        cmd = [
            str(ray_cli), "start", "--head", "--block",
            "--node-ip-address=127.0.0.1",  # Ray maps loopback to the node's own IP
            "--dashboard-host=127.0.0.1",
            f"--temp-dir={self.temp_dir}",
            "--num-cpus=2",
            f"--object-store-memory={256 * 2**20}",
            "--disable-usage-stats",
            *(f"--{k}={v}" for k, v in self.ports.items()),
        ]  # fmt: skip
        env = dict(os.environ)
        # The job must import the uploaded working_dir, not this checkout through PYTHONPATH;
        # `python` in the entrypoint is this interpreter, as on a node set up with the venv.
        env.pop("PYTHONPATH", None)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        # A loopback test cluster: no token (the user's ~/.ray/auth_token stays out of it).
        env["RAY_AUTH_MODE"] = "disabled"
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        # SIGTERM would first wait for a node drain (for Serve); nothing here to drain.
        env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.temp_dir, start_new_session=True
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`ray start` exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.address}/api/version", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"the job API at {self.address} did not answer in {START_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def processes(self) -> list:
        """The `ray start` process, its descendants, and any process whose command line or
        environment names this head's temp dir (a job's driver, once re-parented)."""
        import psutil

        found = {}
        if self.proc is not None:
            try:
                root = psutil.Process(self.proc.pid)
                for p in [root, *root.children(recursive=True)]:
                    found[p.pid] = p
            except psutil.NoSuchProcess:
                pass
        for p in psutil.process_iter(["cmdline"]):
            if p.pid in found or p.pid == os.getpid():
                continue
            try:
                cmdline = " ".join(p.info["cmdline"] or [])
                if self.temp_dir in cmdline or any(self.temp_dir in v for v in p.environ().values()):
                    found[p.pid] = p
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return list(found.values())

    def stop(self) -> list[str]:
        """Stops this head; returns the processes of it still alive afterwards (none expected)."""
        import psutil

        if self.proc is None:
            return []
        procs = self.processes()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
            try:
                self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        _, alive = psutil.wait_procs(procs, timeout=5)
        alive = {p.pid: p for p in alive}
        alive.update({p.pid: p for p in self.processes()})  # anything started meanwhile
        for p in alive.values():
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        _, survivors = psutil.wait_procs(list(alive.values()), timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        return [f"{p.pid} {' '.join(p.cmdline()[:3])}" for p in survivors if p.is_running()]


@pytest.fixture(scope="module")
def ray_head():
    # Short path: Ray's unix sockets live under it and must stay under ~100 characters.
    temp_dir = tempfile.mkdtemp(prefix="m2po-head-", dir="/tmp")
    head = LocalHead(temp_dir, free_port_block())
    try:
        head.start()
        yield head
    finally:
        survivors = head.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not survivors, f"processes of the test's Ray head survived its stop: {survivors}"


def _tiny_job_args(model_dir: str, output: Path) -> list[str]:
    from test_cli import _overrides  # the CLI tests' tiny run

    return [
        "train", "--stop-iters", "2", "--output", str(output), "--no-progress",
        "env_runners.num_env_runners=0", "learners.num_learners=0", *_overrides(model_dir),
    ]


def test_submitted_train_job_succeeds_and_writes_its_summary(ray_head, tiny_model_dir, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    output = tmp_path / "run"
    train = " ".join(["python", "-m", "m2po_rllib.jobs.cli", *_tiny_job_args(tiny_model_dir, output)])
    where = "python -c \"import m2po_rllib; print('m2po_rllib imported from', m2po_rllib.__file__)\""
    client = JobSubmissionClient(ray_head.address)
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
            f"job logs:\n{logs[-6000:]}\n`ray start` log:\n{ray_head.log()}"
        )

    # `m2po train` joined this cluster (RAY_ADDRESS set by the job) rather than starting its own Ray.
    driver = client.get_job_info(job_id).driver_info
    assert driver is not None and driver.node_ip_address, f"no driver of job {job_id} connected to the head"
    # The job ran the uploaded working_dir, not an installed copy.
    imported = next(line for line in logs.splitlines() if line.startswith("m2po_rllib imported from"))
    assert f"{ray_head.temp_dir}/" in imported and "working_dir_files" in imported, imported
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
