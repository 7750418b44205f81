"""Goodput, defined once: the controller's live gauges, the job page, `rrl status`, the chaos
report and the benchmarks all compute it here.

ETTR (effective training time ratio) = committed steps x fault-free step time / wall time,
capped at 1. The fault-free step time is the median ``step_seconds`` of the committed steps
(robust to the slow steps around faults) unless a baseline is given. A step's seconds are its
wall time, from the previous step's result to its own (``JobRunner._loop``): its hand-off and
commit included, so a fault-free run's steps add up to its wall time but for the periodic
costs the median leaves out (snapshots). Lost work: steps
replayed (``replay`` events), rollout samples regenerated (exactly, from ``shard_resumed``
events: the samples the next worker generated again of a lost shard; a fault with no such
event, a take-over's or an idle worker's, counts its shard whole: an upper bound), and the time in recovery (each fault
to its recovery, from ``views.annotate``'s MTTR). Light: no worker imports.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

HOUR_S = 3600.0


def fault_free_step_s(step_seconds: Iterable[Any]) -> float | None:
    """The median of the numeric ``step_seconds`` given, None without any."""
    secs = [float(s) for s in step_seconds if isinstance(s, int | float) and not isinstance(s, bool) and s > 0]
    return statistics.median(secs) if secs else None


def ettr(steps: int, step_s: float | None, wall_s: float | None) -> float | None:
    """Committed ``steps`` x fault-free ``step_s`` / ``wall_s``, at most 1 (None if unknown)."""
    if not step_s or not wall_s or wall_s <= 0:
        return None
    return round(min(1.0, steps * step_s / wall_s), 4)


def lost(events: list[dict[str, Any]], samples_per_shard: float) -> dict[str, Any]:
    """Steps replayed and rollout samples regenerated (estimate), from a job's events."""
    replayed = sum(e["last"] - e["first"] + 1 for e in events if e.get("kind") == "replay"
                   and isinstance(e.get("first"), int) and isinstance(e.get("last"), int))  # fmt: skip
    lost_shards = sum(e.get("kind") in ("rollout_hang", "rollout_fault") for e in events)
    resumed = [e for e in events if e.get("kind") == "shard_resumed" and isinstance(e.get("regenerated"), int)]
    est = sum(e["regenerated"] for e in resumed) + max(0, lost_shards - len(resumed)) * samples_per_shard
    return {"steps_replayed": replayed, "samples_regenerated_est": int(est)}


def samples_per_shard(spec: dict[str, Any]) -> float:
    """Samples a shard of the job holds (prompts per step x n, over its shards per step)."""
    rollout = spec.get("rollout") or {}
    prompts = int(spec.get("prompts_per_step") or 1)
    n = int((rollout.get("sampling") or {}).get("n") or 1)
    shards = min(prompts, int(rollout.get("shards_per_step") or rollout.get("replicas") or 1))
    return prompts * n / max(1, shards)


def live(
    points: list[dict[str, Any]], events: list[dict[str, Any]], spec: dict[str, Any], state: dict[str, Any],
    now: float,
) -> dict[str, Any]:  # fmt: skip
    """A job's goodput now. ``points``: its committed steps (``time`` of the commit and
    ``step_seconds``, as the page's history); ``events``: annotated (``views.annotate``).
    ETTR since the first step started and over the last hour, up to now while the job runs
    (a stall shows at once), up to its end once it has ended."""
    base = fault_free_step_s(p.get("step_seconds") for p in points)
    times = sorted(float(p["time"]) for p in points if isinstance(p.get("time"), int | float))
    out: dict[str, Any] = {"fault_free_step_s": base, "ettr": None, "ettr_last_hour": None, "committed": len(times)}
    if times:
        first = next(p for p in points if isinstance(p.get("time"), int | float))
        start = times[0] - float(first.get("step_seconds") or 0.0)
        ended = state.get("phase") in ("SUCCEEDED", "FAILED", "CANCELLED")
        end = max(times[-1], float(state.get("finished_at") or times[-1])) if ended else max(now, times[-1])
        out["ettr"] = ettr(len(times), base, end - start)
        lo = max(start, end - HOUR_S)
        out["ettr_last_hour"] = ettr(sum(1 for t in times if lo < t <= end), base, end - lo)
    faults = [e for e in events if e.get("category") == "fault"]
    out.update(lost(events, samples_per_shard(spec)))
    out["faults"] = len(faults)
    out["recovery_s"] = in_recovery_s(faults)
    return out


def in_recovery_s(faults: list[dict[str, Any]]) -> float:
    """Seconds during which at least one fault was not yet recovered from (the union of each
    fault's ``[time, time + mttr_s]``: a hang and the kill that follows it count once)."""
    spans = sorted((float(e["time"]), float(e["time"]) + float(e["mttr_s"])) for e in faults
                   if isinstance(e.get("mttr_s"), int | float) and isinstance(e.get("time"), int | float))  # fmt: skip
    total, cur_lo, cur_hi = 0.0, None, None
    for lo, hi in spans:
        if cur_hi is None or lo > cur_hi:
            if cur_hi is not None and cur_lo is not None:
                total += cur_hi - cur_lo
            cur_lo, cur_hi = lo, hi
        else:
            cur_hi = max(cur_hi, hi)
    if cur_hi is not None and cur_lo is not None:
        total += cur_hi - cur_lo
    return round(total, 2)
