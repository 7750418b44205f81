"""What a new leader records of what the previous one left: snapshots in flight (committed if
complete and verified, else failed and collected), and faults that no commit followed yet
(their recovery is still recorded, by whichever leader commits next)."""

from __future__ import annotations

from pathlib import Path

from checkpoints.snapshots import snapshot_dir, write_manifest
from resilient_rl.job.checkpointing import close_inflight
from resilient_rl.job.faults import classify
from tests.helpers.fake_controller import FakeController
from tests.helpers.fake_controller import bare_runner as runner


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
    assert close_inflight(runner(c, tmp_path, checkpoint={"keep": 3}).ctx) == [6]
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
    close_inflight(runner(c, tmp_path, checkpoint={"keep": 2}).ctx)
    assert sorted(c.records) == [6, 9] and not snapshot_dir(root, 3).exists()


def test_a_fault_open_at_a_leader_change_gets_its_recovery_from_the_next_leader(tmp_path: Path) -> None:
    c = FakeController()
    old = runner(c, tmp_path)
    old.faults.detected(classify("rollout", cause="lost", worker=0))
    assert [f[0] for f in c.state["open_faults"]] == ["rollout_fault"]  # in etcd, not only in memory
    # the old leader dies; the new runner loads the open faults (as _run does) and commits
    new = runner(c, tmp_path)
    new.faults.load(c.state)  # as _run does
    new._commit(0, {"reward_mean": 0.5, "loss": 0.1}, {0: {"tokens": 1, "reward_errors": 0, "version": 0}}, 1.0)
    new.faults.committed(0)
    assert c.state["open_faults"] == [] and c.state["step"] == 1
    rec = [d for k, _, d in c.events if k == "recovered"]
    assert len(rec) == 1 and rec[0]["fault"] == "rollout_fault" and rec[0]["seconds"] >= 0
