"""Procedural integer arithmetic: the built-in task family that needs nothing downloaded.

A problem is `num_operands` uniform integers in [0, 10**digits - 1] joined by operators
drawn uniformly from `operators`, evaluated with the usual precedence (`*` before `+`,
`-`). With `digits=[low, high]` each problem first draws its width uniformly from
low..high, so problem sizes (and worked answers' lengths) are mixed: the long-tailed task. The bare question is the expression without spaces ("123+456*7"); with
`word_problems=True` the same expression is told as a game-score story.

Splits. A hash of the canonical expression alone puts it in the held-out region (about
`HELDOUT_FRACTION` of all expressions) or not; the train split rejects every
expression of the held-out region. So train and held-out are disjoint for every seed
and every `heldout_size`, and an expression never changes side. The held-out set
depends only on the expression knobs (digits, num_operands, operators), not on `seed`,
so runs with different seeds are evaluated on the same problems.
"""

from __future__ import annotations

import hashlib
import itertools
from functools import cached_property

import numpy as np

from envs.tasks import Problem, check_split

VALID_OPERATORS = "+-*"
HELDOUT_FRACTION = 0.1
# Up to this many distinct expressions the held-out set is drawn from a full enumeration,
# so a small task space gives an exact "too small" error instead of endless rejection.
_ENUMERATE_LIMIT = 50_000
_TRAIN_STREAM, _HELDOUT_STREAM, _PHRASING_STREAM = 0, 1, 2
_NAMES = ("Mia", "Noah", "Ava", "Liam", "Zoe", "Omar", "Lena", "Ravi", "Iris", "Tomas")
_CONTAINERS = ("chests", "crates", "bags", "boxes", "pouches", "tins")


def _stable_int(text: str, nbytes: int = 8) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=nbytes).digest(), "big")


def in_heldout_region(expression: str) -> bool:
    """Whether a canonical expression belongs to the held-out side (seed-independent)."""
    return _stable_int("m2po-arith-split:" + expression) % 1000 < HELDOUT_FRACTION * 1000


def expression(operands: list[int], ops: list[str]) -> str:
    """The canonical (bare) form: "123+456*7", no spaces."""
    return str(operands[0]) + "".join(op + str(v) for op, v in zip(ops, operands[1:]))


def evaluate(operands: list[int], ops: list[str]) -> int:
    """Exact value of `operands[0] ops[0] operands[1] ...` with `*` binding tighter."""
    total, product, sign = 0, operands[0], 1
    for op, value in zip(ops, operands[1:]):
        if op == "*":
            product *= value
        else:
            total += sign * product
            sign, product = (1 if op == "+" else -1), value
    return total + sign * product


def _terms(operands: list[int], ops: list[str]) -> list[tuple[str, list[int]]]:
    """Split into signed product terms: 2+3*4-5 -> [('+', [2]), ('+', [3, 4]), ('-', [5])]."""
    terms = [("+", [operands[0]])]
    for op, value in zip(ops, operands[1:]):
        if op == "*":
            terms[-1][1].append(value)
        else:
            terms.append((op, [value]))
    return terms


def _noun_phrase(factors: list[int], rng: np.random.Generator) -> str:
    def points(n: int) -> str:
        return f"{n} point" if n == 1 else f"{n} points"

    if len(factors) == 1:
        return points(factors[0])
    n_containers = len(factors) - 2
    replace = n_containers > len(_CONTAINERS)
    containers = [str(c) for c in rng.choice(_CONTAINERS, size=n_containers, replace=replace)]
    parts = [f"{f} {c}" for f, c in zip(factors[:-2], containers)]
    parts.append(f"{factors[-2]} tokens worth {points(factors[-1])} each")
    return ", each holding ".join(parts)


