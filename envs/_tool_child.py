"""The tool worker process of `envs.tools.ToolSandbox` (run as a script, `python -I`).

It evaluates a calculator expression or a restricted Python expression by walking its AST
against a whitelist: numbers, arithmetic (exact: integers and fractions), and in "python"
mode comparisons, boolean logic, conditional expressions, tuples / lists and a few pure
builtins (abs, min, max, round, sum, len, int, float). Nothing else parses: no names, no
attributes, no subscripts, no comprehensions, no lambdas, so no import, file or object is
reachable. Sizes are bounded before they are computed (digits of a product or a power).
It imports nothing from the `envs` package (only `_sandbox_child.py` beside it); the parent adds the time limit (it kills a child that does
not answer), this process its own address-space, file-size and CPU limits.

Protocol, one JSON object per line: the parent writes {"tool": "calculator" | "python",
"input": str} to stdin; the child answers {"status": "ok" | "error", "output": str} after
first announcing {"ready": true}. The child exits at end of stdin.

argv: memory_limit_mb (address space; 0 = none), cpu_limit_s (this process's CPU seconds, a
backstop for an orphaned child: the parent recycles children long before).
"""

import ast
import json
import math
import operator
import os
import sys
from fractions import Fraction

MAX_CHARS = 1000
MAX_NODES = 400
MAX_BITS = 20_000  # ~6000 decimal digits: any number past it is refused before it is computed
MAX_ITEMS = 1000


class ToolError(Exception):
    """An expression the tool refuses or cannot evaluate; the message goes to the policy."""


def _bits(x) -> int:
    if isinstance(x, bool):
        return 1
    if isinstance(x, int):
        return x.bit_length()
    if isinstance(x, Fraction):
        return x.numerator.bit_length() + x.denominator.bit_length()
    return 64  # float


def _check(x):
    if isinstance(x, (int, Fraction)) and _bits(x) > MAX_BITS:
        raise ToolError("number too large")
    if isinstance(x, complex):
        raise ToolError("the result is a complex number")
    if isinstance(x, float) and not math.isfinite(x):
        raise ToolError("result is not finite")
    if isinstance(x, (tuple, list)) and len(x) > MAX_ITEMS:
        raise ToolError("too many items")
    return x


def _num(x):
    if isinstance(x, bool) or not isinstance(x, (int, Fraction, float)):
        raise ToolError(f"expected a number, got {type(x).__name__}")
    return x


def _div(a, b):
    a, b = _num(a), _num(b)
    if b == 0:
        raise ToolError("division by zero")
    if isinstance(a, float) or isinstance(b, float):
        return a / b
    return Fraction(a) / Fraction(b)


def _floordiv(a, b):
    if _num(b) == 0:
        raise ToolError("division by zero")
    return _num(a) // b


def _mod(a, b):
    if _num(b) == 0:
        raise ToolError("modulo by zero")
    return _num(a) % b


def _mul(a, b):
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        raise ToolError("sequences cannot be multiplied")
    a, b = _num(a), _num(b)
    if _bits(a) + _bits(b) > MAX_BITS:
        raise ToolError("number too large")
    return a * b


def _pow(a, b):
    a, b = _num(a), _num(b)
    if isinstance(b, Fraction) and b.denominator == 1:
        b = int(b)
    if not isinstance(b, int):
        if isinstance(a, (int, Fraction)) and a < 0:
            raise ToolError("a negative number to a fractional power")
        return _check(float(a) ** float(b))
    if a == 0 and b < 0:
        raise ToolError("division by zero")
    if abs(a) not in (0, 1) and _bits(a) * abs(b) > MAX_BITS:
        raise ToolError("number too large")
    return Fraction(a) ** b if b < 0 and not isinstance(a, float) else a ** b


def _add(a, b):
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        if type(a) is not type(b):
            raise ToolError("cannot add a sequence and a number")
        return _check(a + b)
    return _num(a) + _num(b)


def _sub(a, b):
    return _num(a) - _num(b)


BINARY = {ast.Add: _add, ast.Sub: _sub, ast.Mult: _mul, ast.Div: _div, ast.FloorDiv: _floordiv, ast.Mod: _mod,
          ast.Pow: _pow}
UNARY = {ast.USub: lambda x: -_num(x), ast.UAdd: lambda x: +_num(x)}
COMPARE = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Eq: operator.eq,
           ast.NotEq: operator.ne}


def _round(x, digits=0):
    if not isinstance(digits, int) or isinstance(digits, bool) or not -100 <= digits <= 100:
        raise ToolError("round() digits must be an integer in [-100, 100]")
    return round(Fraction(_num(x)) if not isinstance(x, float) else x, digits)


