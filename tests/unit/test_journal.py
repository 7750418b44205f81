"""The rollout journal: shards by digest, complete batches written once."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpoints.journal import Journal, JournalCorrupt


def _sample(i: int) -> dict[str, object]:
    return {"prompt_index": i, "sample": 0, "token_ids": [1, 2], "reward": 0.5}


def test_a_complete_batch_is_written_once_first_writer_wins(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    first = [j.write_shard(0, 0, [_sample(1)], {"worker": 0}), j.write_shard(0, 1, [_sample(2)], {"worker": 0})]
    assert j.commit_batch(0, first) is True
    # a late leader completes the same step with other shard files: refused, nothing changes
    late = [j.write_shard(0, 0, [_sample(7)], {"worker": 1}), j.write_shard(0, 1, [_sample(8)], {"worker": 1})]
    assert j.commit_batch(0, late) is False
    assert j.batch(0) == first
    assert [s["prompt_index"] for s in j.read_batch(0)] == [1, 2]
    assert not [p for p in j.step_dir(0).iterdir() if p.name.endswith(".tmp")]  # no temporary left behind


def test_batch_needs_shards_0_to_n_minus_1(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    ref = j.write_shard(3, 1, [_sample(1)], {})
    with pytest.raises(ValueError, match="not 0..n-1"):
        j.commit_batch(3, [ref])
    assert j.batch(3) is None


def test_a_tampered_shard_is_caught_on_read(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    ref = j.write_shard(0, 0, [_sample(1)], {})
    assert j.commit_batch(0, [ref])
    shard_file = next(p for p in j.step_dir(0).iterdir() if p.name.startswith("shard"))
    shard_file.write_bytes(shard_file.read_bytes().replace(b"0.5", b"0.9"))
    with pytest.raises(JournalCorrupt):
        j.read_batch(0)


def test_a_prompt_group_is_journaled_once_first_writer_wins_and_a_corrupt_one_is_dropped(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    mine = {"worker": 0, "version": 3, "key": [7, 0, 2], "samples": [{"reward": 1.0}, {"reward": 0.0}]}
    zombie = {**mine, "worker": 1, "samples": [{"reward": 0.5}]}  # a late copy that differs
    assert j.write_group(4, 1, 0, mine) is True
    assert j.write_group(4, 1, 0, zombie) is False  # refused: the first writer's stays
    assert j.groups(4, 1) == {0: mine}
    assert j.write_group(4, 1, 2, zombie) is True
    assert sorted(j.groups(4, 1)) == [0, 2] and j.groups(4, 2) == {}
    # a torn or tampered group file does not verify: it is removed, to be generated again
    path = j.parts_dir(4, 1) / "g-0002.json"
    path.write_bytes(path.read_bytes().replace(b"0.5", b"0.9"))
    assert j.groups(4, 1) == {0: mine} and not path.exists()
    assert j.write_group(4, 1, 2, mine) is True
    j.drop_groups(4, 1)
    assert j.groups(4, 1) == {} and not j.parts_dir(4, 1).exists()
    j.drop_groups(4, 1)  # idempotent


def test_a_complete_batch_sweeps_its_steps_parts_and_a_late_group_or_claim_leaves_none(tmp_path: Path) -> None:
    """A helper's claim or group that lands after the owner dropped its parts (a race seen under
    load) re-made the ``parts-`` folder; once the batch is complete, nothing keeps it."""
    j = Journal(tmp_path)
    g = {"worker": 0, "version": 0, "key": [0, 0, 1], "samples": [{"reward": 1.0}]}
    assert j.write_group(2, 0, 0, g) and j.claim(2, 1, 3, "1")  # shard 0's group, shard 1's claim
    j.write_group(3, 0, 0, g)  # another step's, not swept by step 2's batch
    ref = j.write_shard(2, 0, g["samples"], {})
    assert j.commit_batch(2, [ref]) is True
    assert not j.parts_dir(2, 0).exists() and not j.parts_dir(2, 1).exists() and j.parts_dir(3, 0).exists()
    # late: a helper's group and claim after the batch; written (first writer), then swept at once
    assert j.write_group(2, 0, 1, g) is True and j.claim(2, 0, 2, "1") is True
    assert not any(p.name.startswith("parts-") for p in j.step_dir(2).iterdir())
    assert j.batch(2) == [ref]  # the batch is untouched
    # a batch committed a second time (a late leader) is refused and sweeps again
    j.write_group(2, 1, 0, g)
    assert j.commit_batch(2, [ref]) is False and not j.parts_dir(2, 1).exists()
