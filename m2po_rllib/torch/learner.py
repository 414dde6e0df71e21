"""The M2PO TorchLearner: the loss library, called by name, on the LLM module's log-probs."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.learner.torch.torch_learner import TorchLearner
from ray.rllib.utils.annotations import override

from m2po_rllib.losses import compute_policy_loss
from m2po_rllib.torch.rl_module import ENTROPY, LOGP


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# Token-level means and the token count each averages over (default: the valid tokens).
_MEAN_WEIGHTS = {"m2po/m2_after": "m2po/kept_tokens", "m2po/entropy_masked": "m2po/masked_tokens"}
_VALID = "policy/valid_tokens"


def _reduce_over_learners(metrics: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """Whole-minibatch metrics from per-shard ones: counts and the loss add up, maxima take
    the max, means are re-weighted by the tokens they average over. RLlib then averages the
    (now identical) values of the learners."""
    keys = sorted(metrics)
    summed = [k for k in keys if k.endswith("_tokens") or k == "policy/loss"]
    maxed = [k for k in keys if k.endswith("_max")]
    means = [k for k in keys if k not in summed and k not in maxed]

    def weight(k):
        return metrics.get(_MEAN_WEIGHTS.get(k, _VALID), torch.ones(())).reshape(()).float().to(device)

    # one SUM all-reduce: the counts, the loss, and (mean x weight, weight) for each mean
    parts = [metrics[k].reshape(()).float().to(device) for k in summed]  # NCCL needs device tensors
    for k in means:
        w = weight(k)
        parts += [torch.nan_to_num(metrics[k].reshape(()).float().to(device)) * w, w]
    out = {}
    if parts:
        buf = torch.stack(parts)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        out.update(zip(summed, buf[: len(summed)]))
        pairs = buf[len(summed) :].reshape(-1, 2)
        for k, (total, w) in zip(means, pairs):
            out[k] = total / w if w > 0 else torch.tensor(float("nan"), device=device)
    if maxed:
        buf = torch.stack([metrics[k].reshape(()).float().to(device) for k in maxed])
        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
        out.update(zip(maxed, buf))
    return out


class M2POTorchLearner(TorchLearner):
    @override(TorchLearner)
    def build(self) -> None:
        super().build()
        # Log-probs are those of the distribution the runners sample from.
        for module_id in self.module.keys():
            self.module[module_id].unwrapped().temperature = float(self.config.temperature)

    def compute_response_logp(self, batch: dict[str, Any]) -> np.ndarray:
        """Per-token log-probs `(B, R)` of the responses under the current weights (no grad)."""
        module = self.module[DEFAULT_MODULE_ID].unwrapped()
        tensors = {k: torch.tensor(v, device=self._device) for k, v in batch.items()}  # copies (ray arrays are read-only)
        with torch.no_grad():
            logp, _ = module.response_logp(tensors, with_entropy=False)
        return logp.float().cpu().numpy()

    @override(TorchLearner)
    def configure_optimizers_for_module(self, module_id, config=None) -> None:
        module = self._module[module_id]
        params = self.get_parameters(module)
        optimizer = torch.optim.AdamW(
            params, betas=tuple(config.adam_betas), weight_decay=config.weight_decay
        )
        self.register_optimizer(
            module_id=module_id, optimizer=optimizer, params=params, lr_or_lr_schedule=config.lr
        )

    @override(TorchLearner)
    def compute_loss_for_module(
        self, *, module_id: str, config, batch: dict[str, Any], fwd_out: dict[str, Any]
    ) -> torch.Tensor:
        valid = batch["response_mask"] > 0
        loss, metrics = compute_policy_loss(
            config.policy_loss,
            fwd_out[LOGP],
            batch["behavior_logp"],
            batch["advantages"],
            valid,
            entropy=fwd_out.get(ENTROPY),
            loss_agg_mode=config.loss_agg_mode,
            mask_scope=config.mask_scope,
            **config.policy_loss_params(),
        )
        world = _world_size()
        metrics = {k: torch.as_tensor(v, dtype=torch.float32).detach() for k, v in metrics.items()}
        metrics["policy/loss"] = loss.detach().float()
        if world > 1:
            metrics = _reduce_over_learners(metrics, self._device)
        with torch.no_grad():
            version = batch["policy_version"].float()
            now = float(self.module[module_id].unwrapped().policy_version)
            metrics["staleness/trained_mean"] = now - version.mean()
            metrics["staleness/trained_max"] = now - version.min()
        for key, value in metrics.items():
            reduce = "max" if key.endswith("_max") else "mean"
            self.metrics.log_value((module_id, key), value, reduce=reduce)
        # compute_policy_loss divides by the *global* token count, so the shards' losses add
        # up to the whole minibatch's loss; DDP averages gradients over ranks, hence * world.
        return loss * world if world > 1 else loss

    @override(TorchLearner)
    def apply_gradients(self, gradients_dict) -> None:
        super().apply_gradients(gradients_dict)
        for module_id in self.module.keys():
            self.module[module_id].unwrapped().policy_version += 1
