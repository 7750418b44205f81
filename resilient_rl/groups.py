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

A restart budget (``fault.max_restarts`` per ``fault.restart_window`` seconds,
per group) turns a crash loop into a FAILED job with a clear reason.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

log = logging.getLogger(__name__)


class RestartBudget:
    def __init__(self, group: str, limit: int, window: float) -> None:
        self.group, self.limit, self.window = group, limit, window
        self.times: deque[float] = deque()

    def spend(self) -> None:
        """Record one restart; raise ``JobFailed`` when the budget is exhausted."""
        from .runner import JobFailed

        now = time.monotonic()
        self.times.append(now)
        while self.times and now - self.times[0] > self.window:
            self.times.popleft()
        if len(self.times) > self.limit:
            raise JobFailed(
                f"{self.group} group restarted {len(self.times)} times within {self.window:.0f}s "
                f"(fault.max_restarts = {self.limit}): giving up on a crash loop"
            )


class RolloutGroup:
    """Rollout workers by index; ``idle`` holds those ready for a shard."""

    def __init__(self, runner: Any, model_dir: str) -> None:
        self.r = runner
        self.model_dir = model_dir
        self.workers: dict[int, Any] = {}
        self.idle: set[int] = set()
        self.joining: dict[Any, int] = {}  # load_weights ref of a new worker -> index
        f = runner.spec.fault
        self.budget = RestartBudget("rollout", f.max_restarts, f.restart_window)

    def _create(self, i: int) -> Any:
        import ray

        from .rollout import RolloutWorker

        r = self.r.spec.rollout
        return (
            ray.remote(RolloutWorker)
            .options(
                # never get_if_exists: a dead worker's handle would be handed back for its replacement
                name=self.r.actor_name("rollout", i), namespace=self.r.namespace, lifetime="detached",
                num_cpus=r.num_cpus, num_gpus=r.num_gpus, runtime_env=self.r.runtime_env(),
            )
            .remote(self.r.job, i, self.r.spec.to_json(), self.model_dir, str(self.r.workdir), self.r.etcd)
        )  # fmt: skip

    def add(self, i: int, version: int, weights: Any) -> None:
        """Start worker ``i``; it joins ``idle`` once it holds ``version`` (async)."""
        w = self.workers[i] = self._create(i)
        self.joining[w.load_weights.remote(version, weights) if weights is not None else w.ready.remote()] = i

    def start(self, n: int, version: int, weights: Any) -> None:
        """Start ``n`` workers and wait until every one holds ``version`` (first start)."""
        import ray

        for i in range(n):
            self.add(i, version, weights)
        ray.get(list(self.joining))
        self.idle |= set(self.joining.values())
        self.joining.clear()

    def refs(self) -> list[Any]:
        return list(self.joining)

    def on_ready(self, ref: Any) -> bool:
        """A join finished (or failed); True if ``ref`` was a join."""
        import ray

        i = self.joining.pop(ref, None)
        if i is None:
            return False
        try:
            ray.get(ref)
        except Exception as e:  # the new worker died while starting: try again (budgeted)
            self.fault(i, e, None, None)
            return True
        self.idle.add(i)
        self.r.c.event(self.r.job, "rollout_joined", f"rollout worker {i} joined", worker=i)
        return True

    def fault(self, i: int, err: BaseException, version: int | None, weights: Any) -> None:
        """Worker ``i`` died: replace it (budgeted). Its shard is re-queued by the caller."""
        import ray

        self.idle.discard(i)
        old = self.workers.pop(i, None)
        if old is not None:
            ray.kill(old)
        self.r.c.event(self.r.job, "rollout_fault", f"rollout worker {i} lost: {type(err).__name__}; replacing it",
                       worker=i)  # fmt: skip
        self.budget.spend()
        self.add(
            i, version if version is not None else self.r.version, weights if weights is not None else self.r.weights
        )

    def resize(self, want: int, version: int, weights: Any) -> None:
        """Grow to ``want`` workers (async join) or drain the ones above it (stop when idle)."""
        import ray

        for i in range(len(self.workers), want):
            if i not in self.workers:
                self.r.c.event(self.r.job, "scale", f"rollout: adding worker {i} (desired {want})", worker=i)
                self.add(i, version, weights)
        for i in sorted(self.workers):
            if i >= want and i in self.idle:
                self.idle.discard(i)
                w = self.workers.pop(i)
                try:
                    ray.get(w.shutdown.remote(), timeout=10)
                except Exception as e:  # already gone: nothing to drain
                    log.info("shutdown of drained worker %d: %s", i, e)
                ray.kill(w)
                self.r.c.event(self.r.job, "scale", f"rollout: worker {i} drained and stopped (desired {want})",
                               worker=i)  # fmt: skip


