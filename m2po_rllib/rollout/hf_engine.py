"""`HFEngine`: batched sampling with plain transformers (left padding, KV cache).

For tiny models, where vLLM's per-step overhead dominates, and as the reference in parity
tests. The sampling loop is written out rather than using `model.generate` so that every
token's behaviour log-prob and every sample's own seeded generator are explicit; its
semantics (temperature, vLLM's top-k / top-p rule from `m2po_rllib.truncation`, stop
strings, seeds per sample, EOS) are those of `engine.py`'s docstring.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from m2po_rllib.rollout.engine import Completion, EngineDeadError, GenerationEngine, SamplingConfig
from m2po_rllib.truncation import truncate_logits_


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


def sample_next(
    logits: torch.Tensor,
    sampling: SamplingConfig,
    generators: list[torch.Generator | None],
    rows: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples one token per row of `logits` (B, V); returns `(tokens, behavior_logp)`, both (B,).

    Only `rows` draw noise (each from its own generator, so a sample's random stream does not
    depend on the rest of the batch); the other rows get a don't-care token.
    """
    logits = logits.float()
    if sampling.temperature == 0:
        tokens = logits.argmax(dim=-1)
        logp = logits.log_softmax(dim=-1)
    else:
        scaled = truncate_logits_(logits / sampling.temperature, sampling.top_k, sampling.top_p)
        logp = scaled.log_softmax(dim=-1)  # (B, V); -inf outside the kept tokens
        # Exponential race (= Gumbel-max): argmax p / q with q ~ Exp(1) samples from p.
        noise = torch.ones_like(logp)
        for row in rows:
            noise[row].exponential_(generator=generators[row])
        tokens = (logp.exp() / noise).argmax(dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def find_stop(text: str, stop: list[str]) -> int | None:
    """Index where the earliest-completing stop string in `text` starts (vLLM's tie rule:
    earliest end, then list order), or None."""
    best_end, best_start = None, None
    for s in stop:
        start = text.find(s)
        if start != -1 and (best_end is None or start + len(s) < best_end):
            best_end, best_start = start + len(s), start
    return best_start


@dataclass(eq=False)
class _Group:
    """A streamed group: its key, sampling settings, samples and how many are unfinished."""

    key: object
    sampling: SamplingConfig
    left: int
    rows: list[_Row] = field(default_factory=list)


@dataclass(eq=False)
class _Row:
    """One streamed sample: its prompt, budget, random stream and what it has generated."""

    group: _Group
    prompt: list[int]
    budget: int
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    reason: str | None = None
    text: str | None = None


@dataclass
class _Stream:
    """The streamed batch: queued groups, the rows decoding, their attention mask (B, L),
    next-token logits (B, V), next positions (B,) and KV cache."""

    queue: collections.deque = field(default_factory=collections.deque)
    rows: list[_Row] = field(default_factory=list)
    mask: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    past: object = None

    def reset(self) -> None:
        self.mask = self.logits = self.positions = self.past = None

    def groups(self):
        """The groups in flight: queued, then decoding (each once)."""
        yield from self.queue
        yield from {id(r.group): r.group for r in self.rows}.values()


def _pad_left(t: torch.Tensor, length: int) -> torch.Tensor:
    """A (B, L) mask left-padded with zeros to `length` columns."""
    return torch.nn.functional.pad(t, (length - t.shape[1], 0))


def _pad_cache(past, columns: int):
    """A DynamicCache with `columns` zero positions added on the left of every layer."""
    if columns:
        for layer in _dynamic_layers(past):
            layer.keys = torch.nn.functional.pad(layer.keys, (0, 0, columns, 0))
            layer.values = torch.nn.functional.pad(layer.values, (0, 0, columns, 0))
    return past


def _cat_caches(a, b):
    """`b`'s rows appended to `a`'s (both of one length), in `a`."""
    for la, lb in zip(_dynamic_layers(a), _dynamic_layers(b)):
        la.keys, la.values = torch.cat([la.keys, lb.keys]), torch.cat([la.values, lb.values])
    return a


def _dynamic_layers(past):
    from transformers.cache_utils import DynamicLayer

    layers = past.layers
    if any(type(layer) is not DynamicLayer for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers})
        raise NotImplementedError(
            f"the HF engine streams models with a plain KV cache (DynamicLayer); this model's has {kinds}: "
            "generate() batches it, or rollout_engine='vllm' streams it"
        )
    return layers


