"""The math-verify worker process of `envs.reward.MathVerifier` (run as a script).

It runs in a fresh interpreter (never a fork of a threaded Ray actor), so math-verify's
`signal.alarm` timeouts work: this is the main thread of the process. It imports nothing
from `envs`, so starting it does not import the parent's modules (torch, ray).

Protocol, one JSON object per line: the parent writes {"pred": str, "gold": str} to
stdin; the child answers {"status": "ok" | "timeout" | "error", "correct": bool} on the
original stdout, after first announcing {"ready": true} (or {"ready": false, "error": ...}).
Anything else the libraries print goes to /dev/null. The child exits at end of stdin.

argv: timeout_s (int, per math-verify call), memory_limit_mb (address space; 0 = none).
"""

import os
import sys

# Before sympy is imported: pure-Python integers keep every operation interruptible by
# the alarm (gmpy2's C factorials are not) and the memory growth predictable.
os.environ["SYMPY_GROUND_TYPES"] = "python"

_GOLD_CACHE_SIZE = 256
_CLEAR_SYMPY_CACHE_EVERY = 100
_CPU_LIMIT_S = 3600  # backstop for an orphaned child; the parent's deadline acts first


def _serve(proto, timeout_s: int) -> None:
    import json
    import logging
    from collections import OrderedDict

    from math_verify import LatexExtractionConfig, parse, verify
    from math_verify.errors import TimeoutException
    from sympy.core.cache import clear_cache

    logging.disable(logging.CRITICAL)
    # LaTeX extraction only: math-verify's plain-expression path calls sympy's parse_expr,
    # which evaluates Python.
    config = [LatexExtractionConfig()]
    gold_cache: OrderedDict = OrderedDict()

    def parse_gold(gold: str):
        if gold not in gold_cache:
            gold_cache[gold] = parse(gold, config, parsing_timeout=timeout_s, raise_on_error=True)
            if len(gold_cache) > _GOLD_CACHE_SIZE:
                gold_cache.popitem(last=False)
        return gold_cache[gold]

    def check(pred: str, gold: str) -> tuple[str, bool]:
        gold_parsed = parse_gold(gold)
        pred_parsed = parse(pred, config, parsing_timeout=timeout_s, raise_on_error=True)
        if not gold_parsed or not pred_parsed:
            return "ok", False
        # Pair by pair, as verify() does, so a TimeoutException is told apart from "wrong".
        compared = errors = 0
        for g in gold_parsed:
            for p in pred_parsed:
                try:
                    if verify(g, p, timeout_seconds=timeout_s, raise_on_error=True):
                        return "ok", True
                    compared += 1
                except Exception:
                    errors += 1
        return ("error" if errors and not compared else "ok"), False

    proto.write(json.dumps({"ready": True}) + "\n")
    proto.flush()
    served = 0
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            status, correct = check(request["pred"], request["gold"])
        except TimeoutException:
            status, correct = "timeout", False
        except (Exception, RecursionError, MemoryError):
            status, correct = "error", False
        served += 1
        if served % _CLEAR_SYMPY_CACHE_EVERY == 0:
            clear_cache()
        proto.write(json.dumps({"status": status, "correct": correct}) + "\n")
        proto.flush()


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _sandbox_child import confine  # beside this script; confine() takes its folder off sys.path again

    timeout_s, memory_limit_mb = int(sys.argv[1]), int(sys.argv[2])
    proto = confine(__file__, cpu_limit_s=_CPU_LIMIT_S, memory_limit_mb=memory_limit_mb)
    try:
        _serve(proto, timeout_s)
    except ImportError as e:
        import json

        proto.write(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        proto.flush()


if __name__ == "__main__":
    main()
