"""The controller process: election, registration, and the leader's reconcile loop.

Every controller registers itself under ``controllers/{id}`` (on its lease) and
campaigns. The one that wins runs :meth:`Controller.reconcile` until it loses
its lease or is fenced out; the others keep campaigning and serve read-only
status. Nothing lives only in memory: a new leader rebuilds everything from etcd.

The RL job itself is driven through a :class:`JobDriver` given by the caller
(``resilient_rl`` implements it), so this module imports neither torch nor Ray.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from . import jobs, keys
from .election import Election, NotLeader
from .events import EventLog, Kind
from .liveness import LeaderWatch, Vacancy
from .store import Compare, Delete, EtcdError, Put, Store
from .watch import KeptLease

log = logging.getLogger(__name__)

QUARANTINED = "QUARANTINED"  # not terminal: `rrl resume` lifts it (see Controller._may_run)


class JobDriver(Protocol):
    """What the leader needs to run one job; implemented by ``resilient_rl``.

    ``reconcile`` is called repeatedly by the leader with the job's current
    record; it does a bounded amount of work and returns state fields to merge
    (or None). A driver may also write through the controller's fenced
    ``update_state`` / ``event`` from its own thread. ``stop`` releases what the
    driver holds and must not return before the driver has stopped writing:
    ``final=False`` when leadership is lost or the controller stops (the
    workers keep running for the next leader to adopt), ``final=True`` when the
    job ended or was cancelled (the workers are stopped too). A driver may expose
    ``exited``, true when it stopped on its own without a terminal phase (e.g. an
    etcd outage): the leader then replaces it.
    """

    def reconcile(self, record: jobs.JobRecord) -> dict[str, Any] | None: ...

    def stop(self, final: bool) -> None: ...


class Controller:
    """One controller process (leader or standby)."""

    def __init__(
        self,
        store: Store,
        cid: str | None = None,
        *,
        ttl: int = 5,
        driver_factory: Any = None,
        info: dict[str, Any] | None = None,
        interval: float = 0.5,
        housekeeping: Callable[[Controller, list[jobs.JobRecord]], None] | None = None,
        housekeeping_interval: float = 10.0,
    ) -> None:
        self.store = store
        self.id = keys.check_name(cid or f"{socket.gethostname()}-{os.getpid()}", "controller id")
        self.election = Election(store, self.id, ttl=ttl)
        self.driver_factory = driver_factory
        self.info = {"id": self.id, "pid": os.getpid(), "node": socket.gethostname(), **(info or {})}
        self.interval = interval
        # called by the leader with every job record when it takes over and every
        # housekeeping_interval after (e.g. stopping workers of finished jobs that a dead
        # leader left running); must return at once (it runs its work elsewhere)
        self.housekeeping = housekeeping
        self.housekeeping_interval = housekeeping_interval
        self.drivers: dict[str, JobDriver] = {}
        self._events: dict[str, EventLog] = {}
        self._members: dict[str, tuple[dict[str, dict[str, Any]], int]] = {}  # group prefix -> (values, revision)
        self._members_lock = threading.Lock()
        self._stop = threading.Event()
        self._lease: KeptLease | None = None
        self._outage: float | None = None  # wall time etcd was first unreachable, until a leader records it
        self._outage_lock = threading.Lock()
        # held by each job's reconcile and by stop(): a driver started by a pass under way when
        # stop() is called is seen by stop (its runner record is cleared: a clean hand-over)
        self._pass_lock = threading.Lock()
        self._last_outage_end: float | None = None  # a term that ended in an outage is not a job's fault
        self._vacancy: Vacancy | None = None  # the dead leader whose lease this one revoked to lead

    # -- lifecycle -----------------------------------------------------------

    def run(self) -> None:
        """Campaign and lead until :meth:`stop`. Survives etcd outages."""
        while not self._stop.is_set():
            try:
                self._register(role="standby")
                watch = LeaderWatch(self.store, self.id).start()  # a dead leader's closed connection
                try:
                    won = self.election.campaign()
                finally:
                    watch.stop()
                if not won:
                    break
                self._vacancy = watch.vacancy
                self._register(role="leader")
                self._lead()
            except EtcdError as e:
                log.warning("controller %s: etcd error: %s; retrying", self.id, e)
                self.note_etcd_error()
                self._stop.wait(1.0)
        self._release()

    def stop(self) -> None:
        self._stop.set()
        with self._pass_lock:  # a reconcile under way (perhaps starting a driver) ends first
            for job in list(self.drivers):  # a clean hand-over, not a term that died under the job (see _may_run)
                try:
                    self.update_state(job, runner=None)
                except (NotLeader, EtcdError, RuntimeError) as e:
                    log.info("job %s: could not record the hand-over: %s", job, e)
        self.election.stop()

    def note_etcd_error(self) -> None:
        """etcd could not be reached (by this controller or a driver of it): the start of an
        outage, recorded as a ``etcd_lost`` / ``etcd_back`` event pair on every running job
        once a leader of this process can write again (events cannot be written during it)."""
        with self._outage_lock:
            if self._outage is None:
                self._outage = time.time()

    def _record_outage(self, recs: list[jobs.JobRecord]) -> None:
        with self._outage_lock:
            since, self._outage = self._outage, None
        if since is None:
            return
        self._last_outage_end = time.time()
        secs = round(time.time() - since, 1)
        for rec in recs:
            if rec.phase in jobs.TERMINAL or not rec.state:
                continue
            self.event(rec.id, Kind.ETCD_LOST, f"etcd unreachable from controller {self.id} since "
                       f"{time.strftime('%H:%M:%S', time.localtime(since))}", since=since, group="etcd")  # fmt: skip
            self.event(rec.id, Kind.ETCD_BACK, f"etcd reachable again after {secs}s", seconds=secs, since=since,
                       group="etcd")  # fmt: skip

    def _register(self, role: str) -> None:
        if self._lease is None or self._lease.lost:
            self._lease = self.store.keep_lease(self.election.ttl)
        value = {**self.info, "role": role, "since": time.time()}
        self.store.put(keys.controller(self.id), json.dumps(value), lease=self._lease.id)

    def _release(self) -> None:
        for d in self.drivers.values():
            d.stop(final=False)
        self.drivers.clear()
        if self._lease is not None:
            self._lease.revoke()

    # -- leading -------------------------------------------------------------

    def _lead(self) -> None:
        log.info("controller %s leads (token %d)", self.id, self.election.token)
        self._events.clear()
        first = True
        last_housekeeping = 0.0
        try:
            while not self._stop.is_set() and self.election.is_leader:
                recs = jobs.list_all(self.store, detail=False)
                self._record_outage(recs)
                for rec in recs:
                    with self._pass_lock:
                        if self._stop.is_set():
                            break
                        self.reconcile(rec, leader_changed=first)
                first = False
                if self.housekeeping and time.monotonic() - last_housekeeping >= self.housekeeping_interval:
                    last_housekeeping = time.monotonic()
                    self.housekeeping(self, recs)
                self._stop.wait(self.interval)
        except NotLeader as e:
            log.warning("controller %s: %s", self.id, e)
        finally:
            # whoever leads next re-adopts the jobs; our drivers must not act any more
            for d in self.drivers.values():
                d.stop(final=False)
            self.drivers.clear()
        if not self._stop.is_set():
            log.warning("controller %s is no longer leader", self.id)

    def event(self, job: str, kind: Kind, message: str, **data: Any) -> None:
        log_ = self._events.setdefault(job, EventLog(self.election, job))
        log_.append(kind, message, **data)

    def read_state(self, job: str) -> dict[str, Any]:
        kv = self.store.get(keys.state(job))
        return dict(json.loads(kv.value)) if kv else {}

    def update_state(
        self, job: str, expect: Callable[[dict[str, Any]], None] | None = None, **changes: Any
    ) -> dict[str, Any]:
        """Merge ``changes`` into the job's state: a fenced compare-and-swap on the state key.

        ``expect(current)`` may raise to refuse the update (e.g. a step commit that
        would apply a step twice). Raises NotLeader when fenced out.
        """
        key = keys.state(job)
        for _ in range(20):
            kv = self.store.get(key)
            cur = json.loads(kv.value) if kv else {}
            if expect is not None:
                expect(cur)
            new = {**cur, **changes, "writer": self.id, "token": self.election.token}  # who wrote it (audit)
            guard = Compare(key, "mod", "=", kv.mod_revision) if kv else Compare(key, "create", "=", 0)
            if self.election.fenced_txn([guard], success=[Put(key, json.dumps(new))]).succeeded:
                return new
        raise RuntimeError(f"state of {job} kept changing under us")

    @property
    def token(self) -> int:
        """The fencing token of this controller's leadership (0 when not leading)."""
        return self.election.token

    @property
    def leads(self) -> bool:
        """This controller certainly leads now (its lease cannot have run out)."""
        return self.election.is_leader

    def record_lineage(self, job: str, step: int, segment: dict[str, Any]) -> None:
        """Record (fenced) the trainer segment that rejoined live training at ``step``."""
        self.election.fenced_txn(success=[Put(keys.lineage(job, step), json.dumps(segment))])

    def record_checkpoint(self, job: str, step: int, info: dict[str, Any]) -> None:
        """Make a durable snapshot visible: its record and ``state.checkpoint`` (fenced)."""
        self.election.fenced_txn(success=[Put(keys.checkpoint(job, step), json.dumps({**info, "step": step}))])
        self.update_state(job, checkpoint=step)

    def forget_checkpoint(self, job: str, step: int) -> None:
        """Drop a snapshot's record (retention); its files are collected afterwards."""
        self.election.fenced_txn(success=[Delete(keys.checkpoint(job, step))])

    def members(self, job: str, group: str) -> dict[str, dict[str, Any]]:
        """The membership records of one group of a job (worker -> value), as etcd has them now.

        Read as a delta of the last read (the runner reads its groups once a second, and a
        large group changes a fraction of its values in a second): the values modified since
        (a range with ``min_mod_revision``) and a count of the group at the same revision; if
        the count says keys went, the group's keys (no values) say which. Only changed values
        travel and are decoded (BENCHMARKS.md section 6). The values are shared with the
        cache: read them, do not modify them."""
        prefix = keys.members(job, group)
        with self._members_lock:
            held = self._members.get(prefix)
            if held is None:
                kvs, rev = self.store.range(prefix)
                values = {kv.key[len(prefix) :]: json.loads(kv.value) for kv in kvs}
            else:
                values, last = held
                kvs, rev = self.store.range(prefix, min_mod_revision=last + 1)
                if rev < last:  # another etcd history (a restore from a snapshot): read it whole
                    kvs, rev = self.store.range(prefix)
                    values = {}
                for kv in kvs:
                    values[kv.key[len(prefix) :]] = json.loads(kv.value)
                if rev != last:  # something changed: perhaps a deletion
                    n = self.store.count(prefix, revision=rev)
                    if n != len(values):  # some went (keys only come back with a change)
                        present = {k[len(prefix) :] for k in self.store.keys(prefix, revision=rev)}
                        values = {w: v for w, v in values.items() if w in present}
            self._members[prefix] = (values, rev)
            return dict(values)

    def checkpoints(self, job: str) -> list[dict[str, Any]]:
        """Committed snapshot records of a job, oldest first."""
        kvs, _ = self.store.range(keys.checkpoints(job))
        return [json.loads(kv.value) for kv in kvs]

    def reconcile(self, rec: jobs.JobRecord, *, leader_changed: bool = False) -> None:
        """Move one job toward its desired state (one bounded pass)."""
        if rec.phase in jobs.TERMINAL:
            self._drop_driver(rec.id)
            return
        if not rec.state:
            self._events.pop(rec.id, None)  # a new job (perhaps a deleted one's name): its own log
            self.update_state(rec.id, phase="PENDING", step=0, policy_version=0, trainer_epoch=0, checkpoint=None)
            self.event(rec.id, Kind.SUBMITTED, f"job {rec.id} accepted by controller {self.id}")
        elif leader_changed:
            v = self._vacancy
            how = {} if v is None else {"previous": v.leader, "detected_by": "connection", "revoked_at": v.at}
            why = "" if v is None else f" ({v.leader}'s process ended: {v.how}; its lease revoked, not waited out)"
            self.event(rec.id, Kind.LEADER, f"controller {self.id} took over as leader{why}",
                       token=self.election.token, **how)  # fmt: skip
        if rec.desired.get("cancel"):
            # written first, whatever the driver is doing (a thread cannot be interrupted): the driver's
            # own writes require a live phase, so it cannot overwrite CANCELLED or commit a step after it
            self.update_state(rec.id, phase="CANCELLED", reason="cancelled by user", finished_at=time.time())
            self.event(rec.id, Kind.CANCELLED, "job cancelled by user")
            self._drop_driver(rec.id)
            return
        if self.driver_factory is None:
            return
        old = self.drivers.get(rec.id)
        if old is not None and getattr(old, "exited", False):  # its loop gave up (etcd outage): start over
            self.drivers.pop(rec.id).stop(final=False)
            self.event(
                rec.id, Kind.DRIVER_RESTART, "the job's driver stopped without finishing; taking the job over again"
            )
        if rec.id not in self.drivers:
            if not self._may_run(rec):
                return
            self.drivers[rec.id] = self.driver_factory(self, rec)
        update = self.drivers[rec.id].reconcile(rec)
        if update:
            self.update_state(rec.id, **update)

    def _may_run(self, rec: jobs.JobRecord) -> bool:
        """The poison-job guard, before this leader starts a job's driver.

        A driver runs inside the leader; a job whose driver makes its leader die or step down
        would take every controller down in turn. So each start is recorded in the job's state
        (``runner``: this leader's token and the committed step). A new leader that finds the
        record of another term counts a strike when that term ended without the job committing
        a step and not in an etcd outage this controller saw (a clean stop erases the record);
        at two strikes in a row the job is QUARANTINED with the reason, and no leader runs it
        until ``rrl resume JOB``. Any committed step clears the strikes."""
        st = rec.state
        if rec.phase == QUARANTINED:
            if float(rec.desired.get("resume") or 0) <= float(st.get("quarantined_at") or 0):
                return False
            self.update_state(rec.id, phase="PENDING", reason=None, runner=None, runner_strikes=0)
            self.event(rec.id, Kind.RESUMED, "quarantine lifted by `rrl resume`: running the job again")
            st = {**st, "runner": None, "runner_strikes": 0}
        prev, strikes = st.get("runner"), int(st.get("runner_strikes") or 0)
        if prev and prev.get("token") != self.election.token:
            progressed = int(st.get("step") or 0) > int(prev.get("step") or 0)
            excused = self._last_outage_end is not None and self._last_outage_end >= float(prev.get("at") or 0)
            strikes = 0 if progressed or excused else strikes + 1
        if strikes >= 2:
            reason = (f"quarantined: the leader running this job died or stepped down {strikes} times in a row "
                      f"before it committed a step (last: controller {prev.get('by') if prev else '?'}); "
                      f"`rrl resume {rec.id}` runs it again")  # fmt: skip
            self.update_state(rec.id, phase=QUARANTINED, reason=reason, quarantined_at=time.time(),
                              runner=None, runner_strikes=strikes)  # fmt: skip
            self.event(rec.id, Kind.QUARANTINED, reason, strikes=strikes)
            return False
        self.update_state(rec.id, runner={"by": self.id, "token": self.election.token, "at": time.time(),
                                          "step": int(st.get("step") or 0)}, runner_strikes=strikes)  # fmt: skip
        return True

    def _drop_driver(self, job: str) -> None:
        with self._members_lock:  # the job's membership reads, cached (see members)
            for prefix in [p for p in self._members if p.startswith(keys.members(job))]:
                del self._members[prefix]
        d = self.drivers.pop(job, None)
        if d is not None:
            d.stop(final=True)


def controllers(store: Store) -> list[dict[str, Any]]:
    """Live controllers (from their registrations), leader first."""
    kvs, _ = store.range(keys.controllers())
    leader = store.get(keys.leader())
    lid = leader.value.decode() if leader else None
    out = [json.loads(kv.value) for kv in kvs]
    for c in out:
        c["leader"] = c["id"] == lid
    return sorted(out, key=lambda c: (not c["leader"], c["id"]))
