"""Scriptable stand-ins for the job's Ray actors, run by the fake actor layer
(tests/helpers/fake_actors.py) under the driver's unit tests.

They speak the workers' protocol (the methods and return shapes of
``resilient_rl/workers/rollout.py`` and ``trainer.py``), write a real journal and real
snapshot folders (``checkpoints/``: manifest last, digests), and fence calls with the real
``check_fence``. What they compute is trivial (a sample's reward is its policy version; a
rank's "weights" are the list of steps it applied), so a test can check exactly what was
generated, trained and published. A :class:`Script` shared by every fake of a job holds
the faults a test injects and what the fakes saw.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError

from checkpoints.journal import Journal
from checkpoints.snapshots import snapshot_dir, write_manifest
from resilient_rl.algo.dynamic import select_groups, varied
from resilient_rl.job.actors import Placement
from resilient_rl.naming import actor_name
from resilient_rl.spec import JobSpec
from resilient_rl.workers.colocated import ColocatedWorker
from resilient_rl.workers.fencing import check_fence
from resilient_rl.workers.weights import WeightStore
from tests.helpers.fake_actors import FakeActors


class Crash(Exception):
    """A scripted worker error (not an actor death)."""


@dataclass
class Script:
    """Faults to inject (consumed as they fire) and what the fake workers saw."""

    kill_rollout_at: set[tuple[int, int]] = field(default_factory=set)  # (step, shard): its worker dies mid-shard
    # (step, shard) -> groups: its worker journals that many of the groups it has to generate, then dies
    kill_rollout_after: dict[tuple[int, int], int] = field(default_factory=dict)
    # (step, shard) -> groups: its worker is preempted (SIGTERM) after journaling that many groups
    preempt_rollout_at: dict[tuple[int, int], int] = field(default_factory=dict)
    on_shard: Any = None  # called (worker, step, shard) as a shard starts
    group_delay_s: dict[tuple[int, int], float] = field(default_factory=dict)  # (step, shard) -> seconds a group
    prompt_delay_s: dict[int, float] = field(default_factory=dict)  # prompt index -> seconds its group takes
    group_order: list[tuple[int, int, int, int]] = field(
        default_factory=list
    )  # (step, shard, prompt, serial) journaled
    stolen: list[tuple[int, int, int, int]] = field(default_factory=list)  # (step, shard, serial, groups) of helpers
    # (step, shard): its helper dies holding its first claim (before it generates that group)
    kill_helper_at: set[tuple[int, int]] = field(default_factory=set)
    on_register: Any = None  # called (index) when a worker takes its membership key (starts, is promoted)
    on_join: Any = None  # called (index, serial) as a rollout worker joins a leader's group (adopt)
    on_rank: Any = None  # called (rank) when a trainer rank takes its membership key (starts, is promoted)
    # (step, shard, position, serial, version) of every prompt group journaled (first writer only)
    group_writes: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    hang_rollout_at: set[tuple[int, int]] = field(default_factory=set)  # (step, shard): its worker stops answering
    freeze_rollout_at: set[tuple[int, int]] = field(default_factory=set)  # (step, shard): ... its liveness calls too
    kill_rank_at: set[tuple[int, int]] = field(default_factory=set)  # (step, rank): that rank dies in train_step
    kill_rank_at_digest: set[tuple[int, int]] = field(default_factory=set)  # (step, rank): ... in digest (the end)
    # (step, rank): that rank dies after the step's collective, having applied it, before it returns
    kill_rank_after: set[tuple[int, int]] = field(default_factory=set)
    hang_rank_at: set[tuple[int, int]] = field(default_factory=set)  # (step, rank): that rank hangs in train_step
    # (step, rank): that rank's process freezes in train_step (SIGSTOP): its liveness calls do not answer either
    freeze_rank_at: set[tuple[int, int]] = field(default_factory=set)
    freeze_snapshot_at: set[tuple[int, int]] = field(default_factory=set)  # (step, rank): ... in its snapshot's staging
    freeze_rank_after: set[tuple[int, int]] = field(default_factory=set)  # (step, rank): ... once it returned that step
    probes: int = 0  # liveness calls answered (FakeTrainer.alive)
    fail_start: int = 0  # trainer ranks that die in setup (each one counts down)
    unreachable_start: int = 0  # trainer ranks whose setup finds them unreachable (ActorUnavailableError)
    shard_delay_s: float = 0.0
    # (step, shard) -> seconds: its worker takes that long, calling on_progress(worker, step, shard) every 0.1 s
    slow_rollout_at: dict[tuple[int, int], float] = field(default_factory=dict)
    snapshot_delay_s: dict[int, float] = field(default_factory=dict)  # step -> seconds its snapshot's staging takes
    staging: list[tuple[int, float, float]] = field(default_factory=list)  # (step, start, end) monotonic, per rank
    on_progress: Any = None
    reward: Any = None  # (step, round, prompt_index, sample) -> a sample's reward; None: its policy version / 10
    # (step, shard, round, prompts) of every shard begun
    rounds: list[tuple[int, int, int, tuple[int, ...]]] = field(default_factory=list)
    kept: dict[int, list[int]] = field(default_factory=dict)  # step -> prompt indices of the groups trained on
    eval_delay_s: float = 0.0  # how long an eval shard takes beyond shard_delay_s
    kill_eval_at: set[tuple[int, int]] = field(default_factory=set)  # (version, shard): its worker dies mid-eval
    # (version asked, shard, version loaded, lo, hi) of every eval shard begun
    evaluated: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    train_delay_s: float = 0.0
    on_train: Any = None  # called (step, rank) at the start of every train_step
    # train_step is a collective (as gloo's all-reduce): every rank waits for the others before it
    # applies the step, and a rank that dies breaks it for the rest ("Connection closed by peer")
    collective: bool = False
    bad_fingerprint: int = 0  # newcomers whose state fingerprint comes out wrong (each one counts down)
    bad_serials: set[int] = field(default_factory=set)  # the actors it hit
    # ranks whose state moves on with their step counter left at the committed step (a drift the
    # counter cannot show: their state sketch at the next adopt differs; each one is consumed)
    drift: set[int] = field(default_factory=set)
    published: list[tuple[int, int]] = field(default_factory=list)  # (step, rank) of every publish() call
    bad_replay: int = 0  # spares promoted without a survivor whose replayed state comes out wrong (count down)
    spare_dies: int = 0  # trainer spares that die while warming (each one counts down)
    rollout_spare_dies: int = 0  # rollout spares that die while warming (each one counts down)
    spare_warm_s: float = 0.0  # how long a spare's warm-up takes (either group's)
    rollout_promoted: list[tuple[int, int, int]] = field(default_factory=list)  # (index, serial, version)
    promoted: list[int] = field(default_factory=list)  # serials of the spares promoted to ranks
    transfers: dict[Any, tuple[int, list[int]]] = field(default_factory=dict)  # reform master -> sent state
    reformed: list[tuple[int, str]] = field(default_factory=list)  # (serial, "kept" | "shadow") per survivor's reform
    barriers: dict[int, threading.Barrier] = field(default_factory=dict)
    broken: bool = False  # a rank died: the process group is broken until the survivors re-form it
    generated: list[tuple[int, int, int]] = field(default_factory=list)  # (step, shard, worker) journaled
    shards_by: list[tuple[int, int, int, int, float]] = field(default_factory=list)  # (step, shard, serial, version, t)
    setup_delay_s: float = 0.0  # how long a rank's setup (a restore) takes
    setups: list[tuple[float, float]] = field(default_factory=list)  # (start, end) monotonic of every setup
    trained: list[tuple[int, int, int]] = field(default_factory=list)  # (step, rank, actor serial) applied
    layer: FakeActors | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def barrier(self, step: int, world: int) -> threading.Barrier:
        with self.lock:
            return self.barriers.setdefault(step, threading.Barrier(world))

    def break_collective(self, step: int, which: threading.Barrier | None = None) -> None:
        """A rank of step ``step`` died (or a peer gave up waiting on ``which``): its peers'
        collective fails; the step's next try gets a new one."""
        with self.lock:
            self.broken = which is None or self.broken
            b = self.barriers.get(step)
            if b is not None and (which is None or b is which):
                del self.barriers[step]
        if b is not None:
            b.abort()

    def fire(self, where: set[tuple[int, int]], key: tuple[int, int]) -> bool:
        with self.lock:
            if key in where:
                where.discard(key)
                return True
            return False


