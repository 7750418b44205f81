"""The rollout worker: a Ray actor that generates shards and journals them.

One actor per replica, named ``rrl:{job}:rollout:{index}`` (detached, so a
controller crash does not kill it). Calls on an actor run one at a time, in
the order they were sent: a weight load sent between two shards lands between
them, so a shard is always generated under a single policy version.

Generation is deterministic given ``(seed, step, prompt, sample)``: a shard
regenerated on another worker after a fault has the same content.

A shard is generated as a stream (``Engine.stream``): each prompt group is scored
and journaled as soon as its samples are finished (``Journal.write_group``, first
writer wins), and a shard sent again after its worker was lost generates only the
groups not journaled yet.

Preemption is a drain, not a fault: on SIGTERM (a spot node's notice, a drain) the
worker stops taking work, stops its shard after the groups already finished (they
are journaled), answers ``{"preempted": ...}`` and marks itself ``preempted`` in
membership; the leader gives its unfinished groups to others and replaces it
without spending the fault budget. It exits by itself ``fault.preempt_grace_s``
after the signal if the leader has not stopped it by then.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import ray

from checkpoints.journal import Journal, ShardRef
from controller.membership import Member
from controller.nodeagent import register
from controller.store import Store

from ..algo.dynamic import round_sample_number, varied
from ..algo.sampler import eval_task_seed, sample_seed
from ..algo.tasks import make_task
from ..algo.tasks.reward_pool import RewardPool
from ..spec import JobSpec, TaskSpec
from .engines import Sampling, make_engine
from .fencing import check_fence, exit_stale_policy, exit_superseded
from .logcapture import capture
from .preemption import Preemption
from .transport import fetch

log = logging.getLogger(__name__)


EVAL_SEED_STEP = 10**12  # evaluation seeds: sample_seed(seed, EVAL_SEED_STEP + version, ...), past any step


def _reward_pool(t: TaskSpec) -> RewardPool | None:
    """The killable scorer processes of a user reward function or a reward server (None for the
    built-in scorers, which run in-process)."""
    if t.reward == "function" and t.reward_fn:
        return RewardPool(t.reward_fn, t.reward_timeout_s, t.reward_workers)
    if t.reward == "server" and t.reward_server is not None:
        return RewardPool.for_server(t.reward_server, t.reward_workers)
    return None


class RolloutWorker:
    """Generate shards of prompts with one policy version at a time (see module doc)."""

    def __init__(
        self, job: str, index: int, spec_json: str, model_dir: str, workdir: str, etcd: str, spare: int | None = None
    ) -> None:
        import ray
        import torch

        # first: whatever follows is in the job's logs (`rrl logs`), a failing start included
        self.log = capture(workdir, f"rollout-{index}" if spare is None else f"rollout-spare-{spare}")
        torch.set_num_threads(max(1, int(os.environ.get("RRL_WORKER_THREADS", "1"))))
        self.spec = JobSpec.model_validate_json(spec_json)
        self.job, self.index, self.model_dir = job, index, model_dir
        self.task = make_task(self.spec.task, self.spec.seed, model_dir)
        t = self.spec.task
        # user code runs in killable processes (its own deadline); built-in scorers in-process
        self.rewards = _reward_pool(t)
        r = self.spec.rollout
        self.sampling = Sampling(r.sampling.temperature, r.sampling.top_p, r.sampling.max_tokens)
        self.journal = Journal(os.path.join(workdir, "journal"))
        self.version = 0
        self.fence = 0  # newest leader token seen (see fencing.check_fence)
        self.store = Store(etcd, timeout=2.0, retry_window=30.0)
        self.spare = spare  # a warm spare's number until it is promoted (see promote)
        self._progress_at = 0.0  # when membership's progress_at was last stamped (monotonic)
        self._eval: tuple[Any, RewardPool | None] | None = None  # (eval task, its scorers), see evaluate
        self._node = ray.get_runtime_context().get_node_id()
        if spare is None:
            self.member = self._register("rollout", str(index))
        else:
            self.member = self._register("rollout-spare", str(spare), status="warming")
        t0 = time.monotonic()
        try:
            self.engine = make_engine(r.engine, model_dir, self.spec.model.dtype, r.kv_cache_gib, self.spec.seed)
        except BaseException:
            self.member.close()  # leave at once: a worker that never started is not a member
            raise
        self.engine_start_s = round(time.monotonic() - t0, 2)
        who = f"rollout worker {index}" if spare is None else f"rollout spare {spare}"
        print(f"{who} of job {job}: {r.engine} engine up in {self.engine_start_s}s (pid {os.getpid()})",
              file=sys.stderr, flush=True)  # fmt: skip
        self.member.update(status="ready" if spare is None else "spare", engine_start_s=self.engine_start_s)
        self._busy = False
        self.preemption = Preemption(self._who, self.spec.fault.preempt_grace_s, lambda: self.member,
                                     spare=lambda: self.spare is not None,
                                     mark=lambda: None if self._busy else self._preempted_fields())  # fmt: skip

    def _who(self) -> str:
        return f"rollout worker {self.index}" if self.spare is None else f"rollout spare {self.spare}"

    @property
    def preempted_at(self) -> float | None:
        """Wall time of the SIGTERM that asked this worker to leave (see module doc)."""
        return self.preemption.at

    def _preempted_fields(self) -> dict[str, Any]:
        return {"status": "preempted", **self.preemption.fields()}

    def _register(self, group: str, worker: str, **fields: Any) -> Member:
        return register(self.store, self.job, group, worker, node=self.spec.fault.membership == "node",
                        ttl=self.spec.fault.lease_ttl, version=self.version, engine=self.spec.rollout.engine,
                        ray_node=self._node, on_superseded=exit_superseded,
                        log=self.log.path.name if self.log else None, **fields)  # fmt: skip

    @ray.method(concurrency_group="control")
    def alive(self) -> int:
        """The driver's liveness probe (``faults.LivenessProbe``): answers on the control thread
        while a shard generates; a frozen process (SIGSTOPped, a paused VM) does not answer."""
        return os.getpid()

    def warm(self) -> dict[str, Any]:
        """A spare is warm once its engine is up (the constructor): this answers after it (and at
        once when a new leader asks again). A worker that is no spare (promoted) refuses."""
        if self.spare is None:
            raise RuntimeError(f"rollout worker {self.index} is not a spare")
        return {"spare": self.spare, "pid": os.getpid(), "engine_start_s": self.engine_start_s}

    def promote(self, index: int, token: int, spec_digest: str, version: int, weights: Any) -> int:
        """A warm spare replaces lost worker ``index``: it takes that worker's membership key
        (by compare-and-swap, see ``Registration``), raises its fence to the leader's and loads
        policy ``version``; it takes shards only after this returns. Returns the loaded version."""
        if self.spare is None:
            raise RuntimeError(f"rollout worker {self.index} is not a spare")
        check_fence(self.fence, token, "promote")
        if spec_digest != self.spec.digest():
            raise ValueError("this spare runs another spec of the job (a leftover of an earlier run)")
        self.fence = token
        old, self.index, self.spare = self.member, index, None
        if self.log is not None:
            self.log.rename(f"rollout-{index}")
        self.member = self._register("rollout", str(index), status="ready", engine_start_s=self.engine_start_s)
        old.close()
        if weights is not None:
            self.load_weights(version, weights)
        return self.version

    def load_weights(self, version: int, weights: Any) -> int:
        """Load policy ``version`` in place (between shards) from its published handle (see
        ``transport``; a plain state dict works too). Returns the loaded version."""
        if version <= self.version and version != 0:
            return self.version  # already have it (re-sent after a controller failover)
        before = self.member.info.get("status")
        # the page's worker timeline (membership's status): written only if the load lasts
        # past the registration's period, else the write below carries both (one put a load)
        self.member.note(status="loading")
        self.engine.load_weights(fetch(weights))
        self.version = version
        self.member.update(version=version, status=before)
        return version

    def adopt(self, token: int, spec_digest: str, version: int, state_dict: dict[str, Any] | None) -> int:
        """A (new) leader takes this worker over: raise the fence and make sure it holds
        ``version``. Queued behind a shard still running for the previous leader."""
        check_fence(self.fence, token, "adopt")
        if spec_digest != self.spec.digest():
            raise ValueError("this worker runs another spec of the job (a leftover of an earlier run)")
        self.fence = token
        if state_dict is not None:
            self.load_weights(version, state_dict)
        return self.version

    def generate_shard(
        self,
        step: int,
        shard: int,
        indices: list[int],
        token: int = 0,
        round_: int = 0,
        steal: bool = False,
        order: list[int] | None = None,
    ) -> dict[str, Any]:
        """Generate ``n`` samples for each prompt index, score them, journal the shard.
        ``round_`` > 0: an extra round of dynamic sampling (fresh seeds, see ``algo/dynamic``).

        Each prompt group is journaled as soon as it is finished (see module doc); groups a
        lost worker journaled before are kept, not generated again. Returns the shard
        reference plus summary figures (never the trajectories: those go to the journal),
        with ``kept`` (samples taken from the journal) and ``generated`` (samples generated
        by this call); or, when this worker was preempted, ``{"preempted": True, ...}`` with
        the groups finished so far. A reward function that raises gives that sample reward 0
        and is recorded in the sample (``reward_error``).

        The groups go in passes of ``rollout.groups_per_pass`` (0: one pass), the journal read
        again before each: groups another worker finished meanwhile are not generated. With
        ``steal`` this worker helps the one the shard was sent to: it takes the unfinished
        groups from the shard's end, writes no shard file, stops once the shard file is there,
        and answers ``{"stolen": groups it journaled, ...}``. ``order`` (``rollout.longest_first``:
        the shard's positions, longest expected group first) is the order owner and helper both
        take groups in, the helper from its start too (the longest unstarted group); the answer's
        ``costs`` are ``[prompt index, seconds]`` of each group, for the next time.
        """
        check_fence(self.fence, token, f"shard {step}/{shard}")
        if self.version < step - self.spec.async_.max_staleness:  # a load it was sent failed
            exit_stale_policy(self.version, step)
        if self.preempted_at is not None:
            return self._preempted_answer(step, shard, 0, len(indices))
        t0 = self._progress_at = time.monotonic()
        self._busy = True
        try:
            return self._generate(step, shard, indices, round_, t0, steal, order)
        finally:
            self._busy = False

    def _journaled(self, step: int, shard: int, examples: list[Any], round_: int) -> dict[int, dict[str, Any]]:
        """The shard's groups in the journal: a lost worker's, a stealer's. A group of another split
        of the step (a leftover of a leader that cut it differently) is not this shard's."""
        return {p: g for p, g in self.journal.groups(step, shard).items()
                if p < len(examples) and g.get("key") == self._group_key(examples[p], round_)}  # fmt: skip

    def _generate(
        self, step: int, shard: int, indices: list[int], round_: int, t0: float, steal: bool, hint: list[int] | None
    ) -> dict[str, Any]:
        self.member.update(status="busy", step=step, shard=shard, started_at=time.time())
        n = self.spec.rollout.sampling.n
        examples = [self.task.example(i) for i in indices]
        have = self._journaled(step, shard, examples, round_)
        kept = sum(len(g["samples"]) for g in have.values())
        per_pass = self.spec.rollout.groups_per_pass or len(examples)
        if hint is not None and sorted(hint) == list(range(len(examples))):  # longest expected first
            order = list(hint)
        else:  # the owner from the start, a helper from the end
            order = list(reversed(range(len(examples)))) if steal else list(range(len(examples)))
        refused = stolen = 0
        me = str(self.index)
        # claims matter only where a helper may share the shard (groups_per_pass > 0); they are an
        # economy, never a wait without end: a claim that no journaled group follows for
        # fault.hang_timeout (a zombie's, made after the leader released its claims) is ignored
        claiming = bool(self.spec.rollout.groups_per_pass)
        waited_since: float | None = None
        while self.preempted_at is None:
            if steal and self.journal.shard_written(step, shard):
                break  # the owner is done: what is left to take is nothing
            before = len(have)
            have.update(self._journaled(step, shard, examples, round_))
            if len(have) == len(examples):
                break
            if len(have) > before:
                waited_since = None
            stale = waited_since is not None and time.monotonic() - waited_since > self.spec.fault.hang_timeout
            claims = self.journal.claims(step, shard) if claiming and not stale else {}
            todo = [p for p in order if p not in have and claims.get(p, me) == me][:per_pass]
            if claiming and not stale:
                todo = [p for p in todo if claims.get(p) == me or self.journal.claim(step, shard, p, me)]
            if not todo:
                if steal:
                    break  # the rest is claimed by the owner: nothing left to take
                waited_since = waited_since or time.monotonic()
                time.sleep(0.05)  # the rest is a helper's (or a lost one's, until the leader releases it)
                self._progress()  # waiting on a helper that makes progress is not a hang
                continue
            for p, group, mine in self._pass(step, shard, examples, round_, todo, stop_if_written=steal):
                have[p] = group
                refused += not mine
                stolen += mine
        if self.preempted_at is not None and (steal or len(have) < len(examples)):  # stopped early
            return self._preempted_answer(step, shard, len(have), len(examples)) | {"stolen": stolen}
        if steal:
            self.member.update(status="idle")
            return {"stolen": stolen, "worker": self.index, "step": step, "shard": shard,
                    "seconds": time.monotonic() - t0}  # fmt: skip
        samples = [x for p in range(len(examples)) for x in have[p]["samples"]]
        reward_errors = sum(x["reward_error"] is not None for x in samples)
        tokens = sum(len(x["token_ids"]) for x in samples)
        secs = time.monotonic() - t0
        version = min(int(g["version"]) for g in have.values())  # the oldest policy in it (staleness)
        generated = len(examples) * n - kept  # by this worker or a stealer
        meta = {"worker": self.index, "version": version, "seconds": secs, "round": round_, "kept": kept,
                "generated": generated, "groups": [[have[p]["worker"], have[p]["version"]]
                                                   for p in range(len(examples))]}  # fmt: skip
        costs = [[examples[p].index, have[p]["seconds"]] for p in range(len(examples)) if "seconds" in have[p]]
        if refused:
            meta["refused"] = refused  # groups another writer journaled first (a stealer, a zombie)
        ref: ShardRef = self.journal.write_shard(step, shard, samples, meta)
        self.journal.drop_groups(step, shard)
        self.member.update(status="idle", shards_done=self.member.info.get("shards_done", 0) + 1)
        rewards = [x["reward"] for x in samples]
        return {
            "ref": ref.to_dict(),
            "bytes": os.path.getsize(ref.path),
            "version": version,
            "reward_mean": sum(rewards) / len(rewards),
            "varied": sum(varied(rewards, n)),  # groups with a reward spread (dynamic sampling counts them)
            "reward_errors": reward_errors,
            "reward_error": next((x["reward_error"] for x in samples if x["reward_error"]), None),
            "samples": len(samples),
            "tokens": tokens,
            "seconds": secs,
            "worker": self.index,
            "kept": kept,
            "generated": generated,
            "costs": costs,
        }

    def _pass(
        self, step: int, shard: int, examples: list[Any], round_: int, todo: list[int], stop_if_written: bool
    ) -> Iterator[tuple[int, dict[str, Any], bool]]:
        """Generate the groups at positions ``todo`` in one engine batch, journaling each as it is
        finished: ``(position, group as journaled, whether ours)``. Stops early on a preemption."""
        n = self.spec.rollout.sampling.n
        prompts, seeds, keys_ = [], [], []
        for p in todo:
            for s in range(n):
                prompts.append(examples[p].prompt)
                seeds.append(sample_seed(self.spec.seed, step, examples[p].index, round_sample_number(round_, n, s)))
                keys_.append((p, s))
        pending: dict[int, dict[int, Any]] = {}
        stream = self.engine.stream(prompts, seeds, self.sampling, stop=self._stopping)
        since = time.monotonic()  # a group's cost: the seconds from the one before it (or the pass's start)
        try:
            for j, c in stream:
                p, s = keys_[j]
                got = pending.setdefault(p, {})
                got[s] = c
                if len(got) < n:
                    continue
                del pending[p]
                if stop_if_written and self.journal.shard_written(step, shard):
                    return  # a stealer's group after the owner finished: nobody needs it
                outs = [got[x] for x in range(n)]
                yield (p, *self._journal_group(step, shard, p, examples[p], round_, outs, since))
                since = time.monotonic()
                if self.preempted_at is not None:
                    return
        finally:
            stream.close()

    def _group_key(self, ex: Any, round_: int) -> list[int]:
        """What a journaled group must have been generated for to count as this one."""
        return [ex.index, round_, self.spec.rollout.sampling.n]

    def _journal_group(
        self, step: int, shard: int, p: int, ex: Any, round_: int, outs: list[Any], since: float
    ) -> tuple[dict[str, Any], bool]:
        """Score one finished prompt group and journal it; returns the group as journaled (ours,
        or the first writer's when another got there first) and whether it is ours."""
        if self.rewards is not None:
            scored = self.rewards.score([(ex.prompt, c.text, ex.answer) for c in outs], self._progress)
        else:
            scored = [self.task.reward(ex, c.text) for c in outs]
        samples = [
            {
                "prompt_index": ex.index,
                "sample": s,
                "prompt_ids": c.prompt_ids,
                "token_ids": c.token_ids,
                "logprobs": [x if math.isfinite(x) else None for x in c.logprobs],
                "text": c.text,
                "reward": rr.value,
                "reward_error": rr.error,
                "version": self.version,
            }
            for s, (c, rr) in enumerate(zip(outs, scored, strict=True))
        ]
        group = {"worker": self.index, "version": self.version, "key": self._group_key(ex, round_), "samples": samples,
                 "seconds": round(time.monotonic() - since, 4)}  # fmt: skip
        self._progress()
        for _ in range(2):
            if self.journal.write_group(step, shard, p, group):
                return group, True
            theirs = self.journal.groups(step, shard).get(p)
            if theirs is not None and theirs.get("key") == group["key"]:
                return theirs, False
            self.journal.drop_group(step, shard, p)  # another split's leftover: ours replaces it
        raise RuntimeError(f"shard {step}/{shard}: group {p} could not be journaled (another writer keeps "
                           "replacing it)")  # fmt: skip

    def _stopping(self) -> bool:
        return self.preempted_at is not None

    def _preempted_answer(self, step: int, shard: int, done: int, groups: int) -> dict[str, Any]:
        self.journal.release(step, shard, str(self.index))  # what it claimed and did not finish goes to others
        self.member.update(**self._preempted_fields())
        print(f"rollout worker {self.index}: preempted on shard {step}/{shard} with {done} of {groups} groups "
              "journaled", file=sys.stderr, flush=True)  # fmt: skip
        return {
            "preempted": True,
            "worker": self.index,
            "groups_done": done,
            "groups": groups,
            **self.preemption.fields(),
        }

    def evaluate(self, version: int, shard: int, lo: int, hi: int, token: int = 0) -> dict[str, Any]:
        """Evaluate the loaded policy on prompts ``lo..hi-1`` of the eval task (``spec.eval``;
        clipped to its size): ``eval.samples`` samples each, scored by that task's reward.
        Nothing is journaled; returns sums the leader adds up over the eval's shards, and the
        policy version actually loaded (``version`` is the one the leader asked for)."""
        check_fence(self.fence, token, f"eval {version}/{shard}")
        if self.preempted_at is not None:
            return self._preempted_answer(version, shard, 0, hi - lo) | {"eval": True}
        ev = self.spec.eval
        if ev is None:
            raise RuntimeError("this job's spec has no eval section")
        if self._eval is None:  # built on first use: a held-out dataset is read once per worker
            et = ev.task or self.spec.task
            seed = eval_task_seed(self.spec.seed) if ev.task else self.spec.seed
            self._eval = (make_task(et, seed, self.model_dir), _reward_pool(et) if ev.task else self.rewards)
        task, pool = self._eval
        t0 = self._progress_at = time.monotonic()
        before = self.member.info.get("status")
        self.member.update(status="evaluating")
        try:
            examples = [task.example(i) for i in range(lo, min(hi, len(task)))]
            r = self.spec.rollout.sampling
            sampling = Sampling(r.temperature if ev.temperature is None else ev.temperature, r.top_p, r.max_tokens)
            k = ev.samples
            # a seed space of its own: the training steps' seeds never repeat here
            seeds = [sample_seed(self.spec.seed, EVAL_SEED_STEP + version, ex.index, s) for ex in examples
                     for s in range(k)]  # fmt: skip
            outs = self.engine.generate([ex.prompt for ex in examples for _ in range(k)], seeds, sampling)
            pairs = [(ex, c) for ex, c in zip([ex for ex in examples for _ in range(k)], outs, strict=True)]
            if pool is not None:
                scored = pool.score([(ex.prompt, c.text, ex.answer) for ex, c in pairs], self._progress)
            else:
                scored = [task.reward(ex, c.text) for ex, c in pairs]
        finally:
            self.member.update(status=before)
        rewards = [x.value for x in scored]
        passed = sum(max(rewards[i : i + k]) >= ev.pass_threshold for i in range(0, len(rewards), k))
        return {"version": self.version, "asked": version, "shard": shard, "prompts": len(examples),
                "samples": len(rewards), "reward_sum": float(sum(rewards)), "passed": int(passed),
                "reward_errors": sum(x.error is not None for x in scored), "seconds": time.monotonic() - t0,
                "worker": self.index}  # fmt: skip

    def _progress(self) -> None:
        """A reward call ended: stamp membership's ``progress_at`` (at most once a second), which
        the driver's watchdog reads before it calls an overdue shard's worker hung."""
        now = time.monotonic()
        if now - self._progress_at >= 1.0:
            self._progress_at = now
            self.member.update()

    def greedy(self, prompts: list[str], max_tokens: int) -> list[list[int]]:
        """Greedy token ids for ``prompts`` under the loaded weights (for equivalence checks)."""
        outs = self.engine.generate(prompts, [0] * len(prompts), Sampling(0.0, 1.0, max_tokens))
        return [c.token_ids for c in outs]

    def shutdown(self) -> None:
        """Leave membership (lease revoked) before the actor is killed."""
        self.member.close()
        if self.rewards is not None:
            self.rewards.close()
        if self._eval is not None and self._eval[1] is not None and self._eval[1] is not self.rewards:
            self._eval[1].close()
