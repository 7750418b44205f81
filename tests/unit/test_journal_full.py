"""A full journal disk is JournalFull naming the folder and the free space, nothing half-written;
it crosses a process boundary (Ray pickles it) with its fields. Real small filesystem (tmpfs)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from checkpoints.journal import Journal, JournalFull


@pytest.mark.parametrize("small_disk", ["256k"], indirect=True)
def test_a_full_disk_is_journal_full_and_leaves_nothing(small_disk: Path) -> None:
    j = Journal(small_disk / "journal")
    j.write_shard(0, 0, [{"x": "a" * 1000}], {})
    with pytest.raises(JournalFull) as exc:
        j.write_shard(1, 0, [{"x": "b" * 400_000}], {})
    e = exc.value
    assert e.path == str(small_disk / "journal") and 0 <= e.free_mb < 0.3
    assert str(e).startswith(f"journal disk full at {small_disk / 'journal'}, ")
    assert not [p for p in (small_disk / "journal").rglob("*") if p.name.startswith(".")]  # no temp file left
    again = pickle.loads(pickle.dumps(e))
    assert isinstance(again, JournalFull) and again.path == e.path and again.free_mb == e.free_mb
