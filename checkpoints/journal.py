"""The durable rollout journal: one file per shard, one manifest per complete batch.

Layout under the journal root::

    step-00000012/shard-0003-<digest>.json  a shard's trajectories (written by a rollout worker)
    step-00000012/parts-0003/g-0005.json   one finished prompt group of shard 3 (position 5)
    step-00000012/batch.json          the batch manifest: every shard's file + digest

A worker journals each prompt group of its shard as soon as the group is finished and
scored (``write_group``: first writer wins, so a zombie's late copy, which may differ, is
refused); a shard generated again after its worker was lost keeps the groups already
there and generates only the rest. The shard file, written once every group is in,
holds them all and is what batches point to; its ``parts-`` folder is then removed. Once a
batch is complete, every ``parts-`` folder of its step is removed too, and a group or claim
written after that (a helper's or a zombie's, late) removes its folder again: no step's
folder keeps parts once its batch is complete, whoever wrote last.

Every file is written atomically (temp file in the same folder, fsync,
``os.replace``, fsync of the folder), so a reader sees either nothing or the
whole file. A shard is referred to by :class:`ShardRef` (path + sha256 digest);
readers verify the digest and raise :class:`JournalCorrupt` on mismatch, so
unverified data is never trained on. A batch is complete once its manifest is
written; the trainer reads batches by manifest, which is what makes replay
after a trainer fault possible without regenerating anything.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


class JournalCorrupt(Exception):
    """A journal file is missing, unreadable or does not match its digest."""


class JournalFull(OSError):
    """The journal's disk is full (or over quota): nothing was written. ``path`` is the
    journal root, ``free_mb`` what its device has left. The job pauses until space is back."""

    def __init__(self, path: str | Path, free_mb: float) -> None:
        super().__init__(errno.ENOSPC, f"journal disk full at {path}, {free_mb:.1f} MB free")
        self.path, self.free_mb = str(path), free_mb

    def __str__(self) -> str:
        return f"journal disk full at {self.path}, {self.free_mb:.1f} MB free"

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray's process boundary with its fields
        return (JournalFull, (self.path, self.free_mb))


_FULL = (errno.ENOSPC, errno.EDQUOT)


def free_mb(path: str | Path) -> float:
    """Free space of the device holding ``path`` (its nearest existing folder), in MB."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free / 1e6


