"""The leader's side of trainer snapshots: start, commit, retain, choose one to restore.

Commit protocol (a snapshot is visible only once every step has happened):

1. at a step boundary every rank stages its state and starts an async write
   (``TrainerRank.snapshot``; training resumes at once);
2. every rank reports its write finished (``wait_snapshot``, beside training);
3. rank 0 fsyncs and digests every file and writes ``MANIFEST.json`` last;
4. the leader records ``jobs/{job}/checkpoints/{step}`` and ``state.checkpoint``
   in etcd (fenced). Only now does the snapshot exist for a restore.

A write that fails (disk full, ...) raises an event; its folder never gets a
manifest and is collected. Retention keeps the newest ``checkpoint.keep``
committed snapshots; folders without an etcd record are garbage and are
collected too. The journal is kept whole (``rrl verify`` replays from step 0).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from checkpoints.snapshots import SnapshotCorrupt, collect_garbage, list_snapshots, retained, snapshot_dir, verify

from ..errors import worker_cause

log = logging.getLogger(__name__)


class SnapshotFlow:
    """At most one snapshot in flight for one job; polled by the step loop."""

    def __init__(self, runner: Any, trainers: Any) -> None:
        self.r = runner
        self.group = trainers  # a TrainerGroup: its ranks change when it restarts
        self.root = Path(runner.workdir) / "snapshots"
        self.every = runner.spec.checkpoint.every
        self.waits: list[Any] = []
        self.step: int | None = None
        self.blocking_s = 0.0

    def maybe_start(self, step: int) -> None:
        """Called after step ``step - 1`` was committed (the ranks are at ``step``)."""
        import ray

        if self.waits or step % self.every:
            return
        try:
            # a deadline: a frozen rank must not hold the step loop here (the loop's hang check catches it)
            started = ray.get([t.snapshot.remote(str(self.root), self.r.token) for t in self.group.ranks],
                              timeout=self.deadline_s())  # fmt: skip
        except Exception as e:  # a rank died or hangs while staging: no snapshot; the step loop sees it next
            self.r.c.event(self.r.job, "snapshot_failed", f"snapshot at step {step} failed while staging: "
                           f"{type(worker_cause(e)).__name__}", step=step)  # fmt: skip
            return
        self.blocking_s = max(x["blocking_s"] for x in started)
        self.waits = [t.wait_snapshot.remote() for t in self.group.ranks]
        self.step = step

    def deadline_s(self) -> float:
        """How long a staging or a manifest write may take before the snapshot counts as failed."""
        return max(10.0, 4 * self.r.spec.fault.hang_timeout)

    def poll(self, block: bool = False) -> None:
        """Commit (or fail) the snapshot in flight once every rank's write has ended."""
        import ray

        if not self.waits:
            return
        _, pending = ray.wait(self.waits, num_returns=len(self.waits), timeout=None if block else 0)
        if pending:
            return
        waits, step = self.waits, self.step
        self.waits, self.step = [], None
        assert step is not None
        meta = {"policy_version": step, "spec_digest": self.r.spec.digest(), "backend": self.r.spec.checkpoint.backend}
        try:
            results = ray.get(waits)
            errors = [x["error"] for x in results if not x["ok"]]
            if not errors:
                info = ray.get(self.group.ranks[0].commit_snapshot.remote(str(self.root), step, meta),
                               timeout=self.deadline_s())  # fmt: skip
        except Exception as e:  # a rank died or the manifest write failed: this snapshot never commits
            errors = [f"{type(worker_cause(e)).__name__}: {str(worker_cause(e))[:300]}"]
        if errors:
            self.r.c.event(self.r.job, "snapshot_failed", f"snapshot at step {step} failed: {errors[0]}", step=step)
            self._collect()
            return
        info.update(blocking_s=round(self.blocking_s, 4), seconds=round(max(x["total_s"] for x in results), 3))
        self.r.c.record_checkpoint(self.r.job, step, info)
        self.r.c.event(self.r.job, "snapshot", f"snapshot at step {step} committed ({info['bytes']} bytes)", step=step)
        self._collect()

    def _collect(self) -> None:
        _retain(self.r, self.step)


def _retain(runner: Any, in_flight: int | None = None) -> None:
    """Retention: forget all but the newest ``checkpoint.keep`` records, remove every other
    folder but the one of the snapshot ``in_flight``."""
    committed = [c["step"] for c in runner.c.checkpoints(runner.job)]
    keep = retained(committed, runner.spec.checkpoint.keep) if committed else set()
    for step in set(committed) - keep:
        runner.c.forget_checkpoint(runner.job, step)
    if in_flight is not None:
        keep.add(in_flight)  # in flight: not garbage
    collect_garbage(Path(runner.workdir) / "snapshots", keep)


def close_inflight(runner: Any) -> list[int]:
    """At take-over: close every snapshot a previous leader left in flight (a folder without
    an etcd record), so none vanishes unrecorded. One whose manifest is there and verifies
    (the leader died between the manifest and its record) is committed now; any other
    (its writers were killed, or abandoned at adopt) is recorded ``snapshot_failed`` and
    collected. Call once the adopted ranks have no write in progress. Returns the steps
    committed here."""
    root = Path(runner.workdir) / "snapshots"
    committed = {c["step"] for c in runner.c.checkpoints(runner.job)}
    done = []
    for step, path in list_snapshots(root):
        if step in committed:
            continue
        try:
            m = verify(path)
        except SnapshotCorrupt as e:
            runner.c.event(runner.job, "snapshot_failed", f"snapshot at step {step} was left unfinished by the "
                           f"previous leader ({e}): collected", step=step, cause="take_over")  # fmt: skip
            continue
        runner.c.record_checkpoint(runner.job, step, {"step": step, "uri": str(m.path), "digest": m.digest,
                                                      "bytes": m.bytes})  # fmt: skip
        runner.c.event(runner.job, "snapshot", f"snapshot at step {step} committed ({m.bytes} bytes): complete "
                       "and verified, its record lost with the previous leader", step=step, cause="take_over")  # fmt: skip
        done.append(step)
    _retain(runner)
    return done


def choose_restore(runner: Any, at_step: int) -> tuple[str | None, int]:
    """The newest committed snapshot at or before ``at_step`` that verifies: ``(path, step)``.

    A snapshot that fails verification is skipped with an event (its record stays
    for the operator to see; retention removes it later); with none left, the
    trainer restarts from the initial weights and replays the whole journal.
    """
    for rec in sorted(runner.c.checkpoints(runner.job), key=lambda c: -c["step"]):
        if rec["step"] > at_step:
            continue
        path = rec.get("uri") or str(snapshot_dir(Path(runner.workdir) / "snapshots", rec["step"]))
        t0 = time.monotonic()
        try:
            m = verify(path)
        except SnapshotCorrupt as e:
            runner.c.event(runner.job, "snapshot_corrupt", f"snapshot at step {rec['step']} does not verify: {e}; "
                           "falling back to the one before", step=rec["step"])  # fmt: skip
            continue
        if rec.get("digest") and m.digest != rec["digest"]:
            runner.c.event(runner.job, "snapshot_corrupt", f"snapshot at step {rec['step']}: manifest digest "
                           "differs from the etcd record; falling back", step=rec["step"])  # fmt: skip
            continue
        log.info("job %s: restoring snapshot %s (verified in %.2fs)", runner.job, path, time.monotonic() - t0)
        return path, int(rec["step"])
    return None, 0
