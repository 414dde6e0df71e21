"""vLLM's request outputs read as `Completion`s, and the version labels on their tokens checked."""

from __future__ import annotations

from m2po_rllib.rollout.engine import Completion


def completions(request_output, n: int) -> list[Completion]:
    """The `n` samples of one request, in order (a greedy request's one sample copied n times),
    with their log-probs and vLLM's per-token version labels."""
    samples = sorted(request_output.outputs, key=lambda c: c.index)
    if len(samples) == 1 < n:  # greedy
        samples = samples * n
    if len(samples) != n:
        raise RuntimeError(
            f"vLLM returned {len(samples)} samples for request "
            f"{request_output.request_id}; asked for {n}"
        )
    return [completion_of(c, request_output.request_id) for c in samples]


def completion_of(c, request_id: str) -> Completion:
    """One finished sample (a vLLM `CompletionOutput`) with its log-probs and vLLM's per-token
    version labels."""
    if c.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM ended request {request_id} with finish_reason {c.finish_reason!r}")
    token_ids = list(c.token_ids)
    logprobs = sampled_logprobs(c.logprobs, token_ids)
    spans = [(int(s.version), s.start, s.end) for s in (getattr(c, "weight_versions", None) or [])]
    return Completion(token_ids, logprobs, c.text, c.finish_reason, spans or None)


def check_versions(group: list[Completion], version: int, what: str, newest: int | None = None) -> None:
    """Every token of `group` was sampled by policy `version` (with loads mid-sequence: by
    a version from `version` to `newest`, never an older one after a newer), as vLLM
    labelled them."""
    newest = version if newest is None else newest
    for c in group:
        labels = [v for v, _, _ in c.weight_versions or ()]
        if any(not version <= v <= newest for v in labels) or labels != sorted(labels):
            raise RuntimeError(
                f"vLLM sampled tokens with weights labelled {c.weight_versions} for {what} started at version "
                f"{version}" + (f" (newest since: {newest})" if newest != version else
                                f": weights changed within {what}")
            )


def sampled_logprobs(logprobs, token_ids: list[int]) -> list[float]:
    """The sampled tokens' log-probs from vLLM's per-position logprobs (requested with
    `logprobs=0`: the sampled token's only)."""
    return [step[t].logprob for step, t in zip(logprobs, token_ids)]
