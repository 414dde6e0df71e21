"""An RLlib `TorchRLModule` around a Hugging Face causal LM.

The rollout engines (vLLM, HF) own generation; the learner needs only per-token log-probs
and entropies of the sampled responses, which `_forward_train` computes, padding-aware.

Batch layout (built by `m2po_rllib.wire.batch.pack_rollouts`), B sequences:
    input_ids       (B, P + R)  prompt left-padded to P, response right-padded to R
    attention_mask  (B, P + R)
    response_mask   (B, R)      1 for generated tokens (eos included), 0 for padding
"""

from __future__ import annotations

from typing import Any

import torch

from ray.rllib.core.rl_module.torch import TorchRLModule
from ray.rllib.utils.annotations import override

from m2po_rllib.torch import fsdp
from m2po_rllib.torch.logp import response_logp as chunked_response_logp

from m2po_rllib.common.log_filters import quiet_rllib_module_config_deprecation

quiet_rllib_module_config_deprecation()

LOGP = "logp"
ENTROPY = "entropy"

# model_config["dtype"] -> the compute dtype (M2POConfig validates the name).
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class HFCausalLMModule(TorchRLModule):
    """A `TorchRLModule` whose policy is `AutoModelForCausalLM.from_pretrained(model)`.

    `model_config` keys (M2POConfig fills in all but `model` and `gradient_checkpointing`):
        model: HF directory, hub name, or a built-in name such as `builtin:arith-tiny`.
        dtype: the compute dtype, "float32" or "bfloat16": the weights, their gradients
            and AdamW's moments stay float32 (master weights; bf16 weights would round
            away updates of lr ~1e-6), and the forward/backward run under autocast.
        temperature, top_k, top_p: those of the rollouts (log-probs are computed for the
            distribution they sample from).
        logp_chunk_size: response positions per chunk of the log-prob computation.
        gradient_checkpointing: trade compute for memory on long responses.
    """

    @override(TorchRLModule)
    def setup(self):
        from transformers import AutoModelForCausalLM

        from m2po_rllib.models.builtin import resolve_model_path

        cfg = dict(self.model_config or {})
        if "model" not in cfg:
            raise ValueError(
                "rl_module(model_config=...) needs 'model': a HF model directory or name, "
                "e.g. model_config={'model': 'builtin:arith-tiny'}"
            )
        self.model_path = resolve_model_path(cfg["model"])
        self.compute_dtype = _DTYPES[cfg["dtype"]]
        # the LM head's dtype when it differs from the compute dtype (float32: as the engines'
        # with the same setting, so that their log-probs and these agree more closely)
        self.head_dtype = _DTYPES[cfg["head_dtype"]] if cfg.get("head_dtype") else None
        self.temperature = float(cfg["temperature"])
        self.top_k, self.top_p = int(cfg.get("top_k", 0)), float(cfg.get("top_p", 1.0))
        self.logp_chunk_size = int(cfg["logp_chunk_size"])
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        if cfg.get("gradient_checkpointing"):
            self.model.gradient_checkpointing_enable()
        # Optimizer updates applied to these weights: the version rollouts are tagged with.
        self.policy_version = 0
        # With sharded weights (`shard`), the FSDP root unit that runs the log-probs; kept
        # out of the module's registry so the parameters keep their `model.` names.
        self.__dict__["_sharded_root"] = None
        self._full_weights: dict[str, torch.Tensor] = {}  # sharded: rank 0's gathered copy

    @property
    def sharded(self) -> bool:
        return self._sharded_root is not None

    def shard(self) -> None:
        """Shards the weights over the learners' process group (FSDP2, `torch/fsdp.py`)."""
        self.__dict__["_sharded_root"] = fsdp.shard(self.model, chunked_response_logp, self.compute_dtype)

    def gather_full_weights(self) -> None:
        """Sharded: gather the whole weights to rank 0's CPU, what `get_state` returns
        (a collective: every learner calls it at once, after each update)."""
        self._full_weights = fsdp.full_state_dict(self.model)

    def response_logp(self, batch: dict[str, Any], with_entropy: bool = True):
        """`(logp, entropy)` of the batch's response tokens, each `(B, R)` float32, with
        memory bounded by `logp_chunk_size` (`m2po_rllib.torch.logp`)."""
        kwargs = dict(temperature=self.temperature, chunk_size=self.logp_chunk_size, with_entropy=with_entropy,
                      compute_dtype=self.compute_dtype, top_k=self.top_k, top_p=self.top_p,
                      head_dtype=self.head_dtype)
        if self._sharded_root is None:
            return chunked_response_logp(self.model, batch, **kwargs)
        out = self._sharded_root(batch, **kwargs)
        if not torch.is_grad_enabled():
            # FSDP keeps the root's gathered weights until a backward, which a no-grad
            # forward never runs: free them, or the next forward would use them stale
            self._sharded_root.reshard()
        return out

    @override(TorchRLModule)
    def _forward_train(self, batch: dict[str, Any], **kwargs) -> dict[str, Any]:
        logp, entropy = self.response_logp(batch)
        return {LOGP: logp, ENTROPY: entropy}

    @override(TorchRLModule)
    def _forward(self, batch: dict[str, Any], **kwargs) -> dict[str, Any]:
        with torch.no_grad():
            logp, entropy = self.response_logp(batch)
        return {LOGP: logp, ENTROPY: entropy}

    # RLlib's default get_state converts to numpy, which has no bfloat16: keep torch tensors.
    # On CPU these share memory with the parameters (as RLlib's numpy conversion does):
    # whoever keeps the state past the next update copies it (a checkpoint or `ray.put`
    # serialises at once; `PublishedWeights.publish` clones for in-process runners).
    # Sharded: rank 0 returns the whole weights its learner gathered after the last update
    # (`gather_full_weights`; the other ranks return none), and every rank loads its shards
    # from a whole state.
    @override(TorchRLModule)
    def get_state(self, components=None, *, not_components=None, inference_only=False, **kwargs):
        if self.sharded:
            weights = dict(self._full_weights)
        else:
            weights = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        return {"weights": weights, "policy_version": int(self.policy_version)}

    @override(TorchRLModule)
    def set_state(self, state: dict) -> None:
        if "weights" in state:
            weights = {
                k: torch.as_tensor(v) for k, v in state["weights"].items()
            }
            if self.sharded:
                fsdp.load_full_state_dict(self.model, weights)
            else:
                self.model.load_state_dict(weights, strict=True)
        if "policy_version" in state:
            self.policy_version = int(state["policy_version"])