def _die(obj: Any) -> None:
    """Kill the actor this object runs in (as a crash of its process would)."""
    obj._script.layer.kill(obj._fake_actor)
    raise SystemExit  # the call ends; the layer already failed it with ActorDiedError


def _hang(obj: Any) -> None:
    while obj._fake_actor.alive:
        time.sleep(0.02)
    raise SystemExit


def _alive(obj: Any) -> int:
    """A worker's liveness probe (``alive``, on its control thread): a frozen process never answers."""
    if obj._frozen:
        _hang(obj)
    with obj._script.lock:
        obj._script.probes += 1
    return int(obj.serial)


_serial = iter(range(1, 1_000_000))


class FakeRollout:
    _script: Script

    def __init__(
        self, job: str, index: int, spec_json: str, model_dir: str, workdir: str, etcd: str, spare: int | None = None
    ) -> None:
        self.index, self.spare = index, spare
        self.spec = JobSpec.model_validate_json(spec_json)
        self.journal = Journal(Path(workdir) / "journal")
        self.version = 0
        self.fence = 0
        self.serial = next(_serial)
        self._frozen = False
        if spare is None and self._script.on_register is not None:
            self._script.on_register(index)

    @ray.method(concurrency_group="control")
    def alive(self) -> int:
        return _alive(self)

    def warm(self) -> dict[str, Any]:
        if self.spare is None:
            raise RuntimeError(f"rollout worker {self.index} is not a spare")
        s = self._script
        with s.lock:
            dies = s.rollout_spare_dies > 0
            s.rollout_spare_dies -= dies
        if dies:
            _die(self)
        time.sleep(s.spare_warm_s)
        return {"spare": self.spare, "pid": self.serial, "engine_start_s": 0.0}

    def promote(self, index: int, token: int, spec_digest: str, version: int, weights: Any) -> int:
        check_fence(self.fence, token, "promote")
        assert self.spare is not None, "not a spare"
        self.fence, self.index, self.spare = token, index, None
        if self._script.on_register is not None:
            self._script.on_register(index)
        with self._script.lock:
            self._script.rollout_promoted.append((index, self.serial, version))
        if weights is not None:
            self.load_weights(version, weights)
        return self.version

    def adopt(self, token: int, spec_digest: str, version: int, weights: Any) -> int:
        if self._script.on_join is not None:
            self._script.on_join(self.index, self.serial)
        check_fence(self.fence, token, "adopt")
        self.fence = token
        if weights is not None:
            self.load_weights(version, weights)
        return self.version

    def load_weights(self, version: int, weights: Any) -> int:
        if version > self.version:
            self.version = version
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
        check_fence(self.fence, token, f"shard {step}/{shard}")
        s = self._script
        if steal:
            return self._help(step, shard, indices, round_, order)
        with s.lock:
            s.rounds.append((step, shard, round_, tuple(indices)))  # as the shard starts
        if s.on_shard is not None:
            s.on_shard(self.index, step, shard)
        if s.fire(s.kill_rollout_at, (step, shard)):
            _die(self)
        if s.fire(s.freeze_rollout_at, (step, shard)):
            self._frozen = True
        if self._frozen or s.fire(s.hang_rollout_at, (step, shard)):
            _hang(self)
        time.sleep(s.shard_delay_s)
        if (slow := s.slow_rollout_at.pop((step, shard), None)) is not None:
            until = time.monotonic() + slow
            while time.monotonic() < until:
                if s.on_progress is not None:
                    s.on_progress(self.index, step, shard)
                time.sleep(0.1)
        n = self.spec.rollout.sampling.n
        # as the real worker: prompt groups journaled one by one (first writer wins), the ones a lost
        # worker journaled kept
        have = self._journaled(step, shard, indices, round_)
        kept = sum(len(g["samples"]) for g in have.values())
        with s.lock:
            dies_after = s.kill_rollout_after.pop((step, shard), None)
            preempted_after = s.preempt_rollout_at.pop((step, shard), None)
        count = 0
        deadline = time.monotonic() + 20
        while len(have) < len(indices):  # passes, as the real worker's: claimed, then generated
            assert time.monotonic() < deadline, f"shard {step}/{shard}: groups claimed by a lost helper never freed"
            todo = self._claim(step, shard, order or range(len(indices)), have)
            if not todo:
                time.sleep(0.01)  # the rest is a helper's
            for p in todo:
                if count == dies_after:
                    _die(self)
                if count == preempted_after:
                    self.journal.release(step, shard, str(self.index))
                    return {"preempted": True, "worker": self.index, "groups_done": len(have), "groups": len(indices),
                            "preempted_at": time.time()}  # fmt: skip
                count += 1
                have[p] = self._group(step, shard, p, indices[p], round_)
            have.update(self._journaled(step, shard, indices, round_))  # a helper's groups
        samples = [x for p in range(len(indices)) for x in have[p]["samples"]]
        version = min(g["version"] for g in have.values())
        ref = self.journal.write_shard(step, shard, samples, {"worker": self.index, "version": version})
        self.journal.drop_groups(step, shard)
        with s.lock:
            s.generated.append((step, shard, self.index))
            s.shards_by.append((step, shard, self.serial, self.version, time.monotonic()))
        return {"ref": ref.to_dict(), "bytes": 100, "version": version, "reward_mean": 0.0, "reward_errors": 0,
                "reward_error": None, "samples": len(samples), "tokens": 2 * len(samples), "seconds": 0.0,
                "worker": self.index, "varied": sum(varied([x["reward"] for x in samples], n)), "kept": kept,
                "generated": len(indices) * n - kept,
                "costs": [[indices[p], have[p]["seconds"]] for p in range(len(indices))]}  # fmt: skip

    def _journaled(self, step: int, shard: int, indices: list[int], round_: int) -> dict[int, dict[str, Any]]:
        n = self.spec.rollout.sampling.n
        return {p: g for p, g in self.journal.groups(step, shard).items() if g["key"] == [indices[p], round_, n]}

    def _group(self, step: int, shard: int, p: int, i: int, round_: int) -> dict[str, Any]:
        """Generate and journal prompt group ``p`` (prompt ``i``); returns the journaled one (first writer's)."""
        s, n = self._script, self.spec.rollout.sampling.n
        delay = s.prompt_delay_s.get(i, s.group_delay_s.get((step, shard), 0.0))
        time.sleep(delay)
        samples = [{"prompt_index": i, "sample": j, "prompt_ids": [3], "token_ids": [4, 1], "logprobs": [0.0, 0.0],
                    "text": "x", "reward_error": None, "version": self.version,
                    "reward": min(1.0, self.version / 10) if s.reward is None else s.reward(step, round_, i, j)}
                   for j in range(n)]  # fmt: skip
        group = {"worker": self.index, "version": self.version, "key": [i, round_, n], "samples": samples,
                 "seconds": delay}  # fmt: skip
        if self.journal.write_group(step, shard, p, group):
            with s.lock:
                s.group_writes.append((step, shard, p, self.serial, self.version))
                s.group_order.append((step, shard, i, self.serial))
        # the first writer's; our own when the step's batch completed under us (its parts swept)
        return self.journal.groups(step, shard).get(p, group)

    def _claim(self, step: int, shard: int, order: Any, have: dict[int, Any]) -> list[int]:
        """The next pass: unjournaled groups in ``order`` not claimed by another worker, claimed."""
        me, per_pass = str(self.index), self.spec.rollout.groups_per_pass or len(have) + len(order)
        claims = self.journal.claims(step, shard)
        todo = [p for p in order if p not in have and claims.get(p, me) == me][:per_pass]
        return [p for p in todo if claims.get(p) == me or self.journal.claim(step, shard, p, me)]

    def _help(self, step: int, shard: int, indices: list[int], round_: int, order: list[int] | None) -> dict[str, Any]:
        """A helper (work stealing): groups from the shard's end (or in ``order``: longest expected
        first), a pass at a time, until the owner's shard file is there or nothing is left."""
        s, mine = self._script, 0
        while not self.journal.shard_written(step, shard):
            todo = self._claim(step, shard, order or list(reversed(range(len(indices)))),
                               self._journaled(step, shard, indices, round_))  # fmt: skip
            if not todo:
                break
            for p in todo:
                if s.fire(s.kill_helper_at, (step, shard)):
                    _die(self)  # holding its claim on p: the leader must release it for the owner
                if self.journal.shard_written(step, shard):
                    break
                mine += self._group(step, shard, p, indices[p], round_)["worker"] == self.index
        with s.lock:
            s.stolen.append((step, shard, self.serial, mine))
        return {"stolen": mine, "worker": self.index, "step": step, "shard": shard, "seconds": 0.0}

    def evaluate(self, version: int, shard: int, lo: int, hi: int, token: int = 0) -> dict[str, Any]:
        """Prompt i's samples score (i + version) % 2 (pass@k: the odd ones); hi clipped at 10 prompts."""
        check_fence(self.fence, token, f"eval {version}/{shard}")
        s = self._script
        with s.lock:
            s.evaluated.append((version, shard, self.version, lo, hi))  # as it starts
        if s.fire(s.kill_eval_at, (version, shard)):
            _die(self)
        time.sleep(s.shard_delay_s + s.eval_delay_s)
        assert self.spec.eval is not None
        k = self.spec.eval.samples
        idx = range(lo, min(hi, 10))
        rewards = [float((i + self.version) % 2) for i in idx for _ in range(k)]
        return {"version": self.version, "asked": version, "shard": shard, "prompts": len(idx),
                "samples": len(rewards), "reward_sum": sum(rewards), "passed": sum((i + self.version) % 2 for i in idx),
                "reward_errors": 0, "seconds": 0.0, "worker": self.index}  # fmt: skip

    def shutdown(self) -> None:
        pass


