"""The verifier reward: answer extraction and the exact fast path (math-verify's pool in a child:
test_reward_pool.py)."""

from __future__ import annotations

import os
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs import MathVerifier
from envs.answers import TAIL_CHARS, extract_answer, normalize_gold, parse_simple_number


# -- extraction ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, answer, source",
    [
        (r"so the answer is \boxed{42}.", "42", "boxed"),
        ("work 7 and 9\n#### 16\n", "16", "####"),
        ("3 apples and then 5 apples", "5", "number"),
        (r"#### 7 but finally \boxed{8}", "8", "boxed"),  # boxed outranks ####
        ("#### 12 apples\nthen 99 more", "12 apples", "####"),  # #### outranks the last number
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", "boxed"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}", "boxed"),  # escaped braces are not structural
        (r"\boxed{\boxed{5}}", "5", "boxed"),
        (r"\fbox{6}", "6", "boxed"),
        (r"first \boxed{3} then truncated \boxed{4", "3", "boxed"),  # only balanced boxes count
        ("it costs 1,234,567 dollars", "1,234,567", "number"),
        ("half is 1/2.", "1/2", "number"),
        ("the value is -3.25", "-3.25", "number"),
        ("", None, None),
        ("no digits here", None, None),
    ],
)
def test_extraction_order(text, answer, source):
    found = extract_answer(text)
    assert (found.answer, found.source, found.hedged) == (answer, source, False)


def test_only_the_tail_is_searched():
    early = r"\boxed{1}" + "x" * TAIL_CHARS
    assert extract_answer(early).answer is None
    assert extract_answer("y" * 10 * TAIL_CHARS + r"\boxed{2}").answer == "2"


@pytest.mark.parametrize(
    "completion",
    [
        r"\boxed{18} or maybe \boxed{19}",
        r"\boxed{18 \text{ or } 19}",
        r"\boxed{18 or 19}",
        "The answer is 18 or 19.",
        "It is either 19, or 18",
        "#### 18 or 19",
    ],
)
@pytest.mark.parametrize("gold", ["18", "19"])
def test_hedged_answers_are_not_rewarded(verifier, completion, gold):
    verdict = verifier.check(completion, gold)
    assert verdict.reward == 0.0 and verdict.verifier == "fast"


def test_repeating_one_answer_is_not_a_hedge(verifier):
    assert verifier.score(r"\boxed{18}, so again: \boxed{ 18 }", "18") == 1.0


def test_or_in_the_gold_answer_is_not_a_hedge(verifier):
    assert not extract_answer(r"\boxed{A or B}", allow_or=True).hedged
    assert verifier.check(r"\boxed{\text{A or B}}", r"\text{A or B}").verifier == "slow"


# -- fast path -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, value",
    [
        ("42", Fraction(42)),
        ("-42", Fraction(-42)),
        ("1,234", Fraction(1234)),
        ("1,234,567.5", Fraction(2469135, 2)),
        ("3.50", Fraction(7, 2)),
        (".5", Fraction(1, 2)),
        ("3/4", Fraction(3, 4)),
        (r"\frac{3}{4}", Fraction(3, 4)),
        (r"-\dfrac{3}{4}", Fraction(-3, 4)),
        ("$42$", Fraction(42)),
        (r"\$42", Fraction(42)),
        ("42.", Fraction(42)),
        (r"579 \text{ apples}", Fraction(579)),
        ("42 dollars", Fraction(42)),
        ("1{,}000", Fraction(1000)),
        ("\u22127", Fraction(-7)),
        (r"\frac12", Fraction(1, 2)),
        (r"\tfrac{12}3", Fraction(4)),
        (r"\frac{-3}{4}", Fraction(-3, 4)),
        (r"-\frac{3}{-4}", Fraction(3, 4)),
        ("(5)", Fraction(5)),
        ("{-5}", Fraction(-5)),
        (r"\left( 5 \right)", Fraction(5)),
        (r"\mathbf{5}", Fraction(5)),
        (r"\text{-0.5}", Fraction(-1, 2)),
        ("- 5", Fraction(-5)),
        ("1 000 000", Fraction(10**6)),
        (r"1\,000", Fraction(1000)),
        # Not simple numbers: left to math-verify.
        ("1,23", None),
        ("12,34,567", None),
        ("1/0", None),
        ("x=5", None),
        ("2x", None),
        (r"\sqrt{2}", None),
        ("9" * 65, None),
        ("\u00b2", None),
        ("12 3", None),  # spaces group thousands only
        ("(1,2)", None),  # a tuple
        (r"\frac123", None),  # \frac{1}{2}3
        ("-(5)", None),
        (r"\boldsymbol{5}", None),  # math-verify does not read it as 5
    ],
)
def test_parse_simple_number(text, value):
    assert parse_simple_number(text) == value


