"""`HFEngine`: batched sampling with plain transformers (left padding, KV cache).

For tiny models, where vLLM's per-step overhead dominates, and as the reference in parity
tests. The sampling loop is written out rather than using `model.generate` so that every
token's behaviour log-prob and every sample's own seeded generator are explicit; its
semantics (temperature, vLLM's top-k / top-p rule from `m2po_rllib.common.truncation`, stop
strings, seeds per sample, EOS) are those of `engine.py`'s docstring. Streaming
(`submit` / `step`) goes through the engine's continuous batch, `hf_stream.py`, which also
loads weights between two decoding steps with groups in flight (`update_weights(...,
mid_sequence=True)`): it recomputes every live sequence's KV cache with the new weights.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from m2po_rllib.rollout.engine import Completion, EngineDeadError, GenerationEngine, SamplingConfig
from m2po_rllib.rollout.hf_sampling import find_stop, sample_next
from m2po_rllib.rollout.hf_stream import ContinuousBatch


def load_weights_into(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copies `weights` (HF names; a subset is fine) into `model` in place, converting to its
    dtype and device; unknown names and wrong shapes raise before anything is copied."""
    state = model.state_dict()
    unknown = sorted(set(weights) - set(state))
    if unknown:
        raise KeyError(f"{len(unknown)} weights are not in the model, e.g. {unknown[:5]}")
    for name, tensor in weights.items():
        if tuple(tensor.shape) != tuple(state[name].shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}; the model's is {tuple(state[name].shape)}"
            )
    with torch.no_grad():
        for name, tensor in weights.items():
            state[name].copy_(torch.as_tensor(tensor))


