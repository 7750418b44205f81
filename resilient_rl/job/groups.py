"""The two worker groups of a job, as the runner sees them: start, replace, resize.

Both groups are detached named Ray actors (``rrl:{job}:{group}:{index}``).

* :class:`RolloutGroup` never blocks the step loop: a new or replacement worker
  is created and sent ``load_weights(current version)``; it becomes *idle*
  (eligible for shards) only when that call returns, so it never generates
  with stale weights. Scale-down drains: a worker above the desired count gets
  no new shard and is stopped once its shard is in.
* :class:`TrainerGroup` (re)starts all ranks together at a committed step k:
  restore the newest snapshot that verifies, replay the journal up to k. The
  same path serves the first start, a rank fault and a world-size change.

Every replacement and restart is spent from the job's :class:`~resilient_rl.job.faults.FaultPolicy`
(``fault.max_restarts`` per ``fault.restart_window`` seconds, per group; a place that
fails in a row is backed off, :func:`~resilient_rl.job.faults.backoff_s`), which turns a
crash loop into a FAILED job with a clear reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from controller.events import Kind

from ..errors import describe_error
from .actors import Placement, actor_died, create_fresh, unreachable
from .context import JobContext, live, trainer_runtime_env
from .faults import FaultPolicy, TrainerProbe, backoff_s
from .spares import SparePool

log = logging.getLogger(__name__)


class RolloutGroup:
    """Rollout workers by index; ``idle`` holds those ready for a shard.

    A worker *joins* (``joining``) through one call, ``adopt(token, spec, version,
    weights)``: for a new worker it is the first call after its engine started, for
    a worker found running (a new leader, an etcd outage) it raises its fence and
    brings it to the current version. Either way it takes shards only afterwards.
    """

    def __init__(self, ctx: JobContext, model_dir: str, faults: FaultPolicy) -> None:
        self.ctx = ctx
        self.actors = ctx.actors
        self.faults = faults
        self.model_dir = model_dir
        self.workers: dict[int, Any] = {}
        self.idle: set[int] = set()
        self.joining: dict[Any, tuple[int, float]] = {}  # join ref -> (index, sent)
        self.waiting: dict[int, float] = {}  # index -> monotonic time its (backed-off) replacement may start
        # warm spares (engine up, in no group): a lost worker's place is taken by one at once
        self.spares = SparePool(ctx, "rollout-spare", self._create_spare,
                                probe=lambda a: self.actors.call(a, "warm"))  # fmt: skip
        self.promoting: dict[int, tuple[str, Any]] = {}  # index -> the spare taken for it, promoted at tick
        self.served_by: dict[int, str] = {}  # index -> the promoted spare serving it (its actor name)
        self._from_spare: dict[int, str] = {}  # index -> spare name, until its join is recorded
        self.draining: dict[int, float] = {}  # index -> deadline: on a Ray node being drained (see drain)
        # index -> when its last worker was removed (epoch s): a preemption notice older than that in
        # membership is the predecessor's, still there until the successor's own record lands
        self.removed_at: dict[int, float] = {}
        self._early: dict[int, Any] = {}  # index -> a worker created by prestart, joined by start
        # index -> its faults in a row, with no shard finished in between (the replacement's backoff)
        self.failures: dict[int, int] = {}

    def prestart(self, n: int) -> None:
        """Create the workers of a fresh start now, before the trainer group is up: an engine
        comes up (process, imports, model) while the ranks do, rather than after them. They
        join in :meth:`start`, which they wait for (their first call queues behind their
        constructor). Not for a take-over: a worker found running is adopted there."""
        for i in range(n):
            self._early[i] = self._create(i)

    def _placement(self) -> Placement:
        r = self.ctx.spec.rollout
        return Placement(r.num_cpus, r.num_gpus, self.ctx.runtime_env())

    def _create(self, i: int) -> Any:
        c = self.ctx
        # never get_if_exists: a dead worker's handle would be handed back for its replacement
        args = (c.job, i, c.spec.to_json(), self.model_dir, str(c.workdir), c.etcd)
        return create_fresh(self.actors, "rollout", c.actor_name("rollout", i), args, self._placement())

    def _create_spare(self, name: str, n: int) -> Any:
        c = self.ctx
        args = (c.job, 0, c.spec.to_json(), self.model_dir, str(c.workdir), c.etcd, n)
        return self.actors.create("rollout", name, args, self._placement())

    def _join(self, i: int, w: Any, version: int, weights: Any) -> None:
        self.workers[i] = w
        ref = self.actors.call(w, "adopt", self.ctx.token, self.ctx.spec.digest(), version, weights)
        self.joining[ref] = (i, time.monotonic())

    def add(self, i: int, version: int, weights: Any) -> None:
        """Start worker ``i`` (or take the one :meth:`prestart` made); it joins ``idle`` once it
        holds ``version`` (async)."""
        early = self._early.pop(i, None)
        self._join(i, early if early is not None else self._create(i), version, weights)
        self._serve(i, None)

    def _promote(self, i: int, name: str, spare: Any, version: int, weights: Any) -> None:
        """Spare ``name`` takes worker ``i``'s place: one call, its weight load (async, as a join)."""
        self.workers[i] = spare
        ref = self.actors.call(spare, "promote", i, self.ctx.token, self.ctx.spec.digest(), version, weights)
        self.joining[ref] = (i, time.monotonic())
        self._from_spare[i] = name
        self._serve(i, name)

    def _serve(self, i: int, name: str | None) -> None:
        """Record which actor serves index ``i`` when it is a promoted spare (``rollout_actors`` in
        the job's state: a new leader finds it there, see :meth:`start`)."""
        if self.served_by.get(i) == name:
            return
        if name is None:
            self.served_by.pop(i, None)
        else:
            self.served_by[i] = name
        self.ctx.update_state(expect=live, rollout_actors={str(j): n for j, n in self.served_by.items()} or None)

    def spares_wanted(self) -> int:
        return self.ctx.spec.rollout.spares

    def _spare(self, i: int) -> tuple[tuple[str, Any] | None, bool]:
        """For index ``i``: a ready spare that answers, else one still warming (see
        :meth:`SparePool.claim`), but not for a place failing in a row (a crash loop: a warm-up
        that fails there, as an engine that cannot start, is not retried without its backoff);
        and whether it was ready."""
        if (ready := self.spares.take()) is not None or self.failures.get(i, 0) > 1:
            return ready, ready is not None
        return self.spares.claim(), False

    def fill_spares(self) -> None:
        """Keep ``rollout.spares`` spares warm or warming, in the background (see :class:`SparePool`)."""
        if self.workers:
            self.spares.fill(self.spares_wanted())

    def start(self, n: int, version: int, weights: Any, was_running: bool = False) -> int:
        """Bring the group to ``n`` workers holding ``version`` and wait for all of them:
        workers of this job found running are adopted, missing ones started, extra
        ones stopped. With ``was_running`` (a take-over of a running job) a missing
        worker was lost while no leader watched: a ``rollout_fault``, and its join is
        its recovery. Returns how many were adopted."""
        A = self.actors
        adopted = 0
        missing = []
        recorded = {int(i): str(name) for i, name in (self.ctx.read_state().get("rollout_actors") or {}).items()}
        self.served_by = dict(recorded)
        for i in [j for j in self._early if j >= n]:  # resized between the prestart and now
            A.kill(self._early.pop(i))
        for i in range(max(n, 16, self.ctx.spec.rollout.max_replicas or 0)):
            a = None if i in self._early else A.find(recorded.get(i) or self.ctx.actor_name("rollout", i))
            if i >= n:
                if a is not None:
                    A.kill(a)
                self.served_by.pop(i, None)
                continue
            if a is not None:
                self._join(i, a, version, weights)
                adopted += 1
            else:
                missing.append(i)
                self.add(i, version, weights)
        if self.served_by != recorded:
            self.ctx.update_state(expect=live, rollout_actors={str(j): m for j, m in self.served_by.items()} or None)
        self.spares.adopt_running(set(self.served_by.values()))  # a previous leader's idle spares serve on
        self.faults.forget_workers(n)
        if was_running:
            for i in [j for j in missing if j not in self.faults.worker_down]:  # else its fault was seen and is open
                self.faults.worker_lost(i)
                self.ctx.event(Kind.ROLLOUT_FAULT, f"rollout worker {i} was gone at take-over: "
                               "starting a replacement", worker=i, group="rollout", cause="take_over")  # fmt: skip
        limit, back = self.join_limit(), []
        for ref, (i, sent) in list(self.joining.items()):
            while not A.wait([ref], timeout=1.0)[0] and time.monotonic() - sent < limit:
                self.ctx.check_leader()  # a deposed runner must stop here, not go on starting workers
            try:
                A.get(ref, timeout=0)
            except Exception as e:
                self.ctx.raise_if_stale(e)
                log.warning("rollout worker %d could not join (%s): replacing it", i, type(e).__name__)
                del self.joining[ref]
                self.fault(i, e, delay=False)
                continue
            del self.joining[ref]
            self.idle.add(i)
            if i in self.faults.worker_down:  # a replacement (perhaps a previous leader's, adopted)
                back.append(i)
        for i in back:  # once all have joined: the last one finds the group whole
            self._joined(i, version, whole_check=i == back[-1])
        return adopted

    def join_limit(self) -> float:
        """Longest a join may take (engine start + weight load) before the worker counts as hung."""
        return max(self.ctx.spec.fault.hang_timeout, 300.0)

    def refs(self) -> list[Any]:
        return list(self.joining)

    def on_ready(self, ref: Any) -> bool:
        """A join finished (or failed); True if ``ref`` was a join."""
        entry = self.joining.pop(ref, None)
        if entry is None:
            return False
        i = entry[0]
        try:
            version = self.actors.get(ref, timeout=0)
        except Exception as e:  # the new worker died while starting: try again (budgeted, backed off)
            self.ctx.raise_if_stale(e)
            self.fault(i, e)
            return True
        self.idle.add(i)
        self._joined(i, version)
        return True

    def _joined(self, i: int, version: int, whole_check: bool = True) -> None:
        """Record that worker ``i`` joined (with its recovery time after a fault), and that the
        group is whole again if it is (unless ``whole_check`` is off: more joins are being recorded)."""
        data: dict[str, Any] = {"worker": i, "version": version}
        t = self.faults.worker_back(i)
        if t is not None:
            data["recovery_s"] = t
        spare = self._from_spare.pop(i, None)
        if spare is not None:
            data["spare"] = spare
        self.ctx.event(Kind.ROLLOUT_JOINED, f"rollout worker {i} joined at policy v{version}"
                       + (f" (the warm spare {spare})" if spare else "")
                       + (f", {data['recovery_s']}s after its fault" if t is not None else ""), **data)  # fmt: skip
        joining = {j for j, _ in self.joining.values()}
        if whole_check and t is not None and len(set(self.workers) - joining) >= self.ctx.want("rollout"):
            self.ctx.event(Kind.GROUP_RESTORED, f"rollout group back at {self.ctx.want('rollout')} workers "
                           f"{data['recovery_s']}s after the fault", group="rollout", seconds=data["recovery_s"])  # fmt: skip

    def overdue_joins(self) -> list[int]:
        now, limit = time.monotonic(), self.join_limit()
        return [i for i, t in self.joining.values() if now - t > limit]

    def _vacate(self, i: int) -> tuple[str, Any] | None:
        """Empty index ``i`` (a fault or a preemption): kill its worker, forget its join and its node's
        drain (its successor may be elsewhere: were the drain kept, the successor's first answer
        would make it leave as preempted), note when (:attr:`removed_at`). Returns the spare that
        was being promoted into it, if any."""
        self.ctx.check_leader()  # a deposed leader must not touch the new leader's workers
        self.idle.discard(i)
        self.draining.pop(i, None)
        self.removed_at[i] = time.time()
        for ref, (j, _) in list(self.joining.items()):
            if j == i:
                del self.joining[ref]
        self._from_spare.pop(i, None)
        taken = self.promoting.pop(i, None)
        old = self.workers.pop(i, None)
        if old is not None:
            self.actors.kill(old)
        return taken

    def fault(self, i: int, err: BaseException, *, delay: bool = True) -> None:
        """Worker ``i`` died or hangs: kill it, replace it after a backoff (budgeted; the
        replacement joins at the version current then, see :meth:`tick`). The backoff grows with
        index ``i``'s faults in a row (:func:`~resilient_rl.job.faults.backoff_s`; a shard it
        finishes resets them, :meth:`free`), not with the group's other faults; none with a spare
        or without ``delay``. Its shard is re-queued by the caller."""
        if self.lost_with_its_process(i):
            return
        if (taken := self._vacate(i)) is not None:  # not promoted yet: it goes back to the pool
            self.spares.ready.append(taken)
        self.faults.worker_lost(i)
        self.faults.restart("rollout")  # spent either way: a crash loop still ends
        self.failures[i] = self.failures.get(i, 0) + 1
        backoff = backoff_s(self.failures[i]) if delay else 0.0
        spare, ready = self._spare(i) if i < self.ctx.want("rollout") else (None, False)
        if spare is not None:  # no process to start (nor, ready, an engine to load): no backoff either
            backoff = 0.0
            self.promoting[i] = spare
        took = f"the {'warm' if ready else 'warming'} spare {spare[0]} takes its place" if spare else None
        self.ctx.event(Kind.ROLLOUT_FAULT, f"rollout worker {i} lost: {describe_error(err)}; "
                       + (took or f"replacing it in {backoff:.1f}s"), worker=i, group="rollout", backoff_s=backoff,
                       **({"spare": spare[0], "spare_ready": ready} if spare else {}))  # fmt: skip
        self.waiting[i] = time.monotonic() + backoff

    def drain(self, i: int, deadline: float) -> None:
        """Worker ``i``'s Ray node is being drained (deadline: epoch seconds, 0 for none): it takes
        no more work, and leaves as a preempted worker once it is idle (see :meth:`free`)."""
        if i not in self.workers or i in self.draining or i in self.waiting or i in self.promoting:
            return
        if any(j == i for j, _ in self.joining.values()):
            return  # not joined yet: the record read may still be its predecessor's, on the draining node
        self.draining[i] = deadline
        left = f" (deadline in {deadline - time.time():.0f}s)" if deadline else ""
        log.info("job %s: rollout worker %d is on a draining Ray node%s", self.ctx.job, i, left)
        if i in self.idle:
            self.preempted(i, {"preempted_at": time.time()}, f"its Ray node is draining{left}")

    def free(self, i: int) -> None:
        """Worker ``i`` answered its call: idle again, or it leaves if its node is draining."""
        if i not in self.workers:
            return
        self.failures.pop(i, None)  # it served: no longer a crash loop
        if i in self.draining:
            self.preempted(i, {"preempted_at": time.time()}, "its Ray node is draining; its shard is in")
            return
        self.idle.add(i)

    def _replace_at_once(self, i: int) -> tuple[str, Any] | None:
        """Empty index ``i`` and take its place at once with a spare (returned) or a new worker
        (see :meth:`tick`): no restart spent from the budget, no backoff."""
        taken = self._vacate(i)
        spare = taken or (self._spare(i)[0] if i < self.ctx.want("rollout") else None)
        if spare is not None:
            self.promoting[i] = spare
        self.waiting[i] = time.monotonic()
        return spare

    def lost_with_its_process(self, i: int) -> bool:
        """True if worker ``i`` ended because the trainer group ended the process it shares with
        a rank (``placement: colocated``: a cold restart, a resize; see ``Actors.lost_with``). Not
        its fault: it is replaced at once, no restart spent (its shard is re-queued by the caller)."""
        w = self.workers.get(i)
        role = self.actors.lost_with(w) if w is not None else None
        if role is None:
            return False
        spare = self._replace_at_once(i)
        self.ctx.event(Kind.ROLLOUT_REPLACED, f"rollout worker {i} ended with its process, which the {role} group "
                       "restarted: " + (f"the warm spare {spare[0]} takes its place" if spare else
                                        "a new worker takes its place"),
                       worker=i, group="rollout", cause=role, **({"spare": spare[0]} if spare else {}))  # fmt: skip
        return True

    def preempted(self, i: int, info: dict[str, Any], what: str) -> None:
        """Worker ``i`` was preempted (SIGTERM, a node drain: see ``RolloutWorker``) and has
        journaled what it finished (``what`` says how much; its shard, if any, is re-queued by the
        caller): stop it and take its place at once with a spare or a new worker. Not a fault:
        no restart is spent from the budget and there is no backoff."""
        spare = self._replace_at_once(i)
        at = info.get("preempted_at")
        drained = round(time.time() - float(at), 3) if isinstance(at, (int, float)) else None
        self.ctx.event(Kind.PREEMPTED, f"rollout worker {i} preempted: {what}; "
                       + (f"the warm spare {spare[0]} takes its place" if spare else "a new worker takes its place"),
                       worker=i, group="rollout", drained_s=drained, grace_s=self.ctx.spec.fault.preempt_grace_s,
                       **({"spare": spare[0]} if spare else {}),
                       **{f: info[f] for f in ("groups_done", "groups") if f in info})  # fmt: skip

    def tick(self, version: int, weights: Any) -> None:
        """Start the replacements whose backoff has passed (a spare taken for one: at once)."""
        now = time.monotonic()
        for i, at in list(self.waiting.items()):
            if at <= now:
                del self.waiting[i]
                spare = self.promoting.pop(i, None)
                if i < self.ctx.want("rollout") and i not in self.workers:
                    spare = spare or self._spare(i)[0]  # one may have begun warming, or be ready, since the fault
                    if spare is not None:
                        self._promote(i, spare[0], spare[1], version, weights)
                    else:
                        self.add(i, version, weights)
                elif spare is not None:  # scaled down meanwhile: the spare goes back
                    self.spares.ready.append(spare)

    def resize(self, want: int, version: int, weights: Any) -> None:
        """Grow to ``want`` workers (async join) or drain the ones above it (stop when idle)."""
        A = self.actors
        self.tick(version, weights)
        for i in range(want):
            if i not in self.workers and i not in self.waiting:
                self.ctx.event(Kind.SCALE, f"rollout: adding worker {i} (desired {want})", worker=i)
                self.add(i, version, weights)
        for i in sorted(self.workers):
            if i >= want and i in self.idle:
                self.idle.discard(i)
                w = self.workers.pop(i)
                try:
                    A.get(A.call(w, "shutdown"), timeout=10)
                    A.retire(w)  # it left: a process it shares with a trainer rank lives on
                except Exception as e:  # already gone: nothing to drain
                    log.info("shutdown of drained worker %d: %s", i, e)
                    A.kill(w)
                self._serve(i, None)
                self.ctx.event(Kind.SCALE, f"rollout: worker {i} drained and stopped (desired {want})",
                               worker=i)  # fmt: skip


