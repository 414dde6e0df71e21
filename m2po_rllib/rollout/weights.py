"""`PublishedWeights`: the learner's newest weights, handed to every EnvRunner once.

The algorithm publishes the learner's module state after an update (or every
`broadcast_interval` steps): remote runners get one `ray.put` of it, shared by all of them;
a runner in the driver's own process gets the state dict itself (no copy through the object
store). Every sample / evaluate request carries the handle; a runner loads the weights at
the top of the request only when their version is newer than what its engine serves (as
RLlib's `EnvRunnerStateServer` pull model does), so a runner never stops in the middle of a
round and a late or duplicate handle never rolls the policy back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray


@dataclass(frozen=True)
class PublishedWeights:
    version: int
    """Optimizer updates behind these weights (the learner's policy version)."""
    state: dict[str, Any] | None = None
    """The module state (`{"weights": {name: tensor}, "policy_version": v}`), in process."""
    ref: Any = None
    """Or an ObjectRef to it, for remote runners (nested in the request, so Ray does not
    resolve it unless the runner needs it)."""

    @classmethod
    def publish(cls, module_state: dict[str, Any], *, remote: bool) -> "PublishedWeights":
        version = int(module_state["policy_version"])
        if remote:
            return cls(version=version, ref=ray.put(module_state))
        # The learner's state may share memory with its parameters: copy once, so that
        # these weights stay those of `version` while the learner moves on.
        weights = {k: v.clone() for k, v in module_state["weights"].items()}
        return cls(version=version, state={**module_state, "weights": weights})

    def get(self) -> dict[str, Any]:
        return self.state if self.ref is None else ray.get(self.ref)
