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
from controller.events import Kind

from ..errors import worker_cause
from .context import JobContext
from .faults import TrainerProbe

log = logging.getLogger(__name__)


class SnapshotFlow:
    """At most one snapshot in flight for one job; polled by the step loop. Every wait on the
    ranks here (the staging, the manifest write, a blocking poll) serves the rollout group
    meanwhile (``TrainerGroup.pump``): a rank slow to stage does not pause the rollouts."""

    def __init__(self, ctx: JobContext, trainers: Any) -> None:
        self.ctx = ctx
        self.actors = ctx.actors
        self.group = trainers  # a TrainerGroup: its ranks change when it restarts
        self.root = Path(ctx.workdir) / "snapshots"
        self.every = ctx.spec.checkpoint.every
        self.waits: list[Any] = []
        self.step: int | None = None
        self.blocking_s = 0.0

    def due(self, step: int) -> bool:
        """Whether :meth:`maybe_start` would start a snapshot at ``step`` (none in flight, a
        multiple of ``checkpoint.every``): the ranks must then not have moved past ``step``."""
        return not self.waits and step % self.every == 0

    def maybe_start(self, step: int) -> None:
        """Called after step ``step - 1`` was committed (the ranks are at ``step``)."""
        A = self.actors
        if not self.due(step):
            return
        calls = [A.call(t, "snapshot", str(self.root), self.ctx.token) for t in self.group.ranks]
        # a deadline, and the liveness probe: a frozen rank must not hold the step loop here (killed, the
        # loop sees it lost); the rollouts are served meanwhile (what that raises is the loop's, not the snapshot's)
        probe = TrainerProbe(self.ctx, self.group.ranks, f"the snapshot at step {step}", self.blocking_s)
        self.group.wait_all(calls, timeout=self.deadline_s(), probe=probe)
        try:
            started = A.get(calls, timeout=0)
        except Exception as e:  # a rank died or hangs while staging: no snapshot; the step loop sees it next
            self.ctx.event(Kind.SNAPSHOT_FAILED, f"snapshot at step {step} failed while staging: "
                           f"{type(worker_cause(e)).__name__}", step=step)  # fmt: skip
            return
        self.blocking_s = max(x["blocking_s"] for x in started)
        self.waits = [A.call(t, "wait_snapshot") for t in self.group.ranks]
        self.step = step

    def deadline_s(self) -> float:
        """How long a staging or a manifest write may take before the snapshot counts as failed."""
        return max(10.0, 4 * self.ctx.spec.fault.hang_timeout)

    def poll(self, block: bool = False) -> None:
        """Commit (or fail) the snapshot in flight once every rank's write has ended."""
        A = self.actors
        if not self.waits:
            return
        if block:
            self.group.wait_all(self.waits)
        elif A.wait(self.waits, num_returns=len(self.waits), timeout=0)[1]:
            return
        waits, step = self.waits, self.step
        self.waits, self.step = [], None
        assert step is not None
        spec = self.ctx.spec
        meta = {"policy_version": step, "spec_digest": spec.digest(), "backend": spec.checkpoint.backend}
        try:
            results = A.get(waits, timeout=0)
            errors = [x["error"] for x in results if not x["ok"]]
        except Exception as e:  # a rank died: this snapshot never commits
            errors = [f"{type(worker_cause(e)).__name__}: {str(worker_cause(e))[:300]}"]
        if not errors:
            call = A.call(self.group.ranks[0], "commit_snapshot", str(self.root), step, meta)
            probe = TrainerProbe(self.ctx, self.group.ranks[:1], f"the manifest of step {step}", self.blocking_s)
            # serving the rollouts (outside the try)
            self.group.wait_all([call], timeout=self.deadline_s(), probe=probe)
            try:
                info = A.get(call, timeout=0)
            except Exception as e:  # the manifest write failed or ran past its deadline
                errors = [f"{type(worker_cause(e)).__name__}: {str(worker_cause(e))[:300]}"]
        if errors:
            self.ctx.event(Kind.SNAPSHOT_FAILED, f"snapshot at step {step} failed: {errors[0]}", step=step)
            self._collect()
            return
        info.update(blocking_s=round(self.blocking_s, 4), seconds=round(max(x["total_s"] for x in results), 3))
        self.ctx.record_checkpoint(step, info)
        self.ctx.event(Kind.SNAPSHOT, f"snapshot at step {step} committed ({info['bytes']} bytes)", step=step)
        self._collect()

    def _collect(self) -> None:
        _retain(self.ctx, self.step)