@dataclass(frozen=True)
class ShardRef:
    """Where a shard lives and what it must hash to."""

    step: int
    shard: int
    path: str
    digest: str
    samples: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _durable_temp(path: Path, data: bytes) -> str:
    """``data`` in a new fsynced temporary file beside ``path``; returns its name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old file or the new one."""
    tmp = _durable_temp(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_create(path: Path, data: bytes) -> bool:
    """Like :func:`atomic_write`, but only if ``path`` does not exist yet (hard link of a
    complete temporary file: atomic and exclusive). True if this call created it."""
    tmp = _durable_temp(path, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    fsync_dir(path.parent)
    return True


def fsync_dir(path: str | Path) -> None:
    """fsync a folder, so that entries created or renamed in it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Journal:
    """The rollout journal of one job, rooted at a folder every worker can reach."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def step_dir(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def write_shard(self, step: int, shard: int, samples: list[dict[str, Any]], meta: dict[str, Any]) -> ShardRef:
        """Durably write one shard; returns its reference.

        Files are named by content (``shard-{i}-{digest[:16]}.json``): a shard generated
        again (a retry after a fault, a worker a new leader re-dispatched) lands in a
        file of its own and never changes one a complete batch already points to; the
        batch manifest decides which one counts.
        """
        data = json.dumps({"step": step, "shard": shard, "meta": meta, "samples": samples}).encode()
        digest = sha256(data)
        path = self.step_dir(step) / f"shard-{shard:04d}-{digest[:16]}.json"
        self._write(atomic_write, path, data)
        return ShardRef(step, shard, str(path), digest, len(samples))

    def parts_dir(self, step: int, shard: int) -> Path:
        return self.step_dir(step) / f"parts-{shard:04d}"

    def write_group(self, step: int, shard: int, pos: int, body: dict[str, Any]) -> bool:
        """Durably write prompt group ``pos`` of a shard (its samples and who made them), unless
        a group is there already: first writer wins. True if this call wrote it."""
        payload = json.dumps(body, sort_keys=True)
        data = json.dumps({"sha256": sha256(payload.encode()), "body": payload}).encode()
        return self._write_part(step, shard, f"g-{pos:04d}.json", data)

    def groups(self, step: int, shard: int) -> dict[int, dict[str, Any]]:
        """The finished groups of a shard, by position, digests verified. A group file that does
        not verify (a torn disk, a tampered file) is removed, so it is generated again."""
        out: dict[int, dict[str, Any]] = {}
        d = self.parts_dir(step, shard)
        try:
            names = sorted(os.listdir(d))
        except FileNotFoundError:
            return out
        for n in names:
            if not (n.startswith("g-") and n.endswith(".json")):
                continue  # a temporary file of a write in progress
            try:
                outer = json.loads((d / n).read_bytes())
                payload = outer["body"]
                if sha256(payload.encode()) != outer["sha256"]:
                    raise ValueError("digest mismatch")
                out[int(n[2:-5])] = dict(json.loads(payload))
            except FileNotFoundError:
                continue  # removed under us: the shard is complete
            except (OSError, ValueError, KeyError, TypeError):
                (d / n).unlink(missing_ok=True)
        return out

    def claim(self, step: int, shard: int, pos: int, who: str) -> bool:
        """Claim group ``pos`` of a shard for worker ``who`` before generating it (first claim wins), so
        that two workers on one shard (an owner and its helper) do not both generate it. A claim is a
        promise, not data: ``release`` drops a lost worker's, and a journaled group needs none."""
        return self._write_part(step, shard, f"c-{pos:04d}", who.encode())

    def _write_part(self, step: int, shard: int, name: str, data: bytes) -> bool:
        """Create a file in a shard's ``parts-`` folder, first writer wins. The folder may be
        removed under the write (its shard or batch completed): the write is tried once more.
        Written after the step's batch was complete (a late helper, a zombie), it is swept
        at once: the batch is what counts, and it never changes."""
        path = self.parts_dir(step, shard) / name
        try:
            made = bool(self._write(atomic_create, path, data))
        except FileNotFoundError:  # the folder went between its mkdir and the link
            made = bool(self._write(atomic_create, path, data))
        if (self.step_dir(step) / "batch.json").exists():
            self.sweep_parts(step)
        return made

    def claims(self, step: int, shard: int) -> dict[int, str]:
        """The shard's claims: position -> who."""
        out: dict[int, str] = {}
        d = self.parts_dir(step, shard)
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            return out
        for n in names:
            if n.startswith("c-") and not n.endswith(".tmp"):
                try:
                    out[int(n[2:])] = (d / n).read_text()
                except (FileNotFoundError, ValueError):
                    continue
        return out

    def release(self, step: int, shard: int, who: str) -> int:
        """Drop ``who``'s claims on a shard (it was lost, or stopped); returns how many."""
        n = 0
        for pos, w in self.claims(step, shard).items():
            if w == who:
                (self.parts_dir(step, shard) / f"c-{pos:04d}").unlink(missing_ok=True)
                n += 1
        return n

    def shard_written(self, step: int, shard: int) -> bool:
        """Whether a shard file of ``shard`` is in step ``step``'s folder (by anyone)."""
        return any(self.step_dir(step).glob(f"shard-{shard:04d}-*.json"))

    def drop_group(self, step: int, shard: int, pos: int) -> None:
        (self.parts_dir(step, shard) / f"g-{pos:04d}.json").unlink(missing_ok=True)

    def drop_groups(self, step: int, shard: int) -> None:
        """Remove a shard's group files once its shard file holds them (idempotent)."""
        shutil.rmtree(self.parts_dir(step, shard), ignore_errors=True)

    def sweep_parts(self, step: int) -> None:
        """Remove every ``parts-`` folder of a step (its batch is complete; idempotent)."""
        for d in self.step_dir(step).glob("parts-*"):
            shutil.rmtree(d, ignore_errors=True)

    def _write(self, how: Any, path: Path, data: bytes) -> Any:
        """``how(path, data)``; a full disk is :class:`JournalFull` (the temporary file is gone)."""
        try:
            return how(path, data)
        except OSError as e:
            if e.errno in _FULL:
                raise JournalFull(self.root, free_mb(self.root)) from None
            raise

    def read_shard(self, ref: ShardRef | dict[str, Any]) -> dict[str, Any]:
        """Read and verify a shard. Raises :class:`JournalCorrupt`."""
        r = ref if isinstance(ref, ShardRef) else ShardRef(**ref)
        try:
            data = Path(r.path).read_bytes()
        except OSError as e:
            raise JournalCorrupt(f"shard {r.path}: {e.strerror}") from None
        if sha256(data) != r.digest:
            raise JournalCorrupt(f"shard {r.path}: digest mismatch (file changed or corrupt)")
        return dict(json.loads(data))

    def commit_batch(self, step: int, refs: list[ShardRef], meta: dict[str, Any] | None = None) -> bool:
        """Record batch ``step`` as complete (all its shards, in shard order).

        First writer wins: a batch, once complete, never changes (the trainer may have
        trained on it, and replay must see the same one). Returns False, changing
        nothing, when the batch was already complete (e.g. written by a previous
        leader that woke up late).
        """
        refs = sorted(refs, key=lambda r: r.shard)
        if [r.shard for r in refs] != list(range(len(refs))):
            raise ValueError(f"batch {step}: shards {[r.shard for r in refs]} are not 0..n-1")
        body = {"step": step, "shards": [r.to_dict() for r in refs], "meta": meta or {}}
        path = self.step_dir(step) / "batch.json"
        won = bool(self._write(atomic_create, path, json.dumps(body).encode()))
        self.sweep_parts(step)  # a late helper's or a lost worker's leftovers: the batch holds what counts
        return won

    def batch(self, step: int) -> list[ShardRef] | None:
        """The shard references of a complete batch, or None if the batch is not complete."""
        path = self.step_dir(step) / "batch.json"
        try:
            body = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise JournalCorrupt(f"batch manifest {path}: {e}") from None
        return [ShardRef(**d) for d in body["shards"]]

    def read_batch(self, step: int) -> list[dict[str, Any]]:
        """Every sample of a complete batch, in (shard, position) order, digests verified."""
        refs = self.batch(step)
        if refs is None:
            raise JournalCorrupt(f"batch {step} is not complete in {self.root}")
        samples: list[dict[str, Any]] = []
        for r in refs:
            samples.extend(self.read_shard(r)["samples"])
        return samples
