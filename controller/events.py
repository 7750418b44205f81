"""The bounded per-job event log (``jobs/{job}/events/{seq}``), written by the leader.

Events are what an operator reads after the fact: faults, detections,
recoveries, scaling, leader changes. Each append is a fenced txn that also
checks that the sequence number is new, so two leaders can never interleave
or overwrite entries. The log keeps the newest ``MAX_EVENTS``.
"""

from __future__ import annotations

import json
import time
from enum import StrEnum
from typing import Any

from . import keys
from .election import Election
from .store import Compare, Delete, Put, Store

MAX_EVENTS = 2000


class Kind(StrEnum):
    """Every kind of event, shared by the driver that writes them and every reader (the page,
    the metrics, the chaos harness). Readers decide by ``kind`` and the structured fields
    (``group``, ``worker``, ``cause``, ``seconds``, ``resize``), never by the message."""

    # the job's life and the control plane's
    SUBMITTED = "submitted"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PAUSED = "paused"
    RESUMED = "resumed"
    QUARANTINED = "quarantined"
    LEADER = "leader"
    DRIVER_RESTART = "driver_restart"
    ETCD_LOST = "etcd_lost"
    ETCD_BACK = "etcd_back"
    TASK_ROWS_QUARANTINED = "task_rows_quarantined"
    REWARD_ERRORS = "reward_errors"
    WORKERS_REAPED = "workers_reaped"
    # faults and detections
    ROLLOUT_FAULT = "rollout_fault"
    ROLLOUT_HANG = "rollout_hang"
    TRAINER_HANG = "trainer_hang"
    TRAINER_RESTART = "trainer_restart"  # also a resize: its ``resize`` field says which
    SNAPSHOT_FAILED = "snapshot_failed"
    SNAPSHOT_CORRUPT = "snapshot_corrupt"
    # a worker asked to leave (SIGTERM, a node drain): drained, replaced, no fault budget spent
    PREEMPTED = "preempted"
    # a rollout worker that shared its process with a trainer rank (``placement: colocated``) ended
    # when the trainer group ended that process (a cold restart, a resize): replaced at once, no fault
    ROLLOUT_REPLACED = "rollout_replaced"
    # recoveries
    RECOVERED = "recovered"  # a step committed after faults: one per fault, with ``seconds``
    ROLLOUT_JOINED = "rollout_joined"
    GROUP_RESTORED = "group_restored"
    TRAINER_RECOVERED = "trainer_recovered"
    ADOPTED = "adopted"
    COMMIT_RECOVERED = "commit_recovered"
    REPLAY = "replay"
    SHADOW_RESTORED = "shadow_restored"  # a restart took the in-memory shadow copy, not a snapshot
    SHARD_RESUMED = "shard_resumed"  # a lost shard done by another worker: ``kept`` + ``regenerated`` samples
    # scaling and snapshots
    SCALE = "scale"
    AUTOSCALE = "autoscale"
    SNAPSHOT = "snapshot"
    # evaluation (``spec.eval``): a policy version evaluated on the held-out task
    EVAL = "eval"


#: what an operator counts as a fault (a ``trainer_restart`` only when not a resize)
FAULTS = frozenset({Kind.ROLLOUT_FAULT, Kind.ROLLOUT_HANG, Kind.TRAINER_RESTART, Kind.SNAPSHOT_FAILED,
                    Kind.SNAPSHOT_CORRUPT, Kind.FAILED})  # fmt: skip
#: the job's own recovery (a step committed after a fault), a group's, a new leader's take-over
RECOVERIES = frozenset({Kind.RECOVERED, Kind.GROUP_RESTORED, Kind.TRAINER_RECOVERED, Kind.ADOPTED,
                        Kind.COMMIT_RECOVERED})  # fmt: skip
ROLLOUT_FAULTS = frozenset({Kind.ROLLOUT_FAULT, Kind.ROLLOUT_HANG})


class EventLog:
    """Appends events for one job as the current leader."""

    def __init__(self, election: Election, job: str) -> None:
        self.election = election
        self.job = job
        self._seq: int | None = None

    def _next_seq(self) -> int:
        if self._seq is None:
            kvs, _ = self.election.store.range(keys.events(self.job))
            self._seq = int(kvs[-1].key.rsplit("/", 1)[1]) + 1 if kvs else 0
        return self._seq

    def append(self, kind: Kind | str, message: str, **data: Any) -> int:
        """Append one event; returns its sequence number. Raises NotLeader if fenced out, and
        ValueError for a kind that is not a :class:`Kind`."""
        kind = Kind(kind)
        for _ in range(5):
            seq = self._next_seq()
            ev = {
                "seq": seq,
                "time": time.time(),
                "kind": kind.value,
                "message": message,
                "leader": self.election.id,
                **data,
            }
            key = keys.event(self.job, seq)
            ops: list[Any] = [Put(key, json.dumps(ev))]
            if seq >= MAX_EVENTS:
                ops.append(Delete(keys.event(self.job, seq - MAX_EVENTS)))
            res = self.election.fenced_txn([Compare(key, "create", "=", 0)], success=ops)
            if res.succeeded:
                self._seq = seq + 1
                return seq
            self._seq = None  # someone else appended (a previous leader): re-read the tail
        raise RuntimeError(f"could not append event to {self.job}: sequence kept moving")


def read(store: Store, job: str, after: int = -1, limit: int = 100) -> list[dict[str, Any]]:
    """Events with ``seq > after``, oldest first, at most ``limit``."""
    kvs, _ = store.range(keys.events(job))
    out = [json.loads(kv.value) for kv in kvs]
    return [e for e in out if e["seq"] > after][:limit]
