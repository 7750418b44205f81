"""Goodput, defined once (controller/goodput.py): ETTR since the first step and over the last
hour, live up to now (a stall shows) and fixed once the job has ended; lost work; time in
recovery as the union of the faults' spans; the chaos report computes ETTR the same way."""

from __future__ import annotations

from controller import goodput
from controller.http.views import annotate
from resilient_rl.chaos import measure

SPEC = {"prompts_per_step": 8, "rollout": {"replicas": 2, "sampling": {"n": 4}}}


def _points(times: list[float], step_s: float = 1.0) -> list[dict[str, float]]:
    return [{"step": i + 1, "time": t, "step_seconds": step_s} for i, t in enumerate(times)]


def test_ettr_since_start_and_last_hour_live_and_ended() -> None:
    pts = _points([float(t) for t in range(1, 11)])  # 10 steps of 1 s, the first started at 0
    g = goodput.live(pts, [], SPEC, {"phase": "RUNNING"}, now=10.0)
    assert (g["ettr"], g["ettr_last_hour"], g["fault_free_step_s"], g["committed"]) == (1.0, 1.0, 1.0, 10)
    stalled = goodput.live(pts, [], SPEC, {"phase": "RUNNING"}, now=20.0)  # nothing committed for 10 s
    assert stalled["ettr"] == 0.5
    ended = goodput.live(pts, [], SPEC, {"phase": "SUCCEEDED", "finished_at": 10.0}, now=5000.0)
    assert ended["ettr"] == 1.0  # an ended job's wall ends with it
    late = goodput.live(_points([1.0, 2.0, 4000.0, 4001.0]), [], SPEC, {"phase": "RUNNING"}, now=4001.0)
    assert late["ettr_last_hour"] == round(2 / 3600, 4) and late["ettr"] == round(4 / 4001, 4)
    assert goodput.live([], [], SPEC, {"phase": "PENDING"}, now=1.0)["ettr"] is None


def test_lost_work_and_time_in_recovery() -> None:
    evs = annotate([{**e, "seq": i} for i, e in enumerate([
        {"kind": "rollout_hang", "worker": 0, "time": 10.0},
        {"kind": "rollout_fault", "worker": 0, "time": 11.0},
        {"kind": "rollout_joined", "worker": 0, "time": 14.0},  # the hang's span 10-14 holds the kill's 11-14
        {"kind": "trainer_restart", "resize": False, "recovery": "cold", "time": 20.0},
        {"kind": "replay", "first": 4, "last": 6, "time": 21.0},
        {"kind": "trainer_recovered", "resize": False, "time": 22.5},
    ])])  # fmt: skip
    g = goodput.live(_points([1.0]), evs, SPEC, {"phase": "RUNNING"}, now=30.0)
    assert g["faults"] == 3 and g["recovery_s"] == 4.0 + 2.5
    assert g["steps_replayed"] == 3 and g["samples_regenerated_est"] == 2 * 16  # two shards of 8 x 4 / 2


def test_samples_regenerated_are_counted_exactly_where_the_next_worker_said_so() -> None:
    """A lost shard whose groups were partly journaled: its ``shard_resumed`` event says how many
    samples were generated again; a fault without one (a take-over's) still counts its shard whole."""
    evs = [{"kind": "rollout_fault", "worker": 0, "time": 10.0, "seq": 0},
           {"kind": "shard_resumed", "kept": 10, "regenerated": 6, "time": 12.0, "seq": 1},
           {"kind": "rollout_fault", "worker": 1, "time": 20.0, "seq": 2}]  # fmt: skip
    assert goodput.lost(evs, 16)["samples_regenerated_est"] == 6 + 16


def test_the_chaos_report_uses_the_same_definition() -> None:
    metrics = [{"step": i, "time": float(i + 1), "step_seconds": 1.0} for i in range(10)]
    metrics[5]["time"] = 30.0  # a slow step after a fault
    for m in metrics[6:]:
        m["time"] += 24.0
    rep = measure.goodput({}, metrics)
    assert rep["ettr"] == goodput.ettr(10, goodput.fault_free_step_s([1.0] * 10), metrics[-1]["time"]) == 0.2941
