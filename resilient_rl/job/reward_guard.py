"""The reward-error guard: what the leader does when user reward functions fail.

A reward function that raises, times out or returns something that is not a finite
number in ``[0, 1]`` scores the sample 0 with ``reward_error`` set (see
``tasks/rewards.py``). A few such samples are the user's business; many mean the
job is learning from a broken reward. Per committed step the runner feeds this guard
the step's error count; it answers with an event to raise (at most one per
``event_every_s``) and, when the error rate over the last ``window`` steps is above
``max_rate``, the reason the job fails.

Pure Python, no I/O: unit-tested directly.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class RewardVerdict:
    """``event``: a message for a ``reward_errors`` event, or None (none to raise now).
    ``fail``: the job's failure reason, or None (go on)."""

    event: str | None
    fail: str | None


class RewardErrorWindow:
    """Reward errors of the last ``window`` committed steps of one job (see module doc)."""

    def __init__(self, scorer: str, max_rate: float, window: int, event_every_s: float = 30.0) -> None:
        self.scorer = scorer  # names the reward function in every message
        self.max_rate = max_rate
        self.window = window
        self.event_every_s = event_every_s
        self._steps: deque[tuple[int, int]] = deque(maxlen=window)  # (errors, samples) per step
        self._last_event: float | None = None
        self._unreported = 0  # errors since the last event

    def observe(
        self, step: int, errors: int, samples: int, example: str | None, now: float, min_steps: int | None = None
    ) -> RewardVerdict:
        """Record step ``step``'s ``errors`` of ``samples``; ``example`` is one error's text.

        ``min_steps`` (default ``window``) is how many steps must be seen before the rate
        can fail the job (a job shorter than the window passes its length)."""
        self._steps.append((errors, max(samples, 1)))
        self._unreported += errors
        event = None
        if self._unreported and (self._last_event is None or now - self._last_event >= self.event_every_s):
            event = (
                f"{self.scorer}: {self._unreported} sample(s) scored 0 because the reward failed "
                f"(step {step}: {errors} of {samples}; e.g. {example})"
            )
            self._last_event, self._unreported = now, 0
        need = self.window if min_steps is None else min(self.window, min_steps)
        err, total = sum(e for e, _ in self._steps), sum(n for _, n in self._steps)
        fail = None
        if len(self._steps) >= need and err / total > self.max_rate:
            fail = (
                f"{self.scorer} failed on {err} of {total} samples ({err / total:.0%}) over the last "
                f"{len(self._steps)} steps, above task.max_reward_error_rate {self.max_rate:g} "
                f"(e.g. {example}); fix the function and resume"
            )
        return RewardVerdict(event, fail)
