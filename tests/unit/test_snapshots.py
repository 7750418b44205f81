"""The snapshot commit protocol on disk: manifest last, verify names the bad file, GC keeps what it is told."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from checkpoints.journal import sha256
from checkpoints.snapshots import (
    MANIFEST,
    SnapshotCorrupt,
    collect_garbage,
    is_committed,
    list_snapshots,
    read_manifest,
    retained,
    snapshot_dir,
    verify,
    write_manifest,
)


def _fake_snapshot(root: Path, step: int, commit: bool = True) -> Path:
    """A folder shaped like an engine's output: a metadata file, data files, a nested folder."""
    d = snapshot_dir(root, step)
    (d / "0").mkdir(parents=True)
    (d / ".metadata").write_bytes(b"meta-%d" % step)
    (d / "__0_0.distcp").write_bytes(bytes(range(256)) * 40)
    (d / "0" / "shard").write_bytes(b"x" * 1000)
    if commit:
        write_manifest(d, {"step": step, "backend": "fake"})
    return d


def test_snapshot_dir_names_are_zero_padded(tmp_path: Path) -> None:
    assert snapshot_dir(tmp_path, 12) == tmp_path / "step-0000000012"
    with pytest.raises(ValueError):
        snapshot_dir(tmp_path, -1)


def test_write_manifest_lists_every_file_with_digest_and_size(tmp_path: Path) -> None:
    d = _fake_snapshot(tmp_path, 3, commit=False)
    assert not is_committed(d)
    m = write_manifest(d, {"step": 3, "world": 2})
    body = json.loads((d / MANIFEST).read_bytes())
    assert body["meta"] == {"step": 3, "world": 2}
    assert set(body["files"]) == {".metadata", "__0_0.distcp", "0/shard"}
    assert body["files"]["0/shard"] == {"sha256": sha256(b"x" * 1000), "bytes": 1000}
    assert body["bytes"] == sum(f["bytes"] for f in body["files"].values()) == m.bytes
    assert m.digest == sha256((d / MANIFEST).read_bytes())
    assert is_committed(d)
    assert read_manifest(d) == m
    assert verify(d) == m
    # no temp files are left next to the manifest
    assert [p.name for p in d.iterdir() if p.name.startswith(".MANIFEST")] == []


def test_a_committed_snapshot_is_immutable(tmp_path: Path) -> None:
    d = _fake_snapshot(tmp_path, 1)
    with pytest.raises(FileExistsError):
        write_manifest(d, {})
    with pytest.raises(FileNotFoundError):
        write_manifest(tmp_path / "nowhere", {})


def test_verify_catches_a_flipped_byte(tmp_path: Path) -> None:
    d = _fake_snapshot(tmp_path, 1)
    f = d / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[5000] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorrupt, match=r"__0_0\.distcp does not match its sha256"):
        verify(d)


def test_verify_catches_a_truncated_file(tmp_path: Path) -> None:
    d = _fake_snapshot(tmp_path, 1)
    with open(d / "0" / "shard", "r+b") as f:
        f.truncate(999)
    with pytest.raises(SnapshotCorrupt, match=r"0/shard has 999 bytes, manifest says 1000"):
        verify(d)


def test_verify_catches_a_missing_file_and_a_missing_or_bad_manifest(tmp_path: Path) -> None:
    d = _fake_snapshot(tmp_path, 1)
    (d / ".metadata").unlink()
    with pytest.raises(SnapshotCorrupt, match=r"\.metadata is missing"):
        verify(d)
    incomplete = _fake_snapshot(tmp_path, 2, commit=False)
    with pytest.raises(SnapshotCorrupt, match="no MANIFEST.json"):
        verify(incomplete)
    (incomplete / MANIFEST).write_text("{not json")
    with pytest.raises(SnapshotCorrupt, match="malformed"):
        verify(incomplete)
    (incomplete / MANIFEST).write_text(
        json.dumps({"files": {"../x": {"sha256": "0", "bytes": 0}}, "meta": {}, "bytes": 0})
    )
    with pytest.raises(SnapshotCorrupt, match="outside the snapshot"):
        verify(incomplete)


