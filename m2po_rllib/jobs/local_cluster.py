"""A Ray cluster of several nodes on one machine: a head and worker nodes, each a
`ray start --block` of its own (its own raylet, object store, CPUs, custom resources, ports and
temp dir), as a user starts them on real machines. What the cluster tests run on, and what
`scripts/local_cluster.py` starts for trying a multi-node config before renting nodes.

Every node is ended by its own PIDs only: SIGTERM to its `ray start --block` process (which
stops the raylet, GCS and agents it started), then SIGKILL for anything of it still alive.
`ray stop` is never used: it kills every Ray on the machine. `LocalNode.kill_raylet()` is a
node lost the hard way (its raylet SIGKILLed: its actors die with it, the GCS marks it dead).
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

PORT_BLOCK = 100  # 9 service ports + a worker-port range
START_TIMEOUT_S = 120
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


def free_port_block(size: int = PORT_BLOCK, avoid: tuple[int, ...] = ()) -> int:
    """The first port of `size` consecutive ports that are free now (and do not overlap the
    blocks starting at `avoid`, taken by nodes that have not bound them all yet)."""
    rng = random.SystemRandom()
    for _ in range(200):
        base = rng.randrange(20_000, 60_000 - size)
        if any(abs(base - a) < size for a in avoid):
            continue
        if all(_bindable(p) for p in range(base, base + size)):
            return base
    raise RuntimeError(f"found no {size} consecutive free ports in 20000-60000")


def _node_env() -> dict[str, str]:
    env = dict(os.environ)
    # A job must import what it was given (a working_dir), not this checkout through
    # PYTHONPATH; `python` and `ray` are this interpreter's, as on a node set up with the venv.
    env.pop("PYTHONPATH", None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    # A loopback cluster: no token (the user's ~/.ray/auth_token stays out of it).
    env["RAY_AUTH_MODE"] = "disabled"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # SIGTERM would first wait for a node drain (for Serve); nothing here to drain.
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    return env


class LocalNode:
    """One node: `ray start --block` in a session of its own. `head_gcs=None` starts a head
    (GCS, dashboard and job API on 127.0.0.1); otherwise a worker node joining that GCS."""

    def __init__(self, temp_dir: str, base_port: int, *, head_gcs: str | None = None, num_cpus: int = 2,
                 resources: dict[str, float] | None = None, object_store_mb: int = 256,
                 system_config: dict | None = None, ip: str = "127.0.0.1"):
        if system_config and head_gcs is not None:
            raise ValueError("system_config is the cluster's: give it to the head")
        self.system_config = dict(system_config or {})
        self.ip = ip  # a loopback address; Ray shows 127.0.0.1 as the machine's own IP
        self.temp_dir, self.head_gcs = temp_dir, head_gcs
        self.num_cpus, self.resources, self.object_store_mb = num_cpus, dict(resources or {}), object_store_mb
        ports = {
            "node-manager-port": base_port + 3,
            "object-manager-port": base_port + 4,
            "dashboard-agent-listen-port": base_port + 5,
            "dashboard-agent-grpc-port": base_port + 6,
            "runtime-env-agent-port": base_port + 7,
            "metrics-export-port": base_port + 8,
            "min-worker-port": base_port + 20,
            "max-worker-port": base_port + PORT_BLOCK - 1,
        }
        if head_gcs is None:
            ports.update({"port": base_port, "dashboard-port": base_port + 1, "ray-client-server-port": base_port + 2})
        self.ports = ports
        self.log_path = Path(temp_dir) / "ray-start.log"
        self.proc: subprocess.Popen | None = None

    @property
    def is_head(self) -> bool:
        return self.head_gcs is None

    @property
    def gcs_address(self) -> str:
        """What `ray.init(address=...)` and RAY_ADDRESS take (a driver on this machine)."""
        return f"127.0.0.1:{self.ports['port']}" if self.is_head else self.head_gcs

    @property
    def dashboard_address(self) -> str:
        """The job API (`ray job submit --address`); the head's."""
        if not self.is_head:
            raise ValueError("a worker node serves no job API: submit to the head's dashboard_address")
        return f"http://127.0.0.1:{self.ports['dashboard-port']}"

    def command(self) -> list[str]:
        role = ["--head", "--dashboard-host=127.0.0.1"] if self.is_head else [f"--address={self.head_gcs}"]
        return [
            str(Path(sys.executable).with_name("ray")), "start", "--block", *role,
            f"--node-ip-address={self.ip}",
            f"--temp-dir={self.temp_dir}",
            f"--num-cpus={self.num_cpus}",
            f"--resources={json.dumps(self.resources)}",
            f"--object-store-memory={self.object_store_mb * 2**20}",
            "--disable-usage-stats",
            *([f"--system-config={json.dumps(self.system_config)}"] if self.system_config else []),
            *(f"--{k}={v}" for k, v in self.ports.items()),
        ]  # fmt: skip

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Starts the node and returns once it serves: the head's job API answers / the worker's
        raylet is registered with the GCS as alive."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=_node_env(), cwd=self.temp_dir,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`ray start` exited with {self.proc.returncode}:\n{self.log()}")
            if self._serving():
                return
            time.sleep(0.2)  # a node serves ~3-8 s after its start: a second's poll costs half a second a node
        raise RuntimeError(f"the Ray node in {self.temp_dir} did not come up in {timeout_s:g} s:\n{self.log()}")

    def _serving(self) -> bool:
        if self.is_head:
            try:
                with urllib.request.urlopen(f"{self.dashboard_address}/api/version", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False
        return self.node_id() is not None

    def node_id(self) -> str | None:
        """This node's Ray node id (hex) once its raylet is registered and alive, else None."""
        from ray._raylet import GcsClient

        try:
            nodes = GcsClient(address=self.gcs_address).get_all_node_info(timeout=5)
        except Exception:  # the GCS is not up yet, or gone
            return None
        for node_id, info in nodes.items():
            if info.node_manager_port == self.ports["node-manager-port"] and info.state == 0:  # ALIVE
                return node_id.hex()
        return None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def processes(self) -> list:
        """The `ray start` process, its descendants, and any process whose command line or
        environment names this node's temp dir (a job's driver, once re-parented)."""
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

    def raylet_pid(self) -> int:
        for p in self.processes():
            try:
                if Path(p.exe()).name == "raylet" or (p.cmdline() or [""])[0].endswith("/raylet"):
                    return p.pid
            except Exception:
                continue
        raise RuntimeError(f"no raylet of the node in {self.temp_dir} is running")

    def kill_raylet(self) -> int:
        """The node lost: SIGKILL to its raylet (its workers and actors die with it; `ray start
        --block` then stops the rest of it). Returns the raylet's PID."""
        pid = self.raylet_pid()
        os.kill(pid, signal.SIGKILL)
        return pid

    def wait_dead(self, timeout_s: float = 60.0) -> None:
        """Returns once the GCS no longer counts this node alive (after `kill_raylet`)."""
        deadline = time.monotonic() + timeout_s
        while self.node_id() is not None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the node in {self.temp_dir} is still alive after {timeout_s:g} s")
            time.sleep(0.2)

    def stop(self) -> list[str]:
        """Stops this node; returns the processes of it still alive afterwards (none expected)."""
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


# A lost node noticed in ~2 s instead of Ray's ~15 s (3 s x 5 missed health checks): for
# tests of a node's loss on one machine, where no network is slow.
FAST_NODE_DEATH = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}