class FakeTrainer:
    _script: Script

    def __init__(
        self,
        job: str,
        rank: int,
        world: int,
        spec_json: str,
        model_dir: str,
        workdir: str,
        etcd: str,
        strategy: str | None = None,
        spare: int | None = None,
    ) -> None:
        self.job, self.rank, self.world, self.spare = job, rank, world, spare
        if spare is None and self._script.on_rank is not None:
            self._script.on_rank(rank)
        self.spec = JobSpec.model_validate_json(spec_json)
        self.warmed = self._frozen = False
        self.strategy = strategy or "ddp"
        self.journal = Journal(Path(workdir) / "journal")
        self.serial = next(_serial)
        self.step = 0
        self.applied: list[int] = []
        self.fence = 0
        self.last: dict[str, Any] | None = None
        self.recent: dict[int, dict[str, Any]] = {}  # the two newest results by step, as TrainerRank keeps
        self.training: int | None = None
        self.pending: int | None = None

    def address(self, fresh: bool = False) -> tuple[str, int]:
        return "127.0.0.1", next(_serial) if fresh else 0

    def reform(self, master: tuple[str, int], token: int, src: int | None, shadow: Any = None) -> dict[str, Any]:
        check_fence(self.fence, token, "reform")
        if self.training is not None:
            raise RuntimeError(f"rank {self.rank} is still in train step {self.training}")
        with self._script.lock:
            self._script.broken = False  # the new group
            self._script.reformed.append((self.serial, "shadow" if shadow is not None else "kept"))
            if self.rank == src:
                self._script.transfers[tuple(master)] = (self.step, list(self.applied))
        if shadow is not None:  # fsdp: the process stays, the state comes from the shadow copy
            self._from_shadow(shadow)
        return {"rank": self.rank, "step": self.step, "pid": self.serial, "seconds": 0.0, "threads": 1,
                "fingerprint": self.fingerprint()["fingerprint"] if src is not None else None}  # fmt: skip

    def _store(self) -> Any:
        layer = self._script.layer
        return layer.find(actor_name(self.job, "weights", 0)) if layer is not None else None

    def _send_shadow(self) -> None:
        """Under fsdp, as ``TrainerRank._shadow``: every ``shadow_every`` steps this rank's part
        (its applied steps) goes to the weight store. (The ddp fakes keep none, as before.)"""
        every = self.spec.trainer.shadow_every
        store = self._store()
        if self.strategy != "fsdp" or not every or self.step % every or store is None:
            return
        meta = {"rank": self.rank, "step": self.step, "world": self.world, "strategy": self.strategy,
                "spec_digest": self.spec.digest(), "sources": self.world}  # fmt: skip
        layer = self._script.layer
        layer.get(layer.call(store, "put_shadow", meta, json.dumps(self.applied), "tree", None), timeout=10)

    def _from_shadow(self, shadow: dict[str, int]) -> None:
        layer = self._script.layer
        applied, _, _ = layer.get(layer.call(self._store(), "shadow_part", int(shadow["rank"]), int(shadow["step"])))
        self.applied = json.loads(applied)
        self.step = int(shadow["step"])
        assert len(self.applied) == self.step, (self.applied, shadow)

    def warm(self) -> dict[str, Any]:
        if self.spare is None:
            raise RuntimeError(f"rank {self.rank} is not a spare")
        s = self._script
        with s.lock:
            dies = s.spare_dies > 0
            s.spare_dies -= dies
        if dies:
            _die(self)
        time.sleep(s.spare_warm_s)
        self.warmed = True
        return {"spare": self.spare, "pid": self.serial, "seconds": 0.0}

    def promote(
        self,
        master: tuple[str, int],
        rank: int,
        world: int,
        token: int,
        src: int | None,
        restore: str | None = None,
        shadow: Any = None,
    ) -> dict[str, Any]:
        check_fence(self.fence, token, "promote")
        assert self.spare is not None and self.warmed
        self.rank, self.world, self.spare = rank, world, None
        if self._script.on_rank is not None:
            self._script.on_rank(rank)
        if src is not None:
            self._receive(master)
        elif shadow is not None:  # fsdp (the ddp fakes keep no shadow copy)
            self._from_shadow(shadow)
        elif restore:  # world 1: from the snapshot
            state = json.loads((Path(restore) / f"rank{rank}.json").read_text())
            self.step, self.applied = state["step"], state["applied"]
        with self._script.lock:
            self._script.promoted.append(self.serial)
            if src is None and self._script.bad_replay > 0:
                self._script.bad_replay -= 1
                self._script.bad_serials.add(self.serial)
        return {"rank": rank, "step": self.step, "pid": self.serial, "seconds": 0.0, "threads": 1,
                "fingerprint": self.fingerprint()["fingerprint"] if src is not None else None}  # fmt: skip

    def _receive(self, master: tuple[str, int]) -> None:
        """A newcomer of a hot recovery takes the state the survivor sent for ``master``."""
        s = self._script
        deadline = time.monotonic() + 10
        while tuple(master) not in s.transfers:
            assert time.monotonic() < deadline, "no survivor sent its state"
            time.sleep(0.01)
        with s.lock:
            self.step, applied = s.transfers[tuple(master)]
            self.applied = list(applied)
            if s.bad_fingerprint > 0:
                s.bad_fingerprint -= 1
                s.bad_serials.add(self.serial)

    def fingerprint(self) -> dict[str, Any]:
        fp = f"{self.step}:{self.digest()}"
        s = self._script
        with s.lock:
            bad = self.serial in s.bad_serials
        return {"rank": self.rank, "step": self.step, "pid": self.serial, "fingerprint": fp + ("!" if bad else "")}

    def setup(
        self, master: tuple[str, int], restore: str | None = None, shadow: Any = None, peer: int | None = None,
        joining: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        if peer is not None:  # a newcomer of a hot recovery: the state the survivor sent
            self._receive(master)
            return {"rank": self.rank, "step": self.step, "digest": self.digest(), "threads": 1,
                    "strategy": self.strategy, "fingerprint": self.fingerprint()["fingerprint"]}  # fmt: skip
        s = self._script
        t0 = time.monotonic()
        time.sleep(s.setup_delay_s)
        with s.lock:
            s.setups.append((t0, time.monotonic()))
            s.broken = False  # a new group
            dies = s.fail_start > 0
            s.fail_start -= dies
        if dies:
            _die(self)
        with s.lock:  # counted per start of the group: rank 0's setup
            unreachable = self.rank == 0 and s.unreachable_start > 0
            s.unreachable_start -= unreachable
        if unreachable:  # as Ray says of an actor on a node it has not seen die yet
            raise ActorUnavailableError("the node of this actor is unreachable (fake)", None)
        if restore:
            state = json.loads((Path(restore) / f"rank{self.rank}.json").read_text())
            self.step, self.applied = state["step"], state["applied"]
        elif shadow is not None:
            self._from_shadow(shadow)
        return {"rank": self.rank, "step": self.step, "digest": self.digest(), "threads": 1, "strategy": self.strategy}

    @ray.method(concurrency_group="control")
    def alive(self) -> int:
        return _alive(self)

    @ray.method(concurrency_group="control")
    def adopt(self, token: int, spec_digest: str) -> dict[str, Any]:
        check_fence(self.fence, token, "adopt")
        self.fence = token
        busy = self.training is not None
        sketch = None if busy else self._sketch()
        if not busy and self.rank in self._script.drift and self.step > 0:
            self._script.drift.discard(self.rank)
            sketch = f"{sketch}~"
        return {"rank": self.rank, "world": self.world, "step": self.step, "pid": self.serial,
                "last": None if busy else self.last, "recent": {} if busy else dict(self.recent), "busy": busy, "strategy": self.strategy,
                "sketch": sketch}  # fmt: skip

    def _sketch(self) -> str:
        """The fake's state sketch: its step and the steps it applied (TrainCore.sketch's role)."""
        bad = "!" if self.serial in self._script.bad_serials else ""
        return f"{self.step}:{','.join(map(str, self.applied))}{bad}"

    def train_step(self, step: int, publish: bool = True, token: int = 0) -> dict[str, Any]:
        check_fence(self.fence, token, f"train step {step}")
        if step != self.step:
            raise RuntimeError(f"rank {self.rank} is at step {self.step}, asked to train step {step}")
        s = self._script
        self.training = step
        try:
            if s.on_train is not None:
                s.on_train(step, self.rank)
            if s.fire(s.kill_rank_at, (step, self.rank)):
                if s.collective:
                    s.break_collective(step)
                _die(self)
            if s.fire(s.freeze_rank_at, (step, self.rank)):
                self._frozen = True
            if self._frozen or s.fire(s.hang_rank_at, (step, self.rank)):
                try:
                    _hang(self)
                finally:  # killed while frozen: its peers' collective fails (the connection closes)
                    if s.collective:
                        s.break_collective(step)
            time.sleep(s.train_delay_s)
            samples = self.journal.read_batch(step)  # the whole batch is journaled, or this raises
            if s.collective and self.world > 1:
                b = s.barrier(step, self.world)
                try:
                    if s.broken:
                        raise threading.BrokenBarrierError
                    b.wait(timeout=10)
                except threading.BrokenBarrierError:
                    s.break_collective(step, b)
                    raise RuntimeError("Connection closed by peer (fake gloo all-reduce)") from None
            self.applied.append(step)
            self.step = step + 1
            with s.lock:
                s.trained.append((step, self.rank, self.serial))
            if s.fire(s.kill_rank_after, (step, self.rank)):
                _die(self)
            out: dict[str, Any] = {"rank": self.rank, "step": step, "loss": 0.0, "samples": len(samples),
                                   "reward_mean": sum(x["reward"] for x in samples) / len(samples),
                                   "sketch": self._sketch()}  # fmt: skip
            ds = self.spec.algorithm.dynamic_sampling
            if ds is not None and ds.drop_zero_variance:  # what the real core keeps (TrainCore.train)
                n = self.spec.rollout.sampling.n
                kept, counts = select_groups(samples, n, self.spec.prompts_per_step)
                out.update(groups_kept=counts["kept"], groups_dropped=counts["dropped"])
                with s.lock:
                    s.kept[step] = [x["prompt_index"] for x in kept[::n]]
            self._send_shadow()
            if self.rank == 0 and publish:
                out["weights"] = ("weights", self.step)
            self.last = {k: v for k, v in out.items() if k != "weights"}
            self.recent[step] = self.last
            for gone in sorted(self.recent)[:-2]:
                del self.recent[gone]
            if s.fire(s.freeze_rank_after, (step, self.rank)):
                self._frozen = True  # stopped right after it answered: idle, waiting for the next batch
            return out
        finally:
            self.training = None

    def publish(self) -> dict[str, Any]:
        with self._script.lock:
            self._script.published.append((self.step, self.rank))
        return {"step": self.step, "weights": ("weights", self.step)}

    def digest(self) -> str:
        if self._script.fire(self._script.kill_rank_at_digest, (self.step, self.rank)):
            _die(self)
        return ",".join(map(str, self.applied))

    def snapshot(self, root: str, token: int) -> dict[str, Any]:
        check_fence(self.fence, token, "snapshot")
        if self._script.fire(self._script.freeze_snapshot_at, (self.step, self.rank)):
            self._frozen = True
            _hang(self)
        t0 = time.monotonic()
        time.sleep(self._script.snapshot_delay_s.get(self.step, 0.0))  # a rank slow to stage (frozen, starved)
        with self._script.lock:
            self._script.staging.append((self.step, t0, time.monotonic()))
        d = snapshot_dir(Path(root), self.step)
        d.mkdir(parents=True, exist_ok=True)
        (d / f"rank{self.rank}.json").write_text(json.dumps({"step": self.step, "applied": self.applied}))
        self.pending = self.step
        return {"rank": self.rank, "step": self.step, "blocking_s": 0.0}

    @ray.method(concurrency_group="io")
    def wait_snapshot(self) -> dict[str, Any]:
        step, self.pending = self.pending, None
        return {"ok": step is not None, "rank": self.rank, "step": step, "total_s": 0.0, "error": None}

    @ray.method(concurrency_group="io")
    def commit_snapshot(self, root: str, step: int, meta: dict[str, Any]) -> dict[str, Any]:
        m = write_manifest(snapshot_dir(Path(root), step), {**meta, "step": step, "world": self.world})
        return {"step": step, "uri": str(m.path), "digest": m.digest, "bytes": m.bytes}

    def shutdown(self) -> None:
        pass


class FakeColocated(ColocatedWorker):
    """The real colocated process (``workers/colocated.py``) over the fake workers: a part's
    scripted death kills the actor they share."""

    def _die(self) -> None:
        pass  # the start's error reaches the driver as a worker error (no process to end here)

    def start(self, role: str, args: tuple[Any, ...]) -> int:
        pid = super().start(role, args)
        self.parts[role]._fake_actor = self._fake_actor  # type: ignore[attr-defined]
        return pid


def fake_layer(script: Script, **kw: Any) -> FakeActors:
    """A fake actor layer whose roles run these fakes, all sharing ``script``."""
    roles = {
        "rollout": type("Rollout", (FakeRollout,), {"_script": script}),
        "trainer": type("Trainer", (FakeTrainer,), {"_script": script}),
        "weights": WeightStore,
    }
    roles["colocated"] = type("Colocated", (FakeColocated,), {"PARTS": {r: roles[r] for r in ("rollout", "trainer")}})
    layer = FakeActors(roles=roles, **kw)
    script.layer = layer
    return layer


__all__ = ["Crash", "FakeRollout", "FakeTrainer", "Placement", "Script", "fake_layer"]