def _slowest_parts(reformed: list[dict[str, Any]]) -> dict[str, float]:
    """Of each part of a hot recovery the ranks timed (their answers' ``phases``: join, regroup,
    state and the state's own parts), the slowest rank's, as ``reform_<part>``."""
    parts = dict.fromkeys(k for x in reformed for k in (x.get("phases") or {}))
    return {f"reform_{k}": max(float((x.get("phases") or {}).get(k, 0.0)) for x in reformed) for k in parts}


class TrainerGroup:
    """All ranks of the trainer, started, restored and replayed together."""

    def __init__(self, ctx: JobContext, model_dir: str, faults: FaultPolicy) -> None:
        self.ctx = ctx
        self.actors = ctx.actors
        self.faults = faults
        self.model_dir = model_dir
        self.ranks: list[Any] = []
        self.strategy = ctx.strategy()  # what the running ranks train under (set by start / adopt)
        # called while a (re)start or a recovery waits on the ranks: the runner serves the rollouts
        # there (dispatch, take in, journal), so generation goes on up to the staleness bound
        self.pump: Callable[[], list[Any]] = list  # returns the calls it serves (to wake up on)
        # called once, by the next start, right after it asked Ray for the ranks: a fresh start's
        # rollout workers are created there (see RolloutGroup.prestart), placed after the ranks
        self.after_ranks_created: Callable[[], None] | None = None
        # a hot recovery's retried step: no spare is refilled until it is committed (see fill_spares)
        self.refill_after: int | None = None
        # why the last hot path did not apply, and when (monotonic): the cold restart that follows
        # says it in its event (``hot_refused``), not only the controller's log
        self.refused: tuple[str, float] | None = None
        c = ctx
        # warm spares, ready to be promoted: taking one raises its fence to this leader's
        self.spares = SparePool(ctx, "trainer-spare", self._create_spare,
                                probe=lambda a: self.actors.call(a, "adopt", c.token, c.spec.digest()))  # fmt: skip

    @property
    def world(self) -> int:
        return len(self.ranks)

    def _placement(self) -> Placement:
        """Where a rank or a spare runs: ``trainer.num_cpus``/``num_gpus`` reserved, with the
        trainer's environment (threads, gloo) over the job's."""
        t = self.ctx.spec.trainer
        return Placement(t.num_cpus, t.num_gpus, trainer_runtime_env(self.ctx.spec))

    def start(self, k: int, world: int) -> Any:
        """(Re)start ``world`` ranks at committed step ``k``; returns the weights of version k
        (None when k is 0: workers start from the model folder, which is version 0)."""
        from .checkpointing import choose_restore

        A, c = self.actors, self.ctx
        self.kill(keep_spares=c.strategy() == self.strategy and c.spec.trainer.hot_recovery)  # spares of the strategy
        # on the stable node (the Ray head): the published weights die with their owner
        store = A.create("weights", c.actor_name("weights", 0), (),
                         Placement(on_this_node=True, get_if_exists=True))  # fmt: skip
        placement = self._placement()
        strategy = self.strategy = c.strategy()
        if c.read_state().get("trainer_actors"):
            c.update_state(expect=live, trainer_actors=None)  # every rank under its own name again
        self.ranks = [
            create_fresh(A, "trainer", c.actor_name("trainer", i),
                         (c.job, i, world, c.spec.to_json(), self.model_dir, str(c.workdir), c.etcd, strategy),
                         placement)
            for i in range(world)
        ]  # fmt: skip
        if self.after_ranks_created is not None:
            hook, self.after_ranks_created = self.after_ranks_created, None
            hook()
        self.refill_after = None
        self.fill_spares()  # the spares warm beside the ranks, not after them: a fault soon after a start is hot too
        A.get(A.call(store, "ping"))  # the ranks and the store start together
        A.call(store, "warm")  # not waited for: it imports while the ranks start (a first pull queues behind it)
        restore, s = choose_restore(c, k)
        shadow = self._usable_shadow(store, k, s, world, strategy)
        master = A.get(A.call(self.ranks[0], "address"))
        if shadow is not None:  # as new as any snapshot: restore it from memory, replay less
            s, restore = shadow["step"], None
            ready = self._get([A.call(r, "setup", master, None, {"step": s, "rank": 0 if shadow["sources"] == 1 else i})
                               for i, r in enumerate(self.ranks)])  # fmt: skip
            self.ctx.event(Kind.SHADOW_RESTORED, f"trainer state of step {s} restored from the in-memory shadow copy",
                           step=s, world=world, strategy=strategy)  # fmt: skip
        else:
            ready = self._get([A.call(r, "setup", master, restore) for r in self.ranks])
        A.get([A.call(r, "adopt", c.token, c.spec.digest()) for r in self.ranks])  # fence them
        self.ctx.record_lineage(k, {"from_step": s, "snapshot": restore if shadow is None else f"shadow@{s}",
                                  "world": world, "strategy": strategy, "threads": ready[0]["threads"]})  # fmt: skip
        if k == 0:
            return None
        if s < k:
            self.ctx.event(Kind.REPLAY, f"replaying steps {s}..{k - 1} from the journal", first=s, last=k - 1)
        out = None
        for j in range(s, k):
            self.ctx.check_leader()
            out = self._get([A.call(t, "train_step", j, j == k - 1, c.token) for t in self.ranks])[0]
        return out["weights"] if out is not None else self.publish()

    def publish(self) -> Any:
        """Publish the current weights; returns the handle. Every rank takes part (under fsdp the
        weights are gathered from the shards); rank 0's answer carries the handle."""
        A = self.actors
        return A.get([A.call(r, "publish") for r in self.ranks])[0]["weights"]

    def digest(self, timeout: float | None = None) -> str:
        """The weights' digest (rank 0's answer; every rank takes part, see :meth:`publish`)."""
        A = self.actors
        return str(A.get([A.call(r, "digest") for r in self.ranks], timeout=timeout)[0])

    def _usable_shadow(self, store: Any, k: int, s: int, world: int, strategy: str) -> dict[str, Any] | None:
        """The weight store's newest complete shadow copy if a restart at committed step ``k`` can
        use it instead of the snapshot of step ``s``: at least as new (a copy in memory of the
        same step loads faster than the disk), not past ``k``, this spec,
        and a layout it loads into (ddp's replicated copy at any world size; fsdp's shards at
        the world size and strategy they were taken at)."""
        if not self.ctx.spec.trainer.shadow_every:
            return None
        A = self.actors
        try:
            sh = A.get(A.call(store, "shadow", k), timeout=30)
        except Exception as e:  # no shadow is no fault: the snapshot serves
            log.warning("job %s: shadow copy not readable (%s): restoring the snapshot", self.ctx.job, e)
            return None
        if not sh or not s <= sh["step"] <= k or sh["spec_digest"] != self.ctx.spec.digest():
            return None
        if sh["strategy"] != strategy or (strategy == "fsdp" and sh["world"] != world):
            return None
        return dict(sh)

    def adopt(self, k: int, world: int) -> tuple[int, dict[int, dict[str, Any]], Any] | None:
        """Take over ranks left running by a previous leader (or an etcd outage).

        Returns ``(step, recent_results, weights)`` when ``world`` ranks of this job answer
        with the same step: ``k`` (committed), ``k + 1`` (trained, commit lost) or ``k + 2``
        (the previous leader sent step k+1 before it committed step k, see
        ``JobRunner._committed``, and then lost both commits); ``recent_results`` is rank
        0's results by step (its two newest). Else None (the caller restarts the group).
        ``adopt`` on a rank waits for a train step in progress, so the steps it reports
        are settled.
        """
        A = self.actors
        found = [A.find(name) for name in self.rank_names(world)]
        if not found or any(a is None for a in found):
            return None
        # adopt answers from its own concurrency group: a rank that cannot answer within the lease
        # TTL and a few seconds is frozen or gone; one still training is asked again until done
        answer_s = self.ctx.spec.fault.lease_ttl + 5.0
        settle_by = time.monotonic() + self.ctx.spec.fault.hang_timeout
        while True:
            try:
                status = A.get([A.call(a, "adopt", self.ctx.token, self.ctx.spec.digest()) for a in found],
                               timeout=answer_s)  # fmt: skip
            except Exception as e:
                self.ctx.raise_if_stale(e)
                log.warning(
                    "job %s: trainer ranks not adoptable (%s): restarting them", self.ctx.job, describe_error(e)
                )
                return None
            if not any(x.get("busy") for x in status):
                break
            if time.monotonic() > settle_by:
                log.warning("job %s: trainer ranks still in the previous leader's step after %.0fs (hang_timeout): "
                            "restarting them", self.ctx.job, self.ctx.spec.fault.hang_timeout)  # fmt: skip
                return None
            self.ctx.check_leader()
            time.sleep(0.2)
        steps = {x["step"] for x in status}
        strategies = {x.get("strategy", "ddp") for x in status}
        if strategies != {self.ctx.strategy()}:
            log.warning("job %s: trainer ranks run %s, the job wants %s: restarting them",
                        self.ctx.job, sorted(strategies), self.ctx.strategy())  # fmt: skip
            return None
        if len(steps) != 1 or {x["world"] for x in status} != {world} or not steps <= {k, k + 1, k + 2}:
            log.warning("job %s: trainer ranks at steps %s (world %s), etcd says %d: restarting them",
                        self.ctx.job, sorted(steps), sorted({x["world"] for x in status}), k)  # fmt: skip
            return None
        s = steps.pop()
        self.ranks, self.strategy = found, strategies.pop()
        self.spares.adopt_running(set(self.rank_names(world)))  # a previous leader's idle spares serve on
        return s, dict(status[0].get("recent") or {}), self.weights_of(s)

    def weights_of(self, s: int) -> Any:
        """The handle of version ``s`` the weight store still holds, else published now (None at 0)."""
        if s == 0:
            return None
        A = self.actors
        ws = A.find(self.ctx.actor_name("weights", 0))
        kept = A.get(A.call(ws, "get", s)) if ws is not None else None
        return kept[0] if kept else self.publish()

    def start_retrying(self, k: int, world: int) -> Any:
        """:meth:`start`; a rank that dies meanwhile (node lost, OOM) costs one restart of the
        budget and the group starts again after a backoff that doubles per start failed in a row
        (:func:`~resilient_rl.job.faults.backoff_s`), rather than failing the job. (The backoff
        matters after a node loss: until Ray has seen the node die it may place a new rank
        there, and retries at once would spend the budget in seconds.)"""
        # a rank Ray cannot reach but has not seen die (its node is gone, Ray's health check
        # lags by ~10-30 s and may even place new ranks there meanwhile) is not the job's
        # crash loop: such starts are retried, backed off, without spending the budget, for
        # as long as Ray may take to notice (at least a minute)
        patience_until = time.monotonic() + max(60.0, self.ctx.spec.fault.hang_timeout)
        waited, failed = 0.5, 0  # failed: starts that died in a row (the backoff; each spends the budget)
        while True:
            self.ctx.check_leader()
            try:
                return self.start(k, world)
            except Exception as e:
                if not actor_died(e):
                    raise
                budgeted = not (unreachable(e) and time.monotonic() < patience_until)
                if budgeted:
                    self.faults.restart("trainer")
                    failed += 1
                    backoff = backoff_s(failed)
                else:
                    backoff, waited = waited, min(10.0, waited * 2)
                self.ctx.event(Kind.TRAINER_RESTART, f"a trainer rank died while starting ({describe_error(e)}): "
                               f"starting the group again in {backoff:.1f}s"
                               + ("" if budgeted else " (unreachable, not yet dead for Ray: no restart counted)"),
                               world=world, group="trainer", cause="start_failed", resize=False, backoff_s=backoff,
                               budgeted=budgeted)  # fmt: skip
                self._wait(backoff)

    def _get(self, refs: Any, timeout: float | None = None) -> Any:
        """``actors.get(refs, timeout)``, calling :attr:`pump` whenever one of the calls it serves
        finished (or every 0.2 s) while it waits. Raises as soon as one of ``refs`` failed (as a
        rank's death fails its peers' collective)."""
        A = self.actors
        watched = list(refs) if isinstance(refs, list) else [refs]
        end = None if timeout is None else time.monotonic() + timeout
        served: list[Any] = self.pump()  # the pump's calls in flight (shards, joins): their end wakes this up
        while True:
            done, pending = A.wait(watched, num_returns=len(watched), timeout=0)
            for ref in done:
                A.get(ref, timeout=0)  # a failed call raises here, whatever the others do
            left = None if end is None else max(0.0, end - time.monotonic())
            if not pending or left == 0.0:
                return A.get(refs, timeout=0)  # (past the timeout: GetTimeoutError)
            A.wait([*pending, *served], num_returns=1, timeout=0.2 if left is None else min(0.2, left))
            served = self.pump()

    def wait_all(self, refs: list[Any], timeout: float | None = None, probe: TrainerProbe | None = None) -> bool:
        """Wait until every call of ``refs`` has ended (failed or not: nothing is raised), serving
        :attr:`pump` meanwhile as :meth:`_get` does; False if ``timeout`` passed first. With a
        ``probe``, a rank found frozen meanwhile is killed (its calls then end, failed)."""
        A = self.actors
        end = None if timeout is None else time.monotonic() + timeout
        served: list[Any] = self.pump()
        while True:
            if probe is not None:
                probe.check()
            _, pending = A.wait(refs, num_returns=len(refs), timeout=0)
            left = None if end is None else max(0.0, end - time.monotonic())
            if not pending or left == 0.0:
                return not pending
            A.wait([*pending, *served], num_returns=1, timeout=0.2 if left is None else min(0.2, left))
            served = self.pump()

    def _wait(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.ctx.check_leader()  # a deposed runner stops waiting at once
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))

    def restart(
        self, k: int, world: int, why: str, *, cause: str = "fault", resize: bool = False, preempted: bool = False
    ) -> Any:
        """A rank died (or the world size changes, ``resize``; or a rank was preempted): restart
        the whole group at step ``k``. Only a loss spends a restart of the budget: a resize is
        an operator's (or the autoscaler's) and a preemption a notice, neither a crash loop.
        Returns the weights of version k (as :meth:`start`)."""
        self.ctx.check_leader()
        t0 = time.monotonic()
        refused, self.refused = self.refused, None
        note = {} if resize or refused is None or t0 - refused[1] > 60.0 else {"hot_refused": refused[0]}
        if note:
            why += f"; not hot: {note['hot_refused']}"
        self.ctx.event(Kind.PREEMPTED if preempted else Kind.TRAINER_RESTART,
                       f"{why}: restarting {world} trainer ranks at step {k}", world=world, group="trainer",
                       cause=cause, resize=resize, step=k, **({} if resize else {"recovery": "cold"}), **note)  # fmt: skip
        if not preempted and not resize:
            self.faults.restart("trainer")
        weights = self.start_retrying(k, world)
        self.ctx.event(Kind.TRAINER_RECOVERED, f"trainer group back at step {k} in {time.monotonic() - t0:.1f}s",
                       seconds=round(time.monotonic() - t0, 2), world=world, group="trainer", resize=resize,
                       preempted=preempted, **({} if resize else {"recovery": "cold"}))  # fmt: skip
        return weights

    def recover_hot(self, k: int, refs: list[Any], why: str, step_s: float = 0.0, *, preempted: bool = False) -> bool:
        """Hot recovery from lost ranks while train step ``k`` ran (``refs``, one per rank): the
        survivors keep their processes and state, re-form the process group with a new rank in
        each lost one's place, and send it their state (broadcast); the caller then trains step
        ``k`` again from its journaled batch. Under fsdp no rank holds a lost rank's shards, so
        every rank loads the shadow copy instead (:meth:`_recover_from_shadow`); at world 1 a
        spare takes over (:meth:`_recover_alone`). True if done; False when only the cold path
        can serve (nothing was changed that :meth:`restart` does not redo): a survivor that does
        not answer, or (ddp) one whose state is not the committed step's (it may have applied
        step ``k``), or a newcomer whose state fingerprint differs from the survivors'. ``step_s``: the slowest train step
        seen (a survivor's call ends when its step reaches the collective that fails).
        ``preempted``: the lost ranks were stopped on notice at a step boundary (the runner's
        ``_hand_over``): a ``preempted`` event instead of a fault's, no restart spent."""
        A, c = self.actors, self.ctx
        self.refused = None
        if self.strategy not in ("ddp", "fsdp"):
            return self._refuse(f"strategy {self.strategy} has no hot path")
        if self.world == 1:
            return self._recover_alone(k, refs[0], why, preempted=preempted)
        t_wait = time.monotonic()
        found = self._survivors(k, refs, step_s)
        if found is None:
            return False
        lost, survivors, status = found
        if self.strategy == "fsdp":
            return self._recover_from_shadow(k, lost, survivors, status, why, t_wait, preempted=preempted)
        if any(x["step"] != k or x["busy"] for x in status):
            return self._refuse(f"surviving trainer ranks at steps {[x['step'] for x in status]}"
                                f"{' (busy)' if any(x['busy'] for x in status) else ''}, committed {k}")  # fmt: skip
        committed = c.read_state().get("state_sketch") or []
        moved = [i for i, x in zip(survivors, status, strict=True)
                 if committed and x.get("sketch") != committed[i if i < len(committed) else 0]]  # fmt: skip
        if moved:  # its step counter says k, its state is not step k's: it cannot be trusted
            return self._refuse(f"surviving trainer rank(s) {moved} do not hold the state committed at step {k} "
                                "(sketch differs)")  # fmt: skip
        t0 = time.monotonic()
        phases = {"survivors": round(t0 - t_wait, 3)}  # their calls ending, their answers, the sketch check
        if not preempted:
            self.faults.restart("trainer")
        c.event(Kind.PREEMPTED if preempted else Kind.TRAINER_RESTART,
                f"{why}: hot {'hand-over' if preempted else 'recovery'} of rank(s) {lost} at step {k}; the survivors "
                f"{survivors} keep their state", world=self.world, group="trainer",
                cause="preempted" if preempted else "lost", resize=False, step=k, recovery="hot", lost=lost,
                survivors=survivors, survivor_pids=[x["pid"] for x in status], worker=lost[0])  # fmt: skip
        promoted, fresh = self._newcomers(lost)
        phases["spares"] = round(time.monotonic() - t0, 3)
        src = survivors[0]
        master = A.get(A.call(self.ranks[src], "address", True), timeout=30)
        calls = [A.call(self.ranks[i], "reform", master, c.token, src) for i in survivors]
        calls += [A.call(a, "promote", master, i, self.world, c.token, src) for i, (_, a) in promoted.items()]
        calls += [A.call(a, "setup", master, None, None, src) for i, a in fresh.items()]
        limit = max(300.0, c.spec.fault.hang_timeout)
        t_reform = time.monotonic()
        reformed = self._get(calls, timeout=limit)
        phases["reform"] = round(time.monotonic() - t_reform, 3)
        phases.update(_slowest_parts(reformed))
        self._seat(lost, promoted, fresh, limit)
        # every rank's state fingerprint, hashed while the state crossed (TrainCore.share_state)
        prints = [x for x in reformed if x.get("fingerprint")]
        if len(prints) != self.world:
            raise RuntimeError(f"after the hot recovery {self.world - len(prints)} rank(s) gave no state fingerprint")
        if len({(x["fingerprint"], x["step"]) for x in prints}) != 1:
            raise RuntimeError(f"after the hot recovery the ranks' state fingerprints differ: "
                               f"{[(x['rank'], x['fingerprint'][:12]) for x in prints]}")  # fmt: skip
        epoch = self._next_epoch()
        secs = round(time.monotonic() - t0, 2)
        c.event(Kind.TRAINER_RECOVERED, f"trainer group whole again at step {k} in {secs}s (hot: rank(s) {lost} "
                f"replaced, epoch {epoch})", seconds=secs, world=self.world, group="trainer", resize=False,
                recovery="hot", epoch=epoch, fingerprint=prints[0]["fingerprint"][:16],
                spares_used=len(promoted), phases=phases, preempted=preempted)  # fmt: skip
        self.refill_after = k
        return True

    def _refuse(self, reason: str) -> bool:
        """The hot path does not apply: say why in the log and keep it for the cold restart's
        event (:meth:`restart`). Returns False (nothing was changed)."""
        log.warning("job %s: %s: cold path", self.ctx.job, reason)
        self.refused = (reason, time.monotonic())
        return False

    def _newcomers(self, lost: list[int]) -> tuple[dict[int, tuple[str, Any]], dict[int, Any]]:
        """Kill the lost ranks' actors; a warm spare for each if one answers (``promoted``: index
        -> (name, actor)), else a new process (``fresh``: index -> actor)."""
        A, c = self.actors, self.ctx
        placement = self._placement()
        for i in lost:
            A.kill(self.ranks[i])
        promoted = {i: a for i in lost if (a := self._take_spare()) is not None}
        fresh = {i: create_fresh(A, "trainer", c.actor_name("trainer", i),
                                 (c.job, i, self.world, c.spec.to_json(), self.model_dir, str(c.workdir), c.etcd,
                                  self.strategy), placement)
                 for i in lost if i not in promoted}  # fmt: skip
        return promoted, fresh

    def _seat(self, lost: list[int], promoted: dict[int, tuple[str, Any]], fresh: dict[int, Any], limit: float) -> None:
        """The newcomers, in the group: in the lost ranks' places, the new processes fenced, and the
        promoted spares' names in the job's state (a new leader adopts ranks by them)."""
        A, c = self.actors, self.ctx
        for i, a in {**{i: a for i, (_, a) in promoted.items()}, **fresh}.items():
            self.ranks[i] = a
        A.get([A.call(fresh[i], "adopt", c.token, c.spec.digest()) for i in fresh], timeout=limit)  # fence them
        names = dict(c.read_state().get("trainer_actors") or {})
        for i in lost:
            names.pop(str(i), None)
        names.update({str(i): name for i, (name, _) in promoted.items()})
        c.update_state(expect=live, trainer_actors=names or None)

    def _survivors(
        self, k: int, refs: list[Any], step_s: float
    ) -> tuple[list[int], list[int], list[dict[str, Any]]] | None:
        """Which ranks of train step ``k`` were lost and which survived, and the survivors'
        answers to ``adopt`` (their step, sketch, pid); None when the hot path cannot apply: a rank
        still in the step after the wait (``step_s``: the slowest train step seen; a survivor's
        call ends when its step reaches the collective that fails), none lost, none left, or a
        survivor that does not answer."""
        A, c = self.actors, self.ctx
        wait_s = self.faults.survivor_wait_s(step_s)
        A.wait(refs, num_returns=len(refs), timeout=wait_s)
        lost, survivors = [], []
        for i, ref in enumerate(refs):
            done, _ = A.wait([ref], timeout=0)
            if not done:
                self._refuse(f"trainer rank {i} still in step {k} after {wait_s:.0f}s")
                return None
            try:
                A.get(ref, timeout=0)
                survivors.append(i)  # (its step finished: the ddp state check refuses it)
            except Exception as e:
                c.raise_if_stale(e)
                (lost if actor_died(e) else survivors).append(i)
        if not lost or not survivors:
            self._refuse(f"trainer ranks lost {lost}, survived {survivors} in step {k}")
            return None
        try:
            status = A.get([A.call(self.ranks[i], "adopt", c.token, c.spec.digest()) for i in survivors],
                           timeout=c.spec.fault.lease_ttl + 5.0)  # fmt: skip
        except Exception as e:
            c.raise_if_stale(e)
            self._refuse(f"a surviving trainer rank does not answer ({describe_error(e)})")
            return None
        return lost, survivors, status

    def _recover_from_shadow(
        self, k: int, lost: list[int], survivors: list[int], status: list[dict[str, Any]], why: str, t_wait: float,
        *, preempted: bool = False,
    ) -> bool:  # fmt: skip
        """Hot recovery of an fsdp group (world >= 2): the lost ranks' shards exist nowhere but
        in the shadow copy, so every rank goes back to it. The survivors keep their processes
        (torch, the model files read, no Ray start) and re-form the process group with a warm
        spare (or a new process) in each lost rank's place; each rank rebuilds its sharded model
        on the new mesh and loads its own part of the newest complete shadow copy of step
        ``s <= k`` from the weight store; the group replays steps ``s..k-1`` from the journal
        (at most ``trainer.shadow_every``) and must then show the sketches the commit of step
        ``k - 1`` recorded, rank by rank. False (nothing changed) when no usable shadow copy is
        held or no weight store answers: the cold path restores the snapshot."""
        from .checkpointing import choose_restore

        A, c = self.actors, self.ctx
        if any(x["busy"] for x in status):
            return self._refuse("a surviving trainer rank is busy")
        store = A.find(c.actor_name("weights", 0))
        if store is None:
            return self._refuse("no weight store answers")
        _, s = choose_restore(c, k)
        shadow = self._usable_shadow(store, k, s, self.world, "fsdp")
        if shadow is None:
            return self._refuse(f"no usable shadow copy of the fsdp shards at or before step {k}")
        s = int(shadow["step"])
        t0 = time.monotonic()
        phases = {"survivors": round(t0 - t_wait, 3)}
        if not preempted:
            self.faults.restart("trainer")
        c.event(Kind.PREEMPTED if preempted else Kind.TRAINER_RESTART,
                f"{why}: hot {'hand-over' if preempted else 'recovery'} of rank(s) {lost} at step {k}; the survivors "
                f"{survivors} keep their processes and, with the newcomers, load the shadow copy of step {s}",
                world=self.world, group="trainer", cause="preempted" if preempted else "lost", resize=False, step=k,
                recovery="hot", lost=lost, survivors=survivors, survivor_pids=[x["pid"] for x in status],
                worker=lost[0])  # fmt: skip
        promoted, fresh = self._newcomers(lost)
        phases["spares"] = round(time.monotonic() - t0, 3)
        master = A.get(A.call(self.ranks[survivors[0]], "address", True), timeout=30)
        calls = [A.call(self.ranks[i], "reform", master, c.token, None, {"step": s, "rank": i}) for i in survivors]
        calls += [A.call(a, "promote", master, i, self.world, c.token, None, None, {"step": s, "rank": i})
                  for i, (_, a) in promoted.items()]  # fmt: skip
        calls += [A.call(a, "setup", master, None, {"step": s, "rank": i}, None, True) for i, a in fresh.items()]
        limit = max(300.0, c.spec.fault.hang_timeout)
        t_reform = time.monotonic()
        reformed = self._get(calls, timeout=limit)
        phases["reform"] = round(time.monotonic() - t_reform, 3)
        phases.update(_slowest_parts(reformed))  # (regroup: the sharded model built)
        self._seat(lost, promoted, fresh, limit)
        c.event(Kind.SHADOW_RESTORED, f"trainer state of step {s} restored from the in-memory shadow copy into the "
                f"re-formed group", step=s, world=self.world, strategy=self.strategy)  # fmt: skip
        c.record_lineage(k, {"from_step": s, "snapshot": f"shadow@{s}", "world": self.world,
                             "strategy": self.strategy, "threads": reformed[0]["threads"]})  # fmt: skip
        if s < k:
            c.event(Kind.REPLAY, f"replaying steps {s}..{k - 1} from the journal", first=s, last=k - 1)
        t_replay = time.monotonic()
        outs: list[dict[str, Any]] = []
        for j in range(s, k):
            c.check_leader()
            outs = self._get([A.call(r, "train_step", j, False, c.token) for r in self.ranks], timeout=limit)
        phases["replay"] = round(time.monotonic() - t_replay, 3)
        committed = c.read_state().get("state_sketch") or []
        now = [x["sketch"] for x in outs] if outs else [x["sketch"] for x in A.get(
            [A.call(r, "adopt", c.token, c.spec.digest()) for r in self.ranks], timeout=limit)]  # fmt: skip
        if committed and now != committed[: len(now)]:
            raise RuntimeError(f"the group's state after the replay to step {k} is not the committed one "
                               f"(sketches {now} != {committed})")  # fmt: skip
        epoch = self._next_epoch()
        secs = round(time.monotonic() - t0, 2)
        c.event(Kind.TRAINER_RECOVERED, f"trainer group whole again at step {k} in {secs}s (hot: rank(s) {lost} "
                f"replaced, every rank from the shadow copy of step {s}, epoch {epoch})", seconds=secs,
                world=self.world, group="trainer", resize=False, recovery="hot", epoch=epoch,
                spares_used=len(promoted), source="shadow", replayed=k - s, phases=phases,
                preempted=preempted)  # fmt: skip
        self.refill_after = k
        return True

    def _recover_alone(self, k: int, ref: Any, why: str, *, preempted: bool = False) -> bool:
        """Hot recovery at world 1, where no survivor holds the state: a warm spare becomes rank 0
        and loads the newest state from memory (the shadow copy) or, older, the snapshot, then
        replays the journal up to the committed step ``k`` (at most ``trainer.shadow_every``
        steps from the shadow copy). No process is started. The replayed state must show the
        sketch the commit of step ``k - 1`` recorded, else the cold path runs. False (nothing
        changed) when the rank did not die or no spare answers."""
        A, c = self.actors, self.ctx
        try:
            A.get(ref, timeout=0)
            return self._refuse("the only trainer rank answered: not a loss")  # (finished: not one this path serves)
        except Exception as e:
            c.raise_if_stale(e)
            if not actor_died(e):
                return self._refuse(f"the only trainer rank failed but did not die ({describe_error(e)})")
        store = A.find(c.actor_name("weights", 0))
        taken = self._take_spare()
        if taken is None or store is None:
            return self._refuse("no warm trainer spare answers" if store is not None else "no weight store answers")
        self._promote_alone(k, taken, store, why, cause="preempted" if preempted else "lost", preempted=preempted)
        return True

    def adopt_alone(self, k: int, why: str) -> bool:
        """A take-over at world 1 whose rank did not answer (killed with the previous leader or
        just before it, or stuck): an idle warm spare the previous leader left becomes rank 0 as
        in :meth:`_recover_alone` (the shadow copy, a replay up to the committed step ``k``)
        instead of a new process (a cold start: seconds of importing torch on the critical
        path; the burst of BENCHMARKS section 5). True if done; False when it does not apply
        (hot recovery off, another world or strategy, no spare answers, no weight store): the
        caller takes the cold path, which keeps the spares taken in here. Raises if the
        promoted spare's state misses the commit (the caller takes the cold path too)."""
        A, c = self.actors, self.ctx
        if not c.spec.trainer.hot_recovery or c.spec.trainer.spares < 1 or c.strategy() not in ("ddp", "fsdp"):
            return self._refuse("hot recovery is off, or no trainer spares, or a strategy without a shadow copy")
        self.strategy = c.strategy()
        self.spares.adopt_running(set(self.rank_names(1)))
        # their warm() answers at once for a warm spare; one still warming is given a lease TTL
        deadline = time.monotonic() + c.spec.fault.lease_ttl + 5.0
        while not self.spares.ready and self.spares.still_warming() and time.monotonic() < deadline:
            c.check_leader()
            time.sleep(0.05)
        self.kill(keep_spares=True)  # the rank that did not answer, and any spare not taken in
        store = A.find(c.actor_name("weights", 0))
        taken = self._take_spare() if store is not None else None
        if taken is None:
            return self._refuse("no warm trainer spare answers" if store is not None else "no weight store answers")
        if A.get(A.call(taken[1], "adopt", c.token, c.spec.digest()), timeout=30).get("strategy") != self.strategy:
            A.kill(taken[1])  # warmed under the strategy before an ``rrl scale --strategy``
            return self._refuse(f"the warm spare was built for another strategy than {self.strategy}")
        self._promote_alone(k, taken, store, why, cause="take_over")
        return True

    def _promote_alone(
        self, k: int, taken: tuple[str, Any], store: Any, why: str, *, cause: str, preempted: bool = False
    ) -> None:
        """Make the spare ``taken`` rank 0 of world 1 at committed step ``k`` (see :meth:`_recover_alone`)."""
        from .checkpointing import choose_restore

        A, c = self.actors, self.ctx
        name, spare = taken
        t0 = time.monotonic()
        if not preempted:
            self.faults.restart("trainer")
        c.event(Kind.PREEMPTED if preempted else Kind.TRAINER_RESTART,
                f"{why}: hot {'hand-over' if preempted else 'recovery'} of rank 0 at step {k} by a warm spare",
                world=1, group="trainer", cause=cause, resize=False, recovery="hot",
                lost=[0], survivors=[], step=k, worker=0)  # fmt: skip
        if self.ranks:
            self.actors.kill(self.ranks[0])
        restore, s = choose_restore(c, k)
        shadow = self._usable_shadow(store, k, s, 1, self.strategy)
        if shadow is not None:
            s, restore = int(shadow["step"]), None
        master = A.get(A.call(spare, "address", True), timeout=30)
        limit = max(300.0, c.spec.fault.hang_timeout)
        ready = self._get(A.call(spare, "promote", master, 0, 1, c.token, None, restore,
                                 {"step": s, "rank": 0} if shadow is not None else None), timeout=limit)  # fmt: skip
        self.ranks = [spare]
        c.update_state(expect=live, trainer_actors={"0": name})
        if shadow is not None:
            c.event(Kind.SHADOW_RESTORED, f"trainer state of step {s} restored from the in-memory shadow copy "
                    "into a warm spare", step=s, world=1, strategy=self.strategy)  # fmt: skip
        c.record_lineage(k, {"from_step": s, "snapshot": restore if shadow is None else f"shadow@{s}", "world": 1,
                             "strategy": self.strategy, "threads": ready["threads"]})  # fmt: skip
        if s < k:
            c.event(Kind.REPLAY, f"replaying steps {s}..{k - 1} from the journal", first=s, last=k - 1)
        out: dict[str, Any] | None = None
        for j in range(s, k):
            c.check_leader()
            out = self._get(A.call(spare, "train_step", j, False, c.token), timeout=limit)
        committed = c.read_state().get("state_sketch") or []
        now = out["sketch"] if out is not None else A.get(A.call(spare, "adopt", c.token, c.spec.digest()))["sketch"]
        if committed and now != committed[0]:
            raise RuntimeError(f"the spare's state after the replay to step {k} is not the committed one "
                               f"(sketch {now} != {committed[0]})")  # fmt: skip
        epoch = self._next_epoch()
        secs = round(time.monotonic() - t0, 2)
        c.event(Kind.TRAINER_RECOVERED, f"trainer back at step {k} in {secs}s (hot: a warm spare took rank 0 "
                f"from {'the shadow copy' if shadow is not None else 'the snapshot'} of step {s}, epoch {epoch})",
                seconds=secs, world=1, group="trainer", resize=False, recovery="hot", epoch=epoch,
                spares_used=1, source="shadow" if shadow is not None else "snapshot", replayed=k - s,
                preempted=preempted)  # fmt: skip
        self.refill_after = k

    def _next_epoch(self) -> int:
        """Count one more hot recovery in ``state.trainer_epoch`` (the group re-formed); the new epoch."""
        epoch = int(self.ctx.read_state().get("trainer_epoch") or 0) + 1
        self.ctx.update_state(expect=live, trainer_epoch=epoch)
        return epoch

    def rank_names(self, world: int) -> list[str]:
        """The actor names of ranks 0..world-1: ``trainer:{i}``, or the name of the spare that
        was promoted in its place (recorded in the job's state, for a new leader's adopt)."""
        promoted = self.ctx.read_state().get("trainer_actors") or {}
        return [str(promoted.get(str(i)) or self.ctx.actor_name("trainer", i)) for i in range(world)]

    def kill(self, keep_spares: bool = False) -> None:
        """Kill every rank and spare this job may have, by name (old runs included). With
        ``keep_spares`` (a restart of this leader's group, same strategy) the idle spares this group
        warmed or is warming live on: a cold restart does not cost the next fault its spare."""
        A = self.actors
        keep = self.spares.names() if keep_spares else set()
        for group in ("trainer", "trainer-spare"):
            for name in A.names(self.ctx.actor_prefix(group)):
                a = A.find(name) if name not in keep else None
                if a is not None:
                    A.kill(a)
        self.ranks = []
        if not keep_spares:
            self.spares.forget()

    # -- warm spares -----------------------------------------------------------------

    def spares_wanted(self) -> int:
        """``trainer.spares`` where a hot recovery can use them, else 0."""
        t = self.ctx.spec.trainer
        return t.spares if t.hot_recovery and self.strategy in ("ddp", "fsdp") and self.world >= 1 else 0

    def fill_spares(self) -> None:
        """Keep :meth:`spares_wanted` spares warm or warming, in the background (see
        :class:`SparePool`); called once per pass of the step loop. After a hot recovery the
        refill waits for the retried step's commit (:meth:`committed`): a spare's start-up
        (a process importing torch, a model built: about 9 CPU seconds at 104.7M parameters)
        would otherwise compete with the retried step for the CPUs, on the recovery's
        critical path (BENCHMARKS section 5)."""
        if self.ranks and self.refill_after is None:
            self.spares.fill(self.spares_wanted())

    def committed(self, k: int) -> None:
        """Step ``k`` was committed: a refill held for a hot recovery's retried step may start."""
        if self.refill_after is not None and k >= self.refill_after:
            self.refill_after = None

    def _create_spare(self, name: str, n: int) -> Any:
        c = self.ctx
        args = (c.job, 0, self.world, c.spec.to_json(), self.model_dir, str(c.workdir), c.etcd, self.strategy, n)
        return self.actors.create("trainer", name, args, self._placement())

    def _take_spare(self) -> tuple[str, Any] | None:
        """A warm spare that answers, its fence raised to this leader's (see :meth:`SparePool.take`);
        else one still warming, waited for (its answer queues behind its warm-up; the rollouts are
        served meanwhile), which is ready sooner than a new process or a cold start of the group.
        None if there is neither, or the warming one fails."""
        if (ready := self.spares.take()) is not None or (warming := self.spares.claim()) is None:
            return ready
        return warming if self.spares.answers(warming, self._get, max(60.0, self.ctx.spec.fault.hang_timeout)) else None