class HFEngine(GenerationEngine):
    """A transformers causal LM that samples `SamplingConfig` batches on one device."""

    sleep_unavailable = "the HF engine has no sleep mode; rollout_engine='vllm' on a GPU has one"

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
        self._stream = _Stream()

    def _check_alive(self) -> None:
        if self.model is None:
            raise EngineDeadError("HFEngine was shut down; build a new engine")

    def _generators(self, sampling: SamplingConfig, num_prompts: int) -> list[torch.Generator]:
        return [self._generator(sampling.request_seed(i, j)) for i in range(num_prompts) for j in range(sampling.n)]

    def _generator(self, seed: int | None) -> torch.Generator:
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
        budgets = [self._budget(p, sampling) for p in prompts]
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
        logits, past = self._forward(input_ids, attention_mask, position_ids, None)
        for _step in range(max(budgets)):
            tokens, logps = sample_next(logits, sampling, generators, active)
            tokens_list, logps_list = tokens.tolist(), logps.tolist()
            still_active = []
            for row in active:
                tokens_out[row].append(tokens_list[row])
                logps_out[row].append(logps_list[row])
                reasons[row], texts[row] = self._end(tokens_out[row], budgets[row], sampling.stop)
                if reasons[row] is None:
                    still_active.append(row)
            active = still_active
            if not active:
                break
            # Finished rows keep decoding a don't-care token; dropping them from the KV cache
            # would cost more than it saves at these batch sizes.
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], -1)
            position_ids = position_ids[:, -1:] + 1
            logits, past = self._forward(tokens[:, None], attention_mask, position_ids, past)

        completions = [self._completion(tokens_out[row], logps_out[row], texts[row], reasons[row])
                       for row in range(batch)]
        return [completions[i * n : (i + 1) * n] for i in range(len(prompt_token_ids))]

    # -- one sample's rules, shared by `generate` and the stream ------------------------------
    def _budget(self, prompt: list[int], sampling: SamplingConfig) -> int:
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

    def _end(self, tokens: list[int], budget: int, stop: list[str]) -> tuple[str | None, str | None]:
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

    def _completion(self, tokens: list[int], logps: list[float], text: str | None, reason: str) -> Completion:
        if text is None:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return Completion(tokens, logps, text, reason)

    # -- streaming: rows join and leave one KV-cached batch ----------------------------------
    # The batch's rows are the samples of the groups in flight, left-padded to one cache
    # length: a joining group is prefilled on its own and padded (or the batch padded) to the
    # longer of the two; a finished row leaves the cache at once, and cache columns that no
    # row attends to any more are dropped, so the cache spans the longest live sequence.

    def submit(self, key, prompt_token_ids: list[int], sampling: SamplingConfig, index: int = 0) -> None:
        self._check_alive()
        if any(g.key == key for g in self._stream.groups()):
            raise ValueError(f"a group with key {key!r} is already in flight")
        prompt = list(prompt_token_ids)
        budget = self._budget(prompt, sampling)
        group = _Group(key, sampling, left=sampling.n)
        group.rows = [_Row(group, prompt, budget, self._generator(sampling.request_seed(index, j)))
                       for j in range(sampling.n)]
        self._stream.queue.append(group)

    @property
    def in_flight(self) -> int:
        return sum(1 for _ in self._stream.groups())

    @torch.inference_mode()
    def step(self) -> list[tuple[object, list[Completion]]]:
        self._check_alive()
        st = self._stream
        while st.queue and (not st.rows or len(st.rows) + st.queue[0].sampling.n <= self.stream_rows):
            self._join(st.queue.popleft().rows)
        if not st.rows:
            return []
        # one token for every row, each group's rows by its own sampling settings
        tokens = torch.empty(len(st.rows), dtype=torch.long, device=self.device)
        logps = torch.empty(len(st.rows), device=self.device)
        by_group: dict[int, list[int]] = {}
        for i, row in enumerate(st.rows):
            by_group.setdefault(id(row.group), []).append(i)
        for idx in by_group.values():
            rows = [st.rows[i] for i in idx]
            t, lp = sample_next(st.logits[idx], rows[0].group.sampling, [r.generator for r in rows],
                                list(range(len(rows))))
            tokens[idx], logps[idx] = t, lp.to(logps.dtype)
        finished, keep = [], []
        for i, (row, token, logp) in enumerate(zip(st.rows, tokens.tolist(), logps.tolist())):
            row.tokens.append(token)
            row.logps.append(logp)
            row.reason, row.text = self._end(row.tokens, row.budget, row.group.sampling.stop)
            if row.reason is None:
                keep.append(i)
                continue
            row.group.left -= 1
            if row.group.left == 0:
                g = row.group
                finished.append((g.key, [self._completion(r.tokens, r.logps, r.text, r.reason) for r in g.rows]))
        if len(keep) < len(st.rows):
            self._leave(keep)
        if st.rows:
            st.mask = torch.cat([st.mask, st.mask.new_ones(len(st.rows), 1)], -1)
            st.logits, st.past = self._forward(tokens[keep][:, None], st.mask, st.positions[:, None], st.past)
            st.positions = st.positions + 1
        return finished

    def _join(self, rows: list[_Row]) -> None:
        """Prefills `rows` and adds them to the batch, both left-padded to one cache length."""
        st = self._stream
        width = max(len(r.prompt) for r in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        logits, past = self._forward(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), None)
        positions = mask.sum(-1)  # the next token's position
        if not st.rows:
            st.rows, st.mask, st.logits, st.past, st.positions = list(rows), mask, logits, past, positions
            return
        length = max(st.mask.shape[1], width)
        st.past = _cat_caches(_pad_cache(st.past, length - st.mask.shape[1]), _pad_cache(past, length - width))
        st.mask = torch.cat([_pad_left(st.mask, length), _pad_left(mask, length)])
        st.logits = torch.cat([st.logits, logits])
        st.positions = torch.cat([st.positions, positions])
        st.rows.extend(rows)

    def _leave(self, keep: list[int]) -> None:
        """Keeps rows `keep` of the batch; drops the cache columns no kept row attends to."""
        st = self._stream
        st.rows = [st.rows[i] for i in keep]
        if not keep:
            st.reset()
            return
        index = torch.tensor(keep, device=self.device)
        st.past.batch_select_indices(index)
        st.mask, st.logits, st.positions = st.mask[index], st.logits[index], st.positions[index]
        first = int(st.mask.any(0).nonzero()[0])
        if first:
            st.mask = st.mask[:, first:]
            for layer in _dynamic_layers(st.past):
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]

    def _forward(self, input_ids, attention_mask, position_ids, past):
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

    def shutdown(self) -> None:
        self.model = None
        self._stream = _Stream()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def is_healthy(self) -> bool:
        return self.model is not None
