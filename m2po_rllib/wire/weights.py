"""`PublishedWeights`: the learner's newest weights, handed to every EnvRunner once.

The learner publishes its weights after an update (or every `broadcast_interval` steps):
remote runners get one `ray.put` of them, shared by all of them; a runner in the driver's
own process gets the tensors themselves (no copy through the object store). Every sample /
evaluate request carries the handle; a runner fetches and loads the weights at the top of
the request only when their version is newer than what it serves (as RLlib's
`EnvRunnerStateServer` pull model does), so a runner never stops in the middle of a round
and a late or duplicate handle never rolls the policy back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray


@dataclass(frozen=True)
class PublishedWeights:
    version: int
    """Optimizer updates behind these weights (the learner's policy version)."""
    weights: dict[str, Any] | None = None
    """The weights by HF parameter name, in process."""
    ref: Any = None
    """Or an ObjectRef to them, for remote runners (nested in the request, so Ray does not
    resolve it unless the runner needs it)."""
    native: bool = False
    """Or neither: the learner broadcast them to the runners' engines itself (weight_sync="native")."""

    @classmethod
    def publish(cls, weights: dict[str, Any], *, version: int, remote: bool) -> "PublishedWeights":
        if remote:
            return cls(version=int(version), ref=ray.put(weights))
        # The learner's tensors may share memory with its parameters: copy once, so that
        # these weights stay those of `version` while the learner moves on.
        return cls(version=int(version), weights={k: v.clone() for k, v in weights.items()})

    @classmethod
    def broadcast(cls, version: int) -> "PublishedWeights":
        """Weights the learner broadcast to the runners (they carry only their version)."""
        return cls(version=int(version), native=True)

    def get(self) -> dict[str, Any]:
        """The weights by parameter name (fetched from the object store if remote)."""
        if self.native:
            raise RuntimeError(f"weights version {self.version} went by native sync: they are not in the object store")
        return self.weights if self.ref is None else ray.get(self.ref)
