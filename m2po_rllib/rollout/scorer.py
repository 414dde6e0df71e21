"""`BehaviorScorer`: a runner's own samples scored in the learner's numerics, beside its engine.

With asynchronous rollouts the learner never holds the weights that generated a round when
the round arrives (it has moved on), so behaviour log-probs in the learner's numerics must
be computed where those weights are: on the runner, right after generation, with the same
weights the engine just sampled from. The scorer runs the learner's own log-prob function
(`m2po_rllib.torch.logp.response_logp`: the decoder, the chunked head, the sampling
temperature and truncation replayed) with the learner's compute dtype over float32 master
weights, i.e. the numbers `recompute_behavior_logp` gives in sync mode, where the learners
compute them.

Memory: a float32 copy of the weights beside the engine, unless the engine is the HF engine
in float32, whose model is shared (it already holds exactly those weights).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from m2po_rllib.rollout.hf_engine import load_weights_into
from m2po_rllib.torch.logp import response_logp
from m2po_rllib.wire.batch import pack_rollouts, to_train_batch


class BehaviorScorer:
    """Behaviour log-probs `(B, R)` of a rollout batch under the runner's current weights."""

    def __init__(
        self,
        model_path: str,
        *,
        compute_dtype: torch.dtype,
        temperature: float,
        top_k: int = 0,
        top_p: float = 1.0,
        chunk_size: int = 256,
        head_dtype: torch.dtype | None = None,
        model: torch.nn.Module | None = None,
        device: str = "cpu",
        rows_per_forward: int | None = None,
    ):
        """`model`: a float32 model that already serves the engine's weights (shared, never
        loaded here); None loads the checkpoint at `model_path` and takes every weight sync
        through `load`. `rows_per_forward`: sequences per no-grad forward, the learner's
        `micro_batch_size` (None: the whole round at once, as the learner does)."""
        from transformers import AutoModelForCausalLM

        self.owns_model = model is None
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
            model.eval()
            model.requires_grad_(False)
        elif next(model.parameters()).dtype != torch.float32:
            raise ValueError("a shared scoring model must hold float32 weights (the learner's master weights)")
        self.model = model
        self.rows_per_forward = rows_per_forward
        self.kwargs = dict(
            temperature=float(temperature), chunk_size=int(chunk_size), with_entropy=False,
            compute_dtype=compute_dtype, top_k=int(top_k), top_p=float(top_p), head_dtype=head_dtype,
        )

    @classmethod
    def beside(cls, engine, config, model_path: str) -> "BehaviorScorer":
        """The scorer for a runner's `engine` under an M2POConfig: the learner's compute
        dtype, sampling settings, chunk and micro-batch sizes, on the engine's device (the
        learner's kernels are those of its device type), sharing the HF engine's model when
        it is float32."""
        shared = getattr(engine, "model", None)
        if shared is None or next(shared.parameters()).dtype != torch.float32:
            shared = None
        device = getattr(engine, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
        return cls(
            model_path,
            compute_dtype=getattr(torch, config.model_config["dtype"]),
            temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
            chunk_size=config.logp_chunk_size, model=shared, device=str(device),
            head_dtype=getattr(torch, config.model_config["head_dtype"]) if config.model_config.get("head_dtype") else None,
            rows_per_forward=config.micro_batch_size,
        )

    def load(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copies a weight sync (HF names, as the engines take them) into the scoring model;
        a shared model already has it (the engine loaded it)."""
        if self.owns_model:
            load_weights_into(self.model, weights)

    @torch.no_grad()
    def score(self, rollout: dict[str, np.ndarray]) -> np.ndarray:
        """float32 `(B, R)` log-probs of `rollout`'s response tokens (0 on padding)."""
        train = to_train_batch(rollout, np.zeros(len(rollout["response_mask"]), np.float32))
        device = next(self.model.parameters()).device
        n = len(train["response_mask"])
        rows = self.rows_per_forward or max(1, n)
        out = []
        for start in range(0, n, rows):
            part = {
                k: torch.as_tensor(np.ascontiguousarray(train[k][start : start + rows])).to(device)
                for k in ("input_ids", "attention_mask", "response_mask")
            }
            logp, _ = response_logp(self.model, part, **self.kwargs)
            out.append(logp.float().cpu().numpy())
        logp = np.concatenate(out)
        return np.where(rollout["response_mask"] > 0, logp, 0.0).astype(np.float32)

    def score_rows(self, prompts: list[list[int]], responses: list[list[int]]) -> list[np.ndarray]:
        """Each response's log-probs after its prompt (rows of tokens, not a rollout batch:
        `segments.SegmentScores` scores rows still generating)."""
        zeros = [[0.0] * len(r) for r in responses]
        logp = self.score(pack_rollouts(prompts, responses, zeros, [0.0] * len(responses), 0))
        return [logp[k, : len(r)] for k, r in enumerate(responses)]
