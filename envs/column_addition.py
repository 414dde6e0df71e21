"""Column addition written out: the reasoning-length built-in task (`m2po/ColumnAddition-v0`).

The problems are `ArithmeticTasks`' additions (`num_operands` integers of up to `digits`
digits, the same expressions, the same seed-independent held-out split), with a worked
solution: one step per column, right to left, each adding the column's digits and the
carry into the column sum, then the answer boxed:

    4821+3795=  ->  1+5=6,2+9=11,8+7+1=16,4+3+1=8 \\boxed{8616}

The answer is the last digit of every column sum, read from the last column to the first,
after the last sum's leading digits, so a model that answers right must carry and keep
track of the columns, over 24-64 tokens of the built-in character-level tokenizer at the
default 5 digits (12 per column; tests/test_column_addition.py measures it). Only the
final `\\boxed{}` is scored, by the existing verifier: a model may skip the work and
answer straight, and that is what RL on it can learn or unlearn.

`Problem.solution` holds the worked solution, for a supervised warm start.
"""

from __future__ import annotations

import dataclasses

from envs.arithmetic import ArithmeticTasks
from envs.tasks import Problem


def column_steps(operands: list[int]) -> list[tuple[list[int], int, int]]:
    """For each column from the right: (its digits, in operand order, from the operands that
    reach it; the carry into it; the column sum). Columns run to the longest operand."""
    width = max(len(str(v)) for v in operands)
    steps, carry = [], 0
    for col in range(width):
        digits = [(v // 10**col) % 10 for v in operands if col < len(str(v))]
        total = sum(digits) + carry
        steps.append((digits, carry, total))
        carry = total // 10
    return steps


def worked_solution(operands: list[int]) -> str:
    """'1+5=6,2+9=11,8+7+1=16,4+3+1=8 \\boxed{8616}' for 4821+3795."""
    steps = column_steps(operands)
    parts = []
    for digits, carry, total in steps:
        terms = [str(d) for d in digits] + ([str(carry)] if carry else [])
        parts.append("+".join(terms) + f"={total}")
    return ",".join(parts) + f" \\boxed{{{sum(operands)}}}"


class ColumnAdditionTasks(ArithmeticTasks):
    """`ArithmeticTasks` restricted to addition, each problem with its worked solution.

    Args:
        digits: operands are uniform integers in [0, 10**digits - 1] (default 5).
        num_operands: how many operands are added (>= 2).
        seed: selects the train problems; the held-out set does not depend on it.
        heldout_size: how many problems `heldout()` returns.
    """

    def __init__(self, digits: int = 5, num_operands: int = 2, seed: int = 0, heldout_size: int = 500):
        super().__init__(digits=digits, num_operands=num_operands, operators="+", seed=seed,
                         heldout_size=heldout_size)

    def __repr__(self) -> str:
        return (f"ColumnAdditionTasks(digits={self.digits}, num_operands={self.num_operands}, "
                f"seed={self.seed}, heldout_size={self.heldout_size})")

    def _make(self, operands: list[int], ops: list[str], phrasing_entropy: list[int]) -> Problem:
        problem = super()._make(operands, ops, phrasing_entropy)
        return dataclasses.replace(problem, id="column-add:" + problem.question, solution=worked_solution(operands))
