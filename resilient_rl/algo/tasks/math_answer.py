"""Final answers of math problems: extraction and equivalence (``task.reward: math``).

A completion (or a reference answer written as a worked solution, GSM8K style) states its final
answer in one of three ways, tried in this order: the last ``\\boxed{...}`` (balanced braces,
as MATH-style solutions do), the text after the last ``####`` (GSM8K), else the last number in
the text. Two answers are equivalent when both read as numbers (``1,000``, ``$5``, ``0.5``,
``1/2``, ``50%`` is not a number here) that are equal within 1e-6 relative, else when their
normalised strings (whitespace, ``$``, a trailing period and ``\\text{}``/``\\left``/``\\right``
dropped) are equal. Pure Python; never raises on any input.
"""

from __future__ import annotations

import re
from fractions import Fraction

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
    return _normalise(reference) == _normalise(answer) != ""


def math_reward(answer: str, completion: str) -> float:
    """1.0 if the completion's final answer is equivalent to the reference's, else 0.0. The
    reference may be a bare answer or a worked solution; a completion stating no answer scores 0."""
    ref = extract_answer(answer, last_number=False)
    if ref is None:
        ref = answer.strip()
    got = extract_answer(completion)
    return 1.0 if got is not None and equivalent(ref, got) else 0.0