def _items(s):
    if not isinstance(s, (tuple, list)):
        raise ToolError("expected a tuple or list")
    return s


def _seq(args):
    items = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
    if not items:
        raise ToolError("an empty sequence")
    return [_num(v) for v in items]


FUNCTIONS = {
    "abs": lambda *a: abs(_num(*a)),
    "min": lambda *a: min(_seq(a)),
    "max": lambda *a: max(_seq(a)),
    "round": _round,
    "sum": lambda s: _check(sum(_seq((s,)))),
    "len": lambda s: len(_items(s)),
    "int": lambda x: int(_num(x)),
    "float": lambda x: float(_num(x)),
}


def evaluate(text: str, tool: str):
    if len(text) > MAX_CHARS:
        raise ToolError(f"input longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ToolError("cannot parse the expression") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise ToolError(f"expression larger than {MAX_NODES} parts")
    python = tool == "python"

    def ev(node):
        if isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool) and python:
                return v
            if isinstance(v, float) and not math.isfinite(v):
                raise ToolError("number too large")
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return _check(Fraction(repr(v)) if isinstance(v, float) else v)
            raise ToolError(f"{type(v).__name__} constants are not allowed")
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            return _check(BINARY[type(node.op)](ev(node.left), ev(node.right)))
        if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
            return _check(UNARY[type(node.op)](ev(node.operand)))
        if python:
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
                return not ev(node.operand)
            if isinstance(node, ast.Compare) and all(type(op) in COMPARE for op in node.ops):
                left = ev(node.left)
                for op, right_node in zip(node.ops, node.comparators):
                    right = ev(right_node)
                    if not COMPARE[type(op)](left, right):
                        return False
                    left = right
                return True
            if isinstance(node, ast.BoolOp):  # Python's: the deciding operand, not a bool
                value = None
                for v in node.values:
                    value = ev(v)
                    if bool(value) != isinstance(node.op, ast.And):
                        break
                return value
            if isinstance(node, ast.IfExp):
                return ev(node.body) if ev(node.test) else ev(node.orelse)
            if isinstance(node, (ast.Tuple, ast.List)):
                return _check(tuple(ev(e) for e in node.elts) if isinstance(node, ast.Tuple) else [ev(e) for e in node.elts])
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS
                    and not node.keywords):
                try:
                    return _check(FUNCTIONS[node.func.id](*[ev(a) for a in node.args]))
                except TypeError:
                    raise ToolError(f"wrong arguments to {node.func.id}()") from None
        raise ToolError(f"{type(node).__name__} is not allowed")

    return ev(tree.body)


def render(value) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, Fraction):
        if value.denominator == 1:
            return str(value.numerator)
        try:
            approx = float(value)
        except OverflowError:
            approx = 0.0
        if approx == 0.0:  # past a float's range: exact only
            return f"{value.numerator}/{value.denominator}"
        text = f"{approx:.12g}"
        return text if Fraction(text) == value else f"{value.numerator}/{value.denominator} (~{text})"
    if isinstance(value, float):
        return f"{value:.12g}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(render(v) for v in value)
        return f"({inner}{',' if len(value) == 1 else ''})" if isinstance(value, tuple) else f"[{inner}]"
    return str(value)


def _serve(proto) -> None:
    proto.write(json.dumps({"ready": True}) + "\n")
    proto.flush()
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            status, output = "ok", render(evaluate(str(request["input"]), request.get("tool", "calculator")))
            if len(output) > 2 * MAX_CHARS + 4000:
                status, output = "error", "result too long"
        except ToolError as e:
            status, output = "error", str(e)
        except (RecursionError, MemoryError):
            status, output = "error", "expression too deep or too large"
        except (ArithmeticError, ValueError, TypeError) as e:
            status, output = "error", f"{type(e).__name__}: {e}"[:200]
        proto.write(json.dumps({"status": status, "output": output}) + "\n")
        proto.flush()


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _sandbox_child import confine  # beside this script; confine() takes its folder off sys.path again

    memory_limit_mb, cpu_limit_s = int(sys.argv[1]), int(sys.argv[2])
    sys.set_int_max_str_digits(0)  # numbers are bounded by MAX_BITS (~6000 digits) before they exist
    proto = confine(__file__, cpu_limit_s=cpu_limit_s, memory_limit_mb=memory_limit_mb, no_files=True)
    _serve(proto)


if __name__ == "__main__":
    main()
