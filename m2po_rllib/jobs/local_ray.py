"""The Ray a job runs on: the cluster in RAY_ADDRESS (as under `ray job submit`), else a
local instance of the job's own, started with only what a single-machine run needs."""

from __future__ import annotations

import logging
import os

from m2po_rllib.common.ray_watchdog import end_with_this_process

logger = logging.getLogger(__name__)

# No idle workers started ahead (the job's actors start their own; prestarted ones are
# ~80 MB each and compute nothing).
LOCAL_RAY_SYSTEM_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}


def quiet_job_logs() -> None:
    """Keep the job's output readable: RLlib's API-stack notices and transformers' weight
    loading bars say nothing actionable here. Errors still show."""
    import ray.rllib  # noqa: F401  (importing it resets its logger's level: import first)

    logging.getLogger("ray.rllib").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def init_ray(*, worker_logs: bool = True) -> None:
    """Join the cluster in RAY_ADDRESS, else start a local Ray of the job's own (never
    another local instance that happens to run) with only the daemons a single-machine
    job uses. `worker_logs`: forward the actors' output to this terminal (a job with
    remote runners or learners, a Tune search); a job that runs in this process alone
    does without the log monitor."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level=logging.WARNING)
        return
    ray.init(
        address="local", include_dashboard=False, log_to_driver=worker_logs, logging_level=logging.WARNING,
        _system_config=LOCAL_RAY_SYSTEM_CONFIG,
    )
    _stop_unused_daemons(log_monitor=not worker_logs)
    end_with_this_process()  # a kill -9 included (ray_watchdog.py)


def _stop_unused_daemons(*, log_monitor: bool) -> None:
    """Ray 2.60's `ray.init` starts every head daemon and offers no switch for these three
    (`RayParams.no_monitor` / `include_log_monitor` are not exposed): the autoscaler monitor
    (`ray status`; ~90 MB), the dashboard head (with include_dashboard=False it serves only
    usage stats; ~125 MB) and, optionally, the log monitor (~88 MB). A job on one machine
    uses none of them: stop them through the node, as Ray's own tests do. `ray.shutdown()`
    still ends the rest. The raylet's two agents (dashboard, runtime env) cannot go: the
    raylet fate-shares with them."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    if node is None:
        return
    try:
        node.kill_monitor(check_alive=False)
        node.kill_dashboard(check_alive=False)
        if log_monitor:
            node.kill_log_monitor(check_alive=False)
    except Exception as e:  # a Ray whose internals changed: run with its daemons
        logger.debug("left Ray's daemons running: %s", e)
