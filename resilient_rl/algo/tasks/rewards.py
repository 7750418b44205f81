"""Reward primitives: positional credit, exact / regex match, and user reward functions.

Every scorer here returns a value in ``[0, 1]`` and never raises on a completion: a reward that crashes a rollout
worker would turn one bad sample into a fault the controller has to recover from.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from collections.abc import Callable

from resilient_rl.algo.tasks.base import RewardResult, TaskError

RewardFn = Callable[[str, str, str], float]


def positional_credit(answer: str, completion: str) -> float:
    """Fraction of positions ``i`` with ``completion[i] == answer[i]``, over ``max(len(answer), len(completion))``.

    Dividing by the longer length makes both missing and extra characters cost. Trailing whitespace of the
    completion is stripped first (a model that pads or emits a newline is not penalised); leading whitespace is
    not, because it shifts every position and is a real error for a char-level model. Two empty strings score 1.
    """
    completion = completion.rstrip()
    denom = max(len(answer), len(completion))
    if denom == 0:
        return 1.0
    return sum(a == c for a, c in zip(answer, completion, strict=False)) / denom


def exact_match(answer: str, completion: str) -> float:
    """1.0 if the stripped completion equals the stripped answer, else 0.0."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


def regex_match(pattern: re.Pattern[str], completion: str) -> float:
    """1.0 if ``pattern`` fully matches the stripped completion, else 0.0."""
    return 1.0 if pattern.fullmatch(completion.strip()) is not None else 0.0


def load_reward_fn(ref: str | None) -> RewardFn:
    """Import ``module:function`` (the attribute may be dotted, e.g. ``module:Class.method``).

    Raises :class:`TaskError` naming ``task.reward_fn`` when the reference is malformed, the module cannot be
    imported (including errors raised while importing it), the attribute is missing, or it is not callable.
    """
    if not ref or ":" not in ref:
        raise TaskError(f"task.reward_fn: expected 'module:function', got {ref!r}")
    module_name, _, attr_path = ref.partition(":")
    if not module_name or not attr_path:
        raise TaskError(f"task.reward_fn: expected 'module:function', got {ref!r}")
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as e:  # any import-time failure (ImportError, SyntaxError, ...) is a config error
        raise TaskError(f"task.reward_fn: cannot import module {module_name!r}: {type(e).__name__}: {e}") from e
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise TaskError(f"task.reward_fn: {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(obj):
        raise TaskError(f"task.reward_fn: {ref!r} is not callable (got {type(obj).__name__})")
    return obj


def call_reward_fn(
    fn: RewardFn, prompt: str, completion: str, answer: str, on_error: Callable[[Exception], None] | None = None
) -> RewardResult:
    """Call a user reward function defensively.

    The raw completion is passed (the user decides how to normalise it). If the function raises, or
    returns a non-number, NaN, an infinity or a number outside ``[0, 1]``, the reward is ``0.0`` with
    ``error`` set to ``"<ExcType>: message"``: a reward of ``inf`` clamped to 1.0 would be a reward the
    policy learns to exploit, so a value out of range is the function's bug, not a high score. Nothing
    propagates except ``BaseException``s such as ``KeyboardInterrupt``. ``on_error`` is called
    with what the function raised (inside the ``except``: a traceback can be printed there).
    """
    try:
        raw = fn(prompt, completion, answer)
    except Exception as e:
        if on_error is not None:
            on_error(e)
        return RewardResult(0.0, error=f"{type(e).__name__}: {e}")
    return checked_value(raw)


def checked_value(raw: object, who: str = "reward function") -> RewardResult:
    """A scorer's raw value as a reward: a finite real number in [0, 1], else 0 with the error
    (see :func:`call_reward_fn`; reward servers' answers go through it too)."""
    # numbers.Real covers int, float, bool and numpy scalars; complex, str, None, tensors... are refused.
    if not isinstance(raw, numbers.Real):
        return RewardResult(0.0, error=f"TypeError: {who} returned {type(raw).__name__}, expected a number")
    value = float(raw)
    if math.isnan(value):
        return RewardResult(0.0, error=f"ValueError: {who} returned NaN")
    if not 0.0 <= value <= 1.0:
        return RewardResult(0.0, error=f"ValueError: {who} returned {value!r}, outside [0, 1]")
    return RewardResult(value)
