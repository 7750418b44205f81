"""The rollout side of the step loop: which shards each step has, which are queued, in
flight and done, and the watchdog over the ones in flight.

A step's prompts (``algo/sampler``) are cut into ``shards_per_step`` contiguous shards. A
shard is planned once its step is within the staleness bound (``policy_version +
max_staleness``), queued, sent to an idle rollout worker, journaled by that worker, and
*done* when its summary is back; a step's batch is ready for training once every shard
is done and the batch manifest is in the journal. A batch already complete in the journal
(a previous leader's, a restart's) is reused, never generated again. A shard whose worker
dies or hangs goes back to the front of the queue, once per loss; the worker that takes it
keeps the prompt groups the lost one journaled and generates only the rest (an event,
``shard_resumed``, says how many of each). A worker that is preempted (SIGTERM, a node
drain) answers its shard with what it finished, or is found ``preempted`` in membership
while idle: its shard goes back the same way and the worker is replaced, no fault counted.

Work stealing (``rollout.groups_per_pass`` > 0: a worker generates its shard a few prompt
groups at a time): a worker left idle with nothing queued is sent a busy worker's shard to
*help* with (``steal``): it takes the shard's unfinished groups from its end, journals them,
and the owner, reading the journal before each pass, skips them. The owner still writes the
shard file and its answer completes the shard; the helper's answer only frees it. A lost
helper costs nothing but itself: the shard stays with its owner. With ``rollout.longest_first``
(the default) owner and helper share an order of generation, longest expected group first
(:class:`PromptCosts`: each prompt's group seconds the last time it was generated), and the
helper takes the longest unstarted group rather than the last: greedy longest-first list
scheduling, so the step ends on short groups.

Under dynamic sampling (``algorithm.dynamic_sampling``) a step's shards come in rounds:
once every shard of a round is in, the step's groups with a reward spread are counted
(each summary's ``varied``) and, while fewer than ``prompts_per_step`` and the extra
budget allows, another round of extra prompts is queued at the front (``algo/dynamic``
sizes it and draws its prompts from the (seed, step, round) stream). Shards are numbered
on across rounds, so the batch manifest lists them all as ``0..n-1`` and the trainer reads
them in that order. A new leader that finds the batch unfinished starts it again at round
0: the rounds' sizes and prompts depend only on the journaled rewards, so it asks for the
same ones.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from checkpoints.journal import Journal, JournalFull, ShardRef
from controller.events import Kind
from controller.store import EtcdError

from ..algo.dynamic import extra_prompt_indices, next_round, varied
from ..algo.sampler import prompt_indices
from ..errors import worker_cause
from .actors import actor_died
from .context import JobContext
from .faults import FaultPolicy, LivenessProbe, classify
from .groups import RolloutGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shard:
    step: int
    index: int
    prompts: tuple[int, ...]
    round: int = 0  # dynamic sampling's round (0: the step's own prompts); EVAL: an eval shard (step: version)


EVAL = -1  # Shard.round of an eval shard: ``step`` is the policy version, ``prompts`` eval task positions


@dataclass
class Rounds:
    """A step's dynamic-sampling progress: shards expected so far, the round, prompts generated."""

    shards: int
    round: int = 0
    generated: int = 0
    extra: int = 0


@dataclass(frozen=True)
class InFlight:
    shard: Shard
    worker: int
    sent: float  # monotonic
    steal: bool = False  # a second worker helping with the shard (its groups from the end), see dispatch
    order: tuple[int, ...] | None = None  # the shard's positions, longest expected group first (PromptCosts)


