"""The job runner: the leader's step loop for one RL job (a ``JobDriver``).

::

    sampler(seed, k) ──▶ shards ──▶ RolloutWorker ×N ──(trajectories)──▶ journal/step-k/shard-*.json
                                         ▲                                         │ batch.json (complete)
                                         │ load_weights(v, ref)                    ▼
                        object store ◀── rank 0 publishes v=k+1 ◀── TrainerRank ×M (DDP, GRPO on B_k)
                                                                                   │
                      etcd: state {step=k+1, policy_version=k+1}  ◀── fenced commit ┘

The controller never holds tensors or trajectories: it passes shard
references and object-store references. Rollouts for steps up to
``policy_version + max_staleness`` are dispatched while the trainer trains, so
with ``max_staleness: s`` generation runs up to s steps ahead; and what can overlap
the fenced commit of a step (the weight hand-off, the next shards, with s >= 1 the
next train step) is sent before it (see :meth:`JobRunner._committed`).

Runs in its own thread inside the leader controller process; every etcd
write goes through the controller's fenced helpers, so a deposed leader's
runner cannot commit anything.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpoints.journal import Journal, JournalFull, free_mb
from controller.election import NotLeader
from controller.events import Kind
from controller.jobs import STRATEGIES, JobRecord
from controller.store import EtcdError

from ..algo.sampler import eval_task_seed
from ..errors import JobFailed, describe_error
from ..naming import MODEL_MARKER, actor_name, actor_prefix, job_workdir
from ..spec import JobSpec
from .actors import Actors, RayActors, actor_died, connect_ray
from .autoscale import Autoscaler
from .checkpointing import SnapshotFlow, close_inflight
from .colocated import ColocatedActors, colocated_placement
from .committer import StepCommitter
from .context import JobContext, JobRecords, committable, live  # noqa: F401  (committable: re-exported)
from .faults import FaultPolicy, LeaseWatch, TrainerProbe, classify
from .groups import RolloutGroup, TrainerGroup
from .scheduler import ShardScheduler

log = logging.getLogger(__name__)

_RUNNER_SEQ = itertools.count(1)
_RESTARTED = object()  # a train step's outcome: the trainer group was restarted at the same step


@dataclass
class WholeThenLost:
    """A train step's outcome: rank 0 returned the step, so every collective of it ended (a
    DDP step cannot complete on rank 0 without its peers' gradients), and a peer died after
    them. The step is committed from rank 0's result; then the group recovers at the next."""

    results: list[dict[str, Any]]
    error: BaseException
    why: str


@dataclass
class Training:
    """A train step in flight: its step, the ranks' call references, when it was sent."""

    step: int
    refs: list[Any]
    sent: float  # monotonic (moved on by time this process did not run)
    sent_at: float = 0.0  # wall clock, for the metrics line's trace
    probe: TrainerProbe | None = None  # the frozen-rank check over this step (fault.probe_timeout)


