"""The weights leaving an M2PO learner, one mixin of `M2POTorchLearner`: published for the
EnvRunners through the object store (`publish_weights`, the first learner), or broadcast to
their vLLM workers after each update (`connect_weight_sync`, `_send_weights`: weight_sync=
"native", sync/sender.py); with sharded (FSDP) learners the whole weights gathered to rank 0's
CPU when something needs them (`_refresh_full_weights`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from ray.rllib.core import DEFAULT_MODULE_ID

from m2po_rllib.common import keys
from m2po_rllib.torch import fsdp
from m2po_rllib.wire.weights import PublishedWeights


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class LearnerWeights:
    """Reads the learner's `config`, `module`, `policy_version`, `_sharded`, `_device`; owns
    `_weight_sync` (None until the driver connects it) and `_full_weights_version`."""

    @property
    def _rank(self) -> int:
        return dist.get_rank() if world_size() > 1 else 0

    def _refresh_full_weights(self) -> None:
        """Sharded: gather the whole weights to rank 0's CPU (every learner at once, after
        each update and each set_state), so that `get_state` on the first learner, which
        is all RLlib asks, needs no collective. With a native weight sync the runners get
        the weights gathered per tensor instead, and the whole copy is made only when asked
        for (`publish_weights`, `gather_optimizer_state`: every learner calls them)."""
        if self._sharded and self._full_weights_version != self.policy_version:
            for module_id in self.module.keys():
                self.module[module_id].unwrapped().gather_full_weights()
            self._full_weights_version = self.policy_version

    # -- native weight sync (weight_sync="native"; sync/sender.py) ----------------
    def connect_weight_sync(self, targets: list, workers_per_target: list[int]) -> dict[str, float] | None:
        """Forms the weight-transfer group with the EnvRunner actors `targets` (the first
        learner; with sharded weights every learner calls this, the others only gather) and
        sends the current weights. Returns the sync's metrics on the first learner
        (`LearnerWeightSync.metrics`; None on the others)."""
        from m2po_rllib.sync.learner_sync import LearnerWeightSync

        cfg = self.config
        if self._weight_sync is None:
            module = self.module[DEFAULT_MODULE_ID].unwrapped()
            sharded = dict(materialize=fsdp.full_tensor, agree=self._agree_on_units) if self._sharded else {}
            self._weight_sync = LearnerWeightSync(
                backend=cfg.resolved_weight_sync_backend(), dtype=cfg.served_dtype(),
                state_fn=module.model.state_dict, rank=self._rank, bucket_bytes=cfg.weight_sync_bucket_bytes,
                only_changed=cfg.weight_sync_only_changed, **sharded,
            )
        stats = self._weight_sync.connect(targets if self._rank == 0 else [], workers_per_target, self.policy_version)
        return self._weight_sync.metrics(stats) if self._rank == 0 else None

    def _agree_on_units(self, units: set[str]) -> set[str]:
        """Sharded delta syncs: every learner gathers the units rank 0 found changed."""
        box = [sorted(units)]
        dist.broadcast_object_list(box, src=0)
        return set(box[0])

    def _send_weights(self, result: dict) -> PublishedWeights | None:
        """Native sync after an update: broadcasts the weights (every sharded learner joins
        the gathers) and returns the notice the runners' requests carry; after a failed
        send, the weights through the object store, and a request to form the group again."""
        version = self.policy_version
        stats = self._weight_sync.send(version)
        sent = stats is not None or self._rank != 0
        if self._sharded:  # every learner learns whether rank 0's broadcast went through
            flag = torch.tensor([1.0 if sent else 0.0], device=self._device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            sent = bool(flag.item())
        if self._rank == 0:
            result[keys.NATIVE_SYNC_KEY] = self._weight_sync.metrics(stats)
        if sent:
            return PublishedWeights.broadcast(version) if self._rank == 0 else None
        result[keys.WEIGHT_SYNC_RECONNECT_KEY] = True
        return self.publish_weights()

    # -- weights for the EnvRunners -------------------------------------------------------
    def publish_weights(self) -> PublishedWeights | None:
        """The current weights, published once for every runner: `ray.put` from this process
        when runners are remote (the driver passes the reference on), else in process.
        Only the first learner publishes (the others return None)."""
        self._refresh_full_weights()  # sharded: a collective, if the copy is older than the weights
        if self._rank != 0:
            return None
        state = self.module[DEFAULT_MODULE_ID].unwrapped().get_state(inference_only=True)
        cfg = self.config
        remote = cfg.num_learners > 0 or cfg.num_env_runners > 0 or cfg.evaluation_num_env_runners > 0
        return PublishedWeights.publish(state["weights"], version=self.policy_version, remote=remote)
