"""A `VLLMEngine`'s streamed groups: vLLM's own continuous batching stepped by the runner, and
the groups in flight handed over as far as they got (a checkpoint taken mid-generation).

A group is one vLLM request of `n` samples (its outputs come back once, whole). A group
resumed from a checkpoint (`submit(..., resume=partials)`) is one request per sample that
goes on, and comes back when the last of them ends.

Partials (`partials()`) are read from vLLM's output processor, which lives in this process
(`LLMEngine.output_processor`): each request's tokens, log-probs and weight-version spans so
far, and, for a group still generating, the samples already finished in its parent request's
aggregator. Read between two `step()` calls, they are exactly what `step()` has returned so far.

vLLM keeps no random state that a request could be continued from, so a resumed sample goes on
as a new request: the original prompt plus its tokens so far, `max_tokens` what is left of its
budget, and a seed of its own derived from the sample's seed and its length (a fresh random
stream: never the one whose draws gave its first tokens). Its tokens, log-probs and versions are
kept, and the continuation's follow them; a stop string that straddles the two is found when
the continuation ends (`_joined`). The HF engine, which keeps each sample's generator state,
continues the very stream the uninterrupted sample would have drawn.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from m2po_rllib.rollout.engine import Completion, Partial, SamplingConfig
from m2po_rllib.rollout.hf_sampling import find_stop
from m2po_rllib.rollout.stream_snapshot import ended
from m2po_rllib.rollout.vllm_outputs import check_versions, completion_of, completions, sampled_logprobs


@dataclass
class _Request:
    """One vLLM request in flight: its group, the sample it continues (None: the whole group),
    vLLM's internal id and the version the engine served when it was submitted."""

    key: Hashable
    sample: int | None
    internal_id: str
    n: int
    version: int


@dataclass
class _Resumed:
    """A resumed group: its samples, ended (`Completion`) or continued (`Partial` until its
    request ends), and how many still generate."""

    version: int
    sampling: SamplingConfig
    samples: list = field(default_factory=list)
    left: int = 0


def continuation_seed(seed: int, length: int) -> int:
    """The seed of a sample continued after `length` tokens: a stream of its own (vLLM seeds are
    non-negative 63-bit ints)."""
    return int(np.random.SeedSequence([int(seed) % 2**63, int(length)]).generate_state(1, np.uint64)[0] >> 1)


