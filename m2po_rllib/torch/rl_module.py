"""An RLlib `TorchRLModule` around a Hugging Face causal LM.

The rollout engines (vLLM, HF) own generation; the learner needs only per-token log-probs
and entropies of the sampled responses, which `_forward_train` computes, padding-aware.

Batch layout (built by `m2po_rllib.rollout.batch.pack_rollouts`), B sequences:
    input_ids       (B, P + R)  prompt left-padded to P, response right-padded to R
    attention_mask  (B, P + R)
    response_mask   (B, R)      1 for generated tokens (eos included), 0 for padding
"""

from __future__ import annotations

from typing import Any

import torch

from ray.rllib.core.rl_module.torch import TorchRLModule

from m2po_rllib.log_filters import quiet_rllib_module_config_deprecation

quiet_rllib_module_config_deprecation()

LOGP = "logp"
ENTROPY = "entropy"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def response_logp_and_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob (and entropy) of each response token under `model`.

    Logits are divided by `temperature` before the softmax: the log-probs are those of
    the distribution the rollout engine sampled from (as verl computes them).
    Returns `(B, R)` tensors, float32.
    """
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).logits
    # Token t of the response is predicted by position t - 1.
    prompt_len = input_ids.shape[1] - response_len
    logits = logits[:, prompt_len - 1 : -1, :].float()  # (B, R, V)
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = logits.log_softmax(-1)
    targets = input_ids[:, prompt_len:]
    logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, R)
    entropy = None
    if with_entropy:
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logp, entropy


class HFCausalLMModule(TorchRLModule):
    """A `TorchRLModule` whose policy is `AutoModelForCausalLM.from_pretrained(model)`.

    `model_config` keys:
        model: HF directory, hub name, or a built-in name such as `builtin:arith-tiny`.
        dtype: "float32" (default) | "bfloat16" | "float16".
        temperature: sampling temperature of the rollouts (log-probs are computed for it).
        gradient_checkpointing: trade compute for memory on long responses.
    """

    def setup(self):
        from transformers import AutoModelForCausalLM

        from m2po_rllib.models.builtin import resolve_model_path

        cfg = dict(self.model_config or {})
        if "model" not in cfg:
            raise ValueError(
                "rl_module(model_config=...) needs 'model': a HF model directory or name, "
                "e.g. model_config={'model': 'builtin:arith-tiny'}"
            )
        dtype = cfg.get("dtype", "float32")
        if dtype not in _DTYPES:
            raise ValueError(f"model_config['dtype']={dtype!r}; use one of {sorted(_DTYPES)}")
        self.model_path = resolve_model_path(cfg["model"])
        self.temperature = float(cfg.get("temperature", 1.0))
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=_DTYPES[dtype])
        if cfg.get("gradient_checkpointing"):
            self.model.gradient_checkpointing_enable()
        # Optimizer updates applied to these weights: the version rollouts are tagged with.
        self.policy_version = 0

    def response_logp(self, batch: dict[str, Any], with_entropy: bool = True):
        """`(logp, entropy)` of the batch's response tokens, each `(B, R)`."""
        return response_logp_and_entropy(
            self.model,
            batch["input_ids"],
            batch["attention_mask"],
            batch["response_mask"].shape[1],
            temperature=self.temperature,
            with_entropy=with_entropy,
        )

    def _forward_train(self, batch: dict[str, Any], **kwargs) -> dict[str, Any]:
        logp, entropy = self.response_logp(batch)
        return {LOGP: logp, ENTROPY: entropy}

    def _forward(self, batch: dict[str, Any], **kwargs) -> dict[str, Any]:
        with torch.no_grad():
            logp, entropy = self.response_logp(batch)
        return {LOGP: logp, ENTROPY: entropy}

    # RLlib's default get_state converts to numpy, which has no bfloat16: keep torch tensors.
    def get_state(self, components=None, *, not_components=None, inference_only=False, **kwargs):
        return {
            "weights": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
            "policy_version": int(self.policy_version),
        }

    def set_state(self, state: dict) -> None:
        if "weights" in state:
            weights = {
                k: torch.as_tensor(v) for k, v in state["weights"].items()
            }
            self.model.load_state_dict(weights, strict=True)
        if "policy_version" in state:
            self.policy_version = int(state["policy_version"])
