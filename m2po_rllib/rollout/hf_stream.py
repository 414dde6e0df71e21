"""The HF engine's continuous batch (`HFEngine.submit` / `step`): GRPO groups join one
KV-cached batch as others finish and come back whole.

The batch's rows are the samples of the groups in flight, left-padded to one cache length:
a joining group is prefilled on its own and padded (or the batch padded) to the longer of
the two; a finished row leaves the cache at once, and cache columns that no row attends to
any more are dropped, so the cache spans the longest live sequence. Each sample keeps its
own random stream, seeded as `generate` seeds it, so a streamed sample is the sample
`generate` makes (tests/test_engines.py). The engine owns the model and the per-sample
rules (`budget`, `ending`, `completion`, `forward`, `generator`); this file owns the batch.

Weights loaded between two steps (`HFEngine.update_weights(..., mid_sequence=True)`): the
batch is prefilled again from every row's prompt and tokens so far (`reprefill`), so each
later token is the new weights' own, given its whole context (no KV entry of the old weights
is kept); each row records the version that sampled each of its tokens.

Partial groups (`partials`, `submit(..., resume=...)`): a group in flight handed over as far
as it got, each sample with its tokens, log-probs, versions and random stream's state, and
continued in another batch (a mid-generation checkpoint resumed): its samples join by the same
prefill as above, and draw what they would have drawn uninterrupted.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch

from m2po_rllib.rollout.engine import Completion, Partial, SamplingConfig
from m2po_rllib.rollout.hf_sampling import sample_next


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
    versions: list[int] = field(default_factory=list)  # the policy version that sampled each token
    reason: str | None = None
    text: str | None = None


def _resume(row: _Row, partial: Partial) -> None:
    """`row` goes on from `partial`: its tokens, log-probs and versions, its random stream's
    state; an ended sample stays ended (its group counts it done)."""
    partial.check(row.budget)
    row.tokens, row.logps, row.versions = list(partial.token_ids), list(partial.logprobs), list(partial.versions)
    if partial.rng_state is not None:
        row.generator.set_state(torch.frombuffer(bytearray(partial.rng_state), dtype=torch.uint8))
    if partial.finish_reason is not None:
        row.reason, row.text = partial.finish_reason, partial.text
        row.group.left -= 1


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


class ContinuousBatch:
    """The streamed groups of one `HFEngine` (`engine`): the queued groups, the rows decoding,
    their attention mask (B, L), next-token logits (B, V), next positions (B,) and KV cache."""

    def __init__(self, engine):
        self.engine = engine
        self.queue: collections.deque[_Group] = collections.deque()
        self.rows: list[_Row] = []
        self.reset()

    def reset(self) -> None:
        """Drops the batch's tensors (no row is decoding)."""
        self.mask = self.logits = self.positions = self.past = None

    def clear(self) -> None:
        """Drops every group (the engine shut down)."""
        self.queue.clear()
        self.rows = []
        self.reset()

    def groups(self):
        """The groups in flight: queued, then decoding (each once)."""
        yield from self.queue
        yield from {id(r.group): r.group for r in self.rows}.values()

    def submit(self, key, prompt_token_ids: list[int], sampling: SamplingConfig, index: int = 0,
               resume: list[Partial] | None = None) -> None:
        if any(g.key == key for g in self.groups()):
            raise ValueError(f"a group with key {key!r} is already in flight")
        if resume is not None and len(resume) != sampling.n:
            raise ValueError(f"resume holds {len(resume)} samples for a group of n={sampling.n}")
        prompt = list(prompt_token_ids)
        budget = self.engine.budget(prompt, sampling)
        group = _Group(key, sampling, left=sampling.n)
        group.rows = [_Row(group, prompt, budget, self.engine.generator(sampling.request_seed(index, j)))
                       for j in range(sampling.n)]
        for row, partial in zip(group.rows, resume or []):
            _resume(row, partial)
        self.queue.append(group)

    def partials(self) -> dict[object, list[Partial]]:
        """Every group in flight as far as it got (`GenerationEngine.partials`), each sample
        with its random stream's state."""
        return {g.key: [Partial(list(r.tokens), list(r.logps), list(r.versions), r.reason, r.text,
                                r.generator.get_state().numpy().tobytes()) for r in g.rows]
                for g in self.groups()}

    @property
    def in_flight(self) -> int:
        """Groups submitted and not yet returned by `step()`."""
        return sum(1 for _ in self.groups())

    def step(self) -> list[tuple[object, list[Completion]]]:
        st = self
        finished = []
        while st.queue and (not st.rows or len(st.rows) + st.queue[0].left <= self.engine.stream_rows):
            group = st.queue.popleft()
            if group.left:
                self._join([r for r in group.rows if r.reason is None])
            else:  # resumed with every sample ended: back as it was
                finished.append((group.key, self._completions(group)))
        if not st.rows:
            return finished
        # one token for every row, each group's rows by its own sampling settings
        tokens = torch.empty(len(st.rows), dtype=torch.long, device=self.engine.device)
        logps = torch.empty(len(st.rows), device=self.engine.device)
        by_group: dict[int, list[int]] = {}
        for i, row in enumerate(st.rows):
            by_group.setdefault(id(row.group), []).append(i)
        for idx in by_group.values():
            rows = [st.rows[i] for i in idx]
            t, lp = sample_next(st.logits[idx], rows[0].group.sampling, [r.generator for r in rows],
                                list(range(len(rows))))
            tokens[idx], logps[idx] = t, lp.to(logps.dtype)
        keep = []
        version = self.engine.version  # the weights that computed st.logits (reprefill: after a load)
        for i, (row, token, logp) in enumerate(zip(st.rows, tokens.tolist(), logps.tolist())):
            row.tokens.append(token)
            row.logps.append(logp)
            row.versions.append(version)
            row.reason, row.text = self.engine.ending(row.tokens, row.budget, row.group.sampling.stop)
            if row.reason is None:
                keep.append(i)
                continue
            row.group.left -= 1
            if row.group.left == 0:
                finished.append((row.group.key, self._completions(row.group)))
        if len(keep) < len(st.rows):
            self._leave(keep)
        if st.rows:
            st.mask = torch.cat([st.mask, st.mask.new_ones(len(st.rows), 1)], -1)
            st.logits, st.past = self.engine.forward(tokens[keep][:, None], st.mask, st.positions[:, None], st.past)
            st.positions = st.positions + 1
        return finished

    def _completions(self, group: _Group) -> list[Completion]:
        return [self.engine.completion(r.tokens, r.logps, r.text, r.reason, r.versions) for r in group.rows]

    def reprefill(self) -> None:
        """After a weight load between two steps: every decoding row's context (its prompt and
        the tokens it has so far) prefilled again by the new weights, so the cache, and the
        logits the next token is sampled from, are theirs; rows keep their order, random
        streams and budgets."""
        rows, self.rows = self.rows, []
        self.reset()
        if rows:
            self._join(rows)

    def _join(self, rows: list[_Row]) -> None:
        """Prefills `rows` (each its prompt and what it generated so far) and adds them to the
        batch, both left-padded to one cache length."""
        st = self
        contexts = [r.prompt + r.tokens for r in rows]
        width = max(len(c) for c in contexts)
        ids = torch.full((len(rows), width), self.engine.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, c in enumerate(contexts):
            ids[i, width - len(c):] = torch.tensor(c)
            mask[i, width - len(c):] = 1
        ids, mask = ids.to(self.engine.device), mask.to(self.engine.device)
        logits, past = self.engine.forward(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), None)
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
        st = self
        st.rows = [st.rows[i] for i in keep]
        if not keep:
            st.reset()
            return
        index = torch.tensor(keep, device=self.engine.device)
        st.past.batch_select_indices(index)
        st.mask, st.logits, st.positions = st.mask[index], st.logits[index], st.positions[index]
        first = int(st.mask.any(0).nonzero()[0])
        if first:
            st.mask = st.mask[:, first:]
            for layer in _dynamic_layers(st.past):
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
