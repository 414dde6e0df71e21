"""The sandboxed tools (`envs.tools`): exact answers, hostile calls answered with an error
observation (never an exception, a side effect or a hang), the time limit, a dead child
replaced, and concurrent callers."""

from __future__ import annotations

import os
import threading
import time

import pytest

from envs.tools import ToolSandbox


@pytest.fixture(scope="module")
def sandbox():
    box = ToolSandbox(time_limit_s=5.0)
    yield box
    box.close()


@pytest.mark.parametrize(
    "tool, text, output",
    [
        ("calculator", "12345 * 6789", "83810205"),
        ("calculator", "(2 + 3) * 4 - 10 / 4", "17.5"),
        ("calculator", "0.1 + 0.2", "0.3"),  # exact decimals, not binary floats
        ("calculator", "7 / 3", "7/3 (~2.33333333333)"),
        ("calculator", "2 ** 100", str(2**100)),
        ("calculator", "-7 // 2 + 7 % 3", "-3"),
        ("calculator", "2 ** -2", "0.25"),
        ("python", "max(3, 7, 2) + min([4, 1])", "8"),
        ("python", "1 < 2 <= 2 and not 3 == 4", "True"),
        ("python", "round(2.675, 2)", "2.68"),
        ("python", "sum((1, 2, 3)) if len([1, 2]) == 2 else 0", "6"),
        ("python", "(1, 2.5)", "(1, 2.5)"),
        ("python", "0 or 5", "5"),  # Python's and / or: the deciding operand
        ("python", "3 and 0", "0"),
        ("calculator", "10 ** 5000 // 7", ("142857" * 834)[:5000]),  # past str()'s default 4300 digits
        ("calculator", "1 / 10 ** 400", "1/1" + "0" * 400),  # beyond a float: exact
    ],
)
def test_answers_are_exact(sandbox, tool, text, output):
    result = sandbox.run(tool, text)
    assert result.ok and result.output == output
    assert result.observation == f"<result>{output}</result>"


@pytest.mark.parametrize(
    "tool, text, error",
    [
        ("python", "__import__('os').system('touch pwned')", "Call is not allowed"),
        ("python", "open('pwned', 'w').write('x')", "Call is not allowed"),
        ("python", "().__class__.__bases__[0].__subclasses__()", "is not allowed"),
        ("python", "[c for c in (1, 2)]", "ListComp is not allowed"),
        ("python", "(lambda: 1)()", "is not allowed"),
        ("python", "'a' * 10 ** 9", "str constants are not allowed"),
        ("python", "[1] * 10 ** 9", "sequences cannot be multiplied"),
        ("python", "max()", "an empty sequence"),
        ("python", "abs(1, 2)", "wrong arguments to abs()"),
        ("python", "x + 1", "Name is not allowed"),
        ("calculator", "1 < 2", "Compare is not allowed"),  # the calculator is arithmetic only
        ("calculator", "9 ** 9 ** 9", "number too large"),  # refused before it is computed
        ("calculator", "(10 ** 3000) * (10 ** 3000) * (10 ** 3000)", "number too large"),
        ("calculator", "1 / 0", "division by zero"),
        ("calculator", "(-8) ** 0.5", "a negative number to a fractional power"),
        ("calculator", "1e999", "number too large"),
        ("calculator", "2 +* 3", "cannot parse"),
        ("calculator", "(" * 300 + "1" + ")" * 300, ""),  # parse error or too large: an error either way
        ("calculator", "1+" * 600 + "1", "input longer than 1000 characters"),
        ("nope", "1", "unknown tool 'nope'"),
    ],
)
def test_hostile_or_bad_calls_get_an_error_observation_and_no_side_effect(sandbox, tool, text, error, tmp_path):
    before = set(os.listdir(sandbox._dir)), set(os.listdir(os.getcwd()))
    started = time.monotonic()
    result = sandbox.run(tool, text)
    assert result.status == "error" and error in result.output, result
    assert result.observation.startswith("<error>")
    assert time.monotonic() - started < 5.0
    assert (set(os.listdir(sandbox._dir)), set(os.listdir(os.getcwd()))) == before
    assert sandbox.run("calculator", "1 + 1").output == "2"  # the sandbox still serves


def test_a_call_past_the_time_limit_is_a_timeout_and_the_child_is_replaced():
    box = ToolSandbox(time_limit_s=1e-6)
    try:
        result = box.run("calculator", "2 ** 19000 // 3 ** 11000")
        assert result.status == "timeout" and result.observation == "<error>the tool took longer than 1e-06 s</error>"
        assert box.metrics["tool/timeouts"] == 1 and box.metrics["tool/child_restarts"] == 1 and box._child is None
        box.time_limit_s = 5.0
        assert box.run("calculator", "6 * 7").output == "42"
    finally:
        box.close()


def test_a_dead_child_is_replaced_and_counted(sandbox):
    assert sandbox.run("calculator", "1").ok
    restarts = sandbox.metrics["tool/child_restarts"]
    pid = sandbox._child.pid
    os.kill(pid, 9)
    sandbox._child.wait()
    assert sandbox.run("calculator", "3 * 3").output == "9"
    assert sandbox._child.pid != pid and sandbox.metrics["tool/child_restarts"] == restarts + 1


def test_concurrent_callers_each_get_their_own_answer(sandbox):
    answers = {}

    def call(i):
        answers[i] = sandbox.run("calculator", f"{i} * 1001").output

    threads = [threading.Thread(target=call, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert answers == {i: str(i * 1001) for i in range(16)}


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="time_limit_s"):
        ToolSandbox(time_limit_s=0)
    with pytest.raises(ValueError, match="memory_limit_mb"):
        ToolSandbox(memory_limit_mb=-1)
    box = ToolSandbox()
    assert box.run("calculator", 123).output == "the tool input must be text, got int"
    box.close()
