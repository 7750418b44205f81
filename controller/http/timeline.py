"""The job page's worker timeline: a strip per worker over the last minutes, one state at a time.

Membership holds only each worker's latest value, so every controller serving the page keeps
its own bounded history: it samples the members of every running job every couple of seconds
(:meth:`Timeline.observe`, from the API's sampler thread) and keeps, per worker, runs of one
state (``[state, from, to]``) for :data:`WINDOW_S`. A worker that leaves membership shows
as ``gone`` (dead, or drained: its events say which) until a worker of that name is back. A
controller that started late shows the strips from when it started (as the plots' history
from the committed states does). Bounded: per job at most :data:`MAX_WORKERS` strips, each
runs over the window only.

States are what the workers report in membership (``status``): ``busy`` is a rollout worker
generating, ``training`` and ``snapshotting`` a trainer rank at work, ``loading`` a rollout
worker taking new weights, ``idle`` / ``ready`` waiting, ``starting`` / ``warming`` coming
up, ``spare`` a warm spare.
"""

from __future__ import annotations

import threading
from typing import Any

WINDOW_S = 600.0
MAX_WORKERS = 256
SAMPLE_S = 2.0
# a sample this much later than the last one leaves a gap ("unknown"): the sampler was not running
_GAP_S = 3 * SAMPLE_S


class Timeline:
    """Per job, per worker (``group/worker``), runs of one state (see module doc). Thread-safe."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self._runs: dict[str, dict[str, list[list[Any]]]] = {}  # job -> worker -> [[state, t0, t1], ...]

    def observe(self, job: str, members: dict[str, dict[str, dict[str, Any]]], now: float) -> None:
        """One sample of ``job``'s members (``{group: {worker: value}}``, as a JobRecord has them)."""
        seen = {f"{g}/{w}": str(info.get("status") or "unknown") for g, ws in members.items() for w, info in ws.items()}
        with self._lock:
            strips = self._runs.setdefault(job, {})
            for key in set(strips) | set(seen):
                if key not in strips and len(strips) >= MAX_WORKERS:
                    continue
                runs = strips.setdefault(key, [])
                state = seen.get(key, "gone")
                if runs and runs[-1][0] == state and now - runs[-1][2] <= _GAP_S:
                    runs[-1][2] = now
                elif runs and now - runs[-1][2] <= _GAP_S:
                    runs[-1][2] = now  # the old state lasted until this sample
                    runs.append([state, now, now])
                else:
                    runs.append([state, now, now])
            lo = now - self.window_s
            for key in list(strips):
                runs = [r for r in strips[key] if r[2] >= lo]
                if not runs or all(r[0] == "gone" for r in runs):
                    del strips[key]  # left before the window: no strip
                else:
                    strips[key] = runs

    def keep(self, jobs: set[str]) -> None:
        """Drop the strips of every job not in ``jobs`` (deleted)."""
        with self._lock:
            for job in set(self._runs) - jobs:
                del self._runs[job]

    def get(self, job: str, now: float) -> dict[str, Any]:
        """``{"from", "to", "rows": [{"worker": "rollout/0", "runs": [[state, t0, t1], ...]}]}``."""
        lo = now - self.window_s
        with self._lock:
            strips = self._runs.get(job, {})
            rows = [{"worker": k, "runs": [[s, max(t0, lo), t1] for s, t0, t1 in runs if t1 >= lo]}
                    for k, runs in sorted(strips.items(), key=lambda kv: _order(kv[0]))]  # fmt: skip
        rows = [r for r in rows if r["runs"]]
        first = min((r["runs"][0][1] for r in rows), default=lo)
        return {"from": max(lo, first), "to": now, "rows": rows}  # from the first sample: the strips fill the width


def _order(key: str) -> tuple[str, bool, int, str]:
    """rollout/0, rollout/1, rollout-spare/0, trainer/0, trainer-spare/0 (workers by number)."""
    group, _, worker = key.partition("/")
    return group.removesuffix("-spare"), group.endswith("-spare"), int(worker) if worker.isdigit() else 0, worker