class JobRunner:
    """Drives one job from PENDING to a terminal phase (see module doc)."""

    def __init__(
        self, controller: JobRecords, rec: JobRecord, ray_address: str | None, etcd: str, actors: Actors | None = None
    ) -> None:
        self.c = controller
        self.job = rec.id
        self.spec = JobSpec.model_validate(rec.spec)
        self.ray_address = ray_address
        self.etcd = etcd
        self.workdir = job_workdir(self.spec)
        self.journal = Journal(self.workdir / "journal")
        self.desired = dict(rec.desired)
        self.version, self.weights = 0, None  # the newest committed policy and its object ref
        # fences our calls on workers (see fencing.py): the leader's election token, then a per-process
        # sequence, so a runner started later by the *same* leader (after a lease flicker) also fences
        # out the one before it
        self.token = int(controller.token) * 1_000_000 + next(_RUNNER_SEQ)
        r = self.spec.rollout
        lo, hi = r.min_replicas or r.replicas, r.max_replicas or r.replicas
        self.autoscaler = Autoscaler(lo, hi, self._want("rollout")) if lo < hi else None
        self.paused: JournalFull | None = None  # the journal's disk is full (see _pause)
        self.paused_recorded = self.resume_asked = False
        self._paused_at = self._space_checked = 0.0
        self.slowest_train_s = 0.0  # the slowest train step this runner saw (the hang limit's scale)
        self.train_s: deque[float] = deque(maxlen=20)  # the recent train steps' seconds (the probe's scale)
        self._last_pass = 0.0  # monotonic time of the loop's last pass (see _housekeep)
        self._stop = threading.Event()
        self.actors: Actors = actors if actors is not None else RayActors()
        if self.spec.placement == "colocated":  # trainer rank i and rollout worker i in one process
            spec = self.spec
            self.actors = ColocatedActors(self.actors, lambda: colocated_placement(spec))
        self._connected = False  # to Ray: nothing to kill before
        # everything the driver's parts read, made before the thread starts
        self.ctx = JobContext(self.job, self.spec, self.token, self.workdir, etcd, controller, self.actors,
                              want=self._want, want_strategy=self._strategy, stopped=self._stop)  # fmt: skip
        self.faults = FaultPolicy(self.ctx)
        self.leases = LeaseWatch(self.spec.fault.lease_ttl)  # trainer ranks' membership (see _lease_lost)
        self.preempted_ranks: set[int] = set()  # trainer ranks that got a preemption notice (see _hand_over)
        self.idle_probe: TrainerProbe | None = None  # over the ranks between steps (see _idle_frozen)
        self._drains_read = 0.0  # when the draining Ray nodes were last asked for (see _drains)
        self.committer = StepCommitter(self.ctx)
        self._thread = threading.Thread(target=self._main, name=f"runner:{self.job}", daemon=True)
        self._thread.start()

    # -- JobDriver -----------------------------------------------------------

    def reconcile(self, rec: JobRecord) -> dict[str, Any] | None:
        if rec.desired.get("resume") != self.desired.get("resume"):  # `rrl resume`: try again now
            self.resume_asked = True
        if self.autoscaler is not None and rec.desired.get("rollout") != self.desired.get("rollout"):
            self.autoscaler.reset(int(rec.desired["rollout"]), time.monotonic())  # an operator's `rrl scale`
        strategy = rec.desired.get("strategy")
        if strategy != self.desired.get("strategy") and (why := _strategy_refusal(self.spec, strategy)):
            self.ctx.event(Kind.SCALE, f"trainer strategy {strategy} refused: {why}", refused=True)
        self.desired = dict(rec.desired)  # read by the loop: group sizes and strategy (rrl scale)
        return None  # the runner thread writes its own (fenced) state

    @property
    def exited(self) -> bool:
        """The loop ended without a terminal phase (etcd outage, lost leadership): the
        controller replaces this driver; the new one re-adopts the running workers."""
        return not self._thread.is_alive() and not self._stop.is_set()

    def stop(self, final: bool) -> None:
        """Stop the loop; with ``final`` also stop the job's workers (cancel, job ended).

        Returns only once this runner can write nothing more (a write under way is waited
        for; every later one is refused, see :meth:`JobContext.stop`)."""
        self.ctx.stop()  # sets self._stop
        if threading.current_thread() is not self._thread:
            # final: the job is terminal in etcd already and every write of the runner is refused
            # (`live`, `committable`), so a thread busy elsewhere need not be waited for
            self._thread.join(timeout=3 if final else 30)
        if final:
            self._kill_workers()

    # -- the loop --------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._run()
        except NotLeader as e:
            log.warning("job %s: %s; the next leader takes over", self.job, e)
        except EtcdError as e:  # the workers keep running; the next leader term re-adopts them
            self.c.note_etcd_error()
            log.warning("job %s: etcd unreachable (%s): stepping back; a new runner re-adopts the workers", self.job, e)
        except JobFailed as e:
            self._finish("FAILED", str(e))
        except Exception as e:  # the job fails with the reason; the controller keeps running
            log.exception("job %s failed", self.job)
            self._finish("FAILED", describe_error(e))
        finally:
            self.committer.log.close()

    def _run(self) -> None:
        try:
            self.committer.log.check()
            if self.spec.trainer.lora is not None:
                try:
                    import peft  # noqa: F401
                except ImportError:
                    raise ImportError("trainer.lora needs the peft package: pip install 'resilient-rl[lora]'") from None
        except ImportError as e:
            raise JobFailed(str(e)) from None
        state = self.ctx.read_state()
        k = int(state.get("step", 0))
        self.faults.load(state)  # faults a previous leader detected that no commit has followed yet
        was_running = state.get("phase") == "RUNNING"  # its workers existed: missing ones were lost
        self.committer.reward_errors = int(state.get("reward_errors") or 0)  # the one writer from here
        self.ctx.update_state(expect=live, phase="RUNNING", started_at=state.get("started_at") or time.time())
        self.ctx.event(Kind.RUNNING, f"{'resuming at step ' + str(k) if k else 'starting'}: "
                     f"{self._want('rollout')} rollout / {self._want('trainer')} trainer workers")  # fmt: skip
        self._ray_init()
        model_dir = self._ensure_model()  # first: a chat template's renderer needs its tokenizer
        self.shards = ShardScheduler(self.ctx, self.journal, self.faults, self._task_size(state, model_dir),
                                     pause=self._pause, paused=lambda: self.paused is not None)  # fmt: skip
        self.shards.on_eval = self._evaluated
        self._evals_done = {int(r["version"]) for r in state.get("evals") or []}
        k = self._take_over(k, model_dir, was_running)
        snaps = self._loop(SnapshotFlow(self.ctx, self.trainers), k)
        if self._stop.is_set():
            return
        self._drain_evals()
        if self._stop.is_set():
            return
        snaps.poll(block=True)
        digest = self._final_digest()
        self.ctx.update_state(weights_digest=digest)
        self._kill_workers()
        self._finish("SUCCEEDED", None)

    def _final_digest(self) -> str:
        """The final weights' digest. A rank lost after the last commit (its ``digest`` call fails:
        its actor died) is a fault as between steps: its place is filled by the lost rank's path at
        the last committed step (hot, else cold; the fault budget spent, which bounds the retries)
        and the ranks are asked again. Before, such a kill ended the job FAILED with every step
        committed (seen in an e2e test whose kill came after the job's last step)."""
        while True:
            try:
                return self.trainers.digest(timeout=max(60.0, self.spec.fault.hang_timeout))
            except Exception as e:
                self.ctx.raise_if_stale(e)
                if not actor_died(e):
                    raise
                k = int(self.ctx.read_state().get("step", 0))
                self.faults.detected(classify("trainer", error=e))
                self._recover(self._boundary(k), f"trainer rank lost after the last step: {describe_error(e)}",
                              "lost", lost=True)  # fmt: skip

    def _take_over(self, k: int, model_dir: str, was_running: bool = False) -> int:
        """Bring both groups up at committed step ``k``; returns the step to run next.

        One path for a fresh start, a new leader and a leader back from an etcd
        outage: workers of this job that are still running are *adopted* (fenced with
        this leader's token, brought to the current policy), missing ones are started.
        Trainer ranks that trained step k whose commit was lost (the old leader died
        between the two) get that step committed now; ranks in any other state are
        restarted from the newest snapshot + the journal (state never lives only in a
        worker).
        """
        t0 = time.monotonic()
        self.trainers = TrainerGroup(self.ctx, model_dir, self.faults)
        self.rollouts = RolloutGroup(self.ctx, model_dir, self.faults)
        if not was_running:  # a fresh start: the engines come up beside the ranks, asked for after them
            self.trainers.after_ranks_created = lambda: self.rollouts.prestart(self._want("rollout"))
        got = self.trainers.adopt(k, self._want("trainer"))
        if got is None and was_running:  # ranks lost or stuck while no leader watched: a fault too
            self.faults.detected(classify("trainer", cause="take_over"))
            why = "trainer ranks not adoptable at take-over"
            hot = self._adopt_alone(k, why) if self._want("trainer") == 1 else ""
            self.version = k
            if hot is None:
                self.weights = self.trainers.weights_of(k)
            else:
                why, cause = (f"{why}; hot recovery failed ({hot})", "hot_failed") if hot else (why, "take_over")
                self.weights = self.trainers.restart(k, self._want("trainer"), why, cause=cause)
        elif got is None:
            self.trainers.kill()
            self.version, self.weights = k, self.trainers.start_retrying(k, self._want("trainer"))
        else:
            s, recent, self.weights = got
            while k < s:  # trained before the previous leader could commit (one or two steps): commit once, now
                shards, r0 = self.shards.journaled(k), recent.get(k)
                if shards is None or r0 is None:
                    raise JobFailed(f"trainer ranks trained step {k} but its journal batch or result is missing")
                self.committer.commit(k, r0, shards, float(r0.get("seconds") or 0.0))
                self.ctx.event(Kind.COMMIT_RECOVERED, f"step {k} was trained but not committed by the "
                             "previous leader: committed now", step=k)  # fmt: skip
                k += 1
            self.version = k
        self.trainers.after_ranks_created = None
        close_inflight(self.ctx)  # no rank writes a snapshot now (adopted ones waited theirs out)
        adopted = self.rollouts.start(self._want("rollout"), self.version, self.weights, was_running)
        if got is not None or adopted:
            self.ctx.event(Kind.ADOPTED, f"took over {self.trainers.world if got else 0} running trainer ranks "
                         f"and {adopted} rollout workers at step {k} in {time.monotonic() - t0:.1f}s",
                         trainers=self.trainers.world if got else 0, rollouts=adopted, step=k,
                         seconds=round(time.monotonic() - t0, 2))  # fmt: skip
        return k

    def _loop(self, snaps: SnapshotFlow, k: int) -> SnapshotFlow:
        """The step loop: plan, dispatch, wait, take in what is ready, commit."""
        shards, rollouts = self.shards, self.rollouts
        shards.start_at(k)
        if (ev := self.spec.eval) is not None:  # the newest due version a previous leader did not record
            # (its policy may be gone: evaluated on the current one, the record's ``versions`` says which)
            shards.queue_eval(self.version - self.version % ev.every, self._evals_done)
        self.trainers.pump = self._serve_rollouts  # from here on a trainer recovery keeps the rollouts going
        train: Training | None = None
        t_step = self._last_pass = time.monotonic()
        while k < self.spec.steps and not self._stop.is_set():
            self.ctx.check_leader()
            self._housekeep(train, len(shards.queue))
            shards.plan(self.version)
            shards.dispatch(rollouts)
            shards.write_batches()
            if train is None and self.paused is None and (batch := shards.batch(k)) is not None:
                if self.preempted_ranks:  # a step boundary: hand the leaving rank's place over first
                    self._hand_over(k)
                    snaps = SnapshotFlow(self.ctx, self.trainers)
                    self.leases.reset()
                    continue
                train = self._train(k, batch)
            elif train is None and self._idle_frozen(k):
                train, snaps = None, SnapshotFlow(self.ctx, self.trainers)
                self.leases.reset()  # ranks replaced: their keys are new
                continue
            # a pass is due by a probe's next send or judgement (the step's, a shard's, the idle
            # ranks'), if sooner than 1 s
            probe = train.probe if train is not None else self.idle_probe
            wake = min(shards.wake_at, probe.wake_at if probe is not None else float("inf"))
            ready = self._wait([*shards.refs(), *(train.refs if train else []), *snaps.waits, *rollouts.refs()], wake)
            snaps.poll()
            for ref in ready:
                rollouts.on_ready(ref)
            shards.collect(ready, rollouts)  # before the step's outcome: the next batch may be complete now
            if train is not None:
                done = self._train_outcome(train)
                seen = time.monotonic()  # a step's seconds run from one result seen to the next: its wall time,
                # the hand-off and commit of the step before included (the median of these is what
                # a fault-free step costs: controller/goodput.py)
                if isinstance(done, WholeThenLost):
                    snaps, _ = self._committed(train, done.results, seen - t_step, snaps, whole=False)
                    k, t_step = k + 1, seen
                    # after the commit: it is not a recovery
                    self.faults.detected(classify("trainer", error=done.error))
                    self._recover(Training(k, train.refs, train.sent, train.sent_at), done.why, "lost", lost=True)
                    done = _RESTARTED
                if done is _RESTARTED:
                    train, snaps = None, SnapshotFlow(self.ctx, self.trainers)
                    self.leases.reset()  # ranks replaced: their keys are new
                    continue
                if done is not None:
                    snaps, train = self._committed(train, done, seen - t_step, snaps)
                    k, t_step = k + 1, seen
            shards.watchdog(rollouts)
        return snaps

    def _drain_evals(self) -> None:
        """Every step is committed: wait for the evaluations still queued or running (the last
        version's), serving the rollout group meanwhile (a lost worker's eval shard goes to
        another). Bounded: past ``fault.hang_timeout`` plus the eval's own limit it gives up
        with an event; the job's outcome does not depend on an evaluation."""
        ev = self.spec.eval
        if ev is None or not self.shards.evaluating():
            return
        limit = self.spec.fault.hang_timeout + self.shards.shard_limit(ev.prompts, True)
        deadline = time.monotonic() + limit
        while self.shards.evaluating() and not self._stop.is_set():
            if time.monotonic() > deadline:
                self.ctx.event(Kind.EVAL, f"evaluation of version(s) {sorted(self.shards.evals)} not finished "
                               f"within {limit:g}s of the last commit: given up", failed=True)  # fmt: skip
                return
            self.ctx.check_leader()
            self._wait(self._serve_rollouts())

    def _evaluated(self, version: int, results: list[dict[str, Any]]) -> None:
        """Every shard of the evaluation of ``version`` is in: record it in the job's state
        (``eval``, the newest; ``evals``, the last 100, which the page plots), as an event, in
        ``<workdir>/eval.jsonl`` and in the experiment loggers. Keyed by version: recorded once."""
        ev = self.spec.eval
        assert ev is not None
        prompts, samples = sum(r["prompts"] for r in results), sum(r["samples"] for r in results)
        rec = {"version": version, "step": version - 1, "time": round(time.time(), 3),
               "reward": round(sum(r["reward_sum"] for r in results) / max(1, samples), 6),
               "pass_at_k": round(sum(r["passed"] for r in results) / max(1, prompts), 6), "k": ev.samples,
               "prompts": prompts, "reward_errors": sum(r["reward_errors"] for r in results),
               "versions": sorted({int(r["version"]) for r in results}),
               "seconds": round(max(float(r["seconds"]) for r in results), 3)}  # fmt: skip
        state = self.ctx.read_state()
        if version in {int(r["version"]) for r in state.get("evals") or []}:
            self._evals_done.add(version)
            return
        self.ctx.update_state(expect=live, eval=rec, evals=[*(state.get("evals") or []), rec][-100:])
        self._evals_done.add(version)
        self.ctx.append_eval(rec)
        self.ctx.event(Kind.EVAL, f"policy version {version}: eval reward {rec['reward']:.3f}, pass@{ev.samples} "
                       f"{rec['pass_at_k']:.3f} over {prompts} prompts",
                       **{f: rec[f] for f in ("version", "step", "reward", "pass_at_k", "k", "prompts", "versions")})  # fmt: skip
        self.committer.log.evaluated(rec)

    def _serve_rollouts(self) -> list[Any]:
        """The rollout half of a pass of the loop, run while the trainer group (re)starts or recovers
        (its waits call it, see ``TrainerGroup.pump``): what finished is taken in and journaled,
        the watchdog, replacements, dispatch up to the staleness bound. Nothing trains or commits
        here. Returns the calls now in flight (shards, joins)."""
        shards, rollouts = self.shards, self.rollouts
        watched = [*shards.refs(), *rollouts.refs()]
        ready = self.actors.wait(watched, num_returns=len(watched), timeout=0)[0] if watched else []
        for ref in ready:
            rollouts.on_ready(ref)
        shards.collect(ready, rollouts)
        shards.write_batches()
        shards.watchdog(rollouts)
        rollouts.resize(self._want("rollout"), self.version, self.weights)
        shards.plan(self.version)
        shards.dispatch(rollouts)
        return [*shards.refs(), *rollouts.refs()]

    def _housekeep(self, train: Training | None, queued: int) -> None:
        """Once per pass: credit time this process did not run, the autoscaler, group sizes, the pause."""
        now = time.monotonic()
        gap, self._last_pass = now - self._last_pass, now
        if gap > 5.0 and train is not None:  # this process was stopped or starved: no worker's clock ran
            train.sent += gap
        rollouts = self.rollouts
        if self.autoscaler is not None:
            size = self.autoscaler.size
            if self.autoscaler.observe(queued, len(rollouts.idle), now) != size:
                self.ctx.event(Kind.AUTOSCALE, f"rollout: {size} -> {self.autoscaler.size} workers "
                               f"({queued} shards queued, {len(rollouts.idle)} idle)",
                               size=self.autoscaler.size)  # fmt: skip
        rollouts.resize(self._want("rollout"), self.version, self.weights)
        rollouts.fill_spares()
        self.trainers.fill_spares()
        self._lease_lost(training=train is not None)
        self._drains(now)
        self._pause_tick(busy=train is not None)

    def _idle_frozen(self, k: int) -> bool:
        """Between steps (no train step in flight: the next batch is not complete, or the job is
        paused), the ranks are probed as during a step (:class:`TrainerProbe` with a usual time of
        0: once they have been idle 1 s, then every second; a healthy idle rank answers at once,
        and a job whose batches come faster never sends one). A rank found frozen (SIGSTOPped while
        it waited, whose lease alone would find it, and only once a step is sent to it: the second
        burst of BENCHMARKS section 5) is killed and its place filled at once, by the lost rank's
        path (hot, else cold), while the rollouts go on. True if one was."""
        ranks = self.trainers.ranks
        if not ranks:
            return False
        if self.idle_probe is None or list(self.idle_probe.targets.values()) != ranks:
            self.idle_probe = TrainerProbe(self.ctx, ranks, f"the wait for step {k}'s batch", 0.0)
        frozen = self.idle_probe.check()
        if not frozen:
            return False
        self.idle_probe = None
        why = f"trainer rank(s) {sorted(frozen)} frozen between steps"
        self.faults.detected(classify("trainer", hung=True))
        self._recover(self._boundary(k), why, "hang", lost=True)
        return True

    def _boundary(self, k: int, killed: Sequence[int] = ()) -> Training:
        """At a step boundary, what step ``k``'s calls would say of the ranks (for the lost rank's
        path, :meth:`_recover`): a killed rank's call fails (its actor died), the others' answer.
        ``killed``: ranks this runner has just killed while they were healthy (a hand-over). A kill
        is asynchronous: a call sent right after it can still reach the live process and answer,
        and the hot path would then see no rank lost; such a rank is asked again (every 0.2 s, at
        most 30 s in all) until its call fails as a dead actor's does (any other answer or error
        is the live process's). A call still running at the end is the hot path's to judge."""
        A = self.actors
        ranks = self.trainers.ranks
        calls = Training(k, [A.call(r, "adopt", self.token, self.spec.digest()) for r in ranks],
                         time.monotonic(), time.time())  # fmt: skip
        end = time.monotonic() + 30
        A.wait(calls.refs, num_returns=len(calls.refs), timeout=30)
        for i in killed:
            while time.monotonic() < end:
                self.ctx.check_leader()  # a deposed leader stops asking (this can take 30 s)
                if not A.wait([calls.refs[i]], timeout=min(0.2, max(0.0, end - time.monotonic())))[0]:
                    continue  # still running
                try:
                    A.get(calls.refs[i], timeout=0)
                except Exception as e:
                    self.ctx.raise_if_stale(e)
                    if actor_died(e):
                        break  # the kill has landed
                time.sleep(0.2)  # it answered: the kill has not reached it yet
                calls.refs[i] = A.call(ranks[i], "adopt", self.token, self.spec.digest())
        return calls

    def _train(self, k: int, batch: dict[int, dict[str, Any]]) -> Training:
        self.committer.check_staleness(k, batch)
        self.idle_probe = None  # the step's own probe watches the ranks now; idle time counts from its end
        A = self.actors
        usual = sorted(self.train_s)[len(self.train_s) // 2] if self.train_s else None  # the recent median
        probe = TrainerProbe(self.ctx, self.trainers.ranks, f"train step {k}", usual)
        return Training(k, [A.call(t, "train_step", k, True, self.token) for t in self.trainers.ranks],
                        time.monotonic(), time.time(), probe)  # fmt: skip

    def _wait(self, watched: list[Any], wake: float = float("inf")) -> list[Any]:
        """Block until something happened (at most 1 s, or until the monotonic time ``wake``), then
        take *everything* ready (no starvation)."""
        if not watched:
            time.sleep(0.2)
            return []
        self.actors.wait(watched, num_returns=1, timeout=min(1.0, max(0.01, wake - time.monotonic())))
        return self.actors.wait(watched, num_returns=len(watched), timeout=0)[0]

    def _train_outcome(self, train: Training) -> list[dict[str, Any]] | WholeThenLost | object | None:
        """The ranks' results once all are in; ``_RESTARTED`` if a rank died or hangs (the group
        was restarted at the same step); :class:`WholeThenLost` if a rank died after the step's
        collectives (rank 0's result came back); None while the step runs."""
        A = self.actors
        finished, unfinished = A.wait(train.refs, num_returns=len(train.refs), timeout=0)
        lost = _actor_error(A, finished)
        if lost is None and unfinished and train.probe is not None:
            if train.probe.check():
                return None  # a frozen rank was killed: the next pass sees it lost, and the hot path serves
        hung = self._trainer_hung(train.sent) if lost is None and unfinished else None
        if lost is not None and (r0 := self._whole_on_rank0(train)) is not None:
            return WholeThenLost([r0], lost, f"trainer rank lost ({type(lost).__name__}) after step {train.step} "
                                 "was whole on rank 0")  # fmt: skip
        if lost is not None or hung is not None:  # a rank died or hangs (its peers wait in a collective)
            self.faults.detected(classify("trainer", error=lost, hung=hung is not None))
            why = f"trainer rank lost ({type(lost).__name__})" if lost is not None else hung
            cause = "lost" if lost else "hang"
            if lost is None and self.trainers.world == 1 and self.spec.trainer.hot_recovery:
                # the only rank is the hung one: killed, its call fails, and the lost rank's (hot) path serves
                A.kill(self.trainers.ranks[0])
                A.wait(train.refs, num_returns=len(train.refs), timeout=10.0)
                lost = _actor_error(A, train.refs)
            self._recover(train, str(why), cause, lost=lost is not None)
            return _RESTARTED
        if unfinished:
            return None
        try:
            results: list[dict[str, Any]] = A.get(train.refs, timeout=0)  # StepRejected etc. fail the job
        except Exception as e:
            self.ctx.raise_if_stale(e)
            raise
        self.slowest_train_s = max(self.slowest_train_s, time.monotonic() - train.sent)
        self.train_s.append(time.monotonic() - train.sent)
        return results

    def _recover(self, train: Training, why: str, cause: str, *, lost: bool) -> None:
        """Bring the trainer group back at step ``train.step`` (to be trained next): hot for a lost
        rank when it can (see :meth:`_recover_hot`), else the cold path restarts the group."""
        if lost:
            hot = self._recover_hot(train, why)
            if hot is None:  # the same ranks but the lost ones: the step is trained (again)
                hot = self._publish_again()
                if hot is None:
                    return
            if hot:
                why, cause = f"{why}; hot recovery failed ({hot})", "hot_failed"
        w = self.trainers.restart(train.step, self.trainers.world, why, cause=cause)
        self.weights = w if w is not None else self.weights  # re-published: the old owner may be gone

    def _drains(self, now: float) -> None:
        """Ray nodes being drained (a spot node's notice that reaches the cluster, ``ray drain-node``,
        the autoscaler's preemption): their rollout workers take no more work and leave as a
        preempted worker does once their shard is in; their trainer ranks are handed over at the
        next step boundary (:meth:`_hand_over`). No fault is counted, also when the node goes
        before a worker could leave. Asked at most once a second."""
        if now - self._drains_read < 1.0:
            return
        self._drains_read = now
        try:
            nodes = self.actors.draining_nodes()
            if not nodes:
                return
            rollout, trainer = self.ctx.members("rollout"), self.ctx.members("trainer")
        except Exception as e:  # Ray's control store or etcd not answering: no news from this channel
            self.ctx.raise_if_stale(e)
            log.info("job %s: could not read the draining nodes: %s", self.job, describe_error(e))
            return
        for w, info in rollout.items():
            if w.isdigit() and info.get("ray_node") in nodes:
                self.rollouts.drain(int(w), nodes[info["ray_node"]])
        self.preempted_ranks |= {int(w) for w, info in trainer.items() if w.isdigit() and int(w) < self.trainers.world
                                 and info.get("ray_node") in nodes}  # fmt: skip

    def _hand_over(self, k: int) -> None:
        """Trainer ranks got a preemption notice (SIGTERM: ``TrainerRank`` marks ``preempted_at`` in
        membership and leaves by itself after ``fault.preempt_grace_s``): at this step boundary,
        before step ``k`` trains, stop them and put others in their place by the hot path (a warm
        spare or a new process gets a survivor's state; at world 1 the spare loads the shadow copy),
        else the cold path (the group restarts from the shadow copy or a snapshot). No restart is
        spent from the fault budget: a preemption is not a fault."""
        A, t = self.actors, self.trainers
        ranks = sorted(i for i in self.preempted_ranks if i < t.world)  # (a resize since may have dropped some)
        self.preempted_ranks = set()
        if not ranks:
            return
        why = f"trainer rank(s) {ranks} preempted"
        for i in ranks:
            A.kill(t.ranks[i])
        probe = self._boundary(k, ranks)
        hot = ""
        if self.spec.trainer.hot_recovery:
            try:
                hot = None if t.recover_hot(k, probe.refs, why, self.slowest_train_s, preempted=True) else ""
            except (NotLeader, JobFailed):
                raise
            except Exception as e:
                self.ctx.raise_if_stale(e)
                hot = describe_error(e)
            if hot is None:
                hot = self._publish_again()
                if hot is None:
                    return
        w = t.restart(k, t.world, why + (f"; hot hand-over failed ({hot})" if hot else ""), cause="preempted",
                      preempted=True)  # fmt: skip
        self.weights = w if w is not None else self.weights

    def _whole_on_rank0(self, train: Training) -> dict[str, Any] | None:
        """Rank 0's result of ``train`` if it returns one although a peer died (the peer died
        after the step's last collective), else None. Only where the hot path could follow
        (ddp, world > 1); waits for rank 0's call as long as the hot path waits for survivors."""
        t = self.trainers
        if not self.spec.trainer.hot_recovery or t.world == 1 or t.strategy != "ddp":
            return None
        A = self.actors
        wait_s = self.faults.survivor_wait_s(self.slowest_train_s)
        A.wait(train.refs[:1], num_returns=1, timeout=wait_s)
        try:
            r0: dict[str, Any] = A.get(train.refs[0], timeout=0)
        except Exception as e:
            self.ctx.raise_if_stale(e)
            return None
        return r0

    def _lease_lost(self, training: bool) -> bool:
        """The membership channel, read once a second on every pass (so that every rank's key is
        seen, however short the steps): while a step trains, a rank whose member key has been gone
        for a lease TTL (see :class:`LeaseWatch`) is frozen or cut off; it is killed, so that its
        call fails and its peers' collective with it (a SIGSTOPped rank stays ALIVE for Ray, and
        its peers would wait for it until the process group's timeout); the step's outcome then
        sees a lost rank. True if one was."""
        now = time.monotonic()
        if not self.leases.due(now):
            return False
        try:
            members = self.ctx.members("trainer")
        except EtcdError:
            return False  # etcd unreachable: no news from this channel
        gone = self.leases.observe(members, now)
        self.preempted_ranks |= {int(w) for w, info in members.items()
                                 if w.isdigit() and int(w) < self.trainers.world and info.get("preempted_at")}  # fmt: skip
        ranks = {int(w): secs for w, secs in gone.items() if w.isdigit() and int(w) < self.trainers.world}
        if not ranks or not training:
            return False
        for i, secs in sorted(ranks.items()):
            self.ctx.event(Kind.TRAINER_HANG, f"trainer rank {i}'s membership lease expired ({secs:.1f}s without "
                           "its key) while it trains: frozen or cut off; killing it", group="trainer", worker=i,
                           channel="membership", detection_s=secs)  # fmt: skip
            self.actors.kill(self.trainers.ranks[i])
        self.leases.reset()
        return True

    def _recover_hot(self, train: Training, why: str) -> str | None:
        """The hot path (see :meth:`TrainerGroup.recover_hot`): None when it recovered; else the
        caller takes the cold path, which restarts the whole group: "" when the hot path did not
        apply, the error when it failed half-way."""
        if not self.spec.trainer.hot_recovery:
            return ""
        return self._hot("hot recovery", lambda: self.trainers.recover_hot(train.step, train.refs, why,
                                                                            self.slowest_train_s))  # fmt: skip

    def _adopt_alone(self, k: int, why: str) -> str | None:
        """A take-over at world 1 whose rank is gone: a warm spare the previous leader left takes
        its place (:meth:`TrainerGroup.adopt_alone`). None when it did; "" when it does not
        apply; the error when it failed half-way (the caller takes the cold path either way)."""
        return self._hot("hot take-over", lambda: self.trainers.adopt_alone(k, why))

    def _hot(self, what: str, attempt: Callable[[], bool]) -> str | None:
        """Run one hot path: None when it served; "" when it did not apply (False); the error when
        it failed half-way. Losing the lead or the job is raised, never turned into the cold path."""
        try:
            return None if attempt() else ""
        except (NotLeader, JobFailed):
            raise
        except Exception as e:
            self.ctx.raise_if_stale(e)
            log.warning("job %s: %s failed (%s): cold path", self.job, what, describe_error(e))
            return describe_error(e)

    def _publish_again(self) -> str | None:
        """After a hot recovery: the current weights' handle may have died with the lost rank's
        node (the weight store on it), and a worker loading it would fall behind the policy; the
        recovered group then publishes them again and hands them on. Not when the weight store
        answers that it still holds the current version: it owns the buckets and the handle (see
        ``WeightStore``), so a lost rank did not take them along, and publishing again would cost
        a pass over the weights and a reload in every rollout worker before the step is retrained.
        None if done, else the error (the caller takes the cold path, which re-creates the store)."""
        if self._store_holds(self.version):
            return None
        try:
            self.weights = self.trainers.publish()
        except (NotLeader, JobFailed):
            raise
        except Exception as e:
            self.ctx.raise_if_stale(e)
            return f"publishing the weights again failed: {describe_error(e)}"
        self.committer.hand_off(self.version, self.weights, self.rollouts)
        return None

    def _store_holds(self, version: int) -> bool:
        """Whether the job's weight store is alive and still holds ``version``'s handle."""
        A = self.actors
        store = A.find(self.ctx.actor_name("weights", 0))
        if store is None:
            return False
        try:
            return bool(A.get(A.call(store, "get", version), timeout=10.0))
        except Exception as e:  # gone or not answering: publish again
            self.ctx.raise_if_stale(e)
            return False

    def _committed(
        self, train: Training, results: Any, secs: float, snaps: SnapshotFlow, *, whole: bool = True
    ) -> tuple[SnapshotFlow, Training | None]:
        """Step ``train.step`` trained: hand the weights on, start what can overlap, commit it,
        snapshot, resize the trainer. Returns the snapshot flow and step k+1 if it was sent.

        Nothing waits on the fenced commit that need not (the issue's "nothing that can overlap
        waits"): first the new weights go to the rollout workers and the shards they allow are
        sent, and step k+1 is sent to the ranks if its batch is journaled (``max_staleness``
        >= 1) and the ranks need not stay at k+1 (no snapshot due there, no resize asked,
        not the last step). Then the commit of k. Order is kept where it matters: commit k
        lands before commit k+1 (this thread makes both, and k+1 is taken in only on a later
        pass); what was sent before the commit is harmless if it never lands: the weights
        k+1 are what any replay of the journaled batch k makes again (bit-exact), and ranks
        found at k+2 by the next leader get both commits from their results
        (``TrainerGroup.adopt``). ``whole=False``: a rank was lost after the step (see
        :class:`WholeThenLost`): only the hand-off and the commit; the recovery comes next."""
        k = train.step
        seen = time.time()
        self.version, self.weights = k + 1, results[0]["weights"]
        self.committer.hand_off(self.version, self.weights, self.rollouts)
        self.shards.plan(self.version)
        self.shards.queue_eval(self.version, self._evals_done, final=self.version >= self.spec.steps)  # behind training
        self.shards.dispatch(self.rollouts)
        want, strategy = self._want("trainer"), self._strategy()
        resize = whole and (want != self.trainers.world or strategy != self.trainers.strategy)
        nxt = None
        if (whole and not resize and not snaps.due(k + 1) and k + 1 < self.spec.steps and self.paused is None
                and not self.preempted_ranks):  # a leaving rank is replaced at the boundary first  # fmt: skip
            self.shards.write_batches()
            if (batch := self.shards.batch(k + 1)) is not None:
                nxt = self._train(k + 1, batch)
        trace = {**(results[0].get("trace") or {}), "sent": train.sent_at, "seen": seen, "handed_off": time.time(),
                 "next_sent": nxt.sent_at if nxt else None}  # fmt: skip
        metrics = self.committer.commit(k, results[0], self.shards.take(k), secs, [r.get("sketch") for r in results],
                                        trace, recovered=len(self.faults.open))  # fmt: skip
        if whole:
            snaps.maybe_start(k + 1)
        if resize and k + 1 < self.spec.steps:
            snaps.poll(block=True)
            change = [f"world size {self.trainers.world} -> {want}"] if want != self.trainers.world else []
            if strategy != self.trainers.strategy:
                change.append(f"strategy {self.trainers.strategy} -> {strategy}")
            w = self.trainers.restart(k + 1, want, f"{', '.join(change)} requested", cause="scale", resize=True)
            self.weights = w if w is not None else self.weights
            snaps = SnapshotFlow(self.ctx, self.trainers)
            self.leases.reset()
        self.faults.committed(k)
        self.trainers.committed(k)
        log.info("job %s step %d committed: reward %.3f", self.job, k, metrics["reward"])
        return snaps, nxt

    def _commit(self, k: int, r0: dict[str, Any], shards: dict[int, dict[str, Any]], secs: float) -> dict[str, Any]:
        return self.committer.commit(k, r0, shards, secs)

    # -- a full journal disk: pause, resume -------------------------------------

    def _pause(self, full: JournalFull) -> None:
        """The journal's disk is full: dispatch nothing more; once no step trains the job is
        PAUSED (see :meth:`_pause_tick`). Nothing is lost: the refused shard is queued again."""
        if self.paused is None:
            log.warning("job %s: %s: pausing", self.job, full)
        self.paused = full

    def _pause_tick(self, busy: bool) -> None:
        """Enter PAUSED when nothing trains; leave it when the disk has room again (twice the
        largest shard, at least 8 MB) or on ``rrl resume``."""
        if self.paused is None:
            self.resume_asked = False  # a resume asked while nothing was paused resumes nothing later
            return
        now = time.monotonic()
        if not self.paused_recorded:
            if busy:
                return  # the step in flight commits first (a commit needs RUNNING)
            reason = f"{self.paused}"
            self.ctx.update_state(expect=live, phase="PAUSED", reason=reason)
            self.ctx.event(Kind.PAUSED, f"{reason}: paused; resumes by itself once there is room, or on "
                         f"`rrl resume {self.job}`", path=self.paused.path, free_mb=round(self.paused.free_mb, 1),
                         cause="journal_full")  # fmt: skip
            self.paused_recorded, self._paused_at, self._space_checked = True, now, now
            return
        asked = self.resume_asked
        if not asked and now - self._space_checked < 2.0:
            return
        self._space_checked = now
        free = free_mb(self.paused.path)
        if not asked and free < max(8.0, 2 * self.shards.shard_mb):
            return
        secs = round(now - self._paused_at, 1)
        self.ctx.update_state(expect=live, phase="RUNNING", reason=None)
        self.ctx.event(Kind.RESUMED, f"{'resumed by `rrl resume`' if asked else 'journal disk has room again'}"
                     f" ({free:.0f} MB free) after {secs}s paused", seconds=secs, free_mb=round(free, 1))  # fmt: skip
        self.paused, self.paused_recorded, self.resume_asked = None, False, False

    def _trainer_hung(self, sent: float) -> str | None:
        """A train step running far longer than any before (four times the slowest this runner
        saw, at least ``fault.hang_timeout``; ten times that before the first) has a frozen or
        deadlocked rank: the reason to restart the group, else None."""
        limit = max(self.spec.fault.hang_timeout, 4 * self.slowest_train_s)
        if not self.slowest_train_s:
            limit *= 10  # the first step pays start-up costs (allocations, a cold page cache)
        took = time.monotonic() - sent
        if took <= limit:
            return None
        self.ctx.event(Kind.TRAINER_HANG, f"a train step made no progress for {took:.1f}s (limit {limit:.1f}s): "
                     "a trainer rank is frozen or deadlocked", detection_s=round(took, 2), group="trainer",
                     channel="deadline")  # fmt: skip
        return f"trainer step hung for {took:.0f}s"

    def _strategy(self) -> str:
        """The trainer strategy wanted now (``rrl scale --strategy`` writes it; the spec gives the start).
        fsdp needs sharded snapshots (checkpoint.backend dcp): asked of a job without, it is refused
        (an event says so at the request, see :meth:`reconcile`) and the spec's strategy stays."""
        want = str(self.desired.get("strategy") or self.spec.trainer.strategy)
        return want if _strategy_refusal(self.spec, want) is None else self.spec.trainer.strategy

    def _want(self, group: str) -> int:
        """Desired size of a group (``rrl scale`` writes it; the spec gives the start)."""
        if group == "rollout" and getattr(self, "autoscaler", None) is not None:
            return self.autoscaler.size  # type: ignore[union-attr]
        default = self.spec.rollout.replicas if group == "rollout" else self.spec.trainer.replicas
        return int(self.desired.get(group) or default)

    # -- helpers -------------------------------------------------------------

    def _task_size(self, state: dict[str, Any], model_dir: str) -> int:
        """The number of prompts of the task: recorded in the job's state the first time, by a
        Ray task (a jsonl or dataset task reads its whole file to know it: never in the leader)."""
        ev = self.spec.eval
        if ev is not None and ev.task is not None and not state.get("eval_task_size"):
            try:  # a held-out task that cannot be read fails the job now, not at its first evaluation
                size, _ = self.actors.get(self.actors.task(_task_facts, self.spec.to_json(), model_dir, True),
                                          timeout=600)  # fmt: skip
            except Exception as e:
                raise JobFailed(f"eval.task: {describe_error(e)}") from None
            self.ctx.update_state(expect=live, eval_task_size=size)
        if state.get("task_size"):
            return int(state["task_size"])
        size, quarantined = self.actors.get(self.actors.task(_task_facts, self.spec.to_json(), model_dir),
                                            timeout=600)  # fmt: skip
        self.ctx.update_state(expect=live, task_size=size, task_quarantined=quarantined)
        if quarantined:
            self.ctx.event(Kind.TASK_ROWS_QUARANTINED, f"{quarantined} row(s) of the task's file were skipped "
                         "(see the rollout workers' log for each one)", count=quarantined)  # fmt: skip
        return int(size)

    def _ray_init(self) -> None:
        self.actors.connect(self.ray_address)
        self._connected = True

    def _ensure_model(self) -> str:
        path = self.spec.model.path
        if path:
            # a path-looking value must be a model folder; anything else is a Hugging Face id
            local = path.startswith(("/", ".", "~")) or Path(path).exists()
            if local and not (Path(path).expanduser() / "config.json").exists():
                raise JobFailed(f"model.path: {path} is not a model folder (no config.json there)")
            return str(Path(path).expanduser()) if local else path
        from ..algo.tasks import VOCAB_CHARS

        out = str(self.workdir / "model")
        try:  # already made for this job (a new leader, a restart): no worker process needed to say so
            marker = json.loads((Path(out) / MODEL_MARKER).read_text())
            if marker.get("init") == self.spec.model.init.model_dump(mode="json") and (
                marker.get("vocab_chars") == VOCAB_CHARS
            ):
                return out
        except (OSError, ValueError):
            pass
        # in a worker: torch stays out of the controller
        return str(self.actors.get(self.actors.task(_make_tiny_model, out, self.spec.model.init, VOCAB_CHARS)))

    def _finish(self, phase: str, reason: str | None) -> None:
        if self._stop.is_set():  # deposed or replaced: what went wrong may be the successor's doing
            log.warning("job %s: stopped runner does not record %s (%s)", self.job, phase, reason)
            return
        try:
            self.ctx.update_state(expect=live, phase=phase, reason=reason, finished_at=time.time())
            self.ctx.event(Kind(phase.lower()), reason or f"job {phase.lower()}")
        except NotLeader:
            log.warning("job %s: could not record %s, no longer leader", self.job, phase)
        if phase == "FAILED":
            self._kill_workers()

    def _kill_workers(self) -> None:
        """Kill every worker actor of this job that still exists (by name)."""
        A = self.actors
        if not self._connected:
            return
        warming: set[str] = set()  # a shutdown call would wait for their warm-up (seconds): killed at once
        for group in (getattr(self, "trainers", None), getattr(self, "rollouts", None)):
            with contextlib.suppress(Exception):
                warming |= group.spares.still_warming() if group is not None else set()
        for name in [
            *A.names(actor_prefix(self.job, "trainer-spare")),
            *A.names(actor_prefix(self.job, "rollout-spare")),
        ]:
            if (spare := A.find(name)) is not None:  # spares (and promoted ones) have names beyond the indices
                if name not in warming:
                    with contextlib.suppress(Exception):
                        A.get(A.call(spare, "shutdown"), timeout=5)
                A.kill(spare)
        found = []  # every worker leaves membership before any is killed: a colocated process holds two
        for g in ("rollout", "trainer", "weights"):
            for i in range(max(16, self._want(g) if g != "weights" else 1, self.spec.rollout.max_replicas or 0)):
                actor = A.find(actor_name(self.job, g, i))
                if actor is None:
                    continue  # not there (never started, or already gone)
                try:
                    A.get(A.call(actor, "shutdown"), timeout=5)  # leave membership at once
                except Exception as e:  # the kill below is what matters
                    log.info("shutdown of %s/%d failed: %s", g, i, e)
                found.append(actor)
        for actor in found:
            A.kill(actor)


def _strategy_refusal(spec: JobSpec, strategy: Any) -> str | None:
    """Why the job cannot train under ``strategy`` (None: it can, or none was asked)."""
    if strategy is None:
        return None
    if strategy not in STRATEGIES:
        return f"unknown strategy {strategy!r} ({' or '.join(STRATEGIES)})"
    if strategy == "fsdp" and spec.checkpoint.backend != "dcp":
        return f"fsdp needs checkpoint.backend dcp for sharded snapshots; this job uses {spec.checkpoint.backend}"
    return None


def _task_facts(spec_json: str, model_dir: str, evaluation: bool = False) -> tuple[int, int]:
    """(prompts, quarantined rows) of the job's task (or its eval task), built where it runs: in
    a Ray worker (with the model's tokenizer when prompts go through its chat template, so a
    tokenizer without one fails the job at its start)."""
    from ..algo.tasks import make_task

    spec = JobSpec.model_validate_json(spec_json)
    if evaluation:
        assert spec.eval is not None and spec.eval.task is not None
        task = make_task(spec.eval.task, eval_task_seed(spec.seed), model_dir)
    else:
        task = make_task(spec.task, spec.seed, model_dir)
    return len(task), len(task.quarantined)


def _make_tiny_model(out: str, init: Any, vocab_chars: str) -> str:
    from ..workers.model_init import make_tiny_model

    return str(make_tiny_model(out, init, vocab_chars))


def _actor_error(actors: Actors, refs: list[Any]) -> BaseException | None:
    """The first of ``refs`` (all finished) that failed because its actor died, if any."""
    for r in refs:
        try:
            actors.get(r, timeout=0)
        except Exception as e:  # other errors are raised where the results are read
            if actor_died(e):
                return e
    return None


def runner_factory(ray_address: str | None, etcd: str, *, preconnect: bool = True) -> Any:
    """The ``driver_factory`` the controller uses for RL jobs.

    With ``preconnect`` the controller connects to Ray in the background right away,
    as a standby, and imports the worker modules: that takes seconds of CPU, which a new
    leader should not spend while its lease keep-alive competes for the same
    process (a starved keep-alive makes the leader step down).
    """
    if preconnect and ray_address:  # (without an address the first job starts a local Ray)

        def connect() -> None:
            try:
                connect_ray(ray_address)
                # the actor classes' modules (torch, transformers): seconds of import, paid now
                from ..workers import rollout, trainer  # noqa: F401
            except Exception as e:  # the first job's runner retries and reports it
                log.warning("could not connect to Ray at %s yet: %s", ray_address, e)

        threading.Thread(target=connect, name="ray-connect", daemon=True).start()

    def make(controller: Any, rec: JobRecord) -> JobRunner:
        return JobRunner(controller, rec, ray_address, etcd)

    return make