def test_verify_ignores_files_the_manifest_does_not_list(tmp_path: Path) -> None:
    d = _fake_snapshot(tmp_path, 1)
    (d / "stray.tmp").write_bytes(b"written after the commit")
    assert verify(d).meta["step"] == 1


def test_list_snapshots_sorts_by_step_and_ignores_other_names(tmp_path: Path) -> None:
    assert list_snapshots(tmp_path / "absent") == []
    for step, commit in [(20, True), (3, True), (7, False)]:
        _fake_snapshot(tmp_path, step, commit)
    (tmp_path / "step-12").mkdir()  # not 10 digits
    (tmp_path / "notes").mkdir()
    (tmp_path / "step-0000000099").write_text("a file, not a folder")
    assert [s for s, _ in list_snapshots(tmp_path)] == [3, 7, 20]
    assert list_snapshots(tmp_path, committed_only=True) == [
        (3, snapshot_dir(tmp_path, 3)),
        (20, snapshot_dir(tmp_path, 20)),
    ]


def test_retained_is_the_newest_keep_committed_steps() -> None:
    assert retained([5, 1, 9, 3], 2) == {5, 9}
    assert retained([5, 5, 1], 3) == {1, 5}
    assert retained([], 2) == set()
    with pytest.raises(ValueError):
        retained([1], 0)


def test_collect_garbage_keeps_exactly_the_requested_steps(tmp_path: Path) -> None:
    for step in [1, 2, 3, 4]:
        _fake_snapshot(tmp_path, step)
    _fake_snapshot(tmp_path, 5, commit=False)  # a crashed write
    _fake_snapshot(tmp_path, 6, commit=False)  # in flight: the caller keeps it
    (tmp_path / "other").mkdir()
    committed = [s for s, _ in list_snapshots(tmp_path, committed_only=True)]
    keep = retained(committed, 2) | {6}
    removed = collect_garbage(tmp_path, keep)
    assert sorted(removed) == [snapshot_dir(tmp_path, s) for s in (1, 2, 5)]
    assert [s for s, _ in list_snapshots(tmp_path)] == [3, 4, 6]
    assert (tmp_path / "other").is_dir()
    for s in (3, 4):
        verify(snapshot_dir(tmp_path, s))  # kept snapshots are untouched
    assert collect_garbage(tmp_path, {3, 4, 6}) == []
    assert collect_garbage(tmp_path, set()) == [snapshot_dir(tmp_path, s) for s in (3, 4, 6)]
    assert list_snapshots(tmp_path) == []


def test_garbage_collection_lets_files_vanish_under_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two leaders' retention at a take-over, or a deposed leader's rank renaming its manifest's
    temporary file, change a folder while it is removed: that is no error (it failed a job)."""
    import shutil

    from checkpoints import snapshots

    root = tmp_path / "snaps"
    for step in (1, 2):
        d = snapshots.snapshot_dir(root, step)
        d.mkdir(parents=True)
        (d / "data.bin").write_bytes(b"x")
    real = shutil.rmtree
    calls: list[Path] = []

    def racing(p: Any, *a: Any, **kw: Any) -> None:
        calls.append(Path(p))
        if len(calls) == 1:  # a file vanished mid-walk; the folder is still there: go round again
            raise FileNotFoundError(2, "No such file or directory", ".MANIFEST.json.x.tmp")
        if len(calls) == 2:  # the other remover finished first
            real(p)
            raise FileNotFoundError(2, "No such file or directory", str(p))
        real(p)

    monkeypatch.setattr(snapshots.shutil, "rmtree", racing)
    removed = snapshots.collect_garbage(root, set())
    assert sorted(p.name for p in removed) == ["step-0000000001", "step-0000000002"]
    assert not any(root.iterdir()) and len(calls) == 3