def _retain(ctx: JobContext, in_flight: int | None = None) -> None:
    """Retention: forget all but the newest ``checkpoint.keep`` records, remove every other
    folder but the one of the snapshot ``in_flight``."""
    committed = [c["step"] for c in ctx.checkpoints()]
    keep = retained(committed, ctx.spec.checkpoint.keep) if committed else set()
    for step in set(committed) - keep:
        ctx.forget_checkpoint(step)
    if in_flight is not None:
        keep.add(in_flight)  # in flight: not garbage
    collect_garbage(Path(ctx.workdir) / "snapshots", keep)


def close_inflight(ctx: JobContext) -> list[int]:
    """At take-over: close every snapshot a previous leader left in flight (a folder without
    an etcd record), so none vanishes unrecorded. One whose manifest is there and verifies
    (the leader died between the manifest and its record) is committed now; any other
    (its writers were killed, or abandoned at adopt) is recorded ``snapshot_failed`` and
    collected. Call once the adopted ranks have no write in progress. Returns the steps
    committed here."""
    root = Path(ctx.workdir) / "snapshots"
    committed = {c["step"] for c in ctx.checkpoints()}
    done = []
    for step, path in list_snapshots(root):
        if step in committed:
            continue
        try:
            m = verify(path)
        except SnapshotCorrupt as e:
            ctx.event(Kind.SNAPSHOT_FAILED, f"snapshot at step {step} was left unfinished by the "
                           f"previous leader ({e}): collected", step=step, cause="take_over")  # fmt: skip
            continue
        ctx.record_checkpoint(step, {"step": step, "uri": str(m.path), "digest": m.digest, "bytes": m.bytes})
        ctx.event(Kind.SNAPSHOT, f"snapshot at step {step} committed ({m.bytes} bytes): complete "
                       "and verified, its record lost with the previous leader", step=step, cause="take_over")  # fmt: skip
        done.append(step)
    _retain(ctx)
    return done


def choose_restore(ctx: JobContext, at_step: int) -> tuple[str | None, int]:
    """The newest committed snapshot at or before ``at_step`` that verifies: ``(path, step)``.

    A snapshot that fails verification is skipped with an event (its record stays
    for the operator to see; retention removes it later); with none left, the
    trainer restarts from the initial weights and replays the whole journal.
    """
    for rec in sorted(ctx.checkpoints(), key=lambda c: -c["step"]):
        if rec["step"] > at_step:
            continue
        path = rec.get("uri") or str(snapshot_dir(Path(ctx.workdir) / "snapshots", rec["step"]))
        t0 = time.monotonic()
        try:
            m = verify(path)
        except SnapshotCorrupt as e:
            ctx.event(Kind.SNAPSHOT_CORRUPT, f"snapshot at step {rec['step']} does not verify: {e}; "
                           "falling back to the one before", step=rec["step"])  # fmt: skip
            continue
        if rec.get("digest") and m.digest != rec["digest"]:
            ctx.event(Kind.SNAPSHOT_CORRUPT, f"snapshot at step {rec['step']}: manifest digest "
                           "differs from the etcd record; falling back", step=rec["step"])  # fmt: skip
            continue
        log.info("job %s: restoring snapshot %s (verified in %.2fs)", ctx.job, path, time.monotonic() - t0)
        return path, int(rec["step"])
    return None, 0
