"""The verifier reward's isolated math-verify pool: the slow path in fresh child interpreters,
their deadlines, crashes and recycling, and hostile input answered in time without side effects."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from envs import MathVerifier, math_reward


def warm(v: MathVerifier) -> None:
    """Make sure a child is up, so a timed call measures verification, not interpreter start-up."""
    assert v.check(r"\boxed{\sqrt 2}", r"\sqrt{2}").verifier == "slow"


# -- slow path (math-verify in a child) ------------------------------------------------------
@pytest.mark.parametrize(
    "completion, gold, reward",
    [
        (r"\boxed{\sqrt 2}", r"\sqrt{2}", 1.0),
        (r"\boxed{x^2+1}", "1+x^2", 1.0),
        (r"\boxed{\frac{\sqrt{4}}{4}}", r"\frac12", 1.0),
        (r"\boxed{2\pi}", r"\pi", 0.0),
        (r"\boxed{\{2, -2\}}", r"\{-2, 2\}", 1.0),
        (r"\boxed{18, 19}", "18", 0.0),
        (r"\boxed{50\%}", r"\frac{1}{2}", 1.0),
    ],
)
def test_slow_path_uses_math_verify(verifier, completion, gold, reward):
    verdict = verifier.check(completion, gold)
    assert (verdict.reward, verdict.verifier) == (reward, "slow")


def test_score_batch_matches_score_and_counts(verifier):
    pairs = [
        (r"\boxed{\sqrt 8}", r"2\sqrt{2}"),
        (r"\boxed{3}", "3"),
        (r"\boxed{\frac{\pi}{2}}", r"\pi/2"),
        ("nothing", "1"),
        (r"\boxed{\sqrt 3}", r"\sqrt{2}"),
    ]
    before = verifier.metrics()
    assert verifier.score_batch(pairs) == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert [verifier.score(c, g) for c, g in pairs] == [1.0, 1.0, 1.0, 0.0, 0.0]
    after = verifier.metrics()
    assert after["reward/slow_path"] - before["reward/slow_path"] == 6
    assert after["reward/fast_path"] - before["reward/fast_path"] == 4


def test_metrics_reset():
    v = MathVerifier()
    v.score(r"\boxed{1}", "1")
    assert v.metrics(reset=True)["reward/fast_path"] == 1
    assert v.metrics()["reward/fast_path"] == 0


def test_math_reward_module_function():
    assert math_reward(r"The total is \boxed{579}.", "579") == 1.0
    assert math_reward(r"The total is \boxed{578}.", "579") == 0.0
    assert math_reward(r"\boxed{\sqrt{4}}", "2") == 1.0  # not a simple number: math-verify


def test_children_are_isolated_fresh_interpreters(verifier):
    warm(verifier)
    for pid in verifier.child_pids():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert argv[1].endswith(b"_verify_child.py")  # a fresh interpreter, not a fork of this one
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert b"SYMPY_GROUND_TYPES=python" in f.read().split(b"\0")
        with open(f"/proc/{pid}/limits") as f:
            limit = next(line for line in f if line.startswith("Max address space"))
        assert limit.split()[3] == str(verifier.memory_limit_mb << 20)


def test_a_broken_install_is_loud_not_a_silent_zero(tmp_path, monkeypatch):
    script = tmp_path / "child.py"
    script.write_text('print(\'{"ready": false, "error": "ImportError: no math_verify"}\', flush=True)\n')
    monkeypatch.setattr("envs.reward_child._CHILD_SCRIPT", str(script))
    with MathVerifier() as v:
        with pytest.raises(RuntimeError, match="failed to start.*math_verify"):
            v.check(r"\boxed{\sqrt 2}", r"\sqrt{2}")
        assert v.score(r"\boxed{2}", "2") == 1.0  # the fast path still works


def test_float_timeouts_are_rejected():
    with pytest.raises(ValueError, match="integer"):
        MathVerifier(timeout_s=1.5)


def test_deadline_kills_and_replaces_a_stuck_child():
    # math-verify's own alarm (30 s) is far away: only the parent's deadline can stop this.
    with MathVerifier(timeout_s=30, deadline_s=1.0) as v:
        warm(v)
        (pid,) = v.child_pids()
        start = time.monotonic()
        verdict = v.check(r"\boxed{9^{9^{9^{9}}}}", "1")
        assert time.monotonic() - start < 3 * v.deadline_s
        assert (verdict.reward, verdict.verifier) == (0.0, "timeout")
        assert not os.path.exists(f"/proc/{pid}/status") or _is_zombie_free(pid)
        assert v.child_pids() != [pid]
        assert v.check(r"\boxed{\sqrt 2}", r"\sqrt{2}").reward == 1.0
        m = v.metrics()
        assert (m["reward/timeouts"], m["reward/child_restarts"]) == (1, 1)


def _is_zombie_free(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        return "State:\tZ" not in f.read()


def test_a_crashed_child_is_an_error_and_is_replaced():
    with MathVerifier() as v:
        warm(v)
        (pid,) = v.child_pids()
        os.kill(pid, signal.SIGKILL)
        verdict = v.check(r"\boxed{\sqrt 2}", r"\sqrt{2}")
        assert (verdict.reward, verdict.verifier) == (0.0, "error")
        assert v.metrics()["reward/errors"] == 1
        assert v.check(r"\boxed{\sqrt 2}", r"\sqrt{2}").reward == 1.0


def test_children_are_recycled():
    with MathVerifier(max_tasks_per_child=2) as v:
        pids = set()
        for _ in range(5):
            assert v.score(r"\boxed{\sqrt 2}", r"\sqrt{2}") == 1.0
            pids.update(v.child_pids())
        assert v.metrics()["reward/child_restarts"] == 2
        assert len(pids) == 3


# -- hostile input ---------------------------------------------------------------------------
def _hostile(tmp: str) -> list[tuple[str, object, str]]:
    payload = f"__import__('os').system('touch {tmp}')"
    nested_braces = "{" * 10_000 + "1" + "}" * 10_000
    nested_parens = "(" * 10_000 + "1" + ")" * 10_000
    return [
        ("empty", "", "1"),
        ("None", None, "1"),
        ("bytes", b"\\boxed{7}", "7"),
        ("invalid utf-8", b"\xff\xfe\\boxed{7}\xc3", "7"),
        ("lone surrogate", "\ud800\\boxed{7}", "7"),
        ("1 MB", "9" * 1_000_000, "9"),
        ("1 MB of boxes", r"\boxed{1}" * 120_000, "1"),
        ("1 MB unclosed boxes", r"\boxed{" * 150_000, "1"),
        ("10k braces", nested_braces, "1"),
        ("10k braces boxed", r"\boxed{" + nested_braces + "}", r"\sqrt{2}"),
        ("10k parens", nested_parens, r"\sqrt{2}"),
        ("10k parens boxed", r"\boxed{" + nested_parens + "}", r"\sqrt{2}"),
        ("deep parens boxed", r"\boxed{" + "(" * 12 + "1" + ")" * 12 + "}", r"\sqrt{2}"),
        ("power tower", r"\boxed{9^{9^{9^{9}}}}", "1"),
        ("power tower text", "so it is $9^{9^{9^{9}}}$", r"\sqrt{2}"),
        ("factorial", r"\boxed{(10^{10})!}", "3"),
        ("double factorial", r"\boxed{100000!!}", "3"),
        ("huge product", r"\boxed{99999999^{99999999} \cdot 88888888^{88888888}}", "3"),
        ("huge number", r"\boxed{" + "9" * 5000 + "}", "9"),
        ("payload boxed", rf"\boxed{{{payload}}}", r"\sqrt{2}"),
        ("payload math", f"${payload}$", r"\sqrt{2}"),
        ("payload text", rf"\boxed{{\text{{{payload}}}}}", r"\sqrt{2}"),
        ("payload dollar boxed", rf"\boxed{{${payload}$}}", r"\sqrt{2}"),
        ("payload plain", payload, r"\sqrt{2}"),
        ("payload ####", f"#### {payload}", r"\sqrt{2}"),
        ("payload gold", r"\boxed{1}", payload),
        ("eval-style", r"\boxed{\text{eval}(\text{'1'})}", "1"),
    ]


@pytest.mark.parametrize("case", range(len(_hostile("x"))), ids=[c[0] for c in _hostile("x")])
def test_hostile_input_returns_a_reward_in_time_without_side_effects(verifier, tmp_path, case):
    marker = tmp_path / "pwned"
    name, completion, gold = _hostile(str(marker))[case]
    warm(verifier)
    start = time.monotonic()
    verdict = verifier.check(completion, gold)
    elapsed = time.monotonic() - start
    assert elapsed < 3 * verifier.deadline_s, f"{name}: {elapsed:.1f} s"
    assert verdict.reward in (0.0, 1.0)
    assert verdict.verifier in ("fast", "slow", "timeout", "error")
    assert not marker.exists()
    if name in ("bytes", "invalid utf-8", "lone surrogate", "1 MB of boxes"):
        assert verdict.reward == 1.0
    elif name != "payload gold":
        assert verdict.reward == 0.0
    if name.startswith("payload") and "boxed" in name:
        assert verdict.verifier != "fast"  # it really reached math-verify
    # The pool is still usable afterwards.
    assert verifier.score(r"\boxed{\sqrt 2}", r"\sqrt{2}") == 1.0


def test_programming_errors_still_raise(verifier):
    with pytest.raises(TypeError):
        verifier.score(["not", "text"], "1")
    with pytest.raises(TypeError):
        verifier.score("1", None)


def test_calls_from_several_threads(verifier):
    cases = [
        (r"\boxed{12}", "12", 1.0),
        (r"\boxed{13}", "12", 0.0),
        (r"\boxed{\sqrt 8}", r"2\sqrt{2}", 1.0),
        (r"\boxed{\sqrt 7}", r"2\sqrt{2}", 0.0),
        (r"\boxed{9^{9^{9^{9}}}}", "3", 0.0),
        (None, "3", 0.0),
    ]
    results: dict[tuple[int, int], float] = {}
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i, (completion, gold, _) in enumerate(cases):
                results[t, i] = verifier.score(completion, gold)
            results[t, -1] = math_reward(r"\boxed{\frac{1}{2}}", "0.5")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and not any(thread.is_alive() for thread in threads)
    for t in range(4):
        assert [results[t, i] for i in range(len(cases))] == [c[2] for c in cases]
        assert results[t, -1] == 1.0
