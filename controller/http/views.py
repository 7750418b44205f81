"""What the API, the status page and /metrics show, computed from etcd records.

Pure functions over a :class:`~controller.jobs.JobRecord` and its event log:
no I/O here, so the page, the JSON API and the Prometheus collector agree.

Faults and recoveries are read from the event log the leader writes
(``rollout_fault``, ``rollout_hang``, ``trainer_restart`` ... see
docs/architecture.md). A rollout worker's recovery is the first
``rollout_joined`` of the same worker after its fault (or ``group_restored``);
a trainer group's is ``trainer_recovered``; the job's own is ``recovered`` (the
first step committed after a fault); a new leader's is ``adopted``. Those that
carry ``seconds`` feed the recovery histogram.
"""

from __future__ import annotations

import time
from typing import Any

from ..events import FAULTS as FAULT_KINDS
from ..events import RECOVERIES as RECOVERY_KINDS
from ..events import ROLLOUT_FAULTS, Kind
from ..jobs import JobRecord


def is_fault(ev: dict[str, Any]) -> bool:
    """A fault, by its kind; a trainer restart is also how the trainer group is resized,
    and its ``resize`` field says which (the message is never read)."""
    if ev.get("kind") == Kind.TRAINER_RESTART:
        return not ev.get("resize", False)
    return ev.get("kind") in FAULT_KINDS


