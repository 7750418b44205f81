"""The metrics log: written before each commit, read as one line per committed step in
commit order, whatever a killed or replaced leader left in it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from controller import steplog
from controller.election import NotLeader
from resilient_rl.job.runner import committable
from tests.helpers.fake_controller import FakeController, bare_runner


def test_read_keeps_the_first_line_of_each_committed_step_in_order(tmp_path: Path) -> None:
    p = tmp_path / "metrics.jsonl"
    # step 1 twice (a new leader committed it again), and a deposed runner's late copy of 0
    for row in ({"step": 0, "v": "a"}, {"step": 1, "v": "b"}, {"step": 1, "v": "b2"}, {"step": 2, "v": "c"},
                {"step": 0, "v": "late"}):  # fmt: skip
        steplog.append(p, row)
    with open(p, "ab") as f:
        f.write(b'{"step": 3, "v": "tor')  # a leader killed mid-line
    assert [(r["step"], r["v"]) for r in steplog.read(p)] == [(0, "a"), (1, "b"), (2, "c")]
    # step 2's line was written, its commit never happened (etcd says 2 steps are committed)
    assert [r["step"] for r in steplog.read(p, committed=2)] == [0, 1]
    assert steplog.read(tmp_path / "missing.jsonl") == []


class _CasWatcher(FakeController):
    """Notes how many metrics lines are on disk at each compare-and-swap; may die before it."""

    def __init__(self, log: Path, die_before_cas: bool = False) -> None:
        super().__init__()
        self.log, self.die = log, die_before_cas
        self.lines_at_cas: list[int] = []

    def update_state(self, job: str, expect: Any = None, **changes: Any) -> dict[str, Any]:
        self.lines_at_cas.append(len(steplog.read(self.log)))
        if self.die:
            raise NotLeader("killed between the line and the commit")
        return super().update_state(job, expect, **changes)


SHARDS = {0: {"tokens": 10, "reward_errors": 0, "version": 0, "samples": 8}}
R0 = {"reward_mean": 0.5, "loss": 0.1}


def test_a_commit_writes_its_line_first_and_a_leader_killed_between_leaves_one_line(tmp_path: Path) -> None:
    log = tmp_path / "metrics.jsonl"
    dying = _CasWatcher(log, die_before_cas=True)
    try:
        bare_runner(dying, tmp_path)._commit(0, R0, SHARDS, 1.0)
    except NotLeader:
        pass
    assert dying.lines_at_cas == [1]  # the line was on disk before the compare-and-swap
    assert dying.state["step"] == 0  # ... which never happened
    # the next leader commits step 0 again (commit_recovered / a replay), then step 1
    c = _CasWatcher(log)
    r = bare_runner(c, tmp_path)
    r._commit(0, R0, SHARDS, 1.0)
    r._commit(1, R0, SHARDS, 1.0)
    assert c.state["step"] == 2 and c.lines_at_cas == [1, 2]
    raw = [json.loads(x)["step"] for x in log.read_text().splitlines()]
    assert raw == [0, 0, 1]  # the repeat is in the file ...
    assert [m["step"] for m in steplog.read(log, committed=c.state["step"])] == [0, 1]  # ... read once


def test_commit_refuses_a_job_that_is_not_running() -> None:
    for phase in ("CANCELLED", "SUCCEEDED", "PENDING"):
        try:
            committable({"phase": phase, "step": 3}, 3)
        except NotLeader as e:
            assert f"job is {phase}" in str(e)
        else:
            raise AssertionError(f"committed in phase {phase}")
