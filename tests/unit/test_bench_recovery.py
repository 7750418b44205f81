"""`bench recovery`'s ETTR against a fault-free reference run (pure functions over report dicts)."""

from __future__ import annotations

import pytest

from bench.recovery import (
    AFTER_S,
    REFERENCE_SKIP,
    TAIL_SETTLE_S,
    ettr_vs_reference,
    mttr_bounds,
    reference_step_s,
    speed_after,
    tail_step_s,
)


def _steps(times: list[float]) -> list[dict[str, float]]:
    return [{"step": i, "time": t, "step_seconds": 0.05} for i, t in enumerate(times)]


def test_the_reference_step_is_the_mean_time_between_commits_past_the_start_up() -> None:
    # a slow start-up (10 s for the first steps), then a commit every 0.1 s with a 0.5 s snapshot every 10th
    times, t = [], 0.0
    for i in range(REFERENCE_SKIP + 101):
        t += 10.0 if i < REFERENCE_SKIP else 0.1 + (0.5 if i % 10 == 0 else 0.0)
        times.append(t)
    got = reference_step_s({"steps": _steps(times)})
    assert got == pytest.approx(0.15, abs=1e-9)  # (100 x 0.1 + 10 x 0.5) / 100: the snapshots count, the start-up not


def test_a_reference_run_too_short_for_a_mean_is_refused() -> None:
    with pytest.raises(RuntimeError, match="too few"):
        reference_step_s({"steps": _steps([float(i) for i in range(REFERENCE_SKIP + 5)])})


def test_ettr_counts_the_commits_between_the_first_and_last_injection_against_the_reference() -> None:
    # a commit every 0.1 s for 100 s, except a 10 s stall from t=50: 900 commits in the window [0, 100)
    times = [i * 0.1 for i in range(500)] + [60 + i * 0.1 for i in range(400)]
    faults = [{"kind": "leader_kill", "injected_at": 0.0}, {"kind": "trainer_kill", "injected_at": 50.0},
              {"kind": "rollout_kill", "injected_at": 100.0}, {"kind": "rollout_kill", "status": "not fired"}]  # fmt: skip
    rep = {"steps": _steps(times), "faults": faults}
    assert ettr_vs_reference(rep, 0.1) == pytest.approx(0.9)
    assert ettr_vs_reference(rep, 0.2) == 1.0  # at most 1
    assert ettr_vs_reference({"steps": _steps(times), "faults": faults[:1]}, 0.1) is None  # no window


def test_the_tail_step_is_the_soaks_own_mean_step_from_a_settle_after_its_last_fault() -> None:
    # faults at 0 and 50; then a slow recovery (0.3 s a step) until 70, then 0.12 s a step to the end
    times = [i * 0.1 for i in range(500)] + [50 + i * 0.3 for i in range(1, 67)]
    times += [times[-1] + i * 0.12 for i in range(1, 301)]
    faults = [{"kind": "trainer_kill", "injected_at": 0.0}, {"kind": "rollout_kill", "injected_at": 50.0},
              {"kind": "rollout_kill", "status": "not fired"}]  # fmt: skip
    assert times[-301] < 50 + TAIL_SETTLE_S  # the slow stretch ends before the tail begins
    got = tail_step_s({"steps": _steps(times), "faults": faults})
    assert got == pytest.approx(0.12, abs=1e-9)
    assert tail_step_s({"steps": _steps(times[:600]), "faults": faults}) is None  # too few commits past the settle
    assert tail_step_s({"steps": _steps(times), "faults": faults[2:]}) is None  # no fault injected: no tail


def test_the_speed_after_a_fault_counts_its_stall_and_the_slower_steps_that_follow() -> None:
    # 0.1 s a step; a fault at 10 s stalls 3 s, then steps of 0.2 s for 10 s, then 0.1 s again
    times = [i * 0.1 for i in range(100)]  # to 9.9
    times += [13 + i * 0.2 for i in range(50)]  # 13.0 to 22.8
    times += [23 + i * 0.1 for i in range(300)]  # 23.0 to 52.9
    faults = [{"kind": "trainer_kill", "injected_at": 10.0}, {"kind": "rollout_kill", "status": "not fired"},
              {"kind": "leader_kill", "injected_at": 50.0}]  # fmt: skip
    got = speed_after({"steps": _steps(times), "faults": faults}, 0.1)
    # [10, 10 + AFTER_S): 50 slow commits + those of 0.1 s from 23 s: 17 s of them
    assert AFTER_S == 30.0
    assert got[0] == pytest.approx((50 + 170) * 0.1 / 30, abs=1e-3)  # 0.733: a 3 s stall and 10 s at half speed
    assert got[1] is None  # not injected
    assert got[2] == pytest.approx(30 * 0.1 / 30, abs=1e-3)  # 30 commits, then the run ends: the rest counts as lost


def test_the_100m_bound_is_given_with_the_hot_runs_step_and_with_the_cold_runs() -> None:
    """A hot run whose steps were slowed (a spare warming beside them) has a looser bound; the
    cold run's median step gives the stricter one, and each says how many kills are under it."""
    faults = [
        {"status": "injected", "detection_s": d, "next_commit_s": n} for d, n in ((1.4, 5.7), (1.5, 6.0), (2.0, 6.3))
    ]
    faults.append({"status": "not fired", "detection_s": None, "next_commit_s": None})
    runs = {
        "hot": {"faults": faults, "step_seconds": [4.0, 4.4, 4.5]},
        "cold": {"faults": [], "step_seconds": [3.6, 3.7, 3.8]},
    }
    got = mttr_bounds(runs, gbps=2.0, state_gb=1.0)  # 2 x 1 GB / 2 GB/s = 1 s to move the state
    assert got["median_step_s"] == 4.4 and got["bound_s"] == pytest.approx(1.5 + 4.4 + 1.0)
    assert got["under_bound"] == "3/3"
    assert got["cold_median_step_s"] == 3.7 and got["bound_cold_step_s"] == pytest.approx(1.5 + 3.7 + 1.0)
    assert got["under_bound_cold_step"] == "2/3"  # 6.3 > 6.2
    no_cold = mttr_bounds({"hot": runs["hot"]}, gbps=2.0, state_gb=1.0)
    assert no_cold["bound_cold_step_s"] is None and no_cold["under_bound_cold_step"] is None
