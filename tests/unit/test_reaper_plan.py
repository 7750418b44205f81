"""Which Ray actors the leader stops: those of terminal jobs; rrl: actors of unknown jobs are
only reported; other names are not ours."""

from __future__ import annotations

from controller.jobs import JobRecord
from resilient_rl.job.reaper import parse_actor_name, plan


def rec(job: str, phase: str) -> JobRecord:
    return JobRecord(job, {"name": job}, {}, {"phase": phase})


def test_parse_actor_name() -> None:
    assert parse_actor_name("rrl:j-1:rollout:3") == ("j-1", "rollout", 3)
    for bad in ("rrl:j:rollout", "x:j:rollout:0", "rrl:j:rollout:x", "rrl:a:b:c:1", "plain"):
        assert parse_actor_name(bad) is None


def test_terminal_jobs_are_stopped_unknown_ones_reported_live_ones_kept() -> None:
    names = ["rrl:done:rollout:0", "rrl:done:trainer:1", "rrl:done:weights:0", "rrl:live:rollout:0",
             "rrl:ghost:trainer:0", "someone-else", "rrl:cancelled:rollout:17"]  # fmt: skip
    records = [rec("done", "SUCCEEDED"), rec("live", "RUNNING"), rec("cancelled", "CANCELLED")]
    stop, unknown = plan(names, records)
    assert stop == ["rrl:cancelled:rollout:17", "rrl:done:rollout:0", "rrl:done:trainer:1", "rrl:done:weights:0"]
    assert unknown == ["rrl:ghost:trainer:0"]
