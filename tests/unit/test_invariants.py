"""Each invariant of the chaos checker fails on its broken artefact and passes on a good one.

The artefacts are the plain records resilient_rl/chaos/artefacts.py reads from etcd,
the journal and the checkpoints; here they are built by hand (one good run of 4 steps,
then one thing broken at a time). The last tests feed the reader itself a real journal
folder and real snapshot folders with a damaged file.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from checkpoints.journal import Journal
from checkpoints.snapshots import write_manifest
from resilient_rl.chaos import invariants as inv
from resilient_rl.chaos.artefacts import checkpoint_views, journal_views, restored_after_damage
from resilient_rl.chaos.invariants import Artefacts, BatchView, CheckpointView, Write

N, PROMPTS, SAMPLES = 4, [[1, 2], [3, 4], [5, 6], [7, 8]], 2


def _state_writes(steps: list[int], leader: str = "c0", token: int = 10) -> list[Write]:
    return [
        Write("state", 100 + i, {"step": s, "policy_version": s, "phase": "RUNNING"}, leader, token)
        for i, s in enumerate(steps)
    ]


def _batch(k: int, version: int | None = None, prompts: list[int] | None = None) -> BatchView:
    ps = PROMPTS[k] if prompts is None else prompts
    v = k if version is None else version
    return BatchView(k, True, [0], [(p, s, v) for p in ps for s in range(SAMPLES)])


def good() -> Artefacts:
    return Artefacts(
        job="j",
        steps=N,
        samples_per_prompt=SAMPLES,
        max_staleness=1,
        final_state={"phase": "SUCCEEDED", "step": N, "weights_digest": "abc" * 10, "finished_at": 1000.0},
        state_writes=_state_writes([0, 0, 1, 2, 2, 3, 4, 4]),
        events=[Write("events/0", 101, {"seq": 0, "kind": "running", "leader": "c0"}, "c0", 10)],
        batches={k: _batch(k) for k in range(N)},
        expected_prompts={k: PROMPTS[k] for k in range(N)},
        checkpoints=[CheckpointView(2, {"step": 2}, None)],
        replay={"digest": "abc" * 10, "steps": N},
        restore={"step": 2, "digest": "abc" * 10},
        last_fault_end=900.0,
        settle_timeout_s=300.0,
    )


def _failed(a: Artefacts) -> dict[int, list[str]]:
    return {r.number: r.details for r in inv.check_all(a) if not r.ok}


def test_good_run_passes_every_invariant() -> None:
    results = inv.check_all(good())
    assert [r.number for r in results] == [1, 2, 3, 4, 5, 6, 7]
    assert all(r.ok for r in results), [r.to_dict() for r in results if not r.ok]


def test_gap_in_committed_steps() -> None:
    a = dataclasses.replace(good(), state_writes=_state_writes([0, 1, 3, 4]))
    bad = _failed(a)
    assert list(bad) == [1] and "jumped 1 -> 3" in bad[1][0]


def test_step_committed_twice() -> None:
    a = dataclasses.replace(good(), state_writes=_state_writes([0, 1, 2, 1, 2, 3, 4]))
    bad = _failed(a)
    assert list(bad) == [1]
    assert any("went back 2 -> 1" in d for d in bad[1]) and any("step 1 committed 2 times" in d for d in bad[1])


def test_job_short_of_n_steps() -> None:
    a = dataclasses.replace(good(), state_writes=_state_writes([0, 1, 2, 3]))
    assert any("final state step is 3" in d for d in inv.committed_steps(a.state_writes, N).details)


def test_policy_version_out_of_step() -> None:
    writes = _state_writes([0, 1, 2, 3, 4])
    writes[2] = dataclasses.replace(writes[2], value={"step": 2, "policy_version": 1})
    r = inv.committed_steps(writes, N)
    assert not r.ok and "policy_version 1 != step 2" in r.details[0]


def test_duplicate_prompt_in_a_batch() -> None:
    a = good()
    a.batches[2] = _batch(2, prompts=[5, 5])  # prompt 5 twice, prompt 6 never
    bad = _failed(a)
    assert list(bad) == [2]
    assert any("extra or duplicated: [(5, 0)" in d for d in bad[2]) and any("missing: [(6, 0)" in d for d in bad[2])


def test_missing_batch_and_digest_mismatch() -> None:
    a = good()
    a.batches[1] = BatchView(1, False)
    a.batches[3] = BatchView(3, True, [0], error="shard x: digest mismatch (file changed or corrupt)")
    details = _failed(a)[2]
    assert "step 1: no complete batch in the journal" in details
    assert any("step 3" in d and "digest mismatch" in d for d in details)


def test_replay_digest_mismatch_and_failure() -> None:
    assert _failed(dataclasses.replace(good(), replay={"digest": "other", "steps": N})).keys() == {3}
    r = inv.replay_equivalence(good().final_state, {"error": "JournalCorrupt: batch 2 is not complete"})
    assert not r.ok and "JournalCorrupt" in r.details[0]
    assert not inv.replay_equivalence(good().final_state, None).ok  # not run is not a pass


def test_checkpoint_that_does_not_verify() -> None:
    a = dataclasses.replace(good(), checkpoints=[CheckpointView(2, {}, "file x does not match its sha256 (corrupt)")])
    assert list(_failed(a)) == [4]


def test_checkpoint_that_does_not_restore_to_the_same_weights() -> None:
    a = dataclasses.replace(good(), restore={"step": 2, "digest": "zzz"})
    assert list(_failed(a)) == [4]
    a = dataclasses.replace(good(), restore={"step": 2, "error": "RuntimeError: bad shard"})
    assert list(_failed(a)) == [4]


def test_checkpoint_damaged_by_the_harness_is_exempt_unless_restored_from() -> None:
    damaged = CheckpointView(2, {}, "corrupt", damaged_by_harness=True)
    assert inv.checkpoints_verify([damaged], None, {}).ok
    used = dataclasses.replace(damaged, restored_after_damage=True)
    r = inv.checkpoints_verify([used], None, {})
    assert not r.ok and "restored from after it was damaged" in r.details[0]


def test_too_stale_trajectory() -> None:
    a = good()
    a.batches[3] = _batch(3, version=1)  # max_staleness 1: step 3 needs versions 2..3
    bad = _failed(a)
    assert list(bad) == [5] and "step 3: trained on versions [1]" in bad[5][0]
    a.batches[3] = _batch(3, version=4)  # from the future is wrong too
    assert list(_failed(a)) == [5]


def test_write_from_a_non_leader() -> None:
    a = good()
    # c1 wrote an event while c0 held the leader key at that revision
    a.events.append(Write("events/1", 150, {"seq": 1, "kind": "running", "leader": "c1"}, "c0", 10))
    bad = _failed(a)
    assert list(bad) == [6] and "written by c1, but c0 led" in bad[6][0]


def test_state_write_with_no_leader_and_stale_token() -> None:
    a = good()
    a.state_writes.append(Write("state", 200, {"step": 4, "policy_version": 4}, None, 0))
    assert list(_failed(a)) == [6]
    b = good()
    b.events.append(Write("events/1", 150, {"seq": 1, "kind": "leader", "leader": "c0", "token": 9}, "c0", 10))
    r = inv.leader_only_writes(b.state_writes, b.events)
    assert not r.ok and "fencing token 9" in r.details[0]


def test_state_write_by_a_deposed_leader_is_caught_by_its_writer_and_token() -> None:
    a = good()
    # c1's write landed while c0 held the leader key (fencing broken): named by the state itself
    a.state_writes.append(Write("state", 200, {"step": 5, "writer": "c1", "token": 7}, "c0", 10))
    bad = _failed(a)
    assert 6 in bad and "written by c1, but c0 led" in " ".join(bad[6])
    b = good()
    b.state_writes.append(Write("state", 200, {"step": 5, "writer": "c0", "token": 7}, "c0", 10))
    r = inv.leader_only_writes(b.state_writes, b.events)
    assert not r.ok and "fencing token 7" in r.details[0]
    c = good()
    c.state_writes.append(Write("state", 200, {"step": 5, "writer": "c0", "token": 10}, "c0", 10))
    assert inv.leader_only_writes(c.state_writes, c.events).ok


def test_unavailable_history_is_no_evidence_not_a_pass() -> None:
    a = dataclasses.replace(good(), history_error="etcd history unreadable (compacted)")
    assert set(_failed(a)) == {1, 6}


def test_unfinished_job() -> None:
    a = dataclasses.replace(good(), final_state={**good().final_state, "phase": "RUNNING"})
    bad = _failed(a)
    assert 7 in bad and "ended RUNNING" in bad[7][0]
    failed = {**good().final_state, "phase": "FAILED", "reason": "trainer group restarted 6 times"}
    assert "restarted 6 times" in inv.finishes(failed, None, 60).details[0]


def test_job_finishing_too_long_after_the_last_fault() -> None:
    a = dataclasses.replace(good(), last_fault_end=500.0, settle_timeout_s=300.0)
    bad = _failed(a)
    assert list(bad) == [7] and "500s after" in bad[7][0]


# --- the readers, on real files ---------------------------------------------------


def test_journal_reader_sees_digest_mismatch_and_missing_batch(tmp_path: Path) -> None:
    j = Journal(tmp_path / "journal")
    samples = [{"prompt_index": p, "sample": s, "version": 0} for p in PROMPTS[0] for s in range(SAMPLES)]
    ref = j.write_shard(0, 0, samples, {"version": 0})
    j.commit_batch(0, [ref])
    ref1 = j.write_shard(1, 0, samples, {"version": 1})
    j.commit_batch(1, [ref1])
    body = json.loads(Path(ref1.path).read_text())
    body["samples"][0]["sample"] = 1  # the file no longer matches its digest
    Path(ref1.path).write_text(json.dumps(body))
    views = journal_views(tmp_path / "journal", 3)
    assert views[0].error is None and views[0].samples[:2] == [(1, 0, 0), (1, 1, 0)]
    assert "digest mismatch" in str(views[1].error)
    assert not views[2].complete
    r = inv.journal_batches(views, {0: PROMPTS[0], 1: PROMPTS[0], 2: PROMPTS[0]}, SAMPLES, 3)
    assert not r.ok and len(r.details) == 2


def test_checkpoint_reader_verifies_real_snapshot_folders(tmp_path: Path) -> None:
    recs = []
    for step in (4, 8):
        folder = tmp_path / f"step-{step:010d}"
        folder.mkdir()
        (folder / "data.bin").write_bytes(bytes(range(256)) * 4)
        m = write_manifest(folder, {"step": step})
        recs.append({"step": step, "uri": str(folder), "digest": m.digest})
    views = checkpoint_views(recs, {}, [])
    assert [v.error for v in views] == [None, None]
    data = tmp_path / "step-0000000008" / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    recs[0]["digest"] = "0" * 64  # the etcd record no longer matches the manifest
    views = checkpoint_views(recs, {}, [])
    assert "manifest digest differs" in str(views[0].error) and "does not match its sha256" in str(views[1].error)
    assert not inv.checkpoints_verify(views, None, {}).ok


def test_restore_after_damage_is_told_apart_from_a_detected_one() -> None:
    t = time.time()
    detected = [
        {"kind": "trainer_restart", "time": t + 1},
        {"kind": "snapshot_corrupt", "time": t + 2, "step": 8},
        {"kind": "replay", "time": t + 3, "first": 4, "last": 9},
    ]
    assert not restored_after_damage(8, t, detected)
    silent = [{"kind": "trainer_restart", "time": t + 1}, {"kind": "replay", "time": t + 3, "first": 8, "last": 9}]
    assert restored_after_damage(8, t, silent)
    newer_first = [{"kind": "snapshot", "time": t + 1, "step": 12}, *silent]
    assert not restored_after_damage(8, t, newer_first)