def recoveries(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Recovery events, oldest first, each with ``seconds`` (fault -> back) where it is known.

    The kinds of RECOVERY_KINDS, plus a ``rollout_joined`` that follows a fault of the
    same worker (the first join of a worker is a start, not a recovery); its seconds
    are its ``recovery_s``, else measured from the fault event.
    """
    pending: dict[Any, float] = {}  # rollout worker -> time of its unrecovered fault
    out = []
    for ev in events:
        kind = ev.get("kind")
        if kind in ROLLOUT_FAULTS:
            pending.setdefault(ev.get("worker"), ev["time"])
        elif kind == "rollout_joined" and ev.get("worker") in pending:
            t0 = pending.pop(ev.get("worker"))
            out.append({**ev, "seconds": ev.get("recovery_s", round(ev["time"] - t0, 3))})
        elif kind in RECOVERY_KINDS:
            out.append(ev)
    return out


_SCALING = frozenset({Kind.SCALE, Kind.AUTOSCALE, Kind.ROLLOUT_JOINED, Kind.WORKERS_REAPED})
_TAKE_OVER = frozenset({Kind.LEADER, Kind.REPLAY, Kind.SHADOW_RESTORED})


def annotate(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events (oldest first) each with the ``category`` the page filters by: ``fault``,
    ``recovery`` (a group back, a fault's worker rejoined, a take-over, a replay),
    ``preemption`` (a worker drained on notice: no fault), ``scaling``, ``snapshot`` or
    ``job`` (its lifecycle and the rest). Each fault also gets
    ``path`` (how it was recovered: ``hot`` / ``cold`` trainer restart, a warm ``spare``, a
    new ``process``) and ``mttr_s`` (seconds to its recovery) once its recovery is in the
    list; its ``detection_s`` is the driver's own."""
    recovered = {e["seq"] for e in recoveries(events)}
    rollout_open: dict[Any, list[dict[str, Any]]] = {}  # worker -> its open faults' rows (a hang, then its kill)
    trainer_open: list[dict[str, Any]] = []
    out = []
    for ev in events:
        kind, row = ev.get("kind"), dict(ev)
        if is_fault(ev) or kind == Kind.TRAINER_HANG:
            row["category"] = "fault"
            if kind in ROLLOUT_FAULTS:
                if kind == Kind.ROLLOUT_FAULT:
                    row["path"] = "spare" if ev.get("spare") else "process"
                rollout_open.setdefault(ev.get("worker"), []).append(row)
            elif kind in (Kind.TRAINER_RESTART, Kind.TRAINER_HANG):
                if ev.get("recovery"):
                    row["path"] = ev["recovery"]
                trainer_open.append(row)
        elif kind in (Kind.TRAINER_RESTART, Kind.TRAINER_RECOVERED) and ev.get("resize"):
            row["category"] = "scaling"  # a resize's restart and return: no fault, no recovery
        elif kind == Kind.PREEMPTED:
            row["category"] = "preemption"
        elif ev.get("seq") in recovered or kind in _TAKE_OVER or kind in (Kind.SHARD_RESUMED, Kind.ROLLOUT_REPLACED):
            row["category"] = "recovery"
        elif kind in _SCALING:
            row["category"] = "scaling"
        elif kind == Kind.SNAPSHOT:
            row["category"] = "snapshot"
        else:
            row["category"] = "job"
        if kind == Kind.ROLLOUT_JOINED:
            for f in rollout_open.pop(ev.get("worker"), []):
                f["mttr_s"] = round(ev["time"] - f["time"], 3)
        elif kind == Kind.GROUP_RESTORED and ev.get("group", "rollout") == "rollout":
            for f in (f for fs in rollout_open.values() for f in fs):
                f.setdefault("mttr_s", round(ev["time"] - f["time"], 3))
            rollout_open.clear()
        elif kind == Kind.TRAINER_RECOVERED and not ev.get("resize"):
            for f in trainer_open:
                f["mttr_s"] = round(ev["time"] - f["time"], 3)
                f.setdefault("path", ev.get("recovery"))
            trainer_open.clear()
        out.append(row)
    return out


def recovered_count(events: list[dict[str, Any]]) -> int:
    """How many worker faults were recovered from: a rollout fault by the next join of
    that worker (or the group being restored), a trainer fault by ``trainer_recovered``."""
    rollout: set[Any] = set()  # workers with an open fault
    trainer = 0
    n = 0
    for ev in events:
        kind = ev.get("kind")
        if kind in ROLLOUT_FAULTS:
            rollout.add(ev.get("worker"))
        elif kind == "trainer_restart" and is_fault(ev):
            trainer += 1
        elif kind == "rollout_joined" and ev.get("worker") in rollout:
            rollout.discard(ev.get("worker"))
            n += 1
        elif kind == "group_restored" and ev.get("group", "rollout") == "rollout":
            n += len(rollout)
            rollout.clear()
        elif kind == "trainer_recovered" and trainer:
            n += trainer
            trainer = 0
    return n


def restarts(events: list[dict[str, Any]]) -> dict[tuple[str, str], int]:
    """Restarts per ``(group, worker)`` from fault events (a trainer restart restarts every rank).

    Every replacement of a rollout worker has exactly one ``rollout_fault`` (a hang is a
    ``rollout_hang`` *and* the ``rollout_fault`` of its replacement: counted once)."""
    out: dict[tuple[str, str], int] = {}
    for ev in events:
        if ev.get("kind") == "rollout_fault" and ev.get("worker") is not None:
            key = ("rollout", str(ev["worker"]))
            out[key] = out.get(key, 0) + 1
        elif ev.get("kind") == "trainer_restart" and is_fault(ev):
            out[("trainer", "*")] = out.get(("trainer", "*"), 0) + 1
    return out


def summary(rec: JobRecord, events: list[dict[str, Any]], now: float | None = None) -> dict[str, Any]:
    """One line of the jobs overview."""
    now = time.time() if now is None else now
    st = rec.state
    steps = int(rec.spec.get("steps") or 0)
    step = int(st.get("step") or 0)
    submitted = rec.desired.get("submitted_at")
    end = st.get("finished_at") or now
    return {
        "id": rec.id,
        "phase": rec.phase,
        "reason": st.get("reason"),
        "step": step,
        "steps": steps,
        "progress": round(step / steps, 4) if steps else 0.0,
        "policy_version": st.get("policy_version", 0),
        "reward": st.get("reward"),
        "reward_errors": int(st.get("reward_errors") or 0),
        "tokens_per_s": st.get("tokens_per_s"),
        "step_seconds": st.get("step_seconds"),
        "age_s": round(now - submitted, 1) if submitted else None,
        "runtime_s": round(end - st["started_at"], 1) if st.get("started_at") else None,
        "failures": sum(1 for e in events if is_fault(e)),
        "recoveries": recovered_count(events),
        "preemptions": sum(1 for e in events if e.get("kind") == Kind.PREEMPTED),  # drains, not faults
        "desired": {g: rec.desired.get(g) for g in ("rollout", "trainer")},
        "cancel_requested": bool(rec.desired.get("cancel")),
        "workers": {g: len(m) for g, m in rec.members.items()},
    }


def workers(rec: JobRecord, events: list[dict[str, Any]], now: float | None = None) -> dict[str, list[dict[str, Any]]]:
    """Worker rows per group, from the membership records (sorted by worker id)."""
    now = time.time() if now is None else now
    counts = restarts(events)
    out: dict[str, list[dict[str, Any]]] = {}
    for group, members in sorted(rec.members.items()):
        rows = []
        for wid, info in sorted(members.items(), key=lambda kv: (len(kv[0]), kv[0])):
            beat = info.get("progress_at")
            rows.append(
                {
                    "id": wid,
                    "node": info.get("node"),
                    "pid": info.get("pid"),
                    "state": info.get("status"),
                    "policy_version": info.get("version"),
                    "progress_age_s": round(now - beat, 1) if beat else None,  # the lease is the heartbeat
                    "restarts": counts.get((group, wid), 0) + counts.get((group, "*"), 0),
                    "step": info.get("step"),
                }
            )
        out[group] = rows
    return out


def checkpoint_rows(rec: JobRecord) -> list[dict[str, Any]]:
    """The committed snapshot records, oldest first, each with a ``status``."""
    current = rec.state.get("checkpoint")
    return [
        {**c, "status": "committed, latest" if c.get("step") == current else "committed"}
        for c in sorted(rec.checkpoints, key=lambda c: c.get("step", 0))
    ]


def markers(events: list[dict[str, Any]], history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fault and recovery markers for the plots, placed at the number of steps committed then."""
    times = [p["time"] for p in history if p.get("time") is not None]
    out = []
    recovered = {e["seq"]: e for e in recoveries(events)}
    for ev in events:
        if is_fault(ev):
            what = "fault"
        elif ev["seq"] in recovered:
            what = "recovery"
        else:
            continue
        step = ev.get("step")
        if step is None:
            step = sum(1 for t in times if t <= ev["time"])
        out.append({"seq": ev["seq"], "kind": ev["kind"], "what": what, "step": step, "message": ev.get("message")})
    return out


def downsample(points: list[dict[str, Any]], limit: int = 600) -> list[dict[str, Any]]:
    """At most ``limit`` points, evenly spaced, always keeping the last one."""
    if len(points) <= limit:
        return points
    stride = len(points) / limit
    picked = [points[int(i * stride)] for i in range(limit - 1)]
    return picked + [points[-1]]
