"""Prometheus ``/metrics``, computed from etcd at scrape time.

Nothing is kept in memory except the count of etcd errors this process saw
(and the per-step points the page plots, read from the job's metrics.jsonl, which
the goodput gauges use): any controller (leader or standby) gives the same
numbers, and a restarted one loses nothing. One scrape costs one range read of ``jobs/`` plus one of each
job's event log (bounded at 2000 events).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from .. import events as event_log
from .. import goodput, jobs, keys
from ..store import EtcdError, Store
from . import views

log = logging.getLogger(__name__)

RECOVERY_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class EtcdCollector:
    """A prometheus_client collector reading job state and events from etcd."""

    def __init__(
        self, store: Store, etcd_errors: Any, points: Callable[[jobs.JobRecord], list[Any]] | None = None
    ) -> None:
        self.store = store
        self.etcd_errors = etcd_errors
        self.points = points  # a job's committed steps, as the page plots them (for the goodput gauges)

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("rrl_etcd_up", "1 if this scrape could read etcd.")
        try:
            records = jobs.list_all(self.store)
            logs = {r.id: event_log.read(self.store, r.id, -1, event_log.MAX_EVENTS) for r in records}
            leader = self.store.get(keys.leader())
        except EtcdError as e:
            self.etcd_errors.inc()
            log.warning("metrics: cannot read etcd: %s", e)
            up.add_metric([], 0)
            yield up
            yield self._errors()
            return
        up.add_metric([], 1)
        yield up
        yield self._errors()
        yield from self._jobs(records, logs)
        leader_fam = GaugeMetricFamily("rrl_leader_token", "Fencing token of the current leader (0: none).")
        leader_fam.add_metric([], leader.create_revision if leader else 0)
        yield leader_fam
        # every takeover writes a `leader` event (with its token) to each live job's log
        tokens = {e.get("token") for evs in logs.values() for e in evs if e.get("kind") == "leader"}
        changes = CounterMetricFamily(
            "rrl_leader_changes", "Leader takeovers recorded in the jobs' event logs (distinct fencing tokens)."
        )
        changes.add_metric([], len(tokens - {None}))
        yield changes

    def _errors(self) -> Metric:
        c = CounterMetricFamily("rrl_etcd_request_errors", "etcd requests of this controller's API that failed.")
        c.add_metric([], self.etcd_errors.value)
        return c

    def _jobs(self, records: list[jobs.JobRecord], logs: dict[str, list[dict[str, Any]]]) -> Iterator[Metric]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["job"])

        step = CounterMetricFamily("rrl_job_committed_steps", "Steps committed in etcd.", labels=["job"])
        total = gauge("rrl_job_steps", "Steps the job is to run.")
        phase = GaugeMetricFamily("rrl_job_phase", "1 for the job's current phase.", labels=["job", "phase"])
        step_s = gauge("rrl_job_step_seconds", "Wall time of the last committed step.")
        tps = gauge("rrl_job_rollout_tokens_per_second", "Generated tokens per second in the last committed step.")
        reward = gauge("rrl_job_reward", "Mean reward of the last committed step.")
        policy = gauge("rrl_job_policy_version", "Policy version the trainer last published.")
        ck_block = gauge("rrl_checkpoint_blocking_seconds", "Training time the latest committed snapshot blocked.")
        ck_total = gauge("rrl_checkpoint_seconds", "Total time of the latest committed snapshot (stage to commit).")
        ck_bytes = gauge("rrl_checkpoint_bytes", "Size of the latest committed snapshot.")
        workers = GaugeMetricFamily(
            "rrl_workers", "Registered workers by group and state.", labels=["job", "group", "state"]
        )
        restarts = CounterMetricFamily("rrl_worker_restarts", "Worker restarts after faults.", labels=["job", "group"])
        faults = CounterMetricFamily("rrl_job_faults", "Fault events (worker lost or hung, snapshot failed...).",
                                     labels=["job"])  # fmt: skip
        recovery = HistogramMetricFamily(
            "rrl_recovery_seconds",
            "Time from a fault to its recovery, from the events that carry it (kind: which recovery).",
            labels=["job", "kind"],
        )
        ettr = gauge("rrl_job_ettr", "Effective training time ratio since the first step (controller/goodput.py).")
        ettr_hour = gauge("rrl_job_ettr_last_hour", "Effective training time ratio over the last hour.")
        replayed = gauge("rrl_job_goodput_steps_replayed", "Steps trained again after a restart (replay events).")
        regenerated = gauge("rrl_job_goodput_samples_regenerated", "Rollout samples generated again (estimate).")
        in_recovery = gauge("rrl_job_goodput_recovery_seconds", "Time with at least one fault not recovered from.")
        now = time.time()
        for rec in records:
            st, evs = rec.state, logs.get(rec.id, [])
            g = goodput.live(self.points(rec) if self.points else [], views.annotate(evs), rec.spec, st, now)
            for fam, key in ((ettr, "ettr"), (ettr_hour, "ettr_last_hour"), (replayed, "steps_replayed"),
                             (regenerated, "samples_regenerated_est"), (in_recovery, "recovery_s")):  # fmt: skip
                if g.get(key) is not None:
                    fam.add_metric([rec.id], float(g[key]))
            step.add_metric([rec.id], int(st.get("step") or 0))
            total.add_metric([rec.id], int(rec.spec.get("steps") or 0))
            phase.add_metric([rec.id, rec.phase], 1)
            for fam, key in ((step_s, "step_seconds"), (tps, "tokens_per_s"), (reward, "reward")):
                if st.get(key) is not None:
                    fam.add_metric([rec.id], float(st[key]))
            policy.add_metric([rec.id], int(st.get("policy_version") or 0))
            latest = next((c for c in rec.checkpoints if c.get("step") == st.get("checkpoint")), None)
            if latest is not None:
                for fam, key in ((ck_block, "blocking_s"), (ck_total, "seconds"), (ck_bytes, "bytes")):
                    if latest.get(key) is not None:
                        fam.add_metric([rec.id], float(latest[key]))
            for group, members in sorted(rec.members.items()):
                by_state: dict[str, int] = {}
                for info in members.values():
                    s = str(info.get("status") or "unknown")
                    by_state[s] = by_state.get(s, 0) + 1
                for s, n in sorted(by_state.items()):
                    workers.add_metric([rec.id, group, s], n)
            per_group: dict[str, int] = {}
            for (group, _), n in views.restarts(evs).items():
                per_group[group] = per_group.get(group, 0) + n
            for group in ("rollout", "trainer"):
                restarts.add_metric([rec.id, group], per_group.get(group, 0))
            faults.add_metric([rec.id], sum(1 for e in evs if views.is_fault(e)))
            by_kind: dict[str, list[float]] = {}
            for e in views.recoveries(evs):
                if e.get("seconds") is not None:
                    by_kind.setdefault(e["kind"], []).append(float(e["seconds"]))
            for kind, secs in sorted(by_kind.items()):
                buckets = [(str(b), sum(1 for s in secs if s <= b)) for b in RECOVERY_BUCKETS]
                recovery.add_metric([rec.id, kind], [*buckets, ("+Inf", len(secs))], sum(secs))
        yield from (step, total, phase, step_s, tps, reward, policy, ck_block, ck_total, ck_bytes)
        yield from (workers, restarts, faults, recovery, ettr, ettr_hour, replayed, regenerated, in_recovery)