class PromptCosts:
    """The seconds each prompt's group took the last time it was generated (as its shard's answer
    reported them), bounded to the ``limit`` prompts seen last; the order of generation of a shard
    follows from them (``rollout.longest_first``). In the runner's memory only: a new leader learns
    them again, and until then a shard goes in prompt order."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self.limit = limit
        self.seconds: dict[int, float] = {}  # prompt index -> seconds (insertion order: oldest first)

    def learn(self, costs: Any) -> None:
        """``[[prompt index, seconds], ...]`` from a shard's answer; anything malformed is ignored."""
        for item in costs or []:
            try:
                i, s = int(item[0]), float(item[1])
            except (TypeError, ValueError, IndexError):
                continue
            if s >= 0 and s == s:  # not NaN
                self.seconds.pop(i, None)
                self.seconds[i] = s
        while len(self.seconds) > self.limit:
            del self.seconds[next(iter(self.seconds))]

    def order(self, prompts: tuple[int, ...]) -> tuple[int, ...] | None:
        """The shard's positions, longest expected group first (ties: in prompt order); a prompt not
        seen yet counts as the mean of those seen. None when none of them was seen."""
        known = [self.seconds[i] for i in prompts if i in self.seconds]
        if not known:
            return None
        mean = sum(known) / len(known)
        return tuple(sorted(range(len(prompts)), key=lambda p: (-self.seconds.get(prompts[p], mean), p)))


