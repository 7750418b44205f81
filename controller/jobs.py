"""Job records in etcd: submit, read, cancel, scale.

Like Kubernetes, requests write *desired* state (``spec`` once, ``desired``
afterwards) and the leader reconciles toward it, writing ``state``. Any
controller (or the CLI) may write ``spec``/``desired``; only the leader writes
``state``, ``checkpoints`` and ``events``, through fenced txns.

The spec is stored as JSON already validated by the caller: this module does
not know the RL job's schema (it must import without the RL code).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from . import keys
from .store import Compare, Put, Store

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


class JobExists(Exception):
    pass


class JobNotFound(KeyError):
    def __str__(self) -> str:
        return f"no job named {self.args[0]!r}"


@dataclass
class JobRecord:
    """Everything etcd holds about one job (members grouped by group name)."""

    id: str
    spec: dict[str, Any]
    desired: dict[str, Any]
    state: dict[str, Any]
    members: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)

    @property
    def phase(self) -> str:
        # a job the leader has not picked up yet has no state: it is pending
        return str(self.state.get("phase", "PENDING"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "phase": self.phase,
            "spec": self.spec,
            "desired": self.desired,
            "state": self.state,
            "members": self.members,
            "checkpoints": self.checkpoints,
        }


def submit(store: Store, job_id: str, spec_json: str, desired: dict[str, Any]) -> int:
    """Create a job (spec + desired) atomically; raises :class:`JobExists` if the id is taken."""
    res = store.txn(
        [Compare(keys.spec(job_id), "create", "=", 0)],
        success=[
            Put(keys.spec(job_id), spec_json),
            Put(keys.desired(job_id), json.dumps({**desired, "submitted_at": time.time()})),
        ],
    )
    if not res.succeeded:
        raise JobExists(f"a job named {job_id!r} already exists (choose another name or `rrl cancel` it)")
    return res.revision


def list_ids(store: Store) -> list[str]:
    kvs, _ = store.range(keys.jobs())
    ids = []
    for kv in kvs:
        parts = keys.split_job_key(kv.key)
        if parts and parts[1] == "spec":
            ids.append(parts[0])
    return ids


def get(store: Store, job_id: str) -> JobRecord:
    """Read one job's record (one range read: consistent at one revision)."""
    kvs, _ = store.range(keys.job(job_id))
    rec = _records(kvs).get(job_id)
    if rec is None:
        raise JobNotFound(job_id)
    return rec


def list_all(store: Store) -> list[JobRecord]:
    kvs, _ = store.range(keys.jobs())
    return sorted(_records(kvs).values(), key=lambda r: r.desired.get("submitted_at", 0))


def _records(kvs: list[Any]) -> dict[str, JobRecord]:
    out: dict[str, JobRecord] = {}
    for kv in kvs:
        parts = keys.split_job_key(kv.key)
        if parts is None:
            continue
        job_id, rest = parts
        rec = out.setdefault(job_id, JobRecord(job_id, {}, {}, {}))
        if rest == "spec":
            rec.spec = json.loads(kv.value)
        elif rest == "desired":
            rec.desired = json.loads(kv.value)
        elif rest == "state":
            rec.state = json.loads(kv.value)
        elif rest.startswith("members/"):
            bits = rest.split("/")
            if len(bits) == 3:
                rec.members.setdefault(bits[1], {})[bits[2]] = json.loads(kv.value)
        elif rest.startswith("checkpoints/"):
            rec.checkpoints.append(json.loads(kv.value))
    return {k: v for k, v in out.items() if v.spec}


def update_desired(store: Store, job_id: str, **changes: Any) -> dict[str, Any]:
    """Merge ``changes`` into ``desired`` with a compare-and-swap loop (no lost update)."""
    for _ in range(20):
        kv = store.get(keys.desired(job_id))
        if kv is None:
            raise JobNotFound(job_id)
        desired = {**json.loads(kv.value), **changes}
        res = store.txn(
            [Compare(keys.desired(job_id), "mod", "=", kv.mod_revision)],
            success=[Put(keys.desired(job_id), json.dumps(desired))],
        )
        if res.succeeded:
            return desired
    raise RuntimeError(f"desired state of {job_id} kept changing under us; try again")


def cancel(store: Store, job_id: str) -> dict[str, Any]:
    """Ask the leader to cancel the job."""
    return update_desired(store, job_id, cancel=True)


def scale(store: Store, job_id: str, **groups: int) -> dict[str, Any]:
    """Ask for new group sizes, e.g. ``scale(store, job, rollout=3)``."""
    for g, n in groups.items():
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{g}: replicas must be a positive integer, got {n!r}")
    return update_desired(store, job_id, **groups)