FAST_ONLY = MathVerifier()  # used only for fast-path cases, so it never starts a child


@given(st.integers(-(10**15), 10**15), st.sampled_from(["{:d}", "{:,d}"]))
@settings(max_examples=200, deadline=None)
def test_integers_are_exact_in_every_format(n, fmt):
    for completion in (rf"so \boxed{{{fmt.format(n)}}}.", f"steps\n#### {fmt.format(n)}", f"it is {fmt.format(n)}"):
        for gold in (str(n), f"{n:,d}"):
            v = FAST_ONLY.check(completion, gold)
            assert (v.reward, v.verifier) == (1.0, "fast")
            assert FAST_ONLY.check(completion, str(n + 1)).reward == 0.0


@given(st.integers(0, 10**6), st.integers(0, 10**6 - 1))
@settings(max_examples=200, deadline=None)
def test_decimals_match_a_plain_reference(whole, frac):
    text = f"{whole}.{frac:06d}"
    assert parse_simple_number(text) == Fraction(whole * 10**6 + frac, 10**6)


@given(st.integers(1, 999), st.integers(1, 999), st.integers(1, 50))
@settings(max_examples=100, deadline=None)
def test_equal_fractions_in_any_form_are_correct(a, b, k):
    gold = rf"\frac{{{a}}}{{{b}}}"
    assert FAST_ONLY.score(rf"\boxed{{\frac{{{a * k}}}{{{b * k}}}}}", gold) == 1.0
    assert FAST_ONLY.score(rf"\boxed{{{a * k}/{b * k}}}", gold) == 1.0
    assert FAST_ONLY.score(rf"\boxed{{\frac{{{a * k + 1}}}{{{b * k}}}}}", gold) == 0.0
    assert FAST_ONLY.child_pids() == []


def _numeric_forms(value: Fraction) -> tuple[list[str], list[str]]:
    """(ways to write `value`, nearby wrong values), in the notations models use."""
    n, d = value.numerator, value.denominator
    right = [rf"\frac{{{2 * n}}}{{{2 * d}}}", rf"\dfrac{{{n}}}{{{d}}}", f"{{{n}/{d}}}" if d > 1 else f"{{{n}}}"]
    if d == 1:
        right += [str(n), f"{n}.0", f"({n})", rf"\mathbf{{{n}}}", rf"\text{{{n}}}", rf"\left({n}\right)", rf"\${n}"]
        right += [f"+{n}"] if n >= 0 else [rf"-\frac{{{-2 * n}}}{{2}}", rf"\frac{{{n}}}{{1}}"]
        right += [f"{n:,}"] if abs(n) >= 1000 else []
    elif 10**6 % d == 0:
        right += [str(float(value)), rf"\frac{{{-n}}}{{{-d}}}"]
    wrong = [str(value + 1) if d == 1 else rf"\frac{{{n + 1}}}{{{d}}}", rf"\frac{{{n}}}{{{d + 1}}}"]
    wrong += [str(-n)] if n and d == 1 else []
    wrong += [str(10 * n)] if n and d == 1 else []
    return right, wrong


def _fixture_golds() -> list[str]:
    import json

    import pandas as pd

    here = os.path.join(os.path.dirname(__file__), "fixtures")
    with open(os.path.join(here, "gsm8k_sample.jsonl")) as f:
        golds = [normalize_gold(json.loads(line)["answer"]) for line in f]
    golds += [normalize_gold(a) for a in pd.read_parquet(os.path.join(here, "math_sample.parquet"))["answer"]]
    return golds


