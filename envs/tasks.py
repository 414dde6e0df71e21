"""The task-source interface shared by the procedural and the dataset-backed tasks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class Problem:
    """One prompt with its gold answer."""

    question: str
    """The problem text, without any prompt template around it."""
    answer: str
    """The normalised gold answer, as `math_reward` expects it (e.g. "579", "\\frac{1}{2}")."""
    id: str
    """A stable identifier: the same problem has the same id in every run."""
    solution: str = ""
    """A worked solution ending in the boxed answer, where the task family writes one
    (`ColumnAdditionTasks`); for a supervised warm start, never shown to the policy."""


@runtime_checkable
class TaskSource(Protocol):
    """What the environments need from a task family."""

    def problem(self, index: int, split: str = "train") -> Problem: ...

    def sample(self, rng: np.random.Generator, split: str = "train") -> Problem: ...

    def heldout(self) -> list[Problem]: ...

    def num_problems(self, split: str = "train") -> int | None: ...


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}")
    return split
