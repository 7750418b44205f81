"""Reward functions used by tests/unit/test_tasks.py through ``task.reward_fn: tests.unit.reward_fns:<name>``."""

from __future__ import annotations


def length_ratio(prompt: str, completion: str, answer: str) -> float:
    """len(completion) / len(answer): above 1 (an error) when the completion is longer."""
    return len(completion) / len(answer)


def always_raises(prompt: str, completion: str, answer: str) -> float:
    raise RuntimeError(f"boom on {completion!r}")


def returns_string(prompt: str, completion: str, answer: str) -> float:
    return "1.0"  # type: ignore[return-value]


def returns_nan(prompt: str, completion: str, answer: str) -> float:
    return float("nan")


def returns_inf(prompt: str, completion: str, answer: str) -> float:
    return float("inf")


def returns_minus_inf(prompt: str, completion: str, answer: str) -> float:
    return float("-inf")


def negative(prompt: str, completion: str, answer: str) -> float:
    return -3.0


NOT_CALLABLE = 42
