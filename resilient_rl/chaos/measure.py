"""Recovery figures per fault, goodput (ETTR) and lost work: pure functions of a run's
fault records, the job's events, the harness's timeline samples and the job's metrics.

Per fault (all in seconds after the injection):

* ``detection_s``: first event of a kind that shows the system noticed this fault
  (``DETECT`` below). A ``detection_s`` field on that event, when the runner
  measured it itself (``rollout_hang`` does), is reported as ``detection_reported_s``.
* ``next_commit_s``: first committed step after the injection (timeline).
* ``recovered_s``: first recovery event (``RECOVER``; else any kind naming "recover", but
  of the fault's own group for a rollout or trainer fault: a trainer's recovery is not a
  rollout worker's).
* ``group_restored_s``: first timeline sample at which every group has its desired
  size again *and* the process the fault hit is no longer a member (for kills
  and hangs); this is the "back to desired group size" figure. A hang that nothing
  detected (an idle worker stopped and continued: it held no work, so it was never
  replaced) is back once its process is a member of a whole group again after the
  SIGCONT (``ended_at``).

ETTR = committed steps x fault-free mean step time / wall time, as
``controller/goodput.py`` defines it for the live gauges too. The fault-free
mean step time is the run's median ``step_seconds`` (robust to the slow steps
around faults) unless a baseline is given. Two walls: ``ettr`` over the training
phase (first step's start to last commit) and ``ettr_total`` from the job's
``started_at`` (includes worker start-up). With fault injection times given,
``ettr_window`` counts only the complete intervals between the first and the
last injection (each interval holds one fault and its recovery), so a soak whose
job runs on fault-free after the fault window is not flattered by that tail.

Event timestamps are read robustly (``time``, ``ts``, ``at``, ``timestamp``;
epoch seconds or ISO strings), since the runner's events are still growing.
"""

from __future__ import annotations

import statistics
from datetime import datetime
from typing import Any

from controller import goodput as goodput_def

DETECT: dict[str, tuple[str, ...]] = {
    "rollout_kill": ("rollout_fault", "rollout_hang"),
    "rollout_hang": ("rollout_hang", "rollout_fault"),
    "rollout_slow": ("rollout_hang", "rollout_fault"),
    "rollout_preempt": ("preempted",),
    "trainer_kill": ("trainer_restart", "trainer_fault"),
    "trainer_hang": ("trainer_hang", "trainer_restart"),
    "trainer_preempt": ("preempted",),
    "journal_full": ("paused",),
    "reward_hang": ("reward_errors",),
    "leader_kill": ("leader",),
    "leader_pause": ("leader",),
    "etcd_restart": ("leader", "etcd_lost", "etcd_outage", "etcd_reconnected", "etcd_back"),
    "etcd_outage": ("leader", "etcd_lost", "etcd_outage", "etcd_reconnected", "etcd_back"),
    "etcd_member_kill": ("leader", "etcd_lost", "etcd_failover"),
    "snapshot_corrupt": ("snapshot_corrupt",),
    "disk_full": ("snapshot_failed",),
    "ray_node_remove": ("rollout_fault", "rollout_hang", "trainer_restart"),
    "scale": ("scale", "trainer_restart"),
}
RECOVER: dict[str, tuple[str, ...]] = {
    "rollout_kill": ("rollout_joined",),
    "rollout_hang": ("rollout_joined",),
    "rollout_slow": (),  # nothing to recover from unless declared hung (then rollout_joined, a new fault)
    "rollout_preempt": ("rollout_joined",),
    "trainer_kill": ("trainer_recovered",),
    "trainer_hang": ("trainer_recovered",),
    "trainer_preempt": ("trainer_recovered",),
    "journal_full": ("resumed",),
    "reward_hang": (),  # the worker survives: nothing to recover from
    "leader_kill": ("adopted",),
    "leader_pause": ("adopted",),
    "etcd_restart": ("running", "adopted", "etcd_recovered"),
    "etcd_outage": ("running", "adopted", "etcd_recovered"),
    "etcd_member_kill": ("running", "adopted", "etcd_recovered"),
    "snapshot_corrupt": ("trainer_recovered",),
    "disk_full": ("snapshot",),
    "ray_node_remove": ("rollout_joined", "trainer_recovered"),
    "scale": ("rollout_joined", "trainer_recovered"),
}
# faults after which the hit process must leave membership for the group to count as restored
_REPLACES = {"rollout_kill", "rollout_hang", "trainer_kill", "ray_node_remove", "rollout_preempt", "trainer_preempt"}


