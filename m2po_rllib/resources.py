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
Inside a Tune trial the trial's placement group already holds the resources: no check.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Callable

import ray

from m2po_rllib.errors import ConfigError

logger = logging.getLogger(__name__)

NOTICE_EVERY_S = 30.0
RESOURCES = ("CPU", "GPU")


def requested(bundles: list[dict]) -> dict[str, float]:
    """CPUs and GPUs the actors ask for: every bundle but the main process's (the first)."""
    return {r: float(sum(b.get(r, 0) for b in bundles[1:])) for r in RESOURCES}


def shortfall(need: dict[str, float], have: dict[str, float]) -> dict[str, float]:
    return {r: need[r] - have.get(r, 0.0) for r in RESOURCES if need[r] > have.get(r, 0.0) + 1e-9}


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
            each = " and ".join(f"{group[0].get(r, 0):g} {r}" for r in RESOURCES if group[0].get(r, 0))
            parts.append(f"{len(group)} {name} x {each or '0 CPU'}")
    return " + ".join(parts)


def check_actors_fit(config, bundles: list[dict], *, cluster: dict[str, float], local: bool) -> None:
    """Raises `ConfigError` when the actors of `config` can never fit a local `cluster`."""
    need = requested(bundles)
    missing = shortfall(need, cluster)
    if not missing or not local:
        return
    what = ", ".join(f"{need[r]:g} {r}s" for r in missing)
    have = ", ".join(f"{cluster.get(r, 0.0):g} {r}s" for r in missing)
    raise ConfigError(
        f"the algorithm's actors need {what} ({_arithmetic(config, bundles)}) and this local Ray cluster has "
        f"{have}: Ray would queue them forever. Lower `num_cpus_per_env_runner` (e.g. 0.5: a runner "
        f"mostly waits on its engine), `num_env_runners` or `num_learners` (0 trains in this "
        f"process), or start Ray with more (`ray.init(num_cpus=...)`)",
        ("num_env_runners", "num_cpus_per_env_runner", "num_learners", "num_cpus_per_learner"),
    )


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
    need = requested(bundles)
    if not any(need.values()) or ray.util.get_current_placement_group() is not None:
        yield  # no actors, or a Tune trial whose placement group holds them
        return
    if not ray.is_initialized():
        ray.init()  # what Ray does on the first actor anyway; the check needs the cluster
    local = bool(getattr(ray._private.worker._global_node, "head", False))  # started by this process
    check_actors_fit(config, bundles, cluster=ray.cluster_resources(), local=local)
    with WaitingNotice(need, ray.available_resources):
        yield
