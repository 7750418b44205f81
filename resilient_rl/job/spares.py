"""Warm spares of a worker group: processes started ahead of a fault, promoted at one.

A spare is a detached named actor (``rrl:{job}:{group}-spare:{n}``) that has done its
slow start-up already (a trainer spare: torch imported, model and optimizer built; a
rollout spare: its engine up) and is in no group. Its ``warm()`` call returns once it is
ready. A fault takes one (:meth:`SparePool.take`) instead of starting a process on the
critical path, and the pool starts another in the background (:meth:`SparePool.fill`,
once per pass of the step loop): nothing here waits for a spare to warm.

The pool does not know what a spare does once promoted; its group does. Shared by
:class:`~resilient_rl.job.groups.TrainerGroup` and :class:`~resilient_rl.job.groups.RolloutGroup`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from controller.election import NotLeader

from ..errors import JobFailed, describe_error
from .context import JobContext

log = logging.getLogger(__name__)


class SparePool:
    """The warm spares of one group (see module doc).

    ``create(name, n)`` creates spare number ``n`` under ``name`` (and may raise ValueError
    "taken" for a name Ray has not freed yet); ``probe(actor)`` is the call a spare must
    answer to be taken (the trainer's raises its fence)."""

    def __init__(
        self, ctx: JobContext, group: str, create: Callable[[str, int], Any], probe: Callable[[Any], Any]
    ) -> None:
        self.ctx, self.group = ctx, group  # group: "trainer-spare" | "rollout-spare"
        self.create, self.probe = create, probe
        self.ready: list[tuple[str, Any]] = []  # warm, ready to be promoted (name, actor)
        self.warming: dict[Any, tuple[str, Any]] = {}  # warm() call -> (name, actor)
        self._seq = 0

    def __len__(self) -> int:
        return len(self.ready) + len(self.warming)

    def names(self) -> set[str]:
        """The actor names of every spare this pool holds or is warming."""
        return {n for n, _ in self.ready} | {n for n, _ in self.warming.values()}

    def still_warming(self) -> set[str]:
        """The names of the spares whose warm-up has not ended: a call to one queues behind it."""
        self._take_in_warmed()
        return {n for n, _ in self.warming.values()}

    def forget(self) -> None:
        """Drop every spare from the pool (their actors were killed by name)."""
        self.ready, self.warming = [], {}

    def adopt_running(self, serving: set[str]) -> int:
        """A new leader takes in the spares a previous one left running (names not in ``serving``,
        the promoted ones): each is asked ``warm()`` again, which answers at once for a warm one
        (and refuses for one that was promoted meanwhile: dropped). Their fence is raised when
        one is taken. Returns how many."""
        A = self.ctx.actors
        held = self.names()
        found = 0
        for name in A.names(self.ctx.actor_prefix(self.group)):
            if name not in serving and name not in held and (a := A.find(name)) is not None:
                self.warming[A.call(a, "warm")] = (name, a)
                found += 1
        return found

    def fill(self, want: int) -> None:
        """Take in the spares that finished warming (a failed one is dropped) and start new ones
        up to ``want``, in the background."""
        A = self.ctx.actors
        self._take_in_warmed()
        if len(self) >= want:
            return
        taken = [n.rsplit(":", 1)[1] for n in A.names(self.ctx.actor_prefix(self.group))]
        self._seq = max([self._seq, *[int(t) + 1 for t in taken if t.isdigit()]])
        while len(self) < want:
            n, self._seq = self._seq, self._seq + 1
            name = self.ctx.actor_name(self.group, n)
            try:
                a = self.create(name, n)
            except ValueError as e:  # the name of a spare just killed (Ray frees it once it saw the death)
                if "taken" not in str(e):
                    raise
                continue
            self.warming[A.call(a, "warm")] = (name, a)

    def _take_in_warmed(self) -> None:
        """Spares whose warm-up ended join ``ready`` (a failed one is dropped and killed)."""
        A, c = self.ctx.actors, self.ctx
        for ref, (name, a) in list(self.warming.items()):
            if not A.wait([ref], timeout=0)[0]:
                continue
            del self.warming[ref]
            try:
                A.get(ref, timeout=0)
                self.ready.append((name, a))
            except Exception as e:
                c.raise_if_stale(e)
                log.warning("job %s: %s %s failed to warm (%s): starting another", c.job, self.group, name,
                            describe_error(e))  # fmt: skip
                A.kill(a)

    def claim(self) -> tuple[str, Any] | None:
        """The spare that began warming first, taken out of the pool before its warm-up ended
        (for when :meth:`take` found none ready), or None. Its first call as a worker queues
        behind the warm-up on the actor and fails if the warm-up does. A spare warming since
        before a fault is ready sooner than a new process started at it, and one fewer start
        competes for the CPUs (two faults in a row outran the refill: BENCHMARKS section 5)."""
        self._take_in_warmed()
        if not self.warming:
            return None
        return self.warming.pop(next(iter(self.warming)))  # (insertion order: the first begun)

    def take(self) -> tuple[str, Any] | None:
        """A warm spare that answers ``probe``, or None. A spare that died while idle is dropped
        (and killed); a new one is started by the next :meth:`fill`."""
        self._take_in_warmed()  # one that finished since the last pass counts
        while self.ready:
            spare = self.ready.pop(0)
            if self.answers(spare):
                return spare
        return None

    def answers(
        self, spare: tuple[str, Any], get: Callable[..., Any] | None = None, timeout: float | None = None
    ) -> bool:
        """True if ``spare`` (taken out of the pool) answers ``probe`` within ``timeout`` (default:
        the lease TTL + 5 s), awaited by ``get(ref, timeout=...)`` (default: the actor layer's; a
        group's may serve its other calls meanwhile); else it is killed. A spare fenced by a newer
        leader raises NotLeader, as do ``get``'s own NotLeader and JobFailed."""
        A, c = self.ctx.actors, self.ctx
        name, a = spare
        try:
            (get or A.get)(self.probe(a), timeout=timeout if timeout is not None else c.spec.fault.lease_ttl + 5.0)
            return True
        except (NotLeader, JobFailed):
            raise
        except Exception as e:
            c.raise_if_stale(e)
            log.warning("job %s: the %s %s is gone (%s)", c.job, self.group, name, describe_error(e))
            A.kill(a)
            return False
