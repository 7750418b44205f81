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
from .store import Compare, Delete, Get, Put, Store, _prefix_end


def prefix_end(prefix: str) -> str:
    """The range end that selects every key starting with ``prefix``."""
    return _prefix_end(prefix.encode()).decode()


TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


class JobExists(Exception):
    pass


class DesiredChanged(Exception):
    """A compare-and-set on ``desired`` found other values than the caller expected."""


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
    verified: dict[str, Any] | None = None  # the newest `rrl verify` of it (see record_verify)

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
            "verified": self.verified,
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
        raise JobExists(
            f"a job named {job_id!r} already exists: choose another name, or free it with `rrl delete {job_id}` "
            "once it has ended (`rrl submit --replace` does both)"
        )
    return res.revision


def get(store: Store, job_id: str) -> JobRecord:
    """Read one job's record (one range read: consistent at one revision)."""
    kvs, _ = store.range(keys.job(job_id))
    rec = _records(kvs).get(job_id)
    if rec is None:
        raise JobNotFound(job_id)
    return rec


def list_ids(store: Store) -> list[str]:
    """Every job id, one key read per job: the scan jumps over each job's keys (events,
    members, checkpoints), so its cost does not grow with a job's history or its workers."""
    base = keys.jobs()
    end = prefix_end(base)
    out: list[str] = []
    start = base
    while (key := store.next_key(start, end)) is not None:
        parts = keys.split_job_key(key)
        if parts is None or not parts[0]:
            break
        try:
            out.append(keys.check_job_id(parts[0]))
        except keys.InvalidId:  # not a job of ours (written by hand?): skip it
            pass
        start = prefix_end(f"{base}{parts[0]}/")
    return out


def list_all(store: Store, *, detail: bool = True) -> list[JobRecord]:
    """Every job's record, each read at one revision (a txn per job). ``detail=False`` leaves
    out members and checkpoints (the controller's reconcile loop needs neither; reading every
    member of every job twice a second would grow with the cluster). Events are never read."""
    out = []
    for job_id in list_ids(store):
        ops: list[Get] = [Get(keys.spec(job_id)), Get(keys.desired(job_id)), Get(keys.state(job_id)),
                          Get(keys.verified(job_id))]  # fmt: skip
        if detail:
            ops += [Get(keys.members(job_id), prefix=True), Get(keys.checkpoints(job_id), prefix=True)]
        r = store.txn([], ops)
        rec = _records([kv for got in r.results for kv in got]).get(job_id)
        if rec is not None:
            out.append(rec)
    return sorted(out, key=lambda r: r.desired.get("submitted_at", 0))


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
        elif rest == "verified":
            rec.verified = json.loads(kv.value)
    return {k: v for k, v in out.items() if v.spec}


def record_verify(store: Store, job_id: str, result: dict[str, Any]) -> None:
    """Keep the result of an `rrl verify` of the job (``match``, steps, digests, time), unless
    the job has been deleted meanwhile; the newest replaces the one before."""
    res = store.txn([Compare(keys.spec(job_id), "create", ">", 0)],
                    success=[Put(keys.verified(job_id), json.dumps({**result, "time": time.time()}))])  # fmt: skip
    if not res.succeeded:
        raise JobNotFound(job_id)


def lineage(store: Store, job_id: str) -> list[dict[str, Any]]:
    """The job's trainer segments, in step order: one record per (re)start of the trainer group
    (``at_step`` it rejoined live training, ``from_step`` of the snapshot it restored, 0 for the
    initial weights, ``world``, ``strategy``, ``threads``). ``rrl verify`` replays through them."""
    kvs, _ = store.range(keys.lineage(job_id))
    return [json.loads(kv.value) for kv in kvs]


def read_desired(store: Store, job_id: str) -> dict[str, Any]:
    """The job's desired state as it is now."""
    kv = store.get(keys.desired(job_id))
    if kv is None:
        raise JobNotFound(job_id)
    return dict(json.loads(kv.value))


