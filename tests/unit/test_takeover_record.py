"""What a new leader records of what the previous one left: snapshots in flight (committed if
complete and verified, else failed and collected), and faults that no commit followed yet
(their recovery is still recorded, by whichever leader commits next)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from checkpoints.snapshots import snapshot_dir, write_manifest
from resilient_rl.checkpointing import close_inflight
from resilient_rl.reward_guard import RewardErrorWindow
from resilient_rl.runner import JobRunner
from resilient_rl.spec import parse_spec


class FakeController:
    """The controller's fenced record as the runner uses it (state, checkpoints, events)."""

    def __init__(self) -> None:
        self.id = "c2"
        self.state: dict[str, Any] = {"phase": "RUNNING", "step": 0}
        self.records: dict[int, dict[str, Any]] = {}
        self.events: list[tuple[str, str, dict[str, Any]]] = []
        self.election = type("E", (), {"is_leader": True})()

    def checkpoints(self, job: str) -> list[dict[str, Any]]:
        return [self.records[s] for s in sorted(self.records)]

    def record_checkpoint(self, job: str, step: int, info: dict[str, Any]) -> None:
        self.records[step] = {**info, "step": step}

    def forget_checkpoint(self, job: str, step: int) -> None:
        del self.records[step]

    def event(self, job: str, kind: str, message: str, **data: Any) -> None:
        self.events.append((kind, message, data))

    def update_state(self, job: str, expect: Any = None, **changes: Any) -> dict[str, Any]:
        if expect is not None:
            expect(self.state)
        self.state.update(changes)
        return self.state


def runner(c: FakeController, workdir: Path, **spec: Any) -> JobRunner:
    r = object.__new__(JobRunner)  # no thread, no Ray: the record-keeping only
    r.c, r.job, r.workdir, r.reward_errors, r.faults = c, "j", workdir, 0, []
    r.spec = parse_spec({"name": "j", "model": {"init": {}}, **spec})
    r.rewards = RewardErrorWindow("task.reward exact", 0.5, 10)
    r._stop = threading.Event()
    return r


def _snapshot(root: Path, step: int, complete: bool) -> Path:
    p = snapshot_dir(root, step)
    p.mkdir(parents=True)
    (p / "rank0.bin").write_bytes(b"x" * 100)
    if complete:
        write_manifest(p, {"step": step})
    return p


def test_snapshots_left_in_flight_are_committed_or_failed_never_silently_gone(tmp_path: Path) -> None:
    c = FakeController()
    root = tmp_path / "snapshots"
    c.record_checkpoint("j", 3, {"uri": str(_snapshot(root, 3, True))})
    orphan = _snapshot(root, 6, True)  # manifest written, the leader died before its etcd record
    half = _snapshot(root, 9, False)  # writers killed mid-write
    assert close_inflight(runner(c, tmp_path, checkpoint={"keep": 3})) == [6]
    assert sorted(c.records) == [3, 6] and c.records[6]["uri"] == str(orphan)
    kinds = [(k, d.get("step")) for k, _, d in c.events]
    assert kinds == [("snapshot", 6), ("snapshot_failed", 9)]
    assert "previous leader" in c.events[1][1] and not half.exists() and orphan.exists()


def test_retention_applies_to_what_the_take_over_committed(tmp_path: Path) -> None:
    c = FakeController()
    root = tmp_path / "snapshots"
    for s in (3, 6):
        c.record_checkpoint("j", s, {"uri": str(_snapshot(root, s, True))})
    _snapshot(root, 9, True)
    close_inflight(runner(c, tmp_path, checkpoint={"keep": 2}))
    assert sorted(c.records) == [6, 9] and not snapshot_dir(root, 3).exists()


def test_a_fault_open_at_a_leader_change_gets_its_recovery_from_the_next_leader(tmp_path: Path) -> None:
    c = FakeController()
    old = runner(c, tmp_path)
    old._fault("rollout_fault")
    assert [f[0] for f in c.state["open_faults"]] == ["rollout_fault"]  # in etcd, not only in memory
    # the old leader dies; the new runner loads the open faults (as _run does) and commits
    new = runner(c, tmp_path)
    new.faults = [(str(k), float(t)) for k, t in c.state["open_faults"]]
    new._commit(0, {"reward_mean": 0.5, "loss": 0.1}, {0: {"tokens": 1, "reward_errors": 0, "version": 0}}, 1.0)
    new._note_recoveries(0)
    assert c.state["open_faults"] == [] and c.state["step"] == 1
    rec = [d for k, _, d in c.events if k == "recovered"]
    assert len(rec) == 1 and rec[0]["fault"] == "rollout_fault" and rec[0]["seconds"] >= 0
