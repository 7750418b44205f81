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


def test_a_late_group_or_claim_on_a_finished_shard_leaves_no_parts_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An owner and its helper share a shard: the one that writes the shard file removes the
    parts folder, and the other may still be writing into it. A write that lands after the
    removal is removed again; one whose folder goes under it is not written, and raises nothing.
    (Seen under load in CI, 2026-12-07: a helper's claim re-made the folder after the owner's
    drop_groups, and the batch's step kept a parts folder.)"""
    from checkpoints import journal

    j = Journal(tmp_path)
    group = {"worker": 0, "version": 1, "key": [0, 0, 1], "samples": [_sample(0)]}
    assert j.write_group(3, 0, 0, group) is True
    j.write_shard(3, 0, [_sample(0)], {})
    j.drop_groups(3, 0)  # the owner is done
    assert j.claim(3, 0, 1, "helper") is True  # the helper's claim, after the drop ...
    assert j.write_group(3, 0, 1, group) is True  # ... and its group
    assert not j.parts_dir(3, 0).exists()  # both removed again: the shard file holds the shard
    # the folder removed between a write's temporary file and its link: not written, no error
    real_link = journal.os.link

    def link_after_drop(src: str, dst: str) -> None:
        j.drop_groups(3, 0)
        real_link(src, dst)

    monkeypatch.setattr(journal.os, "link", link_after_drop)
    assert j.claim(3, 0, 2, "helper") is False and j.write_group(3, 0, 2, group) is False
    monkeypatch.undo()
    assert not j.parts_dir(3, 0).exists()
    # a shard not yet written keeps its parts (the owner's groups, a helper's claims)
    assert j.write_group(3, 1, 0, group) is True and j.claim(3, 1, 1, "helper") is True
    assert j.groups(3, 1) == {0: group} and j.claims(3, 1) == {1: "helper"}