def update_desired(store: Store, job_id: str, expect: dict[str, Any] | None = None, **changes: Any) -> dict[str, Any]:
    """Merge ``changes`` into ``desired`` with a compare-and-swap loop (no lost update).

    With ``expect`` (e.g. ``{"trainer": 1}``) the write happens only while those fields hold
    those values; otherwise :class:`DesiredChanged` names what they are now."""
    for _ in range(20):
        kv = store.get(keys.desired(job_id))
        if kv is None:
            raise JobNotFound(job_id)
        cur = json.loads(kv.value)
        wrong = {k: cur.get(k) for k, v in (expect or {}).items() if cur.get(k) != v}
        if wrong:
            now = ", ".join(f"{k} is {v}" for k, v in wrong.items())
            want = ", ".join(f"{k}={v}" for k, v in (expect or {}).items() if k in wrong)
            raise DesiredChanged(f"{job_id}: expected {want}, but desired {now}; nothing changed")
        desired = {**cur, **changes}
        res = store.txn(
            [Compare(keys.desired(job_id), "mod", "=", kv.mod_revision)],
            success=[Put(keys.desired(job_id), json.dumps(desired))],
        )
        if res.succeeded:
            return desired
    raise RuntimeError(f"desired state of {job_id} kept changing under us; try again")


RESUMABLE = ("PAUSED", "QUARANTINED")


class NotResumable(Exception):
    """``resume`` of a job that is neither PAUSED nor QUARANTINED."""


def resume(store: Store, job_id: str) -> dict[str, Any]:
    """Ask the leader to resume a PAUSED job now (it also resumes by itself once the cause is gone)
    or to lift a QUARANTINED job's quarantine. Raises :class:`NotResumable` in another phase."""
    phase = get(store, job_id).phase
    if phase not in RESUMABLE:
        raise NotResumable(f"job {job_id!r} is {phase}: only a PAUSED or QUARANTINED job can be resumed")
    return update_desired(store, job_id, resume=time.time())


class JobNotFinished(Exception):
    """``delete`` of a job that is not in a terminal phase."""


def delete(store: Store, job_id: str) -> JobRecord:
    """Remove a terminal job's records (spec, desired, state, events, checkpoints, lineage) in
    one compare-and-delete on its state, so the name can be used again; returns what was
    removed (the caller removes the job's files). Raises :class:`JobNotFinished` for a live job."""
    rec = get(store, job_id)
    if rec.phase not in TERMINAL:
        raise JobNotFinished(f"job {job_id!r} is {rec.phase}: `rrl cancel {job_id}` it first, then delete it")
    kv = store.get(keys.state(job_id))
    guard = [Compare(keys.state(job_id), "mod", "=", kv.mod_revision)] if kv else []
    if not store.txn(guard, success=[Delete(keys.job(job_id), prefix=True)]).succeeded:
        raise JobNotFinished(f"job {job_id!r} changed while being deleted; try again")
    return rec


def cancel(store: Store, job_id: str) -> dict[str, Any]:
    """Ask the leader to cancel the job."""
    return update_desired(store, job_id, cancel=True)


STRATEGIES = ("ddp", "fsdp")


def scale(
    store: Store, job_id: str, expect: dict[str, int] | None = None, strategy: str | None = None, **groups: int
) -> dict[str, Any]:
    """Ask for new group sizes, e.g. ``scale(store, job, rollout=3)``, and/or a new trainer
    ``strategy`` (applied at the next step boundary, like a trainer resize); ``expect`` makes
    it a compare-and-set (``expect={"rollout": 2}``: only while rollout is still 2)."""
    for g, n in groups.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{g}: replicas must be a positive integer, got {n!r}")
    changes: dict[str, Any] = dict(groups)
    if strategy is not None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy: want one of {', '.join(STRATEGIES)}, got {strategy!r}")
        if strategy != "ddp" and (get(store, job_id).spec.get("trainer") or {}).get("lora"):
            raise ValueError(f"strategy: {strategy} cannot train the job's trainer.lora adapters (ddp only)")
        changes["strategy"] = strategy
    return update_desired(store, job_id, expect=expect, **changes)
