"""The M2PO TorchLearner: the loss library, called by name, on the LLM module's log-probs.

One optimizer minibatch (RLlib's `_update`) is processed in micro-batches of
`micro_batch_size` sequences (verl's `ppo_micro_batch_size_per_gpu`) with gradient
accumulation and one optimizer step, and gives the gradient of the unsplit minibatch:
- every micro-batch's loss is normalised by the whole minibatch's token / sequence counts
  (over all learners with `mask_scope="global"`), so the parts add up to the whole;
- the M2PO mask (and the official variant's tau_c) is a property of the whole minibatch:
  with more than one micro-batch it is computed once, from a no-grad forward of the
  minibatch with the current weights, before the first backward (the known cost of an
  exact global mask under accumulation); `mask_scope="local"` masks each micro-batch on
  its own instead (cheaper, split-dependent).
The learner owns the policy version (optimizer updates applied to its weights; every row
carries the version that generated it) and the log-prob computations outside training
(`response_logp`, used by the mismatch check and `recompute_behavior_logp`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.learner.torch.torch_learner import TorchLearner
from ray.rllib.utils.annotations import override

from m2po_rllib.common import keys
from m2po_rllib.common.threads import use_cpus
from m2po_rllib.losses import LOCAL, compute_policy_loss, m2po_keep_mask_global, m2po_official_tau
from m2po_rllib.losses.correction import mismatch_metrics, rollout_correction
from m2po_rllib.torch import fsdp
from m2po_rllib.torch.learner_weights import LearnerWeights, world_size
from m2po_rllib.torch.rl_module import ENTROPY, LOGP
from m2po_rllib.torch.update_stats import M2ByAge, MinibatchMetrics
from m2po_rllib.wire.batch import row_ages

logger = logging.getLogger(__name__)


def _tensor(value, device) -> torch.Tensor:
    if torch.is_tensor(value):
        return value.to(device)
    return torch.from_numpy(np.array(value)).to(device)  # a copy: object-store arrays are read-only


@dataclasses.dataclass
class _Minibatch:
    """What the micro-batches of one optimizer minibatch share: the whole minibatch's token
    and sequence counts, the loss parameters (with tau_c if precomputed), the precomputed
    M2PO mask (B, R), the rollout correction (B, R), the rows of the current micro-batch,
    the metrics so far."""

    params: dict
    mask_scope: str
    n_tokens: float | None = None
    n_seqs: float | None = None
    max_tokens: int | None = None
    keep: torch.Tensor | None = None
    correction: tuple[torch.Tensor, torch.Tensor] | None = None  # a rollout correction's (weight, keep)
    rows: slice = dataclasses.field(default_factory=lambda: slice(None))
    metrics: MinibatchMetrics = dataclasses.field(default_factory=MinibatchMetrics)


class M2POTorchLearner(LearnerWeights, TorchLearner):
    @override(TorchLearner)
    def build(self) -> None:
        if self.config.num_learners > 0:
            use_cpus(self.config.num_cpus_per_learner)  # a learner actor: its own CPUs
        # FSDP2 over the learners (torch/fsdp.py) instead of RLlib's DDP replicas
        self._sharded = self.config.sharded_learners
        self._gathered_optimizer_state: tuple[int, dict] | None = None  # (policy version, state)
        super().build()
        self._grads_finite: dict[str, bool] = {}
        self._m2_by_age = M2ByAge()
        self._weight_sync = None  # LearnerWeightSync, once the driver connects it (weight_sync="native")
        self._full_weights_version: int | None = None
        self._refresh_full_weights()

    @override(TorchLearner)
    def _make_module(self):
        module = super()._make_module()  # on this learner's device
        if self._sharded:  # before the optimizers are built: sharding replaces the parameters
            for module_id in module.keys():
                module[module_id].shard()
        return module

    @override(TorchLearner)
    def _make_modules_ddp_if_necessary(self) -> None:
        if not self._sharded:
            super()._make_modules_ddp_if_necessary()

    @property
    def policy_version(self) -> int:
        """Optimizer updates applied to this learner's weights."""
        return int(self.module[DEFAULT_MODULE_ID].unwrapped().policy_version)

    @override(TorchLearner)
    def update(self, *args, return_state: bool = False, **kwargs):
        """RLlib's update; with `return_state` the result also carries the weights after it
        (`keys.WEIGHTS_KEY`, as IMPALA's learner does), and always the policy version after
        it, the seconds it took (for the learner's idle fraction) and, with
        `max_staleness="auto"`, this learner's squared log-ratios by age."""
        t0 = time.perf_counter()
        self._m2_by_age.clear()  # nothing left from an update that failed part way
        result = super().update(*args, **kwargs)
        result[keys.M2_BY_AGE_KEY] = self._m2_by_age.take()
        native = self._weight_sync is not None and self._weight_sync.connected
        if not native:
            self._refresh_full_weights()
        elif self._sharded:
            # RLlib asks only the first learner for the state; every sharded one joins the send
            due = torch.tensor([float(return_state)], device=self._device)
            dist.all_reduce(due, op=dist.ReduceOp.MAX)
            return_state = bool(due.item())
        if return_state:
            weights = self._send_weights(result) if native else self.publish_weights()
            if weights is not None:
                result[keys.WEIGHTS_KEY] = weights
        result[keys.VERSION_KEY] = self.policy_version
        result[keys.UPDATE_SECONDS_KEY] = time.perf_counter() - t0
        return result

    # -- log-probs outside training ----------------------------------------------------
    def response_logp(self, batch: dict[str, Any], rows: slice | None = None) -> np.ndarray:
        """Per-token log-probs `(B, R)` of `batch`'s responses (rows `rows`, default all) under
        the current weights, in micro-batches, without gradient."""
        module = self.module[DEFAULT_MODULE_ID].unwrapped()
        n = len(batch["response_mask"])
        start, stop = (0, n) if rows is None else (rows.start or 0, n if rows.stop is None else rows.stop)
        micro = self.config.micro_batch_size or max(1, stop - start)
        # sharded: every learner runs as many forwards (collectives) as the busiest one
        slices, padding = fsdp.equal_slices(stop - start, micro, self._sharded, self._device)
        out = []
        with torch.no_grad():
            for sl in slices:
                part = {k: _tensor(v[start + sl.start : start + sl.stop], self._device) for k, v in batch.items()}
                logp, _ = module.response_logp(part, with_entropy=False)
                out.append(logp.float().cpu().numpy())
            for _ in range(padding):
                module.response_logp({k: _tensor(v[:1], self._device) for k, v in batch.items()}, with_entropy=False)
        return np.concatenate(out) if out else np.zeros((0, batch["response_mask"].shape[1]), np.float32)

    def response_logp_share(self, batch: dict[str, Any]) -> tuple[int, np.ndarray]:
        """This learner's contiguous share of `response_logp(batch)`, with its rank: the
        learners compute a whole batch's log-probs together."""
        rank, world = self._rank, world_size()
        n = len(batch["response_mask"])
        return rank, self.response_logp(batch, rows=slice(rank * n // world, (rank + 1) * n // world))

    def logp_mismatch(self, batch: dict[str, Any]) -> dict[str, float]:
        """The learner's log-probs against the behaviour (engine) ones of `batch`, which the
        current weights generated (`mismatch_metrics`: |delta| max / mean, KL, ...)."""
        return mismatch_metrics(self.response_logp(batch), batch["behavior_logp"], batch["response_mask"])

    # -- the update ----------------------------------------------------------------------
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
    def _update(self, batch: dict[str, Any]):
        """One optimizer minibatch: micro-batched forward/backward, one optimizer step."""
        for optim in self._optimizer_parameters:
            optim.zero_grad(set_to_none=True)
        losses = {mid: self._accumulate_gradients(mid, mb) for mid, mb in batch.items()}
        grads = {pid: p.grad for pid, p in self._params.items() if p.grad is not None}
        self.apply_gradients(self.postprocess_gradients(grads))
        return {}, losses, {}

    def _accumulate_gradients(self, module_id: str, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        cfg = self.config.get_config_for_module(module_id)
        module = self.module[module_id]
        world = world_size()
        scope_global = cfg.mask_scope == "global"
        group = None if scope_global else LOCAL
        n = len(mb["response_mask"])
        micro = cfg.micro_batch_size or n
        # sharded: every learner runs as many forward/backwards (collectives) as the busiest
        slices, padding = fsdp.equal_slices(n, micro, self._sharded, self._device)
        valid = mb["response_mask"] > 0

        # The whole minibatch's counts (over every learner with the global scope).
        counts = torch.stack([torch.count_nonzero(valid), torch.count_nonzero(valid.any(dim=1))]).double()
        if scope_global and world > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        n_tokens, n_seqs = counts.tolist()
        ctx = _Minibatch(
            n_tokens=n_tokens, n_seqs=n_seqs, max_tokens=valid.shape[1], params=cfg.policy_loss_params(),
            mask_scope=cfg.mask_scope if len(slices) + padding == 1 else "local",
        )
        self._correct(cfg, mb, ctx)
        if len(slices) + padding > 1 and scope_global and cfg.policy_loss in ("m2po", "m2po_official"):
            logp = torch.as_tensor(self.response_logp(mb), device=self._device)  # (B, R)
            log_ratio = logp - mb["behavior_logp"].float()
            # the tokens the loss sees: finite ratios the rollout correction keeps
            usable = valid & torch.isfinite(log_ratio)
            if ctx.correction is not None:
                usable &= ctx.correction[1]
            log_ratio = torch.where(usable, log_ratio, 0.0)
            threshold = ctx.params["m2_threshold"]
            if cfg.policy_loss == "m2po":
                ctx.keep, mask_stats = m2po_keep_mask_global(
                    log_ratio, usable, threshold, group, sample_id=mb["sample_id"], return_stats=True
                )
                ctx.metrics.add({keys.TIED_KEPT_FRAC: mask_stats[keys.TIED_KEPT_FRAC]})  # global already
            else:
                adv = mb["advantages"].float()[:, None].expand_as(log_ratio)
                ctx.params["tau_c"] = m2po_official_tau(log_ratio, adv, usable, threshold, group)
        total = torch.zeros((), device=self._device)
        ddp = hasattr(module, "no_sync")
        for i, sl in enumerate(slices):
            sub = {k: v[sl] for k, v in mb.items()}
            ctx.rows = sl
            sync = contextlib.nullcontext() if not ddp or i == len(slices) - 1 else module.no_sync()
            with sync:
                fwd_out = module.forward_train(sub)
                loss = self.compute_loss_for_module(
                    module_id=module_id, config=cfg, batch=sub, fwd_out=fwd_out, minibatch=ctx
                )
                # Parts add up to the minibatch's loss; DDP averages over ranks, hence * world.
                (loss * world if world > 1 else loss).backward()
            total = total + loss.detach()
            if cfg.auto_staleness:  # its only reader: the staleness controller
                self._record_m2_by_age(sub, fwd_out[LOGP], ctx, now=module.unwrapped().policy_version)
        for _ in range(padding):  # a forward/backward whose gradient is zero
            pad = {k: v[:1] for k, v in mb.items()}
            (module.forward_train(pad)[LOGP].sum() * 0.0).backward()

        ages = row_ages(mb, module.unwrapped().policy_version).double()  # when this minibatch is trained
        metrics = ctx.metrics.result(self._device, over_learners=world > 1)
        metrics.update(
            {
                keys.TRAINED_MIN: float(ages.min()),
                keys.TRAINED_MEAN: float(ages.mean()),
                keys.TRAINED_MAX: float(ages.max()),
                keys.MICRO_BATCHES: float(len(slices)),
            }
        )
        for key, value in metrics.items():
            reduce = "max" if key.endswith("_max") else "min" if key.endswith("_min") else "mean"
            self.metrics.log_value((module_id, key), value, reduce=reduce)
        return total

    @override(TorchLearner)
    def compute_loss_for_module(
        self, *, module_id: str, config, batch: dict[str, Any], fwd_out: dict[str, Any], minibatch=None
    ) -> torch.Tensor:
        """The policy loss of `batch`, a micro-batch of `minibatch` (whose counts, mask and
        tau_c it uses; its metrics are added to `minibatch.metrics`), or a whole minibatch."""
        ctx = minibatch
        if ctx is None:
            ctx = _Minibatch(params=config.policy_loss_params(), mask_scope=config.mask_scope)
            self._correct(config, batch, ctx)
        weight, keep = (None, None) if ctx.correction is None else (c[ctx.rows] for c in ctx.correction)
        loss, metrics = compute_policy_loss(
            config.policy_loss,
            fwd_out[LOGP],
            batch["behavior_logp"],
            batch["advantages"],
            batch["response_mask"] > 0,
            entropy=fwd_out.get(ENTROPY),
            loss_agg_mode=config.loss_agg_mode,
            keep_mask=None if ctx.keep is None else ctx.keep[ctx.rows],
            num_global_tokens=ctx.n_tokens,
            num_global_seqs=ctx.n_seqs,
            max_tokens=ctx.max_tokens,
            group=None if config.mask_scope == "global" else LOCAL,
            mask_scope=ctx.mask_scope,
            correction_weight=weight,
            correction_keep=keep,
            sample_id=batch["sample_id"],
            **ctx.params,
        )
        metrics[keys.LOSS] = loss.detach()
        ctx.metrics.add(metrics)
        return loss

    def _record_m2_by_age(self, sub: dict[str, Any], logp: torch.Tensor, ctx: _Minibatch, now: int) -> None:
        """The micro-batch's squared log-ratios by age, over the tokens the loss sees (finite
        ratios the rollout correction keeps), with the weights it is trained with."""
        log_ratio = logp.detach().float() - sub["behavior_logp"].float()
        usable = (sub["response_mask"] > 0) & torch.isfinite(log_ratio)
        if ctx.correction is not None:
            usable &= ctx.correction[1][ctx.rows]
        self._m2_by_age.add(log_ratio, usable, row_ages(sub, now), sub["sample_id"])

    @staticmethod
    def _correct(config, batch: dict[str, Any], ctx: _Minibatch) -> None:
        """The configured rollout correction of `batch` (a whole minibatch; per row, so each
        micro-batch takes its slice): its (weight, keep) in `ctx.correction`, its metrics,
        once, in `ctx.metrics`. Nothing without a correction."""
        if config.rollout_correction:
            weight, keep, metrics = rollout_correction(
                config.rollout_correction, batch["behavior_logp"], batch["engine_logp"], batch["response_mask"] > 0,
                low=config.rollout_correction_low, high=config.rollout_correction_high,
            )
            ctx.correction = (weight, keep)
            ctx.metrics.add(metrics)

    @override(TorchLearner)
    def postprocess_gradients_for_module(self, *, module_id, config=None, module_gradients_dict):
        """Global-norm clipping with one pass over the gradients, which also tells whether
        they are finite (a NaN or inf anywhere makes the norm non-finite)."""
        if config.grad_clip_by != "global_norm":
            self._grads_finite[module_id] = True
            return super().postprocess_gradients_for_module(
                module_id=module_id, config=config, module_gradients_dict=module_gradients_dict
            )
        grads = list(module_gradients_dict.values())
        norm = fsdp.full_tensor(torch.nn.utils.get_total_norm(grads)) if grads else torch.zeros(())
        finite = bool(torch.isfinite(norm))
        self._grads_finite[module_id] = finite
        if finite and config.grad_clip:
            torch.nn.utils.clip_grads_with_norm_(grads, config.grad_clip, norm)
        self.metrics.log_value((module_id, keys.GRAD_NORM), float(norm), window=1)
        return module_gradients_dict

    @override(TorchLearner)
    def apply_gradients(self, gradients_dict) -> None:
        """Steps each optimizer once (gradients are already in `param.grad`, accumulated over
        the micro-batches); a minibatch with non-finite gradients is skipped and counted.
        Either way the minibatch counts as one update of the policy version."""
        for module_id in self.module.keys():
            if self._grads_finite.get(module_id, True):
                for _, optim in self.get_optimizers_for_module(module_id):
                    optim.step()
            else:
                logger.warning("non-finite gradients in module %s: this update is skipped", module_id)
                self.metrics.log_value((module_id, keys.SKIPPED_UPDATES), 1, reduce="sum")
            inner = self.module[module_id].unwrapped()
            inner.policy_version += 1
            self.metrics.log_value((module_id, keys.POLICY_VERSION), inner.policy_version, window=1)

    # -- sharded state ---------------------------------------------------------------------
    @override(TorchLearner)
    def set_state(self, state) -> None:
        super().set_state(state)
        self._full_weights_version = None
        self._refresh_full_weights()

    def gather_optimizer_state(self) -> None:
        """Sharded: gather the whole optimizer state to rank 0 for the next `get_state`
        (every learner at once; `M2PO.get_state` asks them before a checkpoint)."""
        if self._sharded:
            self._refresh_full_weights()  # the weights' copy too (lazy with a native sync)
            self._gathered_optimizer_state = self.policy_version, {
                name: {
                    "module_id": self._optimizer_name_to_module[name],
                    "state": fsdp.full_optimizer_state(self._model_of(name), optim),
                }
                for name, optim in self._named_optimizers.items()
            }

    def _model_of(self, optimizer_name: str) -> torch.nn.Module:
        return self.module[self._optimizer_name_to_module[optimizer_name]].unwrapped().model

    @override(TorchLearner)
    def _get_optimizer_state(self):
        if not self._sharded:
            return super()._get_optimizer_state()
        version, state = self._gathered_optimizer_state or (None, None)
        self._gathered_optimizer_state = None
        if version != self.policy_version:  # none gathered, or gathered before an update since
            raise RuntimeError(
                "the optimizer state is sharded over the learners: gather it on every learner first "
                "(`learner.gather_optimizer_state()`, as M2PO.get_state / save_to_path do)"
            )
        return state

    @override(TorchLearner)
    def _set_optimizer_state(self, state) -> None:
        if not self._sharded:
            return super()._set_optimizer_state(state)
        for name, entry in state.items():
            if name in self._named_optimizers:
                fsdp.load_full_optimizer_state(self._model_of(name), self._named_optimizers[name], entry["state"])
