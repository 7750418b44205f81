"""Final answers of math problems: extraction and equivalence (``task.reward: math``).

A completion (or a reference answer written as a worked solution, GSM8K style) states its final
answer in one of three ways, tried in this order: the last ``\\boxed{...}`` (balanced braces,
as MATH-style solutions do), the text after the last ``####`` (GSM8K), else the last number in
the text. Two answers are equivalent when both read as numbers (``1,000``, ``$5``, ``0.5``,
``1/2``, ``50%`` is not a number here) that are equal within 1e-6 relative, else when their
normalised strings (whitespace, ``$``, a trailing period and ``\\text{}``/``\\left``/``\\right``
dropped) are equal, else when math-verify (Hugging Face's symbolic checker, on sympy) finds
them equal: ``\\frac{\\sqrt{2}}{2}`` and ``\\frac{1}{\\sqrt{2}}``, ``\\pi/2`` and ``\\frac{\\pi}{2}``,
sets in any order. It runs in-process with its signal timeouts
off (they only work in a main thread), so it is given only what it decides quickly: both
answers at most 200 characters, no power, factorial or run of over 30 digits (``9^{9^{9}}``
would hold the scorer for ever). Never raises on any input.
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction
from functools import cache
from typing import Any

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_LATEX_FRAC = re.compile(r"^\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}")


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unbalanced: no answer stated


def extract_answer(text: str, last_number: bool = True) -> str | None:
    """The final answer stated in ``text`` (see module doc), or None when it states none.
    ``last_number=False``: no fallback to the last number (for a reference answer, which is
    the whole text when it has neither a box nor a ``####``: ``x+1`` is not ``1``)."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    if not last_number:
        return None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normalise(s: str) -> str:
    s = _TEXT.sub(r"\1", s)
    for junk in ("\\left", "\\right", "\\!", "\\,", "\\;", "$", " "):
        s = s.replace(junk, "")
    return s.rstrip(".").strip()


def _as_number(s: str) -> Fraction | None:
    s = _normalise(s)
    m = _LATEX_FRAC.match(s)
    if m:
        s = f"{m.group(1)}/{m.group(2)}"
    if not _NUMBER.fullmatch(s):
        return None
    try:
        return Fraction(s.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def equivalent(reference: str, answer: str) -> bool:
    """Whether two extracted answers say the same thing (see module doc)."""
    a, b = _as_number(reference), _as_number(answer)
    if a is not None and b is not None:
        return a == b or abs(a - b) <= Fraction(1, 10**6) * max(abs(a), abs(b))
    return _normalise(reference) == _normalise(answer) != "" or _symbolic(reference, answer)


_SLOW = re.compile(r"\^|\*\*|!|\d{31}")  # what could make sympy compute for ever: powers, factorials, huge numbers


@cache
def _math_verify() -> Any:
    """math-verify's (parse, verify), or None when it is not installed (then only the rules above apply)."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled", once per call
    return parse, verify


def _symbolic(reference: str, answer: str) -> bool:
    """math-verify's equivalence of two short answers (see the module doc); False when unsure."""
    mv = _math_verify()
    if mv is None or not reference or not answer or len(reference) > 200 or len(answer) > 200:
        return False
    if _SLOW.search(reference) or _SLOW.search(answer):
        return False
    parse, verify = mv
    try:
        gold = parse(f"${reference}$", parsing_timeout=None)
        got = parse(f"${answer}$", parsing_timeout=None)
        return bool(gold) and bool(got) and bool(verify(gold, got, timeout_seconds=None))
    except Exception:  # noqa: BLE001 - an answer it cannot read is not equivalent
        return False


def math_reward(answer: str, completion: str) -> float:
    """1.0 if the completion's final answer is equivalent to the reference's, else 0.0. The
    reference may be a bare answer or a worked solution; a completion stating no answer scores 0."""
    ref = extract_answer(answer, last_number=False)
    if ref is None:
        ref = answer.strip()
    got = extract_answer(completion)
    return 1.0 if got is not None and equivalent(ref, got) else 0.0
