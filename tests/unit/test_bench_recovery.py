"""`bench recovery`'s ETTR against a fault-free reference run (pure functions over report dicts)."""

from __future__ import annotations

import pytest

from bench.recovery import REFERENCE_SKIP, ettr_vs_reference, reference_step_s


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