def word_problem(operands: list[int], ops: list[str], rng: np.random.Generator) -> str:
    """Tell the expression as a game-score story with the same value (negative scores allowed)."""
    name = str(rng.choice(_NAMES))
    terms = _terms(operands, ops)
    sentences = [f"{name} starts a game with {_noun_phrase(terms[0][1], rng)}."]
    for op, factors in terms[1:]:
        verb = "gains" if op == "+" else "loses"
        sentences.append(f"Then {name} {verb} {_noun_phrase(factors, rng)}.")
    sentences.append(f"What is {name}'s score now?")
    return " ".join(sentences)


def digit_range(digits) -> tuple[int, int]:
    """`digits` (an int, or a pair [low, high]) as (low, high); ValueError naming the fix."""
    pair = list(digits) if isinstance(digits, (list, tuple)) else [digits, digits]
    if len(pair) != 2 or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in pair) \
            or pair[0] > pair[1]:
        raise ValueError(f"digits={digits!r} must be an integer >= 1, or a pair [low, high] of them with "
                         f"low <= high (each problem's width drawn from low..high), e.g. 3 or [2, 12]")
    return pair[0], pair[1]


class ArithmeticTasks:
    """Integer arithmetic problems, deterministic in (knobs, seed, split, index).

    Args:
        digits: operands are uniform integers in [0, 10**digits - 1]; or a pair [low, high]:
            each problem draws its width uniformly from low..high first (mixed sizes).
        num_operands: how many operands an expression has (>= 2).
        operators: the operators to draw from, a non-empty subset of "+-*".
        word_problems: phrase each expression as a short story instead of "12+34".
        seed: selects the train problems; the held-out set does not depend on it.
        heldout_size: how many problems `heldout()` returns.
    """

    def __init__(
        self,
        digits: int = 3,
        num_operands: int = 2,
        operators: str = "+",
        word_problems: bool = False,
        seed: int = 0,
        heldout_size: int = 500,
    ):
        low, high = digit_range(digits)
        if not isinstance(num_operands, int) or num_operands < 2:
            raise ValueError(f"num_operands={num_operands!r} must be an integer >= 2")
        bad = [c for c in str(operators) if c not in VALID_OPERATORS]
        if not operators or bad or len(set(operators)) != len(operators):
            raise ValueError(
                f"operators={operators!r} must be a non-empty string of distinct "
                f"characters from {VALID_OPERATORS!r}"
            )
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} must be a non-negative integer")
        if not isinstance(heldout_size, int) or heldout_size < 0:
            raise ValueError(f"heldout_size={heldout_size!r} must be a non-negative integer")
        self.digits = low if low == high else (low, high)
        self.min_digits, self.max_digits = low, high
        self.num_operands = num_operands
        self.operators = operators
        self.word_problems = bool(word_problems)
        self.seed = seed
        self.heldout_size = heldout_size
        # Word phrasing is kept out of the key: problem i has the same expression either way.
        width = str(low) if low == high else f"{low}-{high}"
        self._key = _stable_int(f"{width}|{num_operands}|{operators}", 4)

    def __repr__(self) -> str:
        return (
            f"ArithmeticTasks(digits={self.digits}, num_operands={self.num_operands}, "
            f"operators={self.operators!r}, word_problems={self.word_problems}, "
            f"seed={self.seed}, heldout_size={self.heldout_size})"
        )

    @property
    def num_expressions(self) -> int:
        """Distinct expressions of this task space (both splits); with a width range, those of its
        widest problems (every narrower expression is one of them)."""
        operator_choices = len(self.operators) ** (self.num_operands - 1)
        return 10 ** (self.max_digits * self.num_operands) * operator_choices

    def num_problems(self, split: str = "train") -> int | None:
        """Size of a split: `heldout_size` for "heldout"; None (unbounded index) for "train"."""
        return self.heldout_size if check_split(split) == "heldout" else None

    def _draw(self, rng: np.random.Generator) -> tuple[list[int], list[str]]:
        width = self.min_digits if self.min_digits == self.max_digits else \
            int(rng.integers(self.min_digits, self.max_digits + 1))
        operands = [int(x) for x in rng.integers(0, 10**width, size=self.num_operands)]
        picks = rng.integers(0, len(self.operators), size=self.num_operands - 1)
        ops = [self.operators[i] for i in picks]
        return operands, ops

    def _make(self, operands: list[int], ops: list[str], phrasing_entropy: list[int]) -> Problem:
        bare = expression(operands, ops)
        answer = str(evaluate(operands, ops))
        if not self.word_problems:
            return Problem(question=bare, answer=answer, id=f"arith:{bare}")
        rng = np.random.default_rng([_PHRASING_STREAM, self._key, *phrasing_entropy])
        question = word_problem(operands, ops, rng)
        return Problem(question=question, answer=answer, id=f"arith-word:{bare}")

    def problem(self, index: int, split: str = "train") -> Problem:
        """The `index`-th problem of a split (train: any index >= 0; heldout: < heldout_size)."""
        if check_split(split) == "heldout":
            return self.heldout()[index]
        if index < 0:
            raise IndexError(f"train index {index} must be >= 0")
        rng = np.random.default_rng([_TRAIN_STREAM, self._key, self.seed, index])
        for _ in range(10_000):
            operands, ops = self._draw(rng)
            if not in_heldout_region(expression(operands, ops)):
                return self._make(operands, ops, [self.seed, index])
        raise RuntimeError(f"{self!r} found no train expression in 10000 draws")

    def sample(self, rng: np.random.Generator, split: str = "train") -> Problem:
        """A problem of `split` chosen by `rng` (the same generator state gives the same problem)."""
        if check_split(split) == "heldout":
            if not self.heldout_size:
                raise ValueError("heldout_size=0: there is no held-out problem to sample")
            return self.heldout()[int(rng.integers(self.heldout_size))]
        return self.problem(int(rng.integers(2**62)), split)

    def heldout(self) -> list[Problem]:
        """The fixed held-out set, `heldout_size` distinct problems."""
        return list(self._heldout)

    @cached_property
    def _heldout(self) -> tuple[Problem, ...]:
        rng = np.random.default_rng([_HELDOUT_STREAM, self._key])
        chosen: dict[str, tuple[list[int], list[str]]] = {}
        # A width range is drawn, never enumerated: held-out sizes follow the train mixture.
        if self.num_expressions <= _ENUMERATE_LIMIT and self.min_digits == self.max_digits:
            candidates = []
            for values in itertools.product(range(10**self.digits), repeat=self.num_operands):
                for ops in itertools.product(self.operators, repeat=self.num_operands - 1):
                    if in_heldout_region(expression(list(values), list(ops))):
                        candidates.append((list(values), list(ops)))
            if len(candidates) < self.heldout_size:
                raise ValueError(
                    f"{self!r} has only {len(candidates)} held-out expressions "
                    f"(of {self.num_expressions}); lower heldout_size or raise digits/num_operands"
                )
            for i in rng.permutation(len(candidates))[: self.heldout_size]:
                chosen[expression(*candidates[i])] = candidates[i]
        else:
            expected = HELDOUT_FRACTION * self.num_expressions
            if self.heldout_size > expected / 2:
                raise ValueError(
                    f"{self!r}: heldout_size={self.heldout_size} is more than half of the about "
                    f"{expected:.0f} held-out expressions; lower heldout_size"
                )
            max_draws = int(50 * self.heldout_size / HELDOUT_FRACTION) + 10_000
            for _ in range(max_draws):
                if len(chosen) >= self.heldout_size:
                    break
                operands, ops = self._draw(rng)
                if in_heldout_region(expression(operands, ops)):
                    chosen.setdefault(expression(operands, ops), (operands, ops))
            if len(chosen) < self.heldout_size:
                raise ValueError(
                    f"{self!r}: found only {len(chosen)} distinct held-out expressions in "
                    f"{max_draws} draws; lower heldout_size"
                )
        return tuple(self._make(o, p, [i]) for i, (o, p) in enumerate(chosen.values()))
