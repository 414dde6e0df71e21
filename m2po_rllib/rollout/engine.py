"""The generation-engine interface the EnvRunner codes against, and `make_engine`.

Two engines implement it: `VLLMEngine` (`vllm_engine.py`, for real models) and `HFEngine`
(`hf_engine.py`, plain transformers; for tiny models, where vLLM's overhead dominates, and as
the reference in parity tests). Both return the same `Completion`s with the same semantics,
from a batch at a time (`generate`) or streamed (`submit` / `step`: continuous batching, GRPO
groups joining the running batch as others finish and coming back whole):

Behaviour log-probs (`Completion.logprobs`) are those of the distribution each token was
actually sampled from, which is what the importance ratio in M2PO / GRPO needs:
- temperature T > 0: `log_softmax(logits / T)[token]`, the same temperature-scaled log-prob
  the learner computes (as verl does); with `top_k` / `top_p` the distribution is
  additionally restricted to the kept tokens and renormalised (`m2po_rllib.common.truncation`: the
  rule both engines and the learner apply, so an on-policy ratio stays 1).
- T == 0 (greedy): `log_softmax(logits)[token]` of the raw logits.

Token ids and stop strings follow vLLM: `token_ids` (and `logprobs`) hold every sampled token,
the EOS token and the token that completed a stop string included; `text` is the decoded
completion without special tokens and cut before the stop string.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingConfig:
    n: int = 1
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Softmax temperature; 0 samples greedily."""
    top_p: float = 1.0
    """Nucleus mass kept before sampling; 1 keeps the whole vocabulary."""
    top_k: int = 0
    """Most likely tokens kept before sampling (before top-p); 0 or -1 keep them all."""
    max_tokens: int = 64
    """Most tokens generated per sample."""
    stop: list[str] = field(default_factory=list)
    """Stop strings; generation ends once the text contains one (it is cut from `text`)."""
    seed: int | None = None
    """Seed base. Requests are the flattened samples: sample j of prompt i (0-based) is request
    `i * n + j` and draws from its own generator seeded with `seed + i * n + j`, so a sample
    is reproducible whatever else is in the batch. None draws fresh randomness."""

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"`n` ({self.n}) must be >= 1 samples per prompt")
        if self.temperature < 0:
            raise ValueError(f"`temperature` ({self.temperature}) must be >= 0; 0 is greedy")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"`top_p` ({self.top_p}) must be in (0, 1]; 1 disables it")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"`top_k` ({self.top_k!r}) must be an int >= 1, or 0 / -1 to disable it")
        if self.max_tokens < 1:
            raise ValueError(f"`max_tokens` ({self.max_tokens}) must be >= 1")
        if isinstance(self.stop, str):
            raise TypeError(f"`stop` must be a list of strings, got the string {self.stop!r}")
        if any(not s for s in self.stop):
            raise ValueError(f"`stop` ({self.stop}) must not contain empty strings")

    def request_seed(self, prompt_index: int, sample_index: int) -> int | None:
        """The seed of sample `sample_index` of prompt `prompt_index` (see `seed`)."""
        if self.seed is None:
            return None
        return self.seed + prompt_index * self.n + sample_index


@dataclass
class Completion:
    token_ids: list[int]
    """Generated tokens, without the prompt (EOS / stop-completing token included)."""
    logprobs: list[float]
    """Behaviour log-prob of each generated token (see the module docstring)."""
    text: str
    """Decoded completion, special tokens skipped, cut before a matched stop string."""
    finish_reason: str
    """Either "stop" (EOS or a stop string) or "length" (`max_tokens` reached)."""
    weight_versions: list[tuple[int, int, int]] | None = None
    """`(version, start, end)` spans: tokens `[start, end)` were sampled by the weights of that
    policy version (vLLM: as it labelled them, `set_weight_version` at each load; the HF
    engine: the version it served at each token). More than one span only where weights
    were loaded in the middle of the sequence (`update_weights(..., mid_sequence=True)`);
    None where the engine did not label them."""

    def token_versions(self) -> list[int] | None:
        """The policy version of each token (`weight_versions` spelled out); None when unlabelled."""
        if not self.weight_versions:
            return None
        out = [v for v, start, end in self.weight_versions for _ in range(start, end)]
        if len(out) != len(self.token_ids):
            raise RuntimeError(f"weight_versions {self.weight_versions} cover {len(out)} tokens of {len(self.token_ids)}")
        return out


