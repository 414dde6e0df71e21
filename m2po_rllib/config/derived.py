"""What an `M2POConfig`'s settings imply, computed from them in one place (`DerivedSettings`,
a mixin of the config): updates per step, the stale-k queue's lag, the engine and weight-sync
backend "auto" resolves to, the served dtype, the loss's keyword arguments, the smallest
async bound and "auto"'s controller settings."""

from __future__ import annotations

from typing import Any

import torch

from m2po_rllib.losses import policy_loss_params
from m2po_rllib.rollout.staleness import AUTO
from m2po_rllib.torch.fsdp import FSDP

# The model's compute dtype unless `model_config["dtype"]` says otherwise (validation.MODEL_DTYPES).
DEFAULT_MODEL_DTYPE = "float32"


class DerivedSettings:
    """Read-only quantities of the settings `M2POConfig` defines (see its `__init__`)."""

    @property
    def updates_per_step(self) -> int:
        return self.num_epochs * (self.prompts_per_step // self.minibatch_prompts)

    @property
    def queue_lag_steps(self) -> int:
        """Training steps between generating a round and training on it."""
        return self.staleness // self.updates_per_step

    @property
    def sharded_learners(self) -> bool:
        """The learners hold FSDP shards of the weights (`learner_sharding`; 2+ learners)."""
        return self.learner_sharding == FSDP and self.num_learners > 1

    @property
    def runners_recompute_behavior_logp(self) -> bool:
        """The training runners score their own rounds in the learner's numerics (async mode:
        the learners no longer hold the generating weights when a round arrives; evaluation
        runners never score)."""
        return bool(self.recompute_behavior_logp and self.async_rollouts and not self.in_evaluation)

    @property
    def minibatch_size_per_learner(self) -> int:
        return self.minibatch_prompts * self.group_size // max(1, self.num_learners)

    def resolved_rollout_engine(self) -> str:
        if self.rollout_engine != "auto":
            return self.rollout_engine
        return "vllm" if torch.cuda.is_available() else "hf"

    @property
    def native_weight_sync(self) -> bool:
        return self.weight_sync == "native"

    def resolved_weight_sync_backend(self) -> str:
        """The native group's backend: "auto" is NCCL when the learners and the runners each
        have whole GPUs (Ray then gives them different ones), else gloo (NCCL refuses two
        ranks on one GPU, which fractional GPUs may share)."""
        if self.weight_sync_backend != "auto":
            return self.weight_sync_backend
        gpus = torch.cuda.is_available() and self.learner_gpus >= 1 and (self.num_gpus_per_env_runner or 0) >= 1
        return "nccl" if gpus else "gloo"

    @property
    def learner_gpus(self) -> float:
        """GPUs per learner, the local one included (RLlib's new API stack gives a learner in
        the main process `num_gpus_per_learner` too: the main process's bundle asks for them)."""
        return self.num_gpus_per_learner or 0

    def served_dtype(self) -> torch.dtype:
        """The dtype the runners' engines serve the weights in (what a native sync sends)."""
        name = (self.engine_kwargs or {}).get("dtype") or (self.model_config or {}).get("dtype", DEFAULT_MODEL_DTYPE)
        return getattr(torch, name)

    def policy_loss_params(self) -> dict[str, Any]:
        """Keyword arguments for `compute_policy_loss(self.policy_loss, ...)`."""
        accepted = policy_loss_params(self.policy_loss)
        params = {}
        for name, value in (("m2_threshold", self.m2_threshold), ("eps_low", self.eps_low), ("eps_high", self.eps_high)):
            if name in accepted and value is not None:
                params[name] = value
        params.update(self.policy_loss_kwargs or {})
        return params

    @property
    def min_max_staleness(self) -> int:
        """The smallest `max_staleness` async mode can keep: a round generated while the
        previous step trains is trained up to (broadcast_interval + 1) x updates_per_step - 1
        updates after the weights that made it."""
        return (self.broadcast_interval + 1) * self.updates_per_step - 1

    @property
    def auto_staleness(self) -> bool:
        """The async bound follows the measured M2 (`max_staleness="auto"`)."""
        return self.max_staleness == AUTO

    def staleness_controller_settings(self) -> dict[str, Any]:
        """`StalenessController`'s arguments, the defaults resolved."""
        floor = self.min_max_staleness if self.staleness_floor is None else self.staleness_floor
        target = self.m2_threshold if self.staleness_target_m2 is None else self.staleness_target_m2
        return {"target_m2": float(target), "floor": int(floor), "ceiling": int(self.staleness_ceiling),
                "half_life": float(self.staleness_half_life)}