def test_numeric_answers_are_decided_in_process_as_math_verify_decides(verifier):
    """The fast path against math-verify (run in its child, as the reference) on the
    arithmetic held-out answers (sums; signed results of + - *) and the fixture datasets'
    numeric answers, each written in the notations above, right and wrong."""
    from concurrent.futures import ThreadPoolExecutor

    from envs import ArithmeticTasks

    golds = [p.answer for p in ArithmeticTasks(digits=3).heldout()[:30]]
    golds += [p.answer for p in ArithmeticTasks(digits=2, num_operands=3, operators="+-*").heldout()[:30]]
    golds += [g for g in _fixture_golds() if parse_simple_number(g) is not None]
    assert any(g.startswith("-") for g in golds) and any("frac" in g for g in golds)
    cases = []
    for gold in golds:
        right, wrong = _numeric_forms(parse_simple_number(gold))
        cases += [(answer, gold, 1.0) for answer in right] + [(answer, gold, 0.0) for answer in wrong]
    fast = [FAST_ONLY.check(rf"so \boxed{{{a}}}.", g) for a, g, _ in cases]
    assert [v.verifier for v in fast] == ["fast"] * len(cases)
    assert FAST_ONLY.child_pids() == []
    with ThreadPoolExecutor(verifier.num_workers) as pool:
        reference = list(pool.map(lambda case: verifier.math_verify(case[0], case[1]), cases))
    assert [v.verifier for v in reference] == ["slow"] * len(cases)
    disagree = [(a, g, v.reward, r.reward) for (a, g, _), v, r in zip(cases, fast, reference) if v.reward != r.reward]
    assert disagree == []
    assert [v.reward for v in fast] == [want for _, _, want in cases]


@pytest.mark.parametrize(
    "answer, gold, reward, decided_by",
    [
        ("19 = 18", "18", 0.0, "fast"),  # a false equation, though its right-hand side is right
        ("18 = 19", "18", 0.0, "fast"),
        ("x = 18", "18", 1.0, "fast"),
        ("18 = 18", "18", 1.0, "fast"),
        (r"a_1 = f(x) = \frac{36}{2}", "18", 1.0, "fast"),
        (r"\text{total} = 18", "18", 1.0, "fast"),
        ("x = y", "18", 0.0, "fast"),  # names only: no value given
        ("2 + 16 = 18", "18", 1.0, "slow"),  # the expression side goes to math-verify
        ("2 + 17 = 18", "18", 0.0, "slow"),
        ("y = x^2 + 1", "1+x^2", 1.0, "slow"),
        ("x^2 = x^2 + 1", "1+x^2", 0.0, "slow"),
        ("y = 2x + 3", "y = 3 + 2x", 1.0, "slow"),  # the gold is an equation: math-verify compares
    ],
)
def test_an_equation_scores_only_if_every_side_is_the_answer(verifier, answer, gold, reward, decided_by):
    verdict = verifier.check(rf"\boxed{{{answer}}}", gold)
    assert (verdict.reward, verdict.verifier) == (reward, decided_by)
    assert verifier.score_batch([(rf"\boxed{{{answer}}}", gold), (r"\boxed{\sqrt 2}", r"\sqrt{2}")]) == [reward, 1.0]


def test_math_verify_alone_takes_the_right_hand_side(verifier):
    """Why the equation rule exists: math-verify scores `19 = 18` as 18."""
    assert verifier.math_verify("19 = 18", "18").reward == 1.0
    assert verifier.check(r"\boxed{19 = 18}", "18").reward == 0.0


def test_fast_path_starts_no_child():
    v = MathVerifier()
    pairs = [(r"\boxed{5}", "5"), ("#### 1,000", "1000"), ("nothing", "3"), (r"\boxed{ }", "3")]
    assert v.score_batch(pairs) == [1.0, 1.0, 0.0, 0.0]
    assert v.child_pids() == []
    m = v.metrics()
    assert (m["reward/fast_path"], m["reward/slow_path"], m["reward/no_answer"]) == (4, 0, 2)


@pytest.mark.parametrize(
    "gold, normalised",
    [
        ("She has 3 + 4 = <<3+4=7>>7.\n#### 7", "7"),
        ("#### 1,234", "1234"),
        (r"so the answer is $\boxed{\frac{5}{6}}$.", r"\frac{5}{6}"),
        ("$42$", "42"),
        (r"\$1,200", "1200"),
        ("(1,2)", "(1,2)"),
        (" 5 ", "5"),
        (17, "17"),
    ],
)
def test_normalize_gold(gold, normalised):
    assert normalize_gold(gold) == normalised