@dataclass
class Partial:
    """One sample of a streamed group as far as it got: what `GenerationEngine.partials()`
    hands over (a checkpoint taken mid-generation) and `submit(..., resume=...)` continues."""

    token_ids: list[int]
    """Tokens generated so far."""
    logprobs: list[float]
    """Their behaviour log-probs."""
    versions: list[int]
    """The policy version that sampled each of them (kept when continued)."""
    finish_reason: str | None = None
    """The sample's finish reason where it had ended; None while it goes on."""
    text: str | None = None
    """An ended sample's text where a stop string cut it (else decoded at the end)."""
    rng_state: bytes | None = None
    """Its random stream's state after its last token (HF: the torch generator's), so the
    continued sample draws what the uninterrupted one would; None: a fresh stream."""
    scored: list[float] | None = None
    """Its tokens' behaviour log-probs in the learner's numerics, each under the weights that
    sampled it, where its runner scores its rounds (`segments.SegmentScores`); None otherwise.
    The engines carry it untouched: the resumed round's runner keeps it for these tokens."""

    def check(self, budget: int) -> None:
        """Refuses a partial that cannot go on within `budget` tokens: a log-prob and a version
        for every token, an unfinished one short of its budget (else it would have ended)."""
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(f"a partial sample of {n} tokens has {len(self.logprobs)} log-probs "
                             f"and {len(self.versions)} versions")
        if self.finish_reason is None and n >= budget:
            raise ValueError(f"an unfinished partial sample of {n} tokens is at its budget ({budget}): "
                             "it would have ended")


def version_spans(versions: Sequence[int]) -> list[tuple[int, int, int]]:
    """Per-token versions as `(version, start, end)` spans (`Completion.weight_versions`)."""
    spans: list[tuple[int, int, int]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1][0] == v:
            spans[-1] = (v, spans[-1][1], i + 1)
        else:
            spans.append((int(v), i, i + 1))
    return spans


class EngineDeadError(RuntimeError):
    """The engine (or its worker process) died; it cannot serve requests any more."""


