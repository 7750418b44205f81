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
with ``max_staleness: s`` generation runs up to s steps ahead.

Runs in its own thread inside the leader controller process; every etcd
write goes through the controller's fenced helpers, so a deposed leader's
runner cannot commit anything.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from checkpoints.journal import Journal, JournalFull, ShardRef, free_mb
from controller.election import NotLeader
from controller.events import Kind
from controller.jobs import TERMINAL, JobRecord
from controller.store import EtcdError

from ..algo.sampler import prompt_indices
from ..errors import JobFailed, describe_error, is_stale, worker_cause
from ..naming import MODEL_MARKER, actor_name, job_workdir
from ..spec import JobSpec
from .actors import Actors, RayActors, actor_died, connect_ray
from .autoscale import Autoscaler
from .checkpointing import SnapshotFlow, close_inflight
from .context import JobContext, JobRecords
from .groups import RolloutGroup, TrainerGroup
from .reward_guard import RewardErrorWindow

log = logging.getLogger(__name__)

_RUNNER_SEQ = itertools.count(1)


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
        # (kind, wall-clock time detected) awaiting the next committed step; kept in the job's state
        # too (open_faults), so a leader that dies before that step still gets its faults' recovery
        # recorded by the next one
        self.faults: list[tuple[str, float]] = []
        r = self.spec.rollout
        lo, hi = r.min_replicas or r.replicas, r.max_replicas or r.replicas
        self.autoscaler = Autoscaler(lo, hi, self._want("rollout")) if lo < hi else None
        t = self.spec.task
        scorer = f"reward function {t.reward_fn}" if t.reward == "function" else f"task.reward {t.reward}"
        self.rewards = RewardErrorWindow(scorer, t.max_reward_error_rate, t.reward_error_window)
        self.paused: JournalFull | None = None  # the journal's disk is full (see _pause)
        self.paused_recorded = self.resume_asked = False
        self._paused_at = self._space_checked = 0.0
        self.shard_mb = 0.0  # the largest shard file so far (how much room a resume needs)
        self.unjournaled: set[int] = set()  # steps whose shards are all in, batch manifest not written
        self.slowest_train_s = 0.0  # the slowest train step this runner saw (the hang limit's scale)
        self._stop = threading.Event()
        self.actors: Actors = actors if actors is not None else RayActors()
        self._connected = False  # to Ray: nothing to kill before
        self.ctx = JobContext(self.job, self.spec, self.token, self.workdir, etcd, controller, self.actors,
                              want=self._want, stopped=self._stop)  # fmt: skip
        self._thread = threading.Thread(target=self._main, name=f"runner:{self.job}", daemon=True)
        self._thread.start()

    # -- JobDriver -----------------------------------------------------------

    def reconcile(self, rec: JobRecord) -> dict[str, Any] | None:
        if rec.desired.get("resume") != self.desired.get("resume"):  # `rrl resume`: try again now
            self.resume_asked = True
        if self.autoscaler is not None and rec.desired.get("rollout") != self.desired.get("rollout"):
            self.autoscaler.reset(int(rec.desired["rollout"]), time.monotonic())  # an operator's `rrl scale`
        self.desired = dict(rec.desired)  # read by the loop: group sizes (rrl scale)
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

    def _run(self) -> None:
        A = self.actors
        state = self.ctx.read_state()
        k = int(state.get("step", 0))
        # faults a previous leader detected that no commit has followed yet
        self.faults = [(str(kind), float(t)) for kind, t in state.get("open_faults") or []]
        was_running = state.get("phase") == "RUNNING"  # its workers existed: missing ones were lost
        self.reward_errors = int(state.get("reward_errors") or 0)  # this runner is the one writer from here
        self.ctx.update_state(expect=live, phase="RUNNING", started_at=state.get("started_at") or time.time())
        self.ctx.event(Kind.RUNNING, f"{'resuming at step ' + str(k) if k else 'starting'}: "
                     f"{self._want('rollout')} rollout / {self._want('trainer')} trainer workers")  # fmt: skip
        self._ray_init()
        self._task_len = self._task_size(state)
        model_dir = self._ensure_model()
        k = self._take_over(k, model_dir, was_running)
        snaps = self._loop(SnapshotFlow(self.ctx, self.trainers), k)
        if self._stop.is_set():
            return
        snaps.poll(block=True)
        digest = A.get(A.call(self.trainers.ranks[0], "digest"), timeout=max(60.0, self.spec.fault.hang_timeout))
        self.ctx.update_state(weights_digest=digest)
        self._kill_workers()
        self._finish("SUCCEEDED", None)

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
        self.trainers = TrainerGroup(self.ctx, model_dir)
        self.rollouts = RolloutGroup(self.ctx, model_dir)
        got = self.trainers.adopt(k, self._want("trainer"))
        if got is None and was_running:  # ranks lost or stuck while no leader watched: a fault too
            self._fault("trainer_fault")
            self.version, self.weights = (
                k,
                self.trainers.restart(
                    k, self._want("trainer"), "trainer ranks not adoptable at take-over", cause="take_over"
                ),
            )
        elif got is None:
            self.trainers.kill()
            self.version, self.weights = k, self.trainers.start_retrying(k, self._want("trainer"))
        else:
            s, last, self.weights = got
            if s == k + 1:  # trained before the previous leader could commit: commit it once, now
                shards = self._journaled(k)
                if shards is None or last is None:
                    raise JobFailed(f"trainer ranks trained step {k} but its journal batch is incomplete")
                self._commit(k, last, shards, float(last.get("seconds") or 0.0))
                self.ctx.event(Kind.COMMIT_RECOVERED, f"step {k} was trained but not committed by the "
                             "previous leader: committed now", step=k)  # fmt: skip
                k += 1
            self.version = k
        close_inflight(self.ctx)  # no rank writes a snapshot now (adopted ones waited theirs out)
        adopted = self.rollouts.start(self._want("rollout"), self.version, self.weights, was_running)
        if got is not None or adopted:
            self.ctx.event(Kind.ADOPTED, f"took over {self.trainers.world if got else 0} running trainer ranks "
                         f"and {adopted} rollout workers at step {k} in {time.monotonic() - t0:.1f}s",
                         trainers=self.trainers.world if got else 0, rollouts=adopted, step=k,
                         seconds=round(time.monotonic() - t0, 2))  # fmt: skip
        return k

    def check_leader(self) -> None:
        self.ctx.check_leader()

    def _loop(self, snaps: SnapshotFlow, k: int) -> SnapshotFlow:
        A = self.actors
        spec, s, rollouts = self.spec, self.spec.async_.max_staleness, self.rollouts
        planned = k - 1
        queue: deque[tuple[int, int, list[int]]] = deque()
        inflight: dict[Any, tuple[int, int, list[int], int, float]] = {}  # ref -> (step, shard, prompts, worker, sent)
        done: dict[int, dict[int, dict[str, Any]]] = {}
        train_refs: list[Any] = []
        t_step = t_train = last_iter = time.monotonic()
        while k < spec.steps and not self._stop.is_set():
            self.check_leader()
            gap, last_iter = time.monotonic() - last_iter, time.monotonic()
            if gap > 5.0:  # this process was stopped or starved: no worker's clock ran against it
                t_train += gap
            while planned + 1 < spec.steps and planned + 1 <= self.version + s:
                planned += 1
                journaled = self._journaled(planned)  # complete before a restart: reuse, never regenerate
                if journaled is not None:
                    done[planned] = journaled
                else:
                    queue.extend((planned, i, idx) for i, idx in enumerate(self._shards(planned)))
            if self.autoscaler is not None:
                size = self.autoscaler.size
                if self.autoscaler.observe(len(queue), len(rollouts.idle), time.monotonic()) != size:
                    self.ctx.event(Kind.AUTOSCALE, f"rollout: {size} -> {self.autoscaler.size} workers "
                                 f"({len(queue)} shards queued, {len(rollouts.idle)} idle)",
                                 size=self.autoscaler.size)  # fmt: skip
            rollouts.resize(self._want("rollout"), self.version, self.weights)
            self._pause_tick(busy=bool(train_refs))
            while queue and rollouts.idle and self.paused is None:
                w = min(rollouts.idle)
                rollouts.idle.discard(w)
                step, shard, idx = queue.popleft()
                ref = A.call(rollouts.workers[w], "generate_shard", step, shard, idx, self.token)
                inflight[ref] = (step, shard, idx, w, time.monotonic())
            self._retry_batches(done)
            if (not train_refs and k in done and len(done[k]) == self._num_shards() and k not in self.unjournaled
                    and self.paused is None):  # fmt: skip
                self._check_staleness(k, done[k])
                train_refs = [A.call(t, "train_step", k, True, self.token) for t in self.trainers.ranks]
                t_train = time.monotonic()
            watched = [*inflight, *train_refs, *snaps.waits, *rollouts.refs()]
            if watched:  # block until something happened, then take *everything* ready (no starvation)
                A.wait(watched, num_returns=1, timeout=1.0)
                ready = A.wait(watched, num_returns=len(watched), timeout=0)[0]
            else:
                time.sleep(0.2)
                ready = []
            snaps.poll()
            for ref in ready:
                rollouts.on_ready(ref)
            finished, unfinished = A.wait(train_refs, num_returns=len(train_refs), timeout=0)
            lost = _actor_error(A, finished)
            hung = self._trainer_hung(t_train) if train_refs and lost is None and unfinished else None
            if lost is not None or hung is not None:  # a rank died or hangs (its peers wait in a collective)
                train_refs = []
                self._fault("trainer_fault" if lost is not None else "trainer_hang")
                why = f"trainer rank lost ({type(lost).__name__})" if lost is not None else hung
                w = self.trainers.restart(k, self.trainers.world, str(why), cause="lost" if lost else "hang")
                self.weights = w if w is not None else self.weights  # re-published: the old owner may be gone
                snaps = SnapshotFlow(self.ctx, self.trainers)
                continue
            if train_refs and not unfinished:
                try:
                    results = A.get(train_refs, timeout=0)  # StepRejected and other errors fail the job
                except Exception as e:
                    if is_stale(e):
                        raise self.ctx.not_leader(e) from None
                    raise
                train_refs = []
                self.slowest_train_s = max(self.slowest_train_s, time.monotonic() - t_train)
                metrics = self._commit(k, results[0], done.pop(k), time.monotonic() - t_step)
                k += 1
                self.version, self.weights = k, results[0]["weights"]
                for wk in rollouts.workers.values():  # in order: every later shard uses >= this version
                    A.call(wk, "load_weights", k, self.weights)
                snaps.maybe_start(k)
                if self._want("trainer") != self.trainers.world and k < spec.steps:
                    snaps.poll(block=True)
                    w = self.trainers.restart(k, self._want("trainer"), f"world size {self.trainers.world} -> "
                                              f"{self._want('trainer')} requested", cause="scale",
                                              resize=True)  # fmt: skip
                    self.weights = w if w is not None else self.weights
                    snaps = SnapshotFlow(self.ctx, self.trainers)
                t_step = time.monotonic()
                self._note_recoveries(k - 1)
                log.info("job %s step %d committed: reward %.3f", self.job, k - 1, metrics["reward"])
            self._watchdog(inflight, queue)
            for ref in [r for r in ready if r in inflight]:
                step, shard, idx, w, _ = inflight.pop(ref)
                try:
                    result = A.get(ref, timeout=0)
                except Exception as e:
                    if actor_died(e):  # the worker died: its shard goes back to the queue
                        queue.appendleft((step, shard, idx))
                        self._fault("rollout_fault")
                        rollouts.fault(w, e)
                        continue
                    if is_stale(e):
                        raise self.ctx.not_leader(e) from None
                    full = worker_cause(e)
                    if not isinstance(full, JournalFull):
                        raise
                    queue.appendleft((step, shard, idx))  # generated again once there is space
                    if w in rollouts.workers:
                        rollouts.idle.add(w)
                    self._pause(full)
                    continue
                if w in rollouts.workers:
                    rollouts.idle.add(w)
                self.shard_mb = max(self.shard_mb, float(result.get("bytes") or 0) / 1e6)
                done.setdefault(step, {})[shard] = result
                if len(done[step]) == self._num_shards():
                    self.unjournaled.add(step)
                    self._retry_batches(done)
        return snaps

    # -- a full journal disk: pause, resume -------------------------------------

    def _retry_batches(self, done: dict[int, dict[int, dict[str, Any]]]) -> None:
        """Write the manifest of every batch whose shards are all in but whose manifest is not
        (new, or refused by a full disk); a step trains only once its batch is journaled."""
        for step in sorted(self.unjournaled):
            if self.paused is not None:
                return
            refs = [ShardRef(**done[step][i]["ref"]) for i in range(self._num_shards())]
            self.ctx.check_leader()
            try:
                if not self.journal.commit_batch(step, refs):  # a previous leader completed it first
                    done[step] = self._journaled(step) or done[step]
            except JournalFull as e:
                self._pause(e)
                return
            self.unjournaled.discard(step)

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
        if not asked and free < max(8.0, 2 * self.shard_mb):
            return
        secs = round(now - self._paused_at, 1)
        self.ctx.update_state(expect=live, phase="RUNNING", reason=None)
        self.ctx.event(Kind.RESUMED, f"{'resumed by `rrl resume`' if asked else 'journal disk has room again'}"
                     f" ({free:.0f} MB free) after {secs}s paused", seconds=secs, free_mb=round(free, 1))  # fmt: skip
        self.paused, self.paused_recorded, self.resume_asked = None, False, False

    def _watchdog(self, inflight: dict[Any, tuple[int, int, list[int], int, float]], queue: deque[Any]) -> None:
        """A worker with a shard in flight for longer than ``fault.hang_timeout`` is hung
        (stopped, deadlocked, starved): kill and replace it, re-queue its shard."""
        now = time.monotonic()
        for ref, (step, shard, idx, w, sent) in list(inflight.items()):
            limit = self._shard_limit(len(idx))
            if now - sent <= limit:
                continue
            del inflight[ref]
            queue.appendleft((step, shard, idx))
            self.ctx.event(Kind.ROLLOUT_HANG, f"rollout worker {w} made no progress on shard {step}/{shard} "
                         f"for {now - sent:.1f}s (limit {limit:g}s: fault.hang_timeout + reward timeouts)", worker=w,
                         detection_s=round(now - sent, 2))  # fmt: skip
            self._fault("rollout_hang")
            self.rollouts.fault(w, TimeoutError(f"hung for {now - sent:.0f}s"))
        for w in self.rollouts.overdue_joins():
            self.ctx.event(Kind.ROLLOUT_HANG, f"rollout worker {w} did not join within "
                         f"{self.rollouts.join_limit():g}s", worker=w)  # fmt: skip
            self._fault("rollout_hang")
            self.rollouts.fault(w, TimeoutError("join timed out"))

    def _fault(self, kind: str) -> None:
        """A fault was detected: remember it (in etcd too) until the next committed step."""
        self.faults.append((kind, time.time()))
        self.ctx.update_state(expect=live, open_faults=[list(f) for f in self.faults])

    def _shard_limit(self, prompts: int) -> float:
        """``fault.hang_timeout`` for a shard of ``prompts`` prompts, plus the longest its user reward
        calls may take by design (each has ``task.reward_timeout_s``, ``reward_workers`` at a time):
        a reward function timing out sample after sample is slow, not a hung worker."""
        t = self.spec.task
        extra = 0.0
        if t.reward == "function":
            calls = prompts * self.spec.rollout.sampling.n
            extra = -(-calls // t.reward_workers) * t.reward_timeout_s
        return self.spec.fault.hang_timeout + extra

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
                     "a trainer rank is frozen or deadlocked", detection_s=round(took, 2), group="trainer")  # fmt: skip
        return f"trainer step hung for {took:.0f}s"

    def _note_recoveries(self, step: int) -> None:
        """Faults since the last commit are recovered from as far as the job goes: record
        the time from each detection to this committed step (``rrl events`` shows it). The
        commit itself cleared ``open_faults`` in etcd."""
        now = time.time()
        for kind, t in self.faults:
            self.ctx.event(Kind.RECOVERED, f"step {step} committed {now - t:.1f}s after a {kind}",
                         fault=kind, step=step, seconds=round(now - t, 2))  # fmt: skip
        self.faults.clear()

    def _want(self, group: str) -> int:
        """Desired size of a group (``rrl scale`` writes it; the spec gives the start)."""
        if group == "rollout" and getattr(self, "autoscaler", None) is not None:
            return self.autoscaler.size  # type: ignore[union-attr]
        default = self.spec.rollout.replicas if group == "rollout" else self.spec.trainer.replicas
        return int(self.desired.get(group) or default)

    def _journaled(self, step: int) -> dict[int, dict[str, Any]] | None:
        """Shard summaries of a batch already complete in the journal, else None."""
        refs = self.journal.batch(step)
        if refs is None or len(refs) != self._num_shards():
            return None
        out = {}
        for r in refs:
            body = self.journal.read_shard(r)
            samples = body["samples"]
            out[r.shard] = {
                "ref": r.to_dict(),
                "version": body["meta"]["version"],
                "tokens": sum(len(x["token_ids"]) for x in samples),
                "reward_errors": sum(x["reward_error"] is not None for x in samples),
                "reward_error": next((x["reward_error"] for x in samples if x["reward_error"]), None),
                "samples": len(samples),
            }
        return out

    def _commit(self, k: int, r0: dict[str, Any], shards: dict[int, dict[str, Any]], secs: float) -> dict[str, Any]:
        """Record step k's metrics line, then commit k in etcd (fenced; refuses a double apply)."""
        tokens = sum(x["tokens"] for x in shards.values())
        metrics = {
            "step": k,
            "reward": r0["reward_mean"],
            "loss": r0["loss"],
            "tokens": tokens,
            "step_seconds": round(secs, 3),
            "tokens_per_s": round(tokens / secs, 1) if secs > 0 else None,
            "reward_errors": sum(x["reward_errors"] for x in shards.values()),
            "versions": sorted({x["version"] for x in shards.values()}),
        }
        errors = metrics["reward_errors"]
        self.check_leader()
        # the line first: a leader killed between the two writes must not lose a committed step's
        # line; a line without its commit is dropped by every reader (controller/steplog.py)
        self.ctx.append_metrics({**metrics, "time": time.time()})
        self.ctx.update_state(
            expect=lambda cur: committable(cur, k),
            step=k + 1,
            policy_version=k + 1,
            reward=metrics["reward"],
            tokens_per_s=metrics["tokens_per_s"],
            step_seconds=metrics["step_seconds"],
            reward_errors=self.reward_errors + errors,
            open_faults=[],  # recovered by this commit (the events follow, _note_recoveries)
        )
        self.reward_errors += errors
        self._guard_rewards(k, errors, shards)
        return metrics

    def _guard_rewards(self, k: int, errors: int, shards: dict[int, dict[str, Any]]) -> None:
        """Raise the (rate-limited) ``reward_errors`` event; fail the job past the error rate."""
        samples = sum(int(x.get("samples") or 0) for x in shards.values())
        example = next((x["reward_error"] for x in shards.values() if x.get("reward_error")), None)
        verdict = self.rewards.observe(k, errors, samples, example, time.monotonic(), min_steps=self.spec.steps)
        if verdict.event:
            self.ctx.event(Kind.REWARD_ERRORS, verdict.event, step=k, errors=errors, samples=samples)
        if verdict.fail:
            raise JobFailed(verdict.fail)

    def _check_staleness(self, k: int, shards: dict[int, dict[str, Any]]) -> None:
        oldest = min(x["version"] for x in shards.values())
        if oldest < k - self.spec.async_.max_staleness:
            raise JobFailed(f"step {k}: a shard was generated by policy v{oldest}, beyond max_staleness")

    # -- helpers -------------------------------------------------------------

    def _num_shards(self) -> int:
        return min(self.spec.prompts_per_step, self.spec.rollout.shards_per_step or self.spec.rollout.replicas)

    def _task_size(self, state: dict[str, Any]) -> int:
        """The number of prompts of the task: recorded in the job's state the first time, by a
        Ray task (a jsonl or dataset task reads its whole file to know it: never in the leader)."""
        if state.get("task_size"):
            return int(state["task_size"])
        size, quarantined = self.actors.get(self.actors.task(_task_facts, self.spec.to_json()), timeout=600)
        self.ctx.update_state(expect=live, task_size=size, task_quarantined=quarantined)
        if quarantined:
            self.ctx.event(Kind.TASK_ROWS_QUARANTINED, f"{quarantined} row(s) of the task's file were skipped "
                         "(see the rollout workers' log for each one)", count=quarantined)  # fmt: skip
        return int(size)

    def _shards(self, step: int) -> list[list[int]]:
        """The prompt indices of step ``step``, split into contiguous shards (whole prompt groups)."""
        idx = prompt_indices(self.spec.seed, step, self.spec.prompts_per_step, self._task_len)
        n = self._num_shards()
        bounds = [round(i * len(idx) / n) for i in range(n + 1)]
        return [idx[bounds[i] : bounds[i + 1]] for i in range(n)]

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
        for g in ("rollout", "trainer", "weights"):
            for i in range(max(16, self._want(g) if g != "weights" else 1, self.spec.rollout.max_replicas or 0)):
                actor = A.find(actor_name(self.job, g, i))
                if actor is None:
                    continue  # not there (never started, or already gone)
                try:
                    A.get(A.call(actor, "shutdown"), timeout=5)  # leave membership at once
                except Exception as e:  # the kill below is what matters
                    log.info("shutdown of %s/%d failed: %s", g, i, e)
                A.kill(actor)


def live(cur: dict[str, Any]) -> None:
    """``expect`` of the runner's phase writes: a job that reached a terminal phase (cancelled by the
    reconcile loop while this thread was busy) is never moved out of it."""
    if cur.get("phase") in TERMINAL:
        raise NotLeader(f"job is {cur['phase']}: the runner does not write its state any more")


def committable(cur: dict[str, Any], k: int) -> None:
    """``expect`` of the commit of step ``k``: the job is RUNNING (not cancelled while the step
    trained) and at step ``k`` (no step applied twice); raises otherwise."""
    if cur.get("phase") != "RUNNING":
        raise NotLeader(f"job is {cur.get('phase')}: step {k} is not committed")
    if cur.get("step") != k:
        raise JobFailed(f"refusing to commit step {k}: etcd says the job is at step {cur.get('step')}")


def _task_facts(spec_json: str) -> tuple[int, int]:
    """(prompts, quarantined rows) of the job's task, built where it runs: in a Ray worker."""
    from ..algo.tasks import make_task

    spec = JobSpec.model_validate_json(spec_json)
    task = make_task(spec.task, spec.seed)
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
