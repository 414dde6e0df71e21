"""The verifier reward: `math_reward(completion, ground_truth) -> float`.

Most answers are plain numbers and are decided in-process by the exact fast path of
`envs.answers`, which also says how an equation answer is judged (every side that is not
a bare name must equal the truth, so `19 = 18` scores 0 against 18). The rest goes to
math-verify, which is not safe to run in the caller: its timeout is `signal.alarm` (it fails off the main thread, e.g. in a threaded Ray
actor), hostile LaTeX can run for minutes or take gigabytes, and sympy's cache grows in
long-lived processes. So math-verify runs only in `MathVerifier`'s child processes:
fresh interpreters (`envs/_verify_child.py`) with integer math-verify timeouts, sympy's
pure-Python ground types, an address-space cap, a hard deadline in the parent that
kills and replaces a stuck child, and recycling after `max_tasks_per_child` requests, a
timeout, or when a child's RSS passes `max_rss_mb`. A timeout, crash or error is reward
0 and a counted metric; it never raises into, or blocks beyond the deadline, the caller.

Thread-safe: calls from several threads share the children; a call waits for a free one.
"""

from __future__ import annotations

import atexit
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from fractions import Fraction

from envs.answers import equation_sides, extract_answer, normalize_gold, parse_simple_number, to_text
from envs.reward_child import VerifierChild

MAX_SLOW_CHARS = 512
"""Longer extracted answers are judged wrong without math-verify (no real answer is)."""
MAX_SLOW_NESTING = 12
"""Deeper bracket nesting is judged wrong without math-verify (its parser is exponential)."""
_METRIC_KEYS = (
    "reward/fast_path",  # decided in-process by the exact fast path (or as no/hedged answer)
    "reward/slow_path",  # sent to a math-verify child
    "reward/timeouts",  # the child hit math-verify's timeout or the parent's deadline
    "reward/errors",  # the child raised, crashed or failed to start
    "reward/no_answer",  # nothing to extract
    "reward/hedged",  # more than one answer given
    "reward/rejected",  # answer too long or too deeply nested for math-verify
    "reward/child_restarts",  # children killed or recycled
)


@dataclass(frozen=True)
class Verdict:
    """The outcome of one verification."""

    reward: float
    correct: bool
    extracted: str | None
    """The final answer taken from the completion (None if it had none)."""
    verifier: str
    """Who decided: "fast" (in-process), "slow" (math-verify), "timeout" or "error"."""


@dataclass(frozen=True)
class _Pending:
    """An answer math-verify must judge: correct iff each of `checks` equals `gold`."""

    answer: str
    checks: tuple[str, ...]
    gold: str


@lru_cache(maxsize=4096)
def _gold(ground_truth: str) -> tuple[str, Fraction | None]:
    gold = normalize_gold(ground_truth)
    return gold, parse_simple_number(gold)


def _nesting(text: str) -> int:
    depth = deepest = 0
    for c in text:
        if c in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in ")]}":
            depth = max(0, depth - 1)
    return deepest


