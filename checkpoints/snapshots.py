"""The snapshot commit protocol on disk.

Layout under the snapshot root::

    step-0000000012/...             the engine's files (DCP or torchsnapshot), one folder per step
    step-0000000012/MANIFEST.json   written LAST: every file's sha256 + size, the caller's meta

The protocol, per snapshot:

1. every rank ``async_save``s into ``snapshot_dir(root, step)`` and training goes on;
2. every rank ``wait()``s (raises on a failed write), then the caller barriers;
3. rank 0 calls :func:`write_manifest`: it fsyncs every file, hashes it, and writes
   ``MANIFEST.json`` atomically. Only now is the snapshot committed.

A folder without ``MANIFEST.json`` is incomplete (a crash or failure before step 3)
and is garbage; a folder whose files do not match its manifest is corrupt
(:func:`verify` says which file). Restores use only verified, committed snapshots.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpoints.journal import atomic_write, fsync_dir, sha256

MANIFEST = "MANIFEST.json"
_STEP_DIR = re.compile(r"step-(\d{10,})")
_CHUNK = 8 << 20  # hash in chunks: snapshot files are GBs, journal.sha256 wants the whole bytes


class SnapshotCorrupt(Exception):
    """A snapshot is incomplete (no manifest) or does not match its manifest."""


@dataclass(frozen=True)
class Manifest:
    """A committed snapshot: ``files`` maps a path relative to ``path`` to ``{"sha256", "bytes"}``;
    ``digest`` is the sha256 of ``MANIFEST.json`` itself (to record the commit elsewhere)."""

    path: Path
    files: dict[str, dict[str, Any]]
    meta: dict[str, Any]
    bytes: int
    digest: str = field(default="")

    def body(self) -> dict[str, Any]:
        return {"files": self.files, "meta": self.meta, "bytes": self.bytes}


def snapshot_dir(root: str | Path, step: int) -> Path:
    """Where the snapshot taken after ``step`` lives."""
    if step < 0:
        raise ValueError(f"step {step} < 0")
    return Path(root) / f"step-{step:010d}"


def _hash_and_fsync(path: Path) -> tuple[str, int]:
    """sha256 and size of a file, fsynced on the way (one open, one pass)."""
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
        os.fsync(f.fileno())
    return h.hexdigest(), n


def _data_files(path: Path) -> list[Path]:
    """Every regular file under ``path`` but the manifest and its temp files, sorted."""
    out = []
    for p in sorted(path.rglob("*")):
        if p.is_symlink() or not p.is_file():
            continue
        if p.parent == path and (p.name == MANIFEST or p.name.startswith(f".{MANIFEST}.")):
            continue
        out.append(p)
    return out


def write_manifest(path: str | Path, meta: dict[str, Any]) -> Manifest:
    """Commit the snapshot in ``path``: fsync + hash every file, then write ``MANIFEST.json``
    atomically, last.

    Called by rank 0 only, after every rank's ``PendingSnapshot.wait()`` returned (the caller
    barriers: a file still being written would be hashed half-done). ``meta`` must be
    JSON-able (step, world size, backend, journal position...). Raises FileNotFoundError if
    ``path`` is not a folder, FileExistsError if it is already committed (a committed
    snapshot is immutable), OSError on I/O errors (then nothing is committed).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"snapshot folder {path} does not exist")
    if (path / MANIFEST).exists():
        raise FileExistsError(f"snapshot {path} is already committed")
    files: dict[str, dict[str, Any]] = {}
    total = 0
    data_files = _data_files(path)
    for p in data_files:
        digest, n = _hash_and_fsync(p)
        files[p.relative_to(path).as_posix()] = {"sha256": digest, "bytes": n}
        total += n
    # the file data is durable; make the folder entries durable too before the commit point
    for d in sorted({p.parent for p in data_files} | {path}, key=lambda d: len(d.parts), reverse=True):
        fsync_dir(d)
    fsync_dir(path.parent)
    m = Manifest(path, files, dict(meta), total)
    data = json.dumps(m.body(), sort_keys=True, indent=1).encode()
    atomic_write(path / MANIFEST, data)  # the commit point
    return Manifest(path, files, dict(meta), total, sha256(data))


