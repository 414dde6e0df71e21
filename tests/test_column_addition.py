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


# -- the long-tailed task: a width range ---------------------------------------------------------
def test_a_width_range_mixes_problem_sizes_uniformly_and_keeps_the_split():
    tasks = ColumnAdditionTasks(digits=[2, 12], heldout_size=300)
    train = [tasks.problem(i) for i in range(1200)]
    widths = np.array([max(len(x) for x in p.question.split("+")) for p in train])
    # Every width occurs, none wider; a narrower one only where both operands lead with a 0
    # (1 in 100 of a width's draws).
    assert set(range(2, 13)) <= set(widths) <= set(range(1, 13)) and np.sum(widths == 1) <= 5
    counts = np.bincount(widths, minlength=13)[2:]
    # Uniform over 11 widths: each count ~ Binomial(1200, 1/11), sd ~10; 5 sd either side.
    assert np.all(np.abs(counts - 1200 / 11) < 5 * np.sqrt(1200 / 11 * (10 / 11))), counts
    for p in train[:100] + tasks.heldout()[:100]:
        check_worked(p.question, p.solution)
    held = tasks.heldout()
    assert len({p.question for p in held}) == 300 and all(in_heldout_region(p.question) for p in held)
    assert not any(in_heldout_region(p.question) for p in train)
    assert {max(len(x) for x in p.question.split("+")) for p in held} >= {3, 12}  # held-out is mixed too
    # A fixed width is the old task, problem for problem; the range is a task of its own.
    assert [ColumnAdditionTasks(digits=[5, 5]).problem(i).question for i in range(20)] == \
        [ColumnAdditionTasks(digits=5).problem(i).question for i in range(20)]
    assert ColumnAdditionTasks(digits=[5, 5]).digits == 5 and tasks.digits == (2, 12)


def test_mixed_widths_spread_answer_lengths_about_tenfold():
    from transformers import AutoTokenizer

    from m2po_rllib.models.builtin import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("builtin:arith-tiny"))
    tasks = ColumnAdditionTasks(digits=[2, 12], heldout_size=500)
    lengths = np.array([len(tokenizer(p.solution, add_special_tokens=False)["input_ids"]) for p in tasks.heldout()])
    assert lengths.max() / lengths.min() >= 8, (lengths.min(), lengths.max())
    env = gym.make("m2po/ColumnAddition-v0", digits=[2, 12], template="compact")
    _, info = env.reset(seed=5)
    assert env.step(env.unwrapped.problem.solution)[1] == 1.0
