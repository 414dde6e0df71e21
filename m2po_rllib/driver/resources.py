"""Do the algorithm's actors fit the Ray cluster? Checked before any actor is created.

Ray queues an actor that asks for more than the cluster has and says nothing: `build_algo()`
with 2 EnvRunners and 1 Learner at 1 CPU each on a 2-CPU machine waits forever. So before
RLlib creates them, `check_actors_fit` adds up what the config asks for (EnvRunners,
evaluation EnvRunners, Learners: the bundles of `M2PO.default_resource_request` past the
main process, which outside Tune takes no Ray resources) and compares it with the cluster:
- a local Ray this process started cannot grow: a request larger than the cluster fails at
  once with a `ConfigError` showing the arithmetic and the fix;
- a cluster this process joined may autoscale, and free resources may be held by other jobs:
  while the actors wait, `WaitingNotice` logs what they wait for every 30 s.
Custom resources (`custom_resources_per_env_runner` / `_per_learner`, e.g. the runners pinned
to the nodes that offer `{"rollout_node": 1}`) count like CPUs and GPUs.
`placement(algo)` says afterwards on which node each actor landed.
Inside a Tune trial the trial's placement group already holds the resources: no check.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Callable

import ray

from m2po_rllib.common.errors import ConfigError

logger = logging.getLogger(__name__)

NOTICE_EVERY_S = 30.0
RESOURCES = ("CPU", "GPU")


def requested(bundles: list[dict]) -> dict[str, float]:
    """CPUs, GPUs and custom resources the actors ask for: every bundle but the main
    process's (the first)."""
    names = [*RESOURCES, *sorted({r for b in bundles[1:] for r in b} - set(RESOURCES) - {"memory"})]
    return {r: float(sum(b.get(r, 0) for b in bundles[1:])) for r in names}


def shortfall(need: dict[str, float], have: dict[str, float]) -> dict[str, float]:
    return {r: need[r] - have.get(r, 0.0) for r in need if need[r] > have.get(r, 0.0) + 1e-9}


def _arithmetic(config, bundles: list[dict]) -> str:
    """'2 EnvRunner(s) x 1 CPU + 1 Learner(s) x 1 CPU': the bundles after the main process
    are the EnvRunners', the evaluation EnvRunners', then the Learners' (RLlib's order)."""
    runners, learners = config.num_env_runners, config.num_learners
    groups = [("EnvRunner(s)", bundles[1 : 1 + runners]),
              ("evaluation EnvRunner(s)", bundles[1 + runners : len(bundles) - learners]),
              ("Learner(s)", bundles[len(bundles) - learners :] if learners else [])]
    parts = []
    for name, group in groups:
        if group:
            each = " and ".join(f"{v:g} {r}" for r, v in group[0].items() if v and r != "memory")
            parts.append(f"{len(group)} {name} x {each or '0 CPU'}")
    return " + ".join(parts)


# The settings that ask for each resource, and how to give a local Ray more of it.
_FIXES = {
    "CPU": ("Lower `num_cpus_per_env_runner` (e.g. 0.5: a runner mostly waits on its engine), "
            "`num_env_runners` or `num_learners` (0 trains in this process), or start Ray with more "
            "(`ray.init(num_cpus=...)`)",
            ("num_env_runners", "num_cpus_per_env_runner", "num_learners", "num_cpus_per_learner")),
    "GPU": ("Lower `num_gpus_per_env_runner` or `num_gpus_per_learner` (0: on CPU; a fraction shares a GPU), "
            "`num_env_runners` or `num_learners`, run it where the GPUs are (RAY_ADDRESS), or start Ray with "
            "the GPUs it has missed (`ray.init(num_gpus=...)`)",
            ("num_gpus_per_env_runner", "num_gpus_per_learner", "num_env_runners", "num_learners")),
}
# A resource of the user's own naming: only a node started with it offers it.
_CUSTOM_FIX = ("Start the nodes the actors should run on with it (`ray start --resources='{{\"{name}\": 2}}'`, or "
               "`ray.init(resources=...)`), or drop it from `custom_resources_per_env_runner` / "
               "`custom_resources_per_learner`",
               ("custom_resources_per_env_runner", "custom_resources_per_learner"))


