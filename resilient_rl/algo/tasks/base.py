"""Core task types shared by the built-in and jsonl tasks.

Pure Python (no torch, no numpy): rollout workers and the controller import this.
"""

from __future__ import annotations

import string
from abc import ABC, abstractmethod
from dataclasses import dataclass

# The policy is a char-level model, so every built-in prompt and answer must stay inside this alphabet.
VOCAB_CHARS: str = string.digits + string.ascii_lowercase + " +-=:?.,"


class TaskError(ValueError):
    """A task that cannot be built; ``str()`` names the offending file or spec field."""


@dataclass(frozen=True)
class Example:
    """One prompt of a task. ``index`` is its position in the task's prompt set (``0 <= index < len(task)``)."""

    index: int
    prompt: str
    answer: str


@dataclass(frozen=True)
class RewardResult:
    """A reward in ``[0, 1]``. ``error`` is set (and ``value`` is 0.0) when a user reward function failed."""

    value: float
    error: str | None = None


@dataclass(frozen=True)
class QuarantinedRow:
    """A dataset row that was skipped: ``file``, 1-based ``line`` and a human-readable ``reason``."""

    file: str
    line: int
    reason: str


class Task(ABC):
    """A finite, indexable prompt set plus a verifiable reward.

    Contract: ``example(i)`` is a pure function of the task's construction arguments and ``i`` (the same
    seed/file gives the same examples on every worker, after every restart); ``reward`` never raises for any
    completion string and always returns a value in ``[0, 1]``.
    """

    name: str
    quarantined: list[QuarantinedRow]

    def __init__(self, name: str) -> None:
        self.name = name
        self.quarantined = []

    @abstractmethod
    def __len__(self) -> int:
        """Number of examples in the prompt set (always >= 1)."""

    @abstractmethod
    def _make_example(self, index: int) -> Example:
        """Build example ``index``; the index is already range-checked."""

    @abstractmethod
    def reward(self, example: Example, completion: str) -> RewardResult:
        """Score ``completion`` for ``example``; never raises."""

    def example(self, index: int) -> Example:
        """Return example ``index``; raises ``IndexError`` outside ``[0, len(self))`` (no negative indexing:
        a negative index here is always a sampler bug, not a request for the tail)."""
        if not 0 <= index < len(self):
            raise IndexError(f"task {self.name!r}: example index {index} out of range [0, {len(self)})")
        return self._make_example(index)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, size={len(self)}, quarantined={len(self.quarantined)})"
