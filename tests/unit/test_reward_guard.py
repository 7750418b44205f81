"""The reward-error guard: a rate-limited event while user rewards fail, the job's failure
(naming the function) when too many samples of the window failed."""

from __future__ import annotations

from resilient_rl.job.reward_guard import RewardErrorWindow

FN = "reward function m:f"


def test_no_errors_no_event_no_failure() -> None:
    g = RewardErrorWindow(FN, max_rate=0.5, window=3)
    for k in range(10):
        v = g.observe(k, 0, 16, None, now=float(k))
        assert v.event is None and v.fail is None


def test_errors_raise_an_event_at_most_every_interval_with_the_count_since_the_last() -> None:
    g = RewardErrorWindow(FN, max_rate=1.0, window=3, event_every_s=30.0)
    v = g.observe(0, 2, 16, "ValueError: reward function returned inf, outside [0, 1]", now=0.0)
    assert v.fail is None and v.event is not None
    assert v.event.startswith(f"{FN}: 2 sample(s) scored 0") and "returned inf" in v.event
    assert g.observe(1, 3, 16, "x", now=10.0).event is None  # rate-limited
    assert g.observe(2, 0, 16, None, now=20.0).event is None
    later = g.observe(3, 1, 16, "y", now=31.0).event
    assert later is not None and "4 sample(s)" in later  # 3 + 1 held back, none lost


def test_the_job_fails_above_the_rate_over_the_window_naming_the_function() -> None:
    g = RewardErrorWindow(FN, max_rate=0.5, window=3)
    assert g.observe(0, 16, 16, "TimeoutError: t", now=0).fail is None  # the window is not full yet
    assert g.observe(1, 16, 16, "TimeoutError: t", now=1).fail is None
    fail = g.observe(2, 0, 16, None, now=2).fail  # 32 of 48 = 67% > 50%
    assert fail is not None and fail.startswith(f"{FN} failed on 32 of 48 samples (67%) over the last 3 steps")
    assert "task.max_reward_error_rate 0.5" in fail


def test_exactly_at_the_rate_goes_on_and_old_steps_leave_the_window() -> None:
    g = RewardErrorWindow(FN, max_rate=0.5, window=2)
    g.observe(0, 16, 16, "e", now=0)
    assert g.observe(1, 0, 16, None, now=1).fail is None  # 16 of 32 = 50%, not above
    assert g.observe(2, 0, 16, None, now=2).fail is None  # step 0 has left the window


def test_a_job_shorter_than_the_window_is_judged_over_its_length() -> None:
    g = RewardErrorWindow(FN, max_rate=0.5, window=10)
    assert g.observe(0, 16, 16, "e", now=0, min_steps=2).fail is None
    assert g.observe(1, 16, 16, "e", now=1, min_steps=2).fail is not None