def _fix(resource: str) -> tuple[str, tuple[str, ...]]:
    if resource in _FIXES:
        return _FIXES[resource]
    return _CUSTOM_FIX[0].format(name=resource), _CUSTOM_FIX[1]


def check_actors_fit(config, bundles: list[dict], *, cluster: dict[str, float], local: bool) -> None:
    """Raises `ConfigError` when the actors of `config` can never fit a local `cluster`; the
    fix names the settings of what is short (GPUs first: they are the harder to add)."""
    need = requested(bundles)
    missing = shortfall(need, cluster)
    if not missing or not local:
        return
    what = ", ".join(f"{need[r]:g} {r}s" for r in missing)
    have = ", ".join(f"{cluster.get(r, 0.0):g} {r}s" for r in missing)
    short = [r for r in ("GPU", "CPU") if r in missing] + [r for r in missing if r not in RESOURCES]
    fix = "; ".join(_fix(r)[0] for r in short)
    settings = tuple(dict.fromkeys(name for r in short for name in _fix(r)[1]))
    raise ConfigError(
        f"the algorithm's actors need {what} ({_arithmetic(config, bundles)}) and this local Ray cluster has "
        f"{have}: Ray would queue them forever. {fix}",
        settings,
    )


def visible_gpus() -> int:
    """GPUs this process can use (CUDA_VISIBLE_DEVICES applied); 0 without CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_local_learner_gpus(config, gpus: int | None = None) -> None:
    """A learner in this process (`num_learners=0`) with `num_gpus_per_learner` > 0 computes on
    GPU `local_gpu_idx` of this process: refused at once, with the GPUs seen, when there is no
    such GPU (RLlib would fail later, deep in building the learner, with an assertion).
    `gpus`: the GPUs this process sees (default: ask CUDA)."""
    if config.num_learners > 0 or not config.num_gpus_per_learner:
        return
    gpus = visible_gpus() if gpus is None else gpus
    index = config.local_gpu_idx
    if index < gpus:
        return
    seen = f"{gpus} GPU{'s' if gpus != 1 else ''}" + ("" if gpus else " (no CUDA device)")
    raise ConfigError(
        f"`num_gpus_per_learner` is {config.num_gpus_per_learner:g} with `num_learners` 0: the learner runs in this "
        f"process on GPU {index} (`local_gpu_idx`), and this process sees {seen}. Set "
        "learners.num_gpus_per_learner=0 to train on CPU"
        + (", or `local_gpu_idx` below {gpus}".format(gpus=gpus) if gpus else "")
        + ", or run where a GPU is (CUDA_VISIBLE_DEVICES names the ones this process may use)",
        ("num_gpus_per_learner", "num_learners", "local_gpu_idx"),
    )


def init_ray_for_api() -> None:
    """What Ray does itself on an algorithm's first actor when a script has not called
    `ray.init()` (the cluster in RAY_ADDRESS, else a new local Ray with its dashboard, as
    RLlib users expect), except that a local Ray started here ends with this process, a
    kill -9 included, as one that `m2po train` starts does."""
    from m2po_rllib.common.ray_watchdog import end_with_this_process, started_here

    ray.init()
    if started_here():
        end_with_this_process()


class WaitingNotice:
    """While the actors are being created on a cluster that cannot hold them yet, logs every
    `every_s` what they wait for (`available()` gives the cluster's free resources)."""

    def __init__(self, need: dict[str, float], available: Callable[[], dict[str, float]],
                 every_s: float = NOTICE_EVERY_S, log: Callable[[str], None] = logger.warning):
        self.need, self.available, self.every_s, self.log = need, available, every_s, log
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="m2po-waiting-notice", daemon=True)

    def notice(self) -> str | None:
        """The line to log now, or None when the free resources cover the request."""
        free = self.available()
        missing = shortfall(self.need, free)
        if not missing:
            return None
        return (
            "waiting for Ray to place the algorithm's actors: they need "
            + ", ".join(f"{self.need[r]:g} {r}s" for r in missing)
            + "; free now: " + ", ".join(f"{free.get(r, 0.0):g} {r}s" for r in missing)
            + " (an autoscaling cluster adds nodes; otherwise other jobs hold them)"
        )

    def _run(self) -> None:
        while not self._done.wait(self.every_s):
            line = self.notice()
            if line:
                self.log(line)

    def __enter__(self):
        line = self.notice()
        if line:
            self.log(line)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join(timeout=1.0)