class ShardScheduler:
    def __init__(
        self, ctx: JobContext, journal: Journal, faults: FaultPolicy, task_len: int, *,
        pause: Callable[[JournalFull], None], paused: Callable[[], bool],
    ) -> None:  # fmt: skip
        self.ctx, self.journal, self.faults, self.task_len = ctx, journal, faults, task_len
        self.pause, self.paused = pause, paused  # the journal's disk is full: the runner pauses the job
        self.queue: deque[Shard] = deque()
        self.evalq: deque[Shard] = deque()  # eval shards: sent only when no training shard waits
        self.evals: dict[int, tuple[int, dict[int, dict[str, Any]]]] = {}  # version -> (shards, results) until all in
        self.final_eval: int | None = None  # the last policy's evaluation, waiting for the one running
        self.on_eval: Callable[[int, list[dict[str, Any]]], None] = lambda v, results: None
        self.inflight: dict[Any, InFlight] = {}  # call ref -> what it generates
        self.done: dict[int, dict[int, dict[str, Any]]] = {}  # step -> shard -> summary
        self.rounds: dict[int, Rounds] = {}  # step -> its shards so far (more than num_shards: dynamic sampling)
        self.unjournaled: set[int] = set()  # steps whose shards are all in, batch manifest not written
        self.planned = -1
        self._progress_read: tuple[float, dict[str, dict[str, Any]]] = (float("-inf"), {})  # see _progress_view
        self.shard_mb = 0.0  # the largest shard file so far (how much room a resume needs)
        self.lost: set[tuple[int, int]] = set()  # (step, shard) sent again after its worker was lost
        self.helped: set[Shard] = set()  # shards a helper was sent to (once per owner: see _steal)
        self.costs = PromptCosts()  # each prompt's group seconds, for longest-first generation
        self.shard_s: deque[float] = deque(maxlen=20)  # the recent training shards' seconds (the probe's scale)
        self.wake_at = float("inf")  # monotonic: a watchdog pass is due by then (a probe to send or judge)
        self.probes: dict[Any, LivenessProbe] = {}  # call ref -> its worker's liveness probe (see _frozen)

    # -- planning ----------------------------------------------------------------

    @property
    def num_shards(self) -> int:
        spec = self.ctx.spec
        return min(spec.prompts_per_step, spec.rollout.shards_per_step or spec.rollout.replicas)

    def shards(self, step: int) -> list[Shard]:
        """The prompt indices of ``step``, split into contiguous shards (whole prompt groups)."""
        spec = self.ctx.spec
        idx = prompt_indices(spec.seed, step, spec.prompts_per_step, self.task_len)
        n = self.num_shards
        bounds = [round(i * len(idx) / n) for i in range(n + 1)]
        return [Shard(step, i, tuple(idx[bounds[i] : bounds[i + 1]])) for i in range(n)]

    def start_at(self, k: int) -> None:
        self.planned = k - 1

    def plan(self, version: int) -> None:
        """Queue the shards of every step up to ``version + max_staleness`` not planned yet."""
        spec = self.ctx.spec
        while self.planned + 1 < spec.steps and self.planned + 1 <= version + spec.async_.max_staleness:
            self.planned += 1
            journaled = self.journaled(self.planned)  # complete before a restart: reuse, never regenerate
            if journaled is not None:
                self.done[self.planned] = journaled
                self.rounds[self.planned] = Rounds(len(journaled))
            else:
                self.queue.extend(self.shards(self.planned))
                self.rounds[self.planned] = Rounds(self.num_shards, generated=spec.prompts_per_step)

    def journaled(self, step: int) -> dict[int, dict[str, Any]] | None:
        """Shard summaries of a batch already complete in the journal, else None."""
        refs = self.journal.batch(step)
        if refs is None or len(refs) < self.num_shards or (len(refs) > self.num_shards and not self.dynamic):
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
                "varied": sum(varied([x["reward"] for x in samples], self.ctx.spec.rollout.sampling.n)),
            }
        return out

    @property
    def dynamic(self) -> bool:
        ds = self.ctx.spec.algorithm.dynamic_sampling
        return ds is not None and ds.drop_zero_variance

    def _round_done(self, step: int) -> None:
        """Every shard of ``step``'s current round is in: queue another round (dynamic sampling,
        too few groups with a spread) or mark the batch ready for its manifest."""
        spec, r = self.ctx.spec, self.rounds[step]
        if self.dynamic:
            ds = spec.algorithm.dynamic_sampling
            assert ds is not None
            kept = sum(int(x.get("varied") or 0) for x in self.done[step].values())
            m = next_round(spec.prompts_per_step, kept, r.generated, r.extra, ds.max_extra_prompts)
            if m > 0:
                r.round += 1
                idx = extra_prompt_indices(spec.seed, step, r.round, m, self.task_len)
                n = min(m, self.num_shards)
                bounds = [round(i * m / n) for i in range(n + 1)]
                new = [Shard(step, r.shards + i, tuple(idx[bounds[i] : bounds[i + 1]]), r.round) for i in range(n)]
                r.shards, r.generated, r.extra = r.shards + n, r.generated + m, r.extra + m
                self.queue.extendleft(reversed(new))  # the step waits on them: before later steps' shards
                log.info("job %s: step %d has %d/%d groups with a reward spread: round %d, %d extra prompts",
                         self.ctx.job, step, kept, spec.prompts_per_step, r.round, m)  # fmt: skip
                return
        self.unjournaled.add(step)
        self.write_batches()

    # -- dispatch and results ------------------------------------------------------

    def dispatch(self, rollouts: RolloutGroup) -> None:
        """Send queued shards to idle workers (lowest index first), training shards before eval
        shards; nothing while paused."""
        A = self.ctx.actors
        while (self.queue or self.evalq) and rollouts.idle and not self.paused():
            w = min(rollouts.idle)
            rollouts.idle.discard(w)
            order = None
            if self.queue:
                shard = self.queue.popleft()
                order = self._order(shard)
                args = (shard.step, shard.index, list(shard.prompts), self.ctx.token, shard.round)
                ref = A.call(rollouts.workers[w], "generate_shard", *args, *((False, list(order)) if order else ()))
            else:
                shard = self.evalq.popleft()
                ref = A.call(rollouts.workers[w], "evaluate", shard.step, shard.index, shard.prompts[0],
                             shard.prompts[-1] + 1, self.ctx.token)  # fmt: skip
            self.inflight[ref] = InFlight(shard, w, time.monotonic(), order=order)
        self._steal(rollouts)

    def _order(self, shard: Shard) -> tuple[int, ...] | None:
        """The order of generation of a training shard's groups (``rollout.longest_first``), or None."""
        r = self.ctx.spec.rollout
        if not (r.groups_per_pass and r.longest_first) or len(shard.prompts) <= r.groups_per_pass:
            return None
        return self.costs.order(shard.prompts)

    def _steal(self, rollouts: RolloutGroup) -> None:
        """Idle workers, nothing queued: each helps with the oldest in-flight training shard that has
        more than one pass of groups and has had no helper since it was sent (see module doc)."""
        per_pass = self.ctx.spec.rollout.groups_per_pass
        if not per_pass or self.queue or self.evalq or not rollouts.idle or self.paused():
            return
        owners = sorted((f for f in self.inflight.values() if not f.steal and f.shard.round != EVAL
                         and len(f.shard.prompts) > per_pass and f.shard not in self.helped), key=lambda f: f.sent)  # fmt: skip
        for f in owners:
            if not rollouts.idle:
                return
            w = min(rollouts.idle)
            rollouts.idle.discard(w)
            s = f.shard
            ref = self.ctx.actors.call(rollouts.workers[w], "generate_shard", s.step, s.index, list(s.prompts),
                                       self.ctx.token, s.round, True, *((list(f.order),) if f.order else ()))  # fmt: skip
            self.inflight[ref] = InFlight(s, w, time.monotonic(), steal=True, order=f.order)
            self.helped.add(s)

    # -- evaluation (spec.eval) ------------------------------------------------------

    def queue_eval(self, version: int, done: set[int], *, final: bool = False) -> None:
        """Queue the evaluation of policy ``version`` if the spec asks for it (a multiple of
        ``eval.every``) and it is neither recorded (``done``) nor queued already: the eval
        task's first ``eval.prompts`` positions, one shard per rollout worker. One runs at a
        time; a version due while another runs is skipped, except the ``final`` one (the job's
        last policy): no newer policy replaces it on the workers, so it waits its turn."""
        ev = self.ctx.spec.eval
        if ev is None or version <= 0 or version % ev.every or version in done or version in self.evals:
            return
        if self.evals and final:
            self.final_eval = version
            self.ctx.event(Kind.EVAL, f"evaluation of the final policy version {version} waits for the evaluation "
                           f"of version {min(self.evals)}", waiting=version)  # fmt: skip
            return
        if self.evals:  # one evaluation at a time: evals slower than eval.every steps must not pile up
            self.ctx.event(Kind.EVAL, f"evaluation of policy version {version} skipped: the evaluation of "
                           f"version {min(self.evals)} is still running (eval.every {ev.every} is shorter "
                           "than an evaluation takes)", skipped=version)  # fmt: skip
            done.add(version)  # never queued later: its policy is gone by then
            return
        n = min(ev.prompts, max(1, self.ctx.spec.rollout.replicas))
        bounds = [round(i * ev.prompts / n) for i in range(n + 1)]
        self.evals[version] = (n, {})
        self.evalq.extend(Shard(version, i, tuple(range(bounds[i], bounds[i + 1])), EVAL) for i in range(n))

    def evaluating(self) -> bool:
        """Whether an evaluation is queued, in flight or waiting (the final one)."""
        return bool(self.evals) or self.final_eval is not None

    def _eval_result(self, shard: Shard, result: dict[str, Any]) -> None:
        if shard.step not in self.evals:
            return
        n, got = self.evals[shard.step]
        got[shard.index] = result
        if len(got) == n:
            del self.evals[shard.step]
            self.on_eval(shard.step, [got[i] for i in sorted(got)])
            if self.final_eval is not None:  # the job's last policy, held back until now
                version, self.final_eval = self.final_eval, None
                self.queue_eval(version, set())

    def refs(self) -> list[Any]:
        return list(self.inflight)

    def collect(self, ready: list[Any], rollouts: RolloutGroup) -> None:
        """Take in the shards among ``ready``: done, re-queued (worker lost, disk full), or raised."""
        for ref in [r for r in ready if r in self.inflight]:
            f = self.inflight.pop(ref)
            again = self.evalq if f.shard.round == EVAL else self.queue
            try:
                result = self.ctx.actors.get(ref, timeout=0)
            except Exception as e:
                if actor_died(e):  # the worker died: its shard goes back to the queue (a helper's stays)
                    self._requeue(f)
                    if rollouts.lost_with_its_process(f.worker):  # the trainer group ended it: no fault
                        continue
                    info = self._member(f.worker)
                    if info.get("preempted_at") or f.worker in rollouts.draining:  # it left on notice: no fault
                        rollouts.preempted(f.worker, info, f"its shard {f.shard.step}/{f.shard.index} goes to another")
                        continue
                    self.faults.detected(classify("rollout", error=e, worker=f.worker))
                    rollouts.fault(f.worker, e)
                    continue
                self.ctx.raise_if_stale(e)
                full = worker_cause(e)
                if not isinstance(full, JournalFull):
                    raise
                self.journal.release(f.shard.step, f.shard.index, str(f.worker))
                if not f.steal:
                    again.appendleft(f.shard)  # generated again once there is space
                rollouts.free(f.worker)
                self.pause(full)
                continue
            if result.get("preempted"):  # it stopped on notice: what it finished is journaled, the rest goes on
                self._requeue(f)
                rollouts.preempted(f.worker, result, f"{result.get('groups_done', 0)} of {result.get('groups', '?')} "
                                   f"prompt groups of shard {f.shard.step}/{f.shard.index} journaled, the rest goes "
                                   "to another worker")  # fmt: skip
                continue
            rollouts.free(f.worker)
            if f.steal:  # a helper's answer: the groups it journaled are in the owner's shard
                continue
            if f.shard.round == EVAL:
                self._eval_result(f.shard, result)
                continue
            self.helped.discard(f.shard)
            if (f.shard.step, f.shard.index) in self.lost:
                self.lost.discard((f.shard.step, f.shard.index))
                kept, regen = int(result.get("kept") or 0), int(result.get("generated") or 0)
                self.ctx.event(Kind.SHARD_RESUMED, f"shard {f.shard.step}/{f.shard.index} done by worker {f.worker}: "
                               f"{kept} samples its lost worker had journaled kept, {regen} generated again",
                               step=f.shard.step, shard=f.shard.index, worker=f.worker, kept=kept,
                               regenerated=regen)  # fmt: skip
            self.shard_mb = max(self.shard_mb, float(result.get("bytes") or 0) / 1e6)
            self.shard_s.append(time.monotonic() - f.sent)
            self.costs.learn(result.get("costs"))
            self.done.setdefault(f.shard.step, {})[f.shard.index] = result
            if len(self.done[f.shard.step]) == self.rounds[f.shard.step].shards:
                self._round_done(f.shard.step)

    def _requeue(self, f: InFlight) -> None:
        """``f``'s worker is lost or leaving: its shard goes back to the front of its queue, unless
        ``f`` was a helper (the owner has it; a helper still on a lost owner's shard writes no
        shard file, so the shard goes back even then). Its claims on the shard's groups are
        dropped: the worker still on the shard takes them over."""
        if f.shard.round != EVAL:
            self.journal.release(f.shard.step, f.shard.index, str(f.worker))
        if f.steal:
            return
        self.helped.discard(f.shard)  # its next owner may have a helper of its own
        if f.shard.round == EVAL:
            self.evalq.appendleft(f.shard)
            return
        self.queue.appendleft(f.shard)
        self.lost.add((f.shard.step, f.shard.index))

    def write_batches(self) -> None:
        """Write the manifest of every batch whose shards are all in but whose manifest is not
        (new, or refused by a full disk); a step trains only once its batch is journaled."""
        for step in sorted(self.unjournaled):
            if self.paused():
                return
            r = self.rounds[step]
            refs = [ShardRef(**self.done[step][i]["ref"]) for i in range(r.shards)]
            self.ctx.check_leader()
            try:
                meta = {"rounds": r.round + 1, "extra_prompts": r.extra} if self.dynamic else None
                if not self.journal.commit_batch(step, refs, meta):  # a previous leader completed it first
                    self.done[step] = self.journaled(step) or self.done[step]
                    r.shards = len(self.done[step])
            except JournalFull as e:
                self.pause(e)
                return
            self.unjournaled.discard(step)

    def batch(self, k: int) -> dict[int, dict[str, Any]] | None:
        """Step ``k``'s shard summaries once its batch is complete and journaled, else None."""
        got, r = self.done.get(k), self.rounds.get(k)
        if got is None or r is None or len(got) != r.shards or k in self.unjournaled:
            return None
        return got

    def take(self, k: int) -> dict[int, dict[str, Any]]:
        self.rounds.pop(k, None)
        return self.done.pop(k)

    # -- the watchdog ----------------------------------------------------------------

    def watchdog(self, rollouts: RolloutGroup) -> None:
        """A worker with a shard in flight for longer than its limit (``fault.hang_timeout``
        plus its reward calls' time) and no progress on it for ``fault.hang_timeout`` is hung
        (stopped, deadlocked, starved): kill and replace it, re-queue its shard. A worker that
        does not join in time is hung too. A shard whose call has ended is not hung, however
        late the runner looks (it may have waited on something else: a snapshot's staging).

        Progress is membership's ``progress_at`` for that very shard (the worker stamps it as
        its reward calls end): on a loaded machine, reward calls that time out one after another
        and the restarts of their children can hold a live worker past the limit."""
        now = time.monotonic()
        progress: dict[str, dict[str, Any]] | None = None
        self.wake_at = float("inf")
        self.probes = {ref: p for ref, p in self.probes.items() if ref in self.inflight}
        for ref, f in list(self.inflight.items()):
            frozen = self._frozen(ref, f, rollouts)
            limit = self.shard_limit(len(f.shard.prompts), f.shard.round == EVAL)
            if frozen is None and now - f.sent <= limit:
                continue
            if self.ctx.actors.wait([ref], timeout=0)[0]:
                continue  # its call has ended (while the runner waited elsewhere): taken in, never a hang
            if frozen is None:
                if progress is None:
                    progress = self._progress_view(now)
                if self._progressing(f, progress.get(str(f.worker))):
                    continue
            del self.inflight[ref]
            self._requeue(f)
            if frozen is not None:
                self.ctx.event(Kind.ROLLOUT_HANG, f"rollout worker {f.worker} did not answer a liveness call in "
                               f"{frozen:.1f}s (fault.probe_timeout), {now - f.sent:.1f}s into shard "
                               f"{f.shard.step}/{f.shard.index}: frozen", worker=f.worker, group="rollout",
                               channel="probe", detection_s=round(now - f.sent, 2))  # fmt: skip
            else:
                self.ctx.event(Kind.ROLLOUT_HANG, f"rollout worker {f.worker} made no progress on shard "
                               f"{f.shard.step}/{f.shard.index} for {now - f.sent:.1f}s (limit {limit:g}s: "
                               "fault.hang_timeout + reward timeouts)", worker=f.worker, group="rollout",
                               channel="progress", detection_s=round(now - f.sent, 2))  # fmt: skip
            self.faults.detected(classify("rollout", hung=True, worker=f.worker))
            rollouts.fault(f.worker, TimeoutError(f"hung for {now - f.sent:.0f}s"))
        self._retire_preempted(rollouts, now)
        for w in rollouts.overdue_joins():
            self.ctx.event(Kind.ROLLOUT_HANG, f"rollout worker {w} did not join within {rollouts.join_limit():g}s",
                           worker=w, group="rollout")  # fmt: skip
            self.faults.detected(classify("rollout", hung=True, worker=w, cause="join_timeout"))
            rollouts.fault(w, TimeoutError("join timed out"))

    def _frozen(self, ref: Any, f: InFlight, rollouts: RolloutGroup) -> float | None:
        """The liveness probe over ``f``'s worker (:class:`LivenessProbe`, scaled by the recent
        training shards' median; none before the first is in): the seconds it was silent if it is
        frozen, else None. Keeps :attr:`wake_at` for the runner's wait."""
        probe = self.probes.get(ref)
        if probe is None:
            actor = rollouts.workers.get(f.worker)
            usual = sorted(self.shard_s)[len(self.shard_s) // 2] if self.shard_s else None
            if actor is None or usual is None or not self.ctx.spec.fault.probe_timeout:
                return None
            probe = self.probes[ref] = LivenessProbe(self.ctx.actors, {f.worker: actor},
                                                     self.ctx.spec.fault.probe_timeout, usual, started=f.sent)  # fmt: skip
        frozen = probe.check().get(f.worker)
        self.wake_at = min(self.wake_at, probe.wake_at)
        return frozen

    def _retire_preempted(self, rollouts: RolloutGroup, now: float) -> None:
        """Idle workers that say ``preempted`` in membership (SIGTERM while between shards) leave
        now, not when their grace runs out: read with the progress view, at most once a second."""
        if not rollouts.idle:
            return
        view = self._progress_view(now)
        for w in sorted(rollouts.idle):
            info = view.get(str(w)) or {}
            at = info.get("preempted_at")  # (a field: a status update of the worker's may come after it)
            # not a notice from before this worker took the index: that is its predecessor's record
            # (the view may be older than the successor's write; seen: a new worker retired at once)
            if isinstance(at, (int, float)) and at > rollouts.removed_at.get(w, float("-inf")):
                rollouts.preempted(w, info, "it was idle")
                self._progress_read = (float("-inf"), {})  # its replacement's record is read afresh

    def _member(self, w: int) -> dict[str, Any]:
        """Worker ``w``'s membership record as etcd has it now ({} if gone or unreadable)."""
        try:
            return dict(self.ctx.members("rollout").get(str(w)) or {})
        except EtcdError:
            return {}

    def _progress_view(self, now: float) -> dict[str, dict[str, Any]]:
        """The rollout group's member records, read at most once a second (while a shard is overdue,
        or a worker idle: a preemption notice); empty while etcd cannot be read (then the limit
        alone decides, as before)."""
        if now - self._progress_read[0] >= 1.0:
            try:
                self._progress_read = (now, self.ctx.members("rollout"))
            except EtcdError:
                self._progress_read = (now, {})
        return self._progress_read[1]

    def _progressing(self, f: InFlight, info: dict[str, Any] | None) -> bool:
        """Whether the worker of ``f`` says it is on that shard and stamped progress on it within
        ``fault.hang_timeout`` (a stopped worker stamps nothing, and its key goes with its lease)."""
        if not info or info.get("status") != "busy" or (info.get("step"), info.get("shard")) != (
            f.shard.step, f.shard.index):  # fmt: skip
            return False
        try:
            return time.time() - float(info["progress_at"]) <= self.ctx.spec.fault.hang_timeout
        except (KeyError, TypeError, ValueError):
            return False

    def shard_limit(self, prompts: int, evaluation: bool = False) -> float:
        """``fault.hang_timeout`` for a shard of ``prompts`` prompts, plus the longest its user reward
        calls may take by design (each has ``task.reward_timeout_s``, ``reward_workers`` at a time):
        a reward function timing out sample after sample is slow, not a hung worker. An eval
        shard: the eval task's reward and ``eval.samples`` per prompt."""
        spec = self.ctx.spec
        t = spec.task
        samples = prompts * spec.rollout.sampling.n
        if evaluation and spec.eval is not None:
            t, samples = spec.eval.task or spec.task, prompts * spec.eval.samples
        extra = 0.0
        if t.reward == "function":
            extra = -(-samples // t.reward_workers) * t.reward_timeout_s
        elif t.reward == "server" and t.reward_server is not None:
            rs = t.reward_server
            batches = -(-samples // rs.batch_size)
            extra = -(-batches // t.reward_workers) * rs.batch_deadline_s()
        return spec.fault.hang_timeout + extra
