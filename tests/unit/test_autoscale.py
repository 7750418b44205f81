"""The rollout autoscaler's policy (pure logic; the runner applies its sizes)."""

from __future__ import annotations

import pytest

from resilient_rl.job.autoscale import Autoscaler


def test_grows_on_sustained_backlog_up_to_max() -> None:
    a = Autoscaler(1, 3, 1, up_after=5, down_after=30, cooldown=20)
    assert a.observe(queued=4, idle=0, now=0) == 1
    assert a.observe(queued=4, idle=0, now=4.9) == 1  # not sustained long enough
    assert a.observe(queued=4, idle=0, now=5.0) == 2
    assert a.observe(queued=4, idle=0, now=15) == 2  # cooldown: the new worker is still starting
    assert a.observe(queued=4, idle=0, now=25) == 2  # cooled down; backlog timer restarts
    assert a.observe(queued=4, idle=0, now=30) == 3
    for t in range(31, 200, 5):
        assert a.observe(queued=9, idle=0, now=t) == 3  # never past max


def test_shrinks_on_sustained_idleness_down_to_min() -> None:
    a = Autoscaler(2, 4, 4, up_after=5, down_after=30, cooldown=20)
    assert a.observe(queued=0, idle=2, now=0) == 4
    assert a.observe(queued=0, idle=2, now=29) == 4
    assert a.observe(queued=0, idle=2, now=30) == 3
    assert a.observe(queued=0, idle=1, now=60) == 3  # cooled down; idleness timer restarts
    assert a.observe(queued=0, idle=1, now=90) == 2
    assert a.observe(queued=0, idle=2, now=500) == 2  # never below min


def test_a_busy_group_keeps_its_size() -> None:
    a = Autoscaler(1, 4, 2, up_after=1, down_after=1, cooldown=0)
    for t in range(100):  # work queued but workers free to take it, or no work and none idle
        assert a.observe(queued=1 if t % 2 else 0, idle=1 if t % 2 else 0, now=t) == 2


def test_backlog_interrupted_resets_the_timer() -> None:
    a = Autoscaler(1, 3, 1, up_after=5, down_after=60, cooldown=0)
    a.observe(queued=2, idle=0, now=0)
    a.observe(queued=0, idle=0, now=3)  # a worker caught up
    assert a.observe(queued=2, idle=0, now=6) == 1
    assert a.observe(queued=2, idle=0, now=11) == 2


def test_operator_scale_resets_within_bounds() -> None:
    a = Autoscaler(1, 3, 1)
    a.reset(10, now=0)
    assert a.size == 3
    a.reset(0, now=0)
    assert a.size == 1


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="min"):
        Autoscaler(3, 2, 2)
