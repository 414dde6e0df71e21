"""The learner calls M2PO makes besides `LearnerGroup.update`, in one place (and the one
EnvRunner lookup it needs, the actor handles a native weight sync broadcasts to).

Ray 2.60's `LearnerGroup` has no public call to run a function on only the first learner,
to unwrap `foreach_learner`'s `RemoteCallResults`, or to poll the results of asynchronous
updates without sending another one (`update(async_update=True)` polls the same way before
it sends). These helpers use its private `_worker_manager` and `_get_results` for that;
they are the only code that does.
"""

from __future__ import annotations

from typing import Any, Callable


def on_learners(group, fn: Callable[[Any], Any], *, first_only: bool) -> list[Any]:
    """`fn(learner)` on every learner, or on the first healthy one (RLlib's choice of learner
    in `LearnerGroup.get_state`); their answers in learner order."""
    ids = group._worker_manager.healthy_actor_ids()[:1] if first_only and not group.is_local else None
    return group._get_results(group.foreach_learner(fn, remote_actor_ids=ids))


def ready_update_results(group) -> list[dict]:
    """The results of asynchronous updates that are done, without sending another one."""
    return group._get_results(group._worker_manager.fetch_ready_async_reqs(timeout_seconds=0.0))


def runner_actors(runner_group) -> list:
    """The healthy remote EnvRunners' actor handles, in runner order (a native weight sync's
    targets)."""
    manager = runner_group._worker_manager
    actors = manager.actors()
    return [actors[i] for i in sorted(manager.healthy_actor_ids())]