class GenerationEngine(abc.ABC):
    """Generates completions for token-id prompts and takes versioned in-place weight syncs.

    Subclasses implement `generate`, `_load_weights`, `shutdown` and `is_healthy`; this base
    class owns the version bookkeeping so both engines drop stale syncs the same way.
    """

    def __init__(self) -> None:
        self._version = -1

    @property
    def version(self) -> int:
        """The version of the last applied weight sync; -1 before any."""
        return self._version

    @abc.abstractmethod
    def generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingConfig
    ) -> list[list[Completion]]:
        """Samples `sampling.n` completions per prompt; outer list: prompts, inner: samples,
        both in input order."""

    # -- streaming (continuous batching): a group at a time in, whole groups out ----------
    @abc.abstractmethod
    def submit(self, key: Hashable, prompt_token_ids: list[int], sampling: SamplingConfig, index: int = 0,
               resume: Sequence[Partial] | None = None) -> None:
        """Queues one group, `sampling.n` samples of one prompt, under `key` (unique among the
        groups in flight). It joins the running batch at the next `step()`, beside the groups
        being generated. Its samples are seeded as prompt `index` of a `generate` call with the
        same `sampling` (`SamplingConfig.request_seed(index, j)`). `resume` (engines with
        `resumes_partial`): sample j goes on from `resume[j]` (`partials()` of an earlier
        engine): its tokens, log-probs and versions kept, an ended one not generated further."""

    resumes_partial: bool = False
    """Whether `partials()` and `submit(..., resume=...)` work (a mid-generation checkpoint)."""

    def partials(self) -> dict[Hashable, list[Partial]]:
        """Every group in flight as far as it got: key -> one `Partial` per sample, in order."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot hand over partially generated groups yet (the HF and vLLM engines can)"
        )

    def _refuse_resume(self, resume) -> None:
        if resume is not None and not self.resumes_partial:
            self.partials()  # raises, naming the engine that can

    @abc.abstractmethod
    def step(self) -> list[tuple[Hashable, list[Completion]]]:
        """Advances every group in flight by one token (admitting the queued ones first); returns
        `(key, completions)` for each group that finished in it, its samples in order."""

    @property
    @abc.abstractmethod
    def in_flight(self) -> int:
        """Groups submitted and not yet returned by `step()`."""

    def completion(self, tokens: list[int], logps: list[float], text: str | None, reason: str,
                   versions: list[int]) -> Completion:
        """A finished sample; `versions`: the policy version that sampled each token; `text`
        None: decoded (special tokens skipped)."""
        if text is None:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return Completion(tokens, logps, text, reason, version_spans(versions))

    def _check_idle(self, action: str) -> None:
        """Refuses `action` while streamed groups are in flight: a group is generated by one
        policy version, and `generate` would interleave with them."""
        if self.in_flight:
            raise RuntimeError(
                f"{type(self).__name__}: cannot {action} with {self.in_flight} streamed groups in flight; "
                "call step() until in_flight is 0 first"
            )

    loads_mid_sequence: bool = False
    """Whether `update_weights(..., mid_sequence=True)` may load with groups in flight."""

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int, *, mid_sequence: bool = False,
                       always: bool = False) -> bool:
        """Loads `weights` (HF checkpoint names; a subset is fine) in place and sets `version`.

        Returns False and changes nothing when `version` is not newer than the current one:
        with asynchronous syncs a late or duplicate message must not roll the policy back.
        `always`: a collective broadcast, which every rank must receive (one that stayed out
        would hang it): loaded whatever its version, which then only moves forward.
        With streamed groups in flight it is refused (each group one version's) unless
        `mid_sequence`: then the engine loads at a token boundary, recomputes the KV cache of
        every sequence in flight with the new weights and goes on; the tokens sampled from
        then on are labelled `version` (`Completion.weight_versions`). Engines that cannot
        (`loads_mid_sequence` False) raise NotImplementedError.
        """
        if not mid_sequence:
            self._check_idle("load weights")
        elif self.in_flight and not self.loads_mid_sequence:
            raise NotImplementedError(
                f"{type(self).__name__} does not load weights with groups in flight yet "
                "(the HF engine does: rollout_engine='hf'); let the groups finish first"
            )
        if version <= self._version and not always:
            return False
        self._load_weights(weights)
        self._version = max(self._version, version)
        if self.in_flight:
            self._continue_after_load()
        return True

    def _continue_after_load(self) -> None:
        """After a load with groups in flight: recompute what the old weights computed (the KV
        cache, the next-token logits) so every later token is the new weights' own."""
        raise NotImplementedError

    @abc.abstractmethod
    def _load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copies `weights` into the served model."""

    # -- sleep (colocated training: the engine gives its accelerator memory to the learner) --
    sleep_unavailable: str | None = "this engine has no sleep mode"
    """Why `sleep()` does nothing here; None where it frees memory."""

    def sleep(self) -> bool:
        """Frees the engine's accelerator memory (weights offloaded, KV cache dropped) until
        `wake_up()`; no request may run in between. False, changing nothing, where the engine
        has no such mode (`sleep_unavailable` says why)."""
        return False

    def wake_up(self) -> None:
        """Restores what `sleep()` freed (the weights it had); a no-op when awake."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Frees the model and any worker processes; idempotent."""

    @abc.abstractmethod
    def is_healthy(self) -> bool:
        """False once the engine was shut down or died."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()


# Imported lazily: `import vllm` alone takes seconds and starts nothing we need for "hf".
ENGINES = {
    "vllm": "m2po_rllib.rollout.vllm_engine:VLLMEngine",
    "hf": "m2po_rllib.rollout.hf_engine:HFEngine",
}


def make_engine(kind: str, model_path: str, **kwargs) -> GenerationEngine:
    """Builds the engine registered as `kind` ("vllm" or "hf") for the HF model at `model_path`;
    `kwargs` go to the engine's constructor."""
    if kind not in ENGINES:
        raise ValueError(f"unknown engine kind {kind!r}; valid kinds: {sorted(ENGINES)}")
    module_name, class_name = ENGINES[kind].split(":")
    engine_cls = getattr(importlib.import_module(module_name), class_name)
    return engine_cls(model_path, **kwargs)