def event_time(e: dict[str, Any]) -> float | None:
    """An event's wall-clock time (epoch seconds), whatever field / format carries it."""
    for k in ("time", "ts", "at", "timestamp", "t"):
        v = e.get(k)
        if isinstance(v, int | float) and not isinstance(v, bool):
            return float(v)
        if isinstance(v, str):
            try:
                return float(v)
            except ValueError:
                pass
            try:
                return datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def _first_event(
    events: list[dict[str, Any]],
    kinds: tuple[str, ...],
    after: float,
    until: float | None,
    recover: bool = False,
    group: str = "",
) -> Any:
    """First event of ``kinds`` in [after, until); with ``recover``, if none, the first whose kind
    names a recovery (the runner's newer events) and starts with ``group`` when one is given."""
    best = None
    for fallback in (False, True) if recover else (False,):
        for e in events:
            t = event_time(e)
            kind = str(e.get("kind", ""))
            hit = ("recover" in kind and kind.startswith(group)) if fallback else (kind in kinds)
            if t is None or t < after or (until is not None and t >= until) or not hit:
                continue
            if best is None or t < event_time(best):  # type: ignore[operator]
                best = e
        if best is not None:
            return best
    return best


def _commit_times(timeline: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> list[tuple[float, int]]:
    """(time, step count after the commit), from metrics.jsonl where present, else the timeline."""
    out = [(float(m["time"]), int(m["step"]) + 1) for m in metrics if "time" in m and "step" in m]
    if out:
        return sorted(out)
    prev = None
    for s in timeline:
        if prev is not None and s.get("step", 0) > prev:
            out.append((float(s["t"]), int(s["step"])))
        prev = s.get("step", 0)
    return out


def fault_figures(
    fault: dict[str, Any],
    events: list[dict[str, Any]],
    timeline: list[dict[str, Any]],
    commits: list[tuple[float, int]],
    until: float | None = None,
) -> dict[str, Any]:
    """The recovery figures of one injected fault (see module doc); None where not seen.

    Events count for this fault only before ``until`` (the next fault's injection), so a
    later fault's detection or recovery is not taken for this one's."""
    t0 = fault.get("injected_at")
    kind = fault["kind"]
    out: dict[str, Any] = {"detection_s": None, "next_commit_s": None, "recovered_s": None, "group_restored_s": None}
    if t0 is None:
        return out
    det = _first_event(events, DETECT.get(kind, ()), t0 - 0.5, until)
    if det is not None:
        out["detection_s"] = round(max(0.0, event_time(det) - t0), 2)  # type: ignore[operator]
        out["detected_by"] = det.get("kind")
        if isinstance(det.get("detection_s"), int | float):
            out["detection_reported_s"] = det["detection_s"]
    group = next((g for g in ("rollout_", "trainer_") if kind.startswith(g)), "")
    rec = _first_event(events, RECOVER.get(kind, ()), t0, until, recover=bool(RECOVER.get(kind)), group=group)
    if rec is not None:
        out["recovered_s"] = round(event_time(rec) - t0, 2)  # type: ignore[operator]
        out["recovered_by"] = rec.get("kind")
    nxt = next((t for t, _ in commits if t > t0), None)
    if nxt is not None:
        out["next_commit_s"] = round(nxt - t0, 2)
    hit = fault.get("target", {}).get("pid")
    start = t0 if det is None else max(t0, event_time(det) or t0)
    # a hang nobody detected was never replaced: its own process is what comes back
    resumed = det is None and kind.endswith("_hang") and fault.get("ended_at") is not None
    if resumed:
        start = max(start, float(fault["ended_at"]))
    for s in timeline:
        if s["t"] < start:
            continue
        desired = s.get("desired", {})
        members = s.get("members", {})
        sized = all(len(members.get(g, [])) == int(n) for g, n in desired.items())
        if resumed:
            gone = hit is None or any(hit in pids for pids in members.values())
        else:
            gone = kind not in _REPLACES or hit is None or all(hit not in pids for pids in members.values())
        if sized and gone:
            out["group_restored_s"] = round(s["t"] - t0, 2)
            break
    return out


def goodput(
    final_state: dict[str, Any],
    metrics: list[dict[str, Any]],
    baseline_step_s: float | None = None,
    injections: list[float] | None = None,
) -> dict[str, Any]:
    """ETTR figures (see module doc). ``injections``: the faults' injection times."""
    steps = len(metrics)
    secs = [float(m["step_seconds"]) for m in metrics if isinstance(m.get("step_seconds"), int | float)]
    base = baseline_step_s if baseline_step_s else goodput_def.fault_free_step_s(secs)
    out: dict[str, Any] = {"committed_steps": steps, "fault_free_step_s": base, "ettr": None, "ettr_total": None}
    times = sorted(float(m["time"]) for m in metrics if "time" in m)
    if base and times and secs:
        first_start = times[0] - secs[0]
        wall = times[-1] - first_start
        out["wall_s"] = round(wall, 2)
        out["ettr"] = goodput_def.ettr(steps, base, wall)
        started, finished = final_state.get("started_at"), final_state.get("finished_at")
        if isinstance(started, int | float) and isinstance(finished, int | float) and finished > started:
            out["wall_total_s"] = round(finished - started, 2)
            out["ettr_total"] = goodput_def.ettr(steps, base, finished - started)
        inj = sorted(injections or [])
        if len(inj) >= 2 and inj[-1] > inj[0]:
            lo, hi = inj[0], inj[-1]
            inside = sum(1 for m in metrics if "time" in m and lo <= float(m["time"]) < hi)  # commits in [lo, hi)
            out["window_s"] = round(hi - lo, 2)
            out["window_faults"] = len(inj) - 1
            out["ettr_window"] = goodput_def.ettr(inside, base, hi - lo)
    return out


def lost_work(
    events: list[dict[str, Any]], samples_per_shard: float, rewritten_shards: int | None = None
) -> dict[str, Any]:
    """Steps replayed (from ``replay`` events) and rollout samples regenerated.

    ``samples_regenerated_est``: one shard per hang / rollout fault (the shard it had in
    flight; an upper bound: a worker that died idle lost none). ``shards_rewritten_seen``:
    shard files the harness saw replaced in the journal (a lower bound: it polls).
    """
    out: dict[str, Any] = {
        **goodput_def.lost(events, samples_per_shard),
        "trainer_restarts": sum(e.get("kind") == "trainer_restart" for e in events),
        "leader_changes": sum(e.get("kind") == "leader" for e in events),
    }
    if rewritten_shards is not None:
        out["shards_rewritten_seen"] = rewritten_shards
        out["samples_rewritten_seen"] = int(rewritten_shards * samples_per_shard)
    return out


def summarize(per_fault: list[dict[str, Any]]) -> dict[str, Any]:
    """MTTR per fault kind: mean of ``next_commit_s`` and ``group_restored_s`` over its faults."""
    by: dict[str, list[dict[str, Any]]] = {}
    for f in per_fault:
        by.setdefault(f["kind"], []).append(f)
    out = {}
    for kind, fs in sorted(by.items()):
        row: dict[str, Any] = {"count": len(fs)}
        for key in ("detection_s", "next_commit_s", "recovered_s", "group_restored_s"):
            vals = [f["figures"][key] for f in fs if f.get("figures", {}).get(key) is not None]
            row[f"mean_{key}"] = round(statistics.mean(vals), 2) if vals else None
        out[kind] = row
    return out
