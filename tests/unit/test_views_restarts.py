"""Restart counts of the worker rows, from the events: every replacement counted once,
whichever leader saw it (take-over included); a resize is not a restart."""

from __future__ import annotations

from controller.http.views import is_fault, restarts


def test_restart_counts_from_events() -> None:
    events = [
        {"kind": "rollout_hang", "worker": 0},  # detected as hung ...
        {"kind": "rollout_fault", "worker": 0},  # ... and replaced: one restart
        {"kind": "rollout_fault", "worker": 1, "cause": "take_over"},  # gone when a new leader took over
        {"kind": "trainer_restart", "resize": False, "cause": "take_over"},
        {"kind": "trainer_restart", "resize": False, "cause": "hang"},
        {"kind": "trainer_restart", "resize": True, "cause": "scale"},  # `rrl scale --trainer`
        {"kind": "trainer_restart", "message": "world size 2 -> 1 requested: restarting"},  # an old event
    ]
    assert restarts(events) == {("rollout", "0"): 1, ("rollout", "1"): 1, ("trainer", "*"): 2}
    assert [is_fault(e) for e in events[3:]] == [True, True, False, False]
