"""Final-answer extraction and the exact fast path, in-process and without sympy.

Model output is untrusted: everything here is linear-time string work on a bounded tail
of the text, and nothing is ever evaluated.

Extraction order (`extract_answer`), on the last `TAIL_CHARS` characters:
  1. the last balanced `\\boxed{...}` (or `\\fbox{...}`); two or more boxed answers
     that differ make the completion hedged;
  2. else the text after the last GSM8K `####`, up to the end of that line;
  3. else the last number (integer, strict thousands commas, decimal or `a/b`).
An answer saying "x or y" is hedged, and a hedged completion is never rewarded.

Fast path (`parse_simple_number`): both the extracted answer and the gold parse as a
plainly written number, and are then compared exactly as fractions:
  - integers and decimals, signed (`-42`, `+0.5`, `.5`, `\u22127`), with strict thousands
    commas (`1,234,567`, `1{,}000`) or thousands groups of spaces (`1 000`, `1\\,000`);
  - fractions `a/b`, `\\frac{a}{b}` (also `\\dfrac`, `\\tfrac`, signed parts, `\\frac34`);
  - wrapped whole: `$...$`, `\\$`, `{5}`, `(5)`, `\\left(5\\right)`, `\\mathbf{5}`,
    `\\text{5}`, a trailing `\\text{unit}` or unit words ("42 dollars"), a final period.
On these the fast path agrees with math-verify (tests/test_reward.py checks it on the
held-out arithmetic answers and the fixture datasets), except where math-verify misreads
plain notation: it reads `1 000` and `1\\,000` as 1 x 000 and rejects a final period
(`42.`); here they are 1000 and 42. Everything else (expressions, `5\\%`, mixed numbers,
anything with letters) goes to math-verify (`envs.reward`).

Equations (`equation_sides`): an answer written as an equation, `x = 18`, `19 = 18` or
`2 + 16 = 18`, is correct only if every side that is not a bare name (`x`, `a_n`,
`f(x)`, `\\theta`, `\\text{total}`) equals the ground truth. So a false equation scores 0
even when its last side is right (math-verify alone would compare only the right-hand
side: `19 = 18` would score 1 against 18), `x = 18` and `18 = 18` score 1, and an answer
of names only (`x = y`) scores 0. When the gold answer is itself an equation, math-verify
compares the two equations as before. Inequalities (`<=`, `\\geq`, `\\neq`) are not
equations: math-verify judges them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

TAIL_CHARS = 4096
"""Only the end of a completion is searched: the final answer is there, and the cost of a
1 MB completion stays that of a short one."""
MAX_NUMBER_DIGITS = 64
"""Longer digit strings are not read as numbers (no big-integer work on hostile input)."""

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_GSM8K_RE = re.compile(r"####[ \t]*([^\n]*)")
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(rf"(?<![\w.,/])(?:{_NUMBER})")
_HEDGE_WORD_RE = re.compile(r"\bor\b", re.IGNORECASE)
# "... 18 or 19" / "18, or 19": a number, "or", and then the last number.
_HEDGE_BEFORE_LAST_RE = re.compile(r"\d\s*,?\s*\bor\s*\$?\s*$", re.IGNORECASE)

_SIMPLE_RE = re.compile(
    r"(?P<sign>[+-]?)(?:"
    r"(?P<int>\d{1,3}(?:,\d{3})+|\d+)(?:\.(?P<frac>\d+))?"
    r"|\.(?P<frac_only>\d+)"
    r"|(?P<num>\d+)/(?P<den>\d+)"
    # \frac{a}{b}, \frac{-a}{b}, \frac{a}{-b}, and LaTeX's single-digit \frac34, \frac{12}3
    r"|\\[dt]?frac(?:\{(?P<lnum>-?\d+)\}|(?P<lnum1>\d))(?:\{(?P<lden>-?\d+)\}|(?P<lden1>\d))"
    r")"
)
# Wrappers around a whole number that leave its value alone: {5}, (5), \left(5\right),
# \mathbf{5}, \text{5}. Parentheses holding a comma are a tuple, not a number.
_WRAPPER_RES = (
    re.compile(r"\\(?:mathbf|textbf|text|mathrm|mbox)\s*\{([^{}]*)\}"),
    re.compile(r"\{([^{}]*)\}"),
    re.compile(r"\\left\s*\(([^(),]*)\\right\s*\)"),
    re.compile(r"\(([^(),]*)\)"),
)
# Digits grouped by spaces: only as thousands (1 000 000); "12 3" is not 123.
_SPACED_THOUSANDS_RE = re.compile(r"\d{1,3}(?: \d{3})+(?:\.\d+)?")
_TRAILING_UNIT_RE = re.compile(r"\s*\\(?:text|mbox|mathrm)\{\s*[A-Za-z][A-Za-z ]*\}$")
# "42 dollars", "7 apples per day": words of two or more letters after a space.
_TRAILING_WORDS_RE = re.compile(r"(?<=\d)\s+[A-Za-z]{2,}(?:\s+[A-Za-z]+)*\.?$")
_LATEX_SPACES = ("\\!", "\\,", "\\;", "\\:", "\\ ", "~")
_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


@dataclass(frozen=True)
class Extraction:
    answer: str | None
    """The extracted final answer, None when the text has none."""
    source: str | None
    """Which rule found it: "boxed", "####", "number" or None."""
    hedged: bool = False
    """The text commits to more than one answer; it is never rewarded."""


def to_text(value) -> str:
    """Model output as text: None -> "", bytes decoded as UTF-8 with invalid bytes replaced."""
    if value is None:
        return ""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, str):
        return value
    raise TypeError(f"expected str, bytes or None, got {type(value).__name__}")


def _matching_braces(text: str) -> dict[int, int]:
    """Map each `{` that is closed to its `}` (escaped `\\{`, `\\}` are not structural)."""
    pairs, stack, i, n = {}, [], 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            pairs[stack.pop()] = i
        i += 1
    return pairs


def boxed_answers(text: str) -> list[str]:
    """Contents of the balanced, outermost `\\boxed{}` / `\\fbox{}` of `text`, in order."""
    if "\\boxed" not in text and "\\fbox" not in text:
        return []
    pairs = _matching_braces(text)
    found, end = [], -1
    for m in _BOX_RE.finditer(text):
        open_at = m.end() - 1
        if open_at < end or open_at not in pairs:
            continue  # nested inside the previous box, or never closed (truncated output)
        end = pairs[open_at]
        found.append(text[open_at + 1 : end].strip())
    return found


def _squash(s: str) -> str:
    return "".join(s.split())


def _says_or(answer: str, allow_or: bool) -> bool:
    return not allow_or and bool(_HEDGE_WORD_RE.search(answer))


def extract_answer(text: str, allow_or: bool = False) -> Extraction:
    """The final answer of a completion, by the order documented in the module docstring.

    `allow_or`: the gold answer itself says "or", so the word does not mark a hedge.
    """
    tail = text[-TAIL_CHARS:]
    boxed = boxed_answers(tail)
    if boxed:
        answer = boxed[-1]
        # \boxed{\boxed{5}} -> 5
        while (m := _BOX_RE.match(answer)) and _matching_braces(answer).get(m.end() - 1) == len(answer) - 1:
            answer = answer[m.end() : -1].strip()
        hedged = len({_squash(b) for b in boxed}) > 1 or _says_or(answer, allow_or)
        return Extraction(answer, "boxed", hedged)
    gsm8k = _GSM8K_RE.findall(tail)
    if gsm8k and gsm8k[-1].strip():
        answer = gsm8k[-1].strip()
        return Extraction(answer, "####", _says_or(answer, allow_or))
    last = None
    for last in _NUMBER_RE.finditer(tail):
        pass
    if last is None:
        return Extraction(None, None)
    before = tail[max(0, last.start() - 40) : last.start()]
    hedged = not allow_or and bool(_HEDGE_BEFORE_LAST_RE.search(before))
    return Extraction(last.group(0), "number", hedged)


def _strip_wrappers(s: str) -> str:
    s = s.strip()
    for _ in range(3):
        before = s
        for left, right in _DELIMITERS:
            if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
                s = s[len(left) : len(s) - len(right)].strip()
        if s.startswith("\\$"):
            s = s[2:].strip()
        if s != before:
            continue
        break
    return s


_NOT_EQUATION_RE = re.compile(r"[<>!]=|=[<>]|\\(?:[lg]eq?|neq?)(?![A-Za-z])")
_NAME_RE = re.compile(
    r"\\?[A-Za-z]+(?:_\{?\w+\}?)?'*(?:\(\s*[A-Za-z]\s*\))?|\\text\s*\{[^{}]*\}"
)


def equation_sides(answer: str, gold: str) -> list[str] | None:
    """The sides of an equation answer that must each equal the truth (names left out),
    or None if `answer` is no equation or `gold` is one; see the module docstring."""
    if "=" not in answer or "=" in gold or _NOT_EQUATION_RE.search(answer):
        return None
    sides = (side.strip() for side in answer.replace(":=", "=").split("="))
    return [side for side in sides if side and not _NAME_RE.fullmatch(side)]


def parse_simple_number(s: str) -> Fraction | None:
    """The exact value of a plainly written number, or None if `s` is anything else."""
    if len(s) > 4 * MAX_NUMBER_DIGITS:
        return None
    if s.isascii() and s.isdigit():  # the common case, GSM8K-style integers
        return Fraction(int(s)) if len(s) <= MAX_NUMBER_DIGITS else None
    s = _strip_wrappers(s)
    s = _TRAILING_UNIT_RE.sub("", s)
    s = _TRAILING_WORDS_RE.sub("", s)
    for space in _LATEX_SPACES:
        s = s.replace(space, " ")
    s = s.replace("{,}", ",").replace("\u2212", "-").strip().rstrip(".").strip()
    for _ in range(3):
        unwrapped = next((m[1].strip() for r in _WRAPPER_RES if (m := r.fullmatch(s))), s)
        if unwrapped == s:
            break
        s = unwrapped
    if s.startswith("-\\$") or s.startswith("\\$"):
        s = s.replace("\\$", "", 1)
    if s[:1] and s[0] in "+-":
        s = s[0] + s[1:].lstrip()
    if " " in s:
        digits = s.lstrip("+-")
        if not _SPACED_THOUSANDS_RE.fullmatch(digits):
            return None
        s = s.replace(" ", "")
    m = _SIMPLE_RE.fullmatch(s)
    if m is None or sum(c.isdigit() for c in s) > MAX_NUMBER_DIGITS:
        return None
    sign = -1 if m["sign"] == "-" else 1
    if m["int"] is not None:
        value = Fraction(int(m["int"].replace(",", "")))
        if m["frac"]:
            value += Fraction(int(m["frac"]), 10 ** len(m["frac"]))
    elif m["frac_only"] is not None:
        value = Fraction(int(m["frac_only"]), 10 ** len(m["frac_only"]))
    else:
        if m["num"] is not None:
            num, den = m["num"], m["den"]
        else:
            num, den = m["lnum"] or m["lnum1"], m["lden"] or m["lden1"]
        if int(den) == 0:
            return None
        value = Fraction(int(num), int(den))
    return sign * value


def normalize_gold(gold) -> str:
    """A dataset's gold answer in the form `math_reward` compares against.

    GSM8K's "...#### 42" -> "42"; the last `\\boxed{...}` of a MATH solution -> its
    content; `$` delimiters and `\\$` stripped; strict thousands commas removed
    ("1,234" -> "1234", while "(1,2)" is left alone).
    """
    text = str(gold).strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip().split("\n", 1)[0].strip()
    else:
        boxed = boxed_answers(text)
        if boxed:
            text = boxed[-1]
    text = _strip_wrappers(text)
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", text):
        text = text.replace(",", "")
    return text
