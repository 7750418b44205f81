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


def hangs_on_x(prompt: str, completion: str, answer: str) -> float:
    """Hangs for ever when the completion is "x"; prints (to check prints cannot garble replies)."""
    import time

    print("scoring", completion)
    while completion == "x":
        time.sleep(1)
    return 0.25


def dies_on_x(prompt: str, completion: str, answer: str) -> float:
    import os

    if completion == "x":
        os._exit(3)
    return 0.75


def always_inf(prompt: str, completion: str, answer: str) -> float:
    return float("inf")


def hangs_sometimes(prompt: str, completion: str, answer: str) -> float:
    """Hangs on about a quarter of the completions (by their characters), else 1 for a non-empty one."""
    import time

    while sum(map(ord, completion)) % 4 == 0:
        time.sleep(1)
    return 1.0 if completion.strip() else 0.0


def length_parity(prompt: str, completion: str, answer: str) -> float:
    """1 for a completion of odd length: about half the groups of two samples have no spread."""
    return float(len(completion) % 2)


def slow_parity(prompt: str, completion: str, answer: str) -> float:
    """``length_parity`` after 50 ms: rollouts slower than a tiny model's training step."""
    import time

    time.sleep(0.05)
    return float(len(completion) % 2)
