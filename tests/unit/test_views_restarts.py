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


def test_events_are_categorised_for_the_page_and_faults_get_their_path_and_mttr() -> None:
    from controller.http.views import annotate

    evs = [
        {"kind": "submitted", "time": 0.0}, {"kind": "snapshot", "time": 1.0},
        {"kind": "rollout_hang", "worker": 1, "time": 2.0, "detection_s": 5.1},
        {"kind": "rollout_fault", "worker": 1, "time": 2.1, "spare": "rrl:j:rollout-spare:0"},
        {"kind": "rollout_joined", "worker": 1, "time": 2.6},
        {"kind": "trainer_hang", "time": 3.0, "detection_s": 6.0},
        {"kind": "trainer_restart", "time": 3.1, "resize": False, "recovery": "hot"},
        {"kind": "trainer_recovered", "time": 4.1, "resize": False, "recovery": "hot"},
        {"kind": "scale", "time": 5.0}, {"kind": "rollout_joined", "worker": 2, "time": 6.0},
        {"kind": "trainer_restart", "time": 7.0, "resize": True}, {"kind": "trainer_recovered", "time": 8.0, "resize": True},
        {"kind": "recovered", "time": 8.5}, {"kind": "leader", "time": 9.0}, {"kind": "succeeded", "time": 10.0},
    ]  # fmt: skip
    rows = annotate([{**e, "seq": i} for i, e in enumerate(evs)])
    assert [r["category"] for r in rows] == [
        "job", "snapshot", "fault", "fault", "recovery", "fault", "fault", "recovery",
        "scaling", "scaling", "scaling", "scaling", "recovery", "recovery", "job",
    ]  # fmt: skip
    hang, kill, thang, restart = rows[2], rows[3], rows[5], rows[6]
    assert (kill["path"], kill["mttr_s"], hang["mttr_s"], hang["detection_s"]) == ("spare", 0.5, 0.6, 5.1)
    assert (restart["path"], restart["mttr_s"], thang["mttr_s"], thang["path"]) == ("hot", 1.0, 1.1, "hot")
    assert "mttr_s" not in rows[10]  # a resize is no fault
