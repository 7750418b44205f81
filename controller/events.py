"""The bounded per-job event log (``jobs/{job}/events/{seq}``), written by the leader.

Events are what an operator reads after the fact: faults, detections,
recoveries, scaling, leader changes. Each append is a fenced txn that also
checks that the sequence number is new, so two leaders can never interleave
or overwrite entries. The log keeps the newest ``MAX_EVENTS``.
"""

from __future__ import annotations

import json
import time
from typing import Any

from . import keys
from .election import Election
from .store import Compare, Delete, Put, Store

MAX_EVENTS = 2000


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

    def append(self, kind: str, message: str, **data: Any) -> int:
        """Append one event; returns its sequence number. Raises NotLeader if fenced out."""
        for _ in range(5):
            seq = self._next_seq()
            ev = {
                "seq": seq,
                "time": time.time(),
                "kind": kind,
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
