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
        # the message is never read: a resize says so in its field, whatever its text
        {"kind": "trainer_restart", "resize": True, "message": "rank lost: restarting"},
    ]
    assert restarts(events) == {("rollout", "0"): 1, ("rollout", "1"): 1, ("trainer", "*"): 2}
    assert [is_fault(e) for e in events[3:]] == [True, True, False, False]


def test_every_kind_the_driver_writes_is_a_declared_kind() -> None:
    """The event kinds are one enum (controller/events.py): the log refuses any other, and
    every kind named in the driver's code is one of them."""
    import re

    import pytest

    from controller.events import Kind
    from tests.conftest import REPO

    with pytest.raises(ValueError):
        Kind("rollout_fualt")
    named = set()
    for p in [*(REPO / "resilient_rl" / "job").glob("*.py"), REPO / "controller" / "service.py"]:
        named |= set(re.findall(r"Kind\.([A-Z_]+)", p.read_text()))
    assert len(named) >= 25 and named <= set(Kind.__members__)