class WeightStore:
    """Owns the published weights of a job (actor ``rrl:{job}:weights:0``, no CPU reserved).

    Ray frees an object when its owner dies. Rank 0 hands each new state dict to
    this actor, which ``ray.put``s it and so owns it: the weights survive trainer
    restarts. It keeps the newest few versions alive for workers still loading them.
    """

    def __init__(self) -> None:
        self.refs: dict[int, Any] = {}

    def put(self, version: int, state: dict[str, Any]) -> list[Any]:
        import ray

        self.refs[version] = ray.put(state)
        for v in sorted(self.refs)[:-4]:
            del self.refs[v]
        return [self.refs[version]]  # in a list: the caller borrows the reference, we stay owner

    def ping(self) -> bool:
        return True


class TrainerGroup:
    """All ranks of the trainer, started, restored and replayed together."""

    def __init__(self, runner: Any, model_dir: str) -> None:
        self.r = runner
        self.model_dir = model_dir
        self.ranks: list[Any] = []
        f = runner.spec.fault
        self.budget = RestartBudget("trainer", f.max_restarts, f.restart_window)

    @property
    def world(self) -> int:
        return len(self.ranks)

    def start(self, k: int, world: int) -> Any:
        """(Re)start ``world`` ranks at committed step ``k``; returns the weights of version k
        (None when k is 0: workers start from the model folder, which is version 0)."""
        import ray

        from .checkpointing import choose_restore
        from .trainer import trainer_actor

        self.kill()
        ray.get(
            ray.remote(WeightStore)
            .options(name=self.r.actor_name("weights", 0), namespace=self.r.namespace, lifetime="detached",
                     get_if_exists=True, num_cpus=0)
            .remote()
            .ping.remote()
        )  # fmt: skip
        restore, s = choose_restore(self.r, k)
        cls = trainer_actor()
        t = self.r.spec.trainer
        self.ranks = [
            cls.options(
                name=self.r.actor_name("trainer", i), namespace=self.r.namespace, lifetime="detached",
                num_cpus=t.num_cpus, num_gpus=t.num_gpus, runtime_env=self.r.runtime_env(),
            ).remote(self.r.job, i, world, self.r.spec.to_json(), self.model_dir, str(self.r.workdir), self.r.etcd)
            for i in range(world)
        ]  # fmt: skip
        master = ray.get(self.ranks[0].address.remote())
        ray.get([r.setup.remote(master, restore) for r in self.ranks])
        if k == 0:
            return None
        if s < k:
            self.r.c.event(self.r.job, "replay", f"replaying steps {s}..{k - 1} from the journal", first=s, last=k - 1)
        out = None
        for j in range(s, k):
            out = ray.get([t.train_step.remote(j, j == k - 1) for t in self.ranks])[0]
        return out["weights"] if out is not None else ray.get(self.ranks[0].publish.remote())["weights"]

    def restart(self, k: int, world: int, why: str) -> None:
        """A rank died (or the world size changes): restart the whole group at step ``k``."""
        t0 = time.monotonic()
        self.r.c.event(self.r.job, "trainer_restart", f"{why}: restarting {world} trainer ranks at step {k}",
                       world=world)  # fmt: skip
        self.budget.spend()
        self.start(k, world)
        self.r.c.event(self.r.job, "trainer_recovered", f"trainer group back at step {k} in {time.monotonic() - t0:.1f}s",
                       seconds=round(time.monotonic() - t0, 2), world=world)  # fmt: skip

    def kill(self) -> None:
        """Kill every rank this job may have, by name (old runs included)."""
        import ray

        for i in range(max(self.world, 64)):
            try:
                a = ray.get_actor(self.r.actor_name("trainer", i), namespace=self.r.namespace)
            except ValueError:
                if i >= self.world:
                    break
                continue
            ray.kill(a)
        self.ranks = []