@contextlib.contextmanager
def actors_placed(config, bundles: list[dict]):
    """Around the creation of the actors that `bundles` (`default_resource_request`) ask for:
    fails at once if they can never fit this local Ray; on a cluster this process joined,
    says every 30 s what they wait for."""
    from m2po_rllib.common.ray_watchdog import started_here

    check_local_learner_gpus(config)
    if not ray.is_initialized():
        # RLlib starts a plain one anyway (EnvRunnerGroup's first `ray.put`, actors or not), as
        # does Ray's own placement-group call below: this one ends with this process
        init_ray_for_api()
    need = requested(bundles)
    if not any(need.values()) or ray.util.get_current_placement_group() is not None:
        yield  # no actors, or a Tune trial whose placement group holds them
        return
    local = started_here()
    check_actors_fit(config, bundles, cluster=ray.cluster_resources(), local=local)
    with WaitingNotice(need, ray.available_resources):
        yield


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def placement(algo) -> dict:
    """On which Ray node each of the algorithm's processes runs now, as hex node ids:
    {"driver": id, "env_runners": {worker index: id}, "learners": [id, ...]}. Remote actors
    only (a local runner or learner runs in the driver); a runner that is down is absent."""
    runners = algo.env_runner_group
    out = {"driver": _node_id(), "env_runners": {}, "learners": []}
    if runners is not None and runners.num_remote_env_runners():
        pairs = runners.foreach_env_runner(lambda r: (r.worker_index, _node_id()), local_env_runner=False)
        out["env_runners"] = {int(i): node for i, node in sorted(pairs)}
    group = algo.learner_group
    if group is not None and group.is_remote:
        out["learners"] = [r.get() for r in group.foreach_learner(lambda learner: _node_id())]
    return out


def describe_placement(where: dict, nodes: dict[str, str]) -> str:
    """`placement()` as one line: 'EnvRunners 1-2 on node 4b38589d (worker), Learners on
    012f41e2 (head, this driver)'. `nodes`: node id -> a name ("head", "worker", an IP)."""
    def name(node: str) -> str:
        tag = nodes.get(node, "")
        driver = ", this driver" if node == where["driver"] else ""
        return f"{node[:8]}" + (f" ({tag}{driver})" if tag or driver else "")

    parts = []
    by_node: dict[str, list[int]] = {}
    for index, node in where["env_runners"].items():
        by_node.setdefault(node, []).append(index)
    for node, indices in by_node.items():
        parts.append(f"EnvRunner{'s' if len(indices) > 1 else ''} {','.join(map(str, indices))} on node {name(node)}")
    for node in dict.fromkeys(where["learners"]):
        n = where["learners"].count(node)
        parts.append(f"{n} Learner{'s' if n > 1 else ''} on node {name(node)}")
    if not where["learners"]:
        parts.append(f"the Learner in this driver on node {name(where['driver'])}")
    return "; ".join(parts)


def node_names() -> dict[str, str]:
    """Every alive Ray node's id -> "head" or its raylet's address (host:port)."""
    import ray

    return {
        n["NodeID"]: "head" if "node:__internal_head__" in n.get("Resources", {})
        else f"{n['NodeManagerAddress']}:{n['NodeManagerPort']}"
        for n in ray.nodes() if n.get("Alive")
    }
