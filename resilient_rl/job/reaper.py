"""The leader's reconciliation of the *actual* Ray actors against etcd.

A job's runner stops its workers when the job ends, but a runner can die first: a
leader killed after a job was cancelled or failed leaves the job's rollout workers,
trainer ranks and weight store running ("ready" for ever, holding CPUs and memory),
and the next leader has no runner for a terminal job. So the leader, when it takes
over and every ``housekeeping_interval`` after, lists every named actor of the Ray
cluster (``ray.util.list_named_actors(all_namespaces=True)``, not a probe of
indices 0..15) and

* stops the actors of jobs in a terminal phase (``shutdown`` then ``ray.kill``), and
* reports ``rrl:`` actors of jobs etcd does not know (a warning, once per name):
  they are not ours to stop, they may belong to another rrl installation on the
  same cluster.

The pass runs in its own thread (the reconcile loop must not wait on Ray) and
checks leadership before every kill: a deposed leader stops nothing.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from controller import jobs
from controller.events import Kind

from ..naming import NAMESPACE
from .actors import connect_ray

log = logging.getLogger(__name__)


def parse_actor_name(name: str) -> tuple[str, str, int] | None:
    """``rrl:{job}:{group}:{index}`` -> ``(job, group, index)``; None for any other name."""
    parts = name.split(":")
    if len(parts) != 4 or parts[0] != "rrl" or not parts[3].isdigit():
        return None
    return parts[1], parts[2], int(parts[3])


def plan(names: list[str], records: list[jobs.JobRecord]) -> tuple[list[str], list[str]]:
    """``(to_stop, unknown)`` among the actor ``names`` of our namespace (pure)."""
    phase = {r.id: r.phase for r in records}
    stop, unknown = [], []
    for name in sorted(names):
        parsed = parse_actor_name(name)
        if parsed is None:
            continue
        job = parsed[0]
        if job not in phase:
            unknown.append(name)
        elif phase[job] in jobs.TERMINAL:
            stop.append(name)
    return stop, unknown


class WorkerReaper:
    """The ``housekeeping`` hook of the controller (see module doc)."""

    def __init__(self, ray_address: str | None) -> None:
        self.ray_address = ray_address
        self._busy = threading.Lock()
        self._reported: set[str] = set()
        self.stopped: list[str] = []  # names stopped by this process (for tests and logs)

    def __call__(self, controller: Any, records: list[jobs.JobRecord]) -> None:
        if not self.ray_address or not self._busy.acquire(blocking=False):
            return  # no cluster to look at, or the previous pass is still running
        threading.Thread(target=self._pass, args=(controller, records), name="reaper", daemon=True).start()

    def _pass(self, controller: Any, records: list[jobs.JobRecord]) -> None:
        try:
            import ray

            connect_ray(self.ray_address)
            names = [
                a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a.get("namespace") == NAMESPACE
            ]
            stop, unknown = plan(names, records)
            # a job whose runner still exists is the runner's to clean up (it stops its workers as it ends)
            stop = [n for n in stop if n.split(":")[1] not in getattr(controller, "drivers", {})]
            for name in unknown:
                if name not in self._reported:
                    self._reported.add(name)
                    log.warning("actor %s belongs to no job in etcd: left alone (another rrl on this cluster?)", name)
            for name in stop:
                if not controller.election.is_leader:
                    return
                self._stop(name)
            if stop:
                by_job: dict[str, int] = {}
                for name in stop:
                    by_job[name.split(":")[1]] = by_job.get(name.split(":")[1], 0) + 1
                for job, n in by_job.items():
                    controller.event(job, Kind.WORKERS_REAPED, f"stopped {n} worker actor(s) the job's runner had "
                                     "left running after it ended", count=n)  # fmt: skip
        except Exception as e:  # the next pass tries again
            log.warning("worker reconciliation failed: %s", e)
        finally:
            self._busy.release()

    def _stop(self, name: str) -> None:
        import ray

        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return  # gone meanwhile
        try:
            ray.get(actor.shutdown.remote(), timeout=5)  # leave membership at once
        except Exception as e:  # the kill below is what matters
            log.info("shutdown of %s failed: %s", name, e)
        ray.kill(actor)
        self.stopped.append(name)
        log.warning("stopped %s: its job has ended", name)