class LocalCluster:
    """A head and worker nodes on this machine, each in its own temp dir under one root
    (short: Ray's unix sockets live there and must stay under ~100 characters).

        with LocalCluster(head_resources={"learner_node": 1}) as cluster:
            cluster.add_worker(num_cpus=2, resources={"rollout_node": 2})
            subprocess.run([...], env={**os.environ, "RAY_ADDRESS": cluster.address})
    """

    def __init__(self, *, head_cpus: int = 2, head_resources: dict[str, float] | None = None,
                 root: str | None = None, object_store_mb: int = 256, system_config: dict | None = None):
        self.root = root or tempfile.mkdtemp(prefix="m2po-cl-", dir="/tmp")
        self._owns_root = root is None
        self._bases: list[int] = []  # every node's port block, stopped ones included
        self.workers: list[LocalNode] = []
        self.head = self._node(num_cpus=head_cpus, resources=head_resources, object_store_mb=object_store_mb,
                               system_config=system_config)

    def _node(self, head_gcs: str | None = None, **kwargs) -> LocalNode:
        """The next node, in `<root>/n<i>` with a port block of its own and, for a worker, an IP
        of its own (127.0.0.<i+1>: Ray, Tune's `node_ip` and the logs tell the nodes apart, as
        on separate machines; Linux routes all of 127.0.0.0/8 to loopback)."""
        i = len(self._bases)
        temp_dir = os.path.join(self.root, f"n{i}")
        os.makedirs(temp_dir, exist_ok=True)
        self._bases.append(free_port_block(avoid=tuple(self._bases)))
        ip = "127.0.0.1" if head_gcs is None else f"127.0.0.{i + 1}"
        return LocalNode(temp_dir, self._bases[-1], head_gcs=head_gcs, ip=ip, **kwargs)

    def nodes(self) -> list[LocalNode]:
        return [self.head, *self.workers]

    @property
    def address(self) -> str:
        """The GCS address: RAY_ADDRESS for a driver on this machine."""
        return self.head.gcs_address

    @property
    def dashboard_address(self) -> str:
        """The job API: `ray job submit --address`."""
        return self.head.dashboard_address

    def driver_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a driver process joining this cluster: `base` (default: this
        process's) with RAY_ADDRESS, and without token authentication, which the nodes run
        without (a process that started a Ray of its own carries RAY_AUTH_MODE=token, and a
        driver with it cannot create actors here)."""
        return {**(os.environ if base is None else base), "RAY_ADDRESS": self.address, "RAY_AUTH_MODE": "disabled"}

    def start(self) -> "LocalCluster":
        self.head.start()
        return self

    def add_worker(self, *, num_cpus: int = 2, resources: dict[str, float] | None = None,
                   object_store_mb: int = 256) -> LocalNode:
        node = self._node(head_gcs=self.address, num_cpus=num_cpus, resources=resources,
                          object_store_mb=object_store_mb)
        self.workers.append(node)
        node.start()
        return node

    def remove_worker(self, node: LocalNode) -> list[str]:
        """Stops a worker node (after a `kill_raylet()`, the rest of it); returns survivors."""
        self.workers.remove(node)
        return node.stop()

    def lose_worker(self, node: LocalNode) -> list[str]:
        """A worker node lost the hard way: its raylet SIGKILLed (its actors die with it), then,
        once the GCS has marked it dead, whatever of it is left stopped. Returns survivors."""
        node.kill_raylet()
        node.wait_dead()
        return self.remove_worker(node)

    def stop(self) -> list[str]:
        """Stops every node, workers first; returns the processes of them still alive."""
        survivors = []
        for node in [*reversed(self.workers), self.head]:
            survivors += node.stop()
        self.workers = []
        if self._owns_root:
            shutil.rmtree(self.root, ignore_errors=True)
        return survivors

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
