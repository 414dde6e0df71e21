"""Final-answer extraction and the exact fast path, in-process and without sympy.

Model output is untrusted: everything here is linear-time string work on a bounded tail
of the text, and nothing is ever evaluated.

Extraction order (`extract_answer`), on the last `TAIL_CHARS` characters:
  1. the last balanced `\\boxed{...}` (or `\\fbox{...}`); two or more boxed answers
     that differ make the completion hedged;
  2. else the text after the last GSM8K `####`, up to the end of that line;
  3. else the last number (integer, strict thousands commas, decimal or `a/b`).
An answer saying "x or y" is hedged, and a hedged completion is never rewarded.

Fast path (`parse_simple_number`): both the extracted answer and the gold parse as an
integer, a strict thousands-comma number (1,234,567), a decimal, `a/b` or `\\frac{a}{b}`
(with `$`, `\\$`, LaTeX thin spaces, a trailing `\\text{unit}` and trailing unit words such
as "42 dollars" stripped); they are then compared exactly as fractions. Everything else
goes to math-verify (`envs.reward`).
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
    r"|\\[dt]?frac\{(?P<lnum>\d+)\}\{(?P<lden>\d+)\}"
    r")"
)
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
        s = s.replace(space, "")
    s = s.replace("{,}", ",").replace("\u2212", "-").replace(" ", "").rstrip(".")
    if s.startswith("-\\$") or s.startswith("\\$"):
        s = s.replace("\\$", "", 1)
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
        num, den = (m["num"], m["den"]) if m["num"] is not None else (m["lnum"], m["lden"])
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
