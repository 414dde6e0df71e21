"""`m2po/ColumnAddition-v0`: the reasoning-length task. Its worked solutions are checked step
by step by an independent reading, scored by the verifier, and measured in the built-in
tokenizer's tokens; the split is ArithmeticTasks'."""

from __future__ import annotations

import re

import gymnasium as gym
import numpy as np
import pytest

import envs  # noqa: F401  (registers the env ids)
from envs import ArithmeticTasks, ColumnAdditionTasks, math_reward, worked_solution
from envs.arithmetic import in_heldout_region

STEP = re.compile(r"^(\d+(?:\+\d+)*)=(\d+)$")


def read_solution(solution: str) -> tuple[list[tuple[list[int], int]], str]:
    """The solution's steps [(terms, written sum)] and its boxed answer, parsed without the
    generator's code."""
    work, boxed = solution.split(" \\boxed{")
    assert boxed.endswith("}")
    steps = []
    for part in work.split(","):
        m = STEP.match(part)
        assert m, part
        steps.append(([int(t) for t in m.group(1).split("+")], int(m.group(2))))
    return steps, boxed[:-1]


def check_worked(question: str, solution: str) -> None:
    """Every step adds the column's digits and the carry of the step before, and the answer
    is assembled from the steps' sums."""
    operands = [int(x) for x in question.split("+")]
    steps, answer = read_solution(solution)
    assert len(steps) == max(len(str(v)) for v in operands)
    carry = 0
    for col, (terms, written) in enumerate(steps):
        digits = [(v // 10**col) % 10 for v in operands if col < len(str(v))]
        assert terms == digits + ([carry] if carry else []), (col, terms)
        assert written == sum(terms)
        carry = written // 10
    assembled = str(steps[-1][1]) + "".join(str(w % 10) for _, w in reversed(steps[:-1]))
    assert assembled == answer == str(sum(operands))


def test_the_example_of_the_docstring():
    assert worked_solution([4821, 3795]) == "1+5=6,2+9=11,8+7+1=16,4+3+1=8 \\boxed{8616}"
    assert worked_solution([7, 0]) == "7+0=7 \\boxed{7}"
    assert worked_solution([95, 7, 8]) == "5+7+8=20,9+2=11 \\boxed{110}"  # a carry of 2


@pytest.mark.parametrize("digits, num_operands", [(5, 2), (3, 3), (8, 2)])
def test_worked_solutions_are_right_step_by_step_and_score_1(digits, num_operands):
    tasks = ColumnAdditionTasks(digits=digits, num_operands=num_operands, heldout_size=200)
    problems = tasks.heldout() + [tasks.problem(i) for i in range(200)]
    for p in problems:
        check_worked(p.question, p.solution)
        assert math_reward(p.solution, p.answer) == 1.0
    wrong = problems[0].solution.replace(f"{{{problems[0].answer}}}", f"{{{int(problems[0].answer) + 1}}}")
    assert math_reward(wrong, problems[0].answer) == 0.0


def test_the_split_is_arithmetic_tasks_and_ids_are_their_own():
    tasks, plain = ColumnAdditionTasks(digits=5), ArithmeticTasks(digits=5, operators="+")
    assert [p.question for p in tasks.heldout()] == [p.question for p in plain.heldout()]
    assert [tasks.problem(i, "train").question for i in range(50)] == [plain.problem(i).question for i in range(50)]
    assert all(in_heldout_region(p.question) for p in tasks.heldout())
    assert not any(in_heldout_region(tasks.problem(i).question) for i in range(500))
    assert tasks.heldout()[0].id == "column-add:" + tasks.heldout()[0].question != plain.heldout()[0].id


def test_answers_take_24_to_64_tokens_of_the_builtin_tokenizer():
    from transformers import AutoTokenizer

    from m2po_rllib.models.builtin import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("builtin:arith-tiny"))
    tasks = ColumnAdditionTasks(heldout_size=500)  # the defaults: 5 digits, 2 operands
    lengths = np.array([len(tokenizer(p.solution, add_special_tokens=False)["input_ids"]) for p in tasks.heldout()])
    assert 24 <= lengths.min() and lengths.max() <= 64, (lengths.min(), lengths.max())
    assert tokenizer.unk_token_id not in tokenizer(tasks.heldout()[0].solution)["input_ids"]


def test_the_env_id_scores_a_worked_solution_and_a_bare_answer_alike():
    env = gym.make("m2po/ColumnAddition-v0", template="compact")
    obs, info = env.reset(seed=3)
    question = info["question"]
    assert obs["prompt"] == question + "="
    problem = env.unwrapped.problem
    _, reward, terminated, _, _ = env.step(problem.solution)
    assert reward == 1.0 and terminated
    env.reset(seed=3)
    assert env.step(f"\\boxed{{{info['answer']}}}")[1] == 1.0  # only the answer is scored
    with pytest.raises(ValueError, match="operators"):
        gym.make("m2po/ColumnAddition-v0", operators="+*")