def _read_manifest(path: Path) -> Manifest:
    try:
        data = (path / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise SnapshotCorrupt(f"snapshot {path}: no {MANIFEST} (incomplete snapshot)") from None
    except OSError as e:
        raise SnapshotCorrupt(f"snapshot {path}: {MANIFEST}: {e.strerror}") from None
    try:
        body = json.loads(data)
        files = {str(k): {"sha256": str(v["sha256"]), "bytes": int(v["bytes"])} for k, v in body["files"].items()}
        return Manifest(path, files, dict(body["meta"]), int(body["bytes"]), sha256(data))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SnapshotCorrupt(f"snapshot {path}: {MANIFEST} is malformed: {e}") from None


def read_manifest(path: str | Path) -> Manifest:
    """The manifest of a committed snapshot, files not checked (cheap). Raises :class:`SnapshotCorrupt`."""
    return _read_manifest(Path(path))


def verify(path: str | Path) -> Manifest:
    """Check every file the manifest lists (size, then sha256); return the manifest.

    Raises :class:`SnapshotCorrupt` naming the file: no manifest, a listed file missing,
    a size mismatch (truncated/extended) or a digest mismatch. Files the manifest does not
    list are ignored (they were never part of the commit). Reads every byte: for a
    restore, not for a listing.
    """
    path = Path(path)
    m = _read_manifest(path)
    for rel, want in m.files.items():
        f = path / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise SnapshotCorrupt(f"snapshot {path}: manifest names {rel!r}, outside the snapshot")
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            raise SnapshotCorrupt(f"snapshot {path}: file {rel} is missing") from None
        if size != want["bytes"]:
            raise SnapshotCorrupt(f"snapshot {path}: file {rel} has {size} bytes, manifest says {want['bytes']}")
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
        if h.hexdigest() != want["sha256"]:
            raise SnapshotCorrupt(f"snapshot {path}: file {rel} does not match its sha256 (corrupt)")
    return m


def is_committed(path: str | Path) -> bool:
    """Whether ``path`` has a manifest (cheap; says nothing about its files: see :func:`verify`)."""
    return (Path(path) / MANIFEST).is_file()


def list_snapshots(root: str | Path, committed_only: bool = False) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every snapshot folder under ``root``, oldest first, complete or
    not unless ``committed_only``. Other names under ``root`` are ignored."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.fullmatch(p.name)
        if m and p.is_dir() and not p.is_symlink() and (not committed_only or is_committed(p)):
            out.append((int(m.group(1)), p))
    return sorted(out)


def retained(committed_steps: Iterable[int], keep: int) -> set[int]:
    """The newest ``keep`` of ``committed_steps`` (what retention keeps). Raises ValueError if
    ``keep`` < 1: a job always keeps its newest commit."""
    if keep < 1:
        raise ValueError(f"keep={keep}: at least the newest snapshot must be kept")
    return set(sorted(set(committed_steps))[-keep:])


def _rmtree(p: Path) -> None:
    """``shutil.rmtree`` that lets files vanish under it: another process may be writing into
    the folder (a deposed leader's rank renaming its manifest's temporary file) or removing
    it too (two leaders' retention at a take-over). Seen as a job failing with
    ``FileNotFoundError: .MANIFEST.json.*.tmp`` in the driver tests."""
    for attempt in range(5):
        try:
            shutil.rmtree(p)
            return
        except OSError:  # FileNotFoundError: a file went meanwhile; ENOTEMPTY: one appeared
            if not p.exists():
                return
            if attempt == 4:
                raise


def collect_garbage(root: str | Path, keep_steps: set[int]) -> list[Path]:
    """Remove every snapshot folder under ``root`` whose step is not in ``keep_steps``
    (committed or not); return the removed folders. Never touches a folder in
    ``keep_steps`` nor anything not named like a snapshot folder.

    The caller passes the committed + retained set and must not call it while a snapshot
    it wants is still being written (its folder has no manifest yet: pass its step in
    ``keep_steps``). The manifest goes first (fsynced), so a crash mid-removal leaves an
    incomplete folder, never a committed one with files missing.
    """
    removed = []
    for step, p in list_snapshots(root):
        if step in keep_steps:
            continue
        manifest = p / MANIFEST
        try:
            if manifest.exists():
                manifest.unlink(missing_ok=True)
                fsync_dir(p)
        except FileNotFoundError:
            pass  # the folder went meanwhile
        _rmtree(p)
        removed.append(p)
    if removed:
        fsync_dir(Path(root))
    return removed