class VLLMStream:
    """The streamed groups of one `VLLMEngine` (`engine`)."""

    def __init__(self, engine):
        self.engine = engine
        self.requests: dict[str, _Request] = {}  # our request id -> what it generates
        self.resumed: dict[Hashable, _Resumed] = {}
        self.count = 0  # requests submitted so far (our ids)

    @property
    def in_flight(self) -> int:
        """Groups submitted and not yet returned by `step()`."""
        return len({r.key for r in self.requests.values()} | set(self.resumed))

    def submit(self, key, prompt_token_ids: list[int], sampling: SamplingConfig, index: int = 0,
               resume: list[Partial] | None = None) -> None:
        if key in self.resumed or any(r.key == key for r in self.requests.values()):
            raise ValueError(f"a group with key {key!r} is already in flight")
        if not prompt_token_ids:
            raise ValueError("every prompt needs at least one token")
        prompt = list(prompt_token_ids)
        if resume is None:
            params = self.engine._sampling_params(sampling, sampling.request_seed(index, 0))
            self._add(key, None, prompt, params, sampling.n)
            return
        if len(resume) != sampling.n:
            raise ValueError(f"resume holds {len(resume)} samples for a group of n={sampling.n}")
        group = _Resumed(self.engine.version, sampling)
        for j, partial in enumerate(resume):
            partial.check(sampling.max_tokens)
            if partial.finish_reason is not None:
                group.samples.append(self.engine.completion(
                    list(partial.token_ids), list(partial.logprobs), partial.text, partial.finish_reason,
                    list(partial.versions)))
                continue
            group.samples.append(partial)
            group.left += 1
            seed = None if sampling.seed is None else continuation_seed(sampling.request_seed(index, j),
                                                                         len(partial.token_ids))
            left = dataclasses.replace(sampling, n=1, max_tokens=sampling.max_tokens - len(partial.token_ids))
            self._add(key, j, prompt + list(partial.token_ids), self.engine._sampling_params(left, seed), 1)
        self.resumed[key] = group

    def _add(self, key, sample: int | None, prompt: list[int], params, n: int) -> None:
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.FINAL_ONLY  # a request comes back once, whole
        # our own request id (vLLM's outputs carry the id they were given), apart from LLM's counter
        self.count += 1
        request_id = f"m2po-stream-{self.count}"
        internal = self.engine._call(self.engine.llm.llm_engine.add_request, request_id,
                                     {"prompt_token_ids": prompt}, params)
        self.requests[request_id] = _Request(key, sample, internal, n, self.engine.version)

    def step(self) -> list[tuple[Hashable, list[Completion]]]:
        finished = [(key, group.samples) for key, group in self.resumed.items() if not group.left]
        for key, _ in finished:  # resumed with every sample ended: back as it was
            del self.resumed[key]
        if not self.requests:
            return finished
        llm_engine = self.engine.llm.llm_engine
        if not llm_engine.has_unfinished_requests():  # its step() would wait for ever
            raise RuntimeError(f"vLLM has no request left for the {self.in_flight} groups in flight")
        for out in self.engine._call(llm_engine.step):
            if not (out.finished and out.request_id in self.requests):
                continue
            request = self.requests.pop(out.request_id)
            group = completions(out, request.n)
            check_versions(group, request.version, f"group {request.key!r}", newest=self.engine.version)
            if request.sample is None:
                finished.append((request.key, group))
                continue
            resumed = self.resumed[request.key]
            resumed.samples[request.sample] = self._joined(resumed, resumed.samples[request.sample], group[0])
            resumed.left -= 1
            if not resumed.left:
                finished.append((request.key, self.resumed.pop(request.key).samples))
        return finished

    def _joined(self, group: _Resumed, partial: Partial, rest: Completion) -> Completion:
        """A resumed sample whole: its partial's tokens, log-probs and versions, then the
        continuation's; cut at a stop string that straddles the two (vLLM saw only the
        continuation's text), as vLLM cuts one: after the token that completes it."""
        tokens = list(partial.token_ids) + list(rest.token_ids)
        logps = list(partial.logprobs) + list(rest.logprobs)
        versions = list(partial.versions) + (rest.token_versions() or [group.version] * len(rest.token_ids))
        reason, text = rest.finish_reason, None
        stop = group.sampling.stop
        if stop:
            decode = self.engine.tokenizer.decode
            # a straddling stop string ends within as many continuation tokens as it has characters
            for end in range(len(partial.token_ids) + 1, min(len(tokens), len(partial.token_ids) + max(map(len, stop))) + 1):
                whole = decode(tokens[:end], skip_special_tokens=True)
                cut = find_stop(whole, stop)
                if cut is not None:
                    tokens, logps, versions, reason, text = tokens[:end], logps[:end], versions[:end], "stop", whole[:cut]
                    break
        return self.engine.completion(tokens, logps, text, reason, versions)

    def partials(self) -> dict[Hashable, list[Partial]]:
        """Every group in flight as far as it got (`GenerationEngine.partials`); no random
        state (vLLM keeps none a request could go on from)."""
        out: dict[Hashable, list[Partial]] = {}
        for key, group in self.resumed.items():
            out[key] = [ended(s, group.version) if isinstance(s, Completion) else s for s in group.samples]
        for request in self.requests.values():
            samples = self._request_partials(request)
            if request.sample is None:
                out[request.key] = samples * request.n if len(samples) == 1 < request.n else samples  # greedy: copied
            else:  # a resumed sample: its partial, then what its continuation has so far
                before = self.resumed[request.key].samples[request.sample]
                now = samples[0]
                out[request.key][request.sample] = Partial(
                    list(before.token_ids) + now.token_ids, list(before.logprobs) + now.logprobs,
                    list(before.versions) + now.versions)
        return out

    def _request_partials(self, request: _Request) -> list[Partial]:
        """The samples of one request as far as vLLM's output processor has them."""
        processor = self.engine.llm.llm_engine.output_processor
        states = processor.request_states
        if request.internal_id in states:  # one sample (n=1, or greedy)
            return [_from_state(states[request.internal_id], request.version)]
        parent = processor.parent_requests.get(request.internal_id)
        if parent is None:
            raise RuntimeError(f"vLLM's output processor holds no request {request.internal_id!r} for group "
                               f"{request.key!r}: this vLLM keeps its requests differently (vLLM 0.32 is pinned)")
        samples = []
        for j in range(request.n):
            child = states.get(f"{j}_{request.internal_id}")  # vLLM's id of sample j (ParentRequest.get_child_info)
            if child is not None:
                samples.append(_from_state(child, request.version))
            else:  # finished, waiting in the parent's aggregator for its siblings
                samples.append(ended(completion_of(parent.output_aggregator[j], request.internal_id), request.version))
        return samples


def _versions(starts: list[tuple[str, int]], n: int, default: int) -> list[int]:
    """Per-token versions from vLLM's `(version, first token)` span starts."""
    if not starts:
        return [default] * n
    ends = [s for _, s in starts[1:]] + [n]
    return [int(v) for (v, s), e in zip(starts, ends) for _ in range(s, e)]


def _from_state(state, version: int) -> Partial:
    """A sample in flight, from vLLM's `RequestState` (its detokenizer's tokens, its logprobs
    processor's log-probs, its weight-version spans)."""
    tokens = list(state.detokenizer.output_token_ids)
    logps = sampled_logprobs(state.logprobs_processor.logprobs, tokens)
    return Partial(tokens, logps, _versions(state.weight_version_starts, len(tokens), version))