class HFEngine(GenerationEngine):
    """A transformers causal LM that samples `SamplingConfig` batches on one device."""

    sleep_unavailable = "the HF engine has no sleep mode; rollout_engine='vllm' on a GPU has one"
    loads_mid_sequence = True

    def __init__(
        self,
        model_path: str,
        *,
        device: str | None = None,
        dtype: str = "float32",
        seed: int = 0,
        attn_implementation: str = "sdpa",
        head_dtype: str | None = None,
        stream_rows: int = 256,
    ):
        """`device`: None picks cuda when available, else cpu. `seed` seeds the draws of
        requests whose `SamplingConfig.seed` is None. `head_dtype` ("float32"): the LM head in
        that dtype (the decoder's hidden states and the head's weights cast up), as vLLM's
        `head_dtype` and the learner's with the same setting; None: the model's dtype.
        `stream_rows`: most samples decoded at once when streaming (`submit`/`step`); a queued
        group joins when its samples fit."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        super().__init__()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, dtype), attn_implementation=attn_implementation
        ).to(self.device)
        self.model.eval()
        self.model.requires_grad_(False)
        head = None if head_dtype is None else getattr(torch, head_dtype)
        self.head_dtype = None if head == self.model.dtype else head
        self._rng = torch.Generator().manual_seed(seed)
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        self.eos_token_ids = (set(gen_eos) | {self.tokenizer.eos_token_id}) - {None}
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else min(self.eos_token_ids)
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)
        self.stream_rows = stream_rows
        self._stream = ContinuousBatch(self)

    def _check_alive(self) -> None:
        if self.model is None:
            raise EngineDeadError("HFEngine was shut down; build a new engine")

    def _generators(self, sampling: SamplingConfig, num_prompts: int) -> list[torch.Generator]:
        return [self.generator(sampling.request_seed(i, j)) for i in range(num_prompts) for j in range(sampling.n)]

    def generator(self, seed: int | None) -> torch.Generator:
        """A sample's own random stream (from the engine's seed where the request has none)."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._rng))
        return torch.Generator(device=self.device).manual_seed(seed)

    @torch.inference_mode()
    def generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingConfig
    ) -> list[list[Completion]]:
        self._check_alive()
        self._check_idle("generate a batch")
        if not prompt_token_ids:
            return []
        n = sampling.n
        prompts = [list(p) for p in prompt_token_ids for _ in range(n)]  # prompt i -> rows i*n..
        batch = len(prompts)
        budgets = [self.budget(p, sampling) for p in prompts]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding
            input_ids[row, width - len(p) :] = torch.tensor(p)
            attention_mask[row, width - len(p) :] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
        generators = self._generators(sampling, len(prompt_token_ids))

        tokens_out: list[list[int]] = [[] for _ in range(batch)]
        logps_out: list[list[float]] = [[] for _ in range(batch)]
        texts: list[str | None] = [None] * batch
        reasons: list[str | None] = [None] * batch
        active = list(range(batch))
        logits, past = self.forward(input_ids, attention_mask, position_ids, None)
        for _step in range(max(budgets)):
            tokens, logps = sample_next(logits, sampling, generators, active)
            tokens_list, logps_list = tokens.tolist(), logps.tolist()
            still_active = []
            for row in active:
                tokens_out[row].append(tokens_list[row])
                logps_out[row].append(logps_list[row])
                reasons[row], texts[row] = self.ending(tokens_out[row], budgets[row], sampling.stop)
                if reasons[row] is None:
                    still_active.append(row)
            active = still_active
            if not active:
                break
            # Finished rows keep decoding a don't-care token; dropping them from the KV cache
            # would cost more than it saves at these batch sizes.
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], -1)
            position_ids = position_ids[:, -1:] + 1
            logits, past = self.forward(tokens[:, None], attention_mask, position_ids, past)

        completions = [self.completion(tokens_out[row], logps_out[row], texts[row], reasons[row],
                                       [self._version] * len(tokens_out[row])) for row in range(batch)]
        return [completions[i * n : (i + 1) * n] for i in range(len(prompt_token_ids))]

    # -- one sample's rules, shared by `generate` and the stream ------------------------------
    def budget(self, prompt: list[int], sampling: SamplingConfig) -> int:
        """A sample ends with "length" at `max_tokens` or when it fills the model's positions."""
        if not prompt:
            raise ValueError("every prompt needs at least one token")
        budget = sampling.max_tokens if self.max_positions is None else min(
            sampling.max_tokens, self.max_positions - len(prompt))
        if budget < 1:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens leaves no room to generate within the model's "
                f"{self.max_positions} positions; shorten the prompt"
            )
        return budget

    def ending(self, tokens: list[int], budget: int, stop: list[str]) -> tuple[str | None, str | None]:
        """(finish reason, text cut before a stop string) once the sample ends with its last
        token; (None, None) while it goes on."""
        if tokens[-1] in self.eos_token_ids:
            return "stop", None
        if stop:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            cut = find_stop(text, stop)
            if cut is not None:
                return "stop", text[:cut]
        return ("length", None) if len(tokens) >= budget else (None, None)

    # -- streaming: the continuous batch (hf_stream.py) ----------------------------------------
    resumes_partial = True

    def submit(self, key, prompt_token_ids: list[int], sampling: SamplingConfig, index: int = 0,
               resume=None) -> None:
        self._check_alive()
        self._stream.submit(key, prompt_token_ids, sampling, index, resume)

    def partials(self):
        return self._stream.partials()

    @property
    def in_flight(self) -> int:
        return self._stream.in_flight

    @torch.inference_mode()
    def step(self) -> list[tuple[object, list[Completion]]]:
        self._check_alive()
        return self._stream.step()

    def forward(self, input_ids, attention_mask, position_ids, past):
        """The last position's logits (B, V) and the KV cache; with `head_dtype`, the head runs
        in it on the decoder's hidden states."""
        kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      past_key_values=past, use_cache=True)
        if self.head_dtype is None:
            out = self.model(**kwargs)
            return out.logits[:, -1], out.past_key_values
        out = self.model.get_decoder()(**kwargs)
        head = self.model.get_output_embeddings()
        hidden = out.last_hidden_state[:, -1].to(self.head_dtype)
        bias = None if head.bias is None else head.bias.to(self.head_dtype)
        return torch.nn.functional.linear(hidden, head.weight.to(self.head_dtype), bias), out.past_key_values

    def _load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._check_alive()
        load_weights_into(self.model, weights)

    @torch.inference_mode()
    def _continue_after_load(self) -> None:
        self._stream.reprefill()

    def shutdown(self) -> None:
        self.model = None
        self._stream.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def is_healthy(self) -> bool:
        return self.model is not None