class MathVerifier:
    """A small pool of math-verify children behind an in-process fast path.

    Args:
        num_workers: math-verify children; each is started when the slow path first needs it.
        timeout_s: math-verify's own timeout per parse/compare call (an integer: math-verify
            implements it with `signal.alarm`, and a float silently disables it).
        deadline_s: the parent's hard limit for one slow verification; past it the child is
            killed and replaced. Default 3 * timeout_s + 2 (two parses and a compare).
        startup_s: how long a new child may take to import math-verify.
        memory_limit_mb: address-space cap of each child (0: none).
        max_tasks_per_child: recycle a child after this many requests (sympy's caches grow).
        max_rss_mb: recycle a child whose resident memory passes this.
    """

    def __init__(
        self,
        num_workers: int = 1,
        timeout_s: int = 3,
        deadline_s: float | None = None,
        startup_s: float = 60.0,
        memory_limit_mb: int = 1024,
        max_tasks_per_child: int = 500,
        max_rss_mb: float = 400.0,
    ):
        if not isinstance(timeout_s, int) or timeout_s < 1:
            raise ValueError(
                f"timeout_s={timeout_s!r} must be an integer >= 1 (math-verify's timeout is signal.alarm)"
            )
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.deadline_s = float(deadline_s) if deadline_s is not None else 3.0 * timeout_s + 2.0
        self.startup_s = startup_s
        self.memory_limit_mb = memory_limit_mb
        self.max_tasks_per_child = max_tasks_per_child
        self.max_rss_mb = max_rss_mb
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._idle: list[VerifierChild] = []
        self._live = 0
        self._counts = dict.fromkeys(_METRIC_KEYS, 0)
        self._count_lock = threading.Lock()

    # -- public API ---------------------------------------------------------------------
    def score(self, completion, ground_truth) -> float:
        """1.0 if the completion's final answer equals `ground_truth`, else 0.0."""
        return self.check(completion, ground_truth).reward

    def check(self, completion, ground_truth) -> Verdict:
        """Like `score`, with the extracted answer and which verifier decided."""
        prepared = self._prepare(completion, ground_truth)
        if isinstance(prepared, Verdict):
            return prepared
        return self._judge(prepared)

    def math_verify(self, answer: str, ground_truth) -> Verdict:
        """math-verify's own verdict on an extracted answer, without the fast path or the
        equation rule: the reference the fast path is tested against."""
        return self._slow(answer, _gold(str(ground_truth))[0])

    def score_batch(self, pairs) -> list[float]:
        """Rewards of (completion, ground_truth) pairs; slow ones run on all children at once."""
        return [v.reward for v in self.check_batch(pairs)]

    def check_batch(self, pairs) -> list[Verdict]:
        prepared = [self._prepare(c, g) for c, g in pairs]
        slow = [i for i, p in enumerate(prepared) if not isinstance(p, Verdict)]
        if len(slow) == 1:
            prepared[slow[0]] = self._judge(prepared[slow[0]])
        elif slow:
            jobs = [(i, answer) for i in slow for answer in prepared[i].checks]
            with ThreadPoolExecutor(min(self.num_workers, len(jobs))) as pool:
                verdicts = list(pool.map(lambda job: self._slow(job[1], prepared[job[0]].gold), jobs))
            for i in slow:
                prepared[i] = _combine(prepared[i], [v for (j, _), v in zip(jobs, verdicts) if j == i])
        return prepared

    def metrics(self, reset: bool = False) -> dict[str, int]:
        """Counts since creation (or since the last `reset=True` call)."""
        with self._count_lock:
            counts = dict(self._counts)
            if reset:
                self._counts = dict.fromkeys(_METRIC_KEYS, 0)
        return counts

    def child_pids(self) -> list[int]:
        """Process ids of the children not busy right now (diagnostics and tests)."""
        with self._cond:
            return [child.proc.pid for child in self._idle]

    def close(self) -> None:
        """Stop all children (idempotent; a later slow call starts new ones)."""
        with self._cond:
            idle, self._idle = self._idle, []
            self._live -= len(idle)
        for child in idle:
            child.kill()

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- internals ----------------------------------------------------------------------
    def _count(self, key: str) -> None:
        with self._count_lock:
            self._counts[key] += 1

    def _fast(self, correct: bool, extracted: str | None, reason: str | None = None) -> Verdict:
        self._count("reward/fast_path")
        if reason:
            self._count(reason)
        return Verdict(float(correct), correct, extracted, "fast")

    def _prepare(self, completion, ground_truth) -> Verdict | _Pending:
        text = to_text(completion)
        if not isinstance(ground_truth, (str, int, Fraction)):
            raise TypeError(f"ground_truth must be str or int, got {type(ground_truth).__name__}")
        gold, gold_value = _gold(str(ground_truth))
        found = extract_answer(text, allow_or="or" in gold.lower())
        if found.answer is None or not found.answer.strip():  # no answer, or `\boxed{}`
            return self._fast(False, None, "reward/no_answer")
        if found.hedged:
            return self._fast(False, found.answer, "reward/hedged")
        sides = equation_sides(found.answer, gold)
        checks = []
        for side in [found.answer] if sides is None else sides:
            value = parse_simple_number(side) if gold_value is not None else None
            if value is not None and value != gold_value:
                return self._fast(False, found.answer)
            if value is None:
                checks.append(side)
        if not checks:  # every value given is the gold number; names only give none
            return self._fast(sides != [], found.answer)
        if len(found.answer) > MAX_SLOW_CHARS or _nesting(found.answer) > MAX_SLOW_NESTING:
            return self._fast(False, found.answer, "reward/rejected")
        return _Pending(found.answer, tuple(checks), gold)

    def _judge(self, pending: _Pending) -> Verdict:
        verdicts = []
        for answer in pending.checks:  # an equation's sides: stop at the first wrong one
            verdicts.append(self._slow(answer, pending.gold))
            if not verdicts[-1].correct:
                break
        return _combine(pending, verdicts)

    def _acquire(self) -> VerifierChild:
        if os.getpid() != self._pid:
            # A forked copy of this object: the children and pipes belong to the parent.
            self._pid, self._idle, self._live = os.getpid(), [], 0
            self._cond = threading.Condition()
        with self._cond:
            while not self._idle and self._live >= self.num_workers:
                self._cond.wait()
            if self._idle:
                return self._idle.pop()
            self._live += 1
        try:
            return VerifierChild(self.timeout_s, self.memory_limit_mb)
        except BaseException:
            with self._cond:
                self._live -= 1
                self._cond.notify()
            raise

    def _release(self, child: VerifierChild, healthy: bool) -> None:
        if healthy and (child.tasks >= self.max_tasks_per_child or child.rss_mb() > self.max_rss_mb):
            healthy = False
        if not healthy:
            child.kill()
            self._count("reward/child_restarts")
            # Start the replacement now: it imports math-verify while the caller goes on.
            try:
                child = VerifierChild(self.timeout_s, self.memory_limit_mb)
            except OSError:
                with self._cond:
                    self._live -= 1
                    self._cond.notify()
                return
        with self._cond:
            self._idle.append(child)
            self._cond.notify()

    def _slow(self, answer: str, gold: str) -> Verdict:
        self._count("reward/slow_path")
        try:
            child = self._acquire()
        except OSError:  # no process could be started (fd or process limits)
            self._count("reward/errors")
            return Verdict(0.0, False, answer, "error")
        healthy, status, correct = False, "error", False
        try:
            child.wait_ready(self.startup_s)
            reply = child.request("\\boxed{" + answer + "}", "\\boxed{" + gold + "}", self.deadline_s)
            if reply is None:
                status = "timeout"
            else:
                status, correct = reply["status"], bool(reply["correct"])
                # An interrupted or failed computation may leave garbage behind: recycle.
                healthy = status == "ok"
        except RuntimeError:
            # Not hostile input but a broken install: say so instead of scoring 0 forever.
            child.kill()
            with self._cond:
                self._live -= 1
                self._cond.notify()
            raise
        except (OSError, EOFError, TimeoutError, ValueError, KeyError):
            status = "error"
        self._release(child, healthy)
        if status == "timeout":
            self._count("reward/timeouts")
            return Verdict(0.0, False, answer, "timeout")
        if status != "ok":
            self._count("reward/errors")
            return Verdict(0.0, False, answer, "error")
        return Verdict(float(correct), correct, answer, "slow")


def _combine(pending: _Pending, verdicts: list[Verdict]) -> Verdict:
    """One verdict for an answer from those of its checks (all must be correct)."""
    wrong = next((v for v in verdicts if not v.correct), None)
    if wrong is None:
        return Verdict(1.0, True, pending.answer, "slow")
    return Verdict(0.0, False, pending.answer, wrong.verifier)


_shared: MathVerifier | None = None
_shared_lock = threading.Lock()


def shared_verifier() -> MathVerifier:
    """The process-wide verifier behind `math_reward` (created on first use)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = MathVerifier()
            atexit.register(_shared.close)
        return _shared


def math_reward(completion, ground_truth) -> float:
    """1.0 if `completion`'s final answer equals `ground_truth`, else 0.0.

    `completion` may be str, bytes (decoded leniently) or None. The answer is extracted
    from the tail of the text (see `envs.answers`); hedged answers score 0. Never raises
    on model output; a slow-path call returns within `MathVerifier.deadline_s` once a
    child is up (a child's start-up, about a second, comes on top, at most `startup_s`).
    """
    return shared_verifier().score(completion, ground_truth)
