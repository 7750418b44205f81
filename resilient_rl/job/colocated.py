"""``placement: colocated``: trainer rank ``i`` and rollout worker ``i`` share one process.

A small job on one machine (or a user with few accelerators) can run with one process per rank
that trains and generates in turns, as TRL and verl's hybrid engine do: a process (its Python,
torch and imports) fewer per index, and a new policy version loaded from the rank's own tensors
rather than through the object store. The engine still holds its own copy of the weights.
(BENCHMARKS.md section 2: level with separate processes on the demo job.)

The driver keeps its two groups and does not know. :class:`ColocatedActors` is an
:class:`~resilient_rl.job.actors.Actors` over another one (Ray's, or the unit tests' fake):

* ``create("trainer", rrl:J:trainer:i, ...)`` and ``create("rollout", rrl:J:rollout:i, ...)``
  both land in the one actor ``rrl:J:colocated:i`` (``workers/colocated.py``), made by
  whichever comes first; the role is started in it by a call (``start``), queued like any
  other, so a create returns at once as Ray's does. What comes back is a :class:`Part`, the
  handle of one role in that actor; ``call`` sends the role's method through the actor's
  dispatch (``run``, or ``run_<group>`` for the trainer's methods of a concurrency group:
  ``adopt`` answers while a step runs, as in a process of its own).
* Calls on one actor run one at a time in order, so a shard and a train step take turns.
* ``kill`` of a part kills the process: both roles. Each group then sees its own loss and
  recovers as it would (the trainer's hot or cold path, the rollout worker's replacement), and
  whichever group recreates index ``i`` first makes the new process, the other joins it.
* Spares (``rrl:J:trainer-spare:n``, ``rrl:J:rollout-spare:n``) and the weight store are
  processes of their own, as without colocation: a promoted spare serves its index from there.

Not for ``rollout.engine: vllm``: vLLM's in-process engine creates torch's default process
group when there is none (and refuses one of another size), which is the trainer's (see
``spec.JobSpec``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..spec import JobSpec
from .actors import Actors, Placement
from .context import trainer_runtime_env

ROLES = ("rollout", "trainer")

# The workers' methods that run in a concurrency group of their own (``TrainerRank``'s and
# ``RolloutWorker``'s ``@ray.method(concurrency_group=...)``; tests/unit/test_colocated.py holds
# this to it).
GROUPS: dict[str, dict[str, str]] = {
    "trainer": {
        "adopt": "control",
        "alive": "control",
        "wait_snapshot": "io",
        "commit_snapshot": "io",
        "export": "export",
    },
    "rollout": {"alive": "control"},
}


def colocated_placement(spec: JobSpec) -> Placement:
    """The shared process's: the larger of the two roles' reservations, the trainer's environment."""
    r, t = spec.rollout, spec.trainer
    return Placement(max(r.num_cpus, t.num_cpus), max(r.num_gpus, t.num_gpus), trainer_runtime_env(spec))


def home_of(name: str) -> str | None:
    """``rrl:J:colocated:i`` for ``rrl:J:trainer:i`` or ``rrl:J:rollout:i``; None for any other name."""
    parts = name.split(":")
    if len(parts) == 4 and parts[2] in ROLES:
        return ":".join((parts[0], parts[1], "colocated", parts[3]))
    return None


class Part:
    """One role in a colocated actor (compared by identity, as the driver compares handles)."""

    __slots__ = ("actor", "role", "name")

    def __init__(self, actor: Any, role: str, name: str) -> None:
        self.actor, self.role, self.name = actor, role, name

    def __repr__(self) -> str:
        return f"Part({self.name})"


class ColocatedActors:
    """:class:`Actors` that colocates trainer rank ``i`` and rollout worker ``i`` (module doc).

    ``placement`` is the shared process's (``colocated_placement``), whichever role creates it."""

    def __init__(self, inner: Actors, placement: Callable[[], Placement]) -> None:
        self.inner = inner
        self._placement = placement
        self._lock = threading.Lock()
        # home name -> (its actor, role -> the part handed out): what this layer made or found
        self._live: dict[str, tuple[Any, dict[str, Part]]] = {}
        # parts whose process a kill of another role ended -> that role (see lost_with; the newest 256)
        self._ended: dict[Part, str] = {}

    # -- the colocated roles ---------------------------------------------------------

    def _roles_of(self, actor: Any, timeout: float = 30.0) -> list[str] | None:
        """The roles running in the actor (asked on its control thread), None if it is dead or
        does not answer within ``timeout``."""
        try:
            return list(self.inner.get(self.inner.call(actor, "roles"), timeout=timeout))
        except Exception:  # noqa: BLE001 - dead, dying or unreachable: not a home to join
            return None

    def _home(self, home: str) -> tuple[Any, dict[str, Part]] | None:
        """The live home actor (this layer's record of it, or one found running), or None."""
        entry = self._live.get(home)
        if entry is not None:
            return entry
        actor = self.inner.find(home)
        if actor is None:
            return None
        roles = self._roles_of(actor)
        if roles is None:
            return None
        entry = self._live[home] = (actor, {r: Part(actor, r, home.replace(":colocated:", f":{r}:")) for r in roles})
        return entry

    def create(self, role: str, name: str, args: Sequence[Any], placement: Placement) -> Any:
        home = home_of(name)
        if home is None or role not in ROLES:
            return self.inner.create(role, name, args, placement)
        with self._lock:
            entry = self._live.get(home)
            if entry is not None and self._roles_of(entry[0]) is None:
                del self._live[home]  # died without a kill through this layer (a crash, a kill by name)
                entry = None
            if entry is None:
                entry = self._home(home)  # one running that this layer did not make (probed there)
            if entry is None:  # the first of the two: make the process (ValueError while a dead one's name is held)
                entry = self._live[home] = (self.inner.create("colocated", home, (), self._placement()), {})
            actor, parts = entry
            if role in parts:
                raise ValueError(f"actor name {name!r} is already taken (its process {home} runs the {role})")
            self.inner.call(actor, "start", role, tuple(args))  # queued: the role's calls follow it
            part = parts[role] = Part(actor, role, name)
            return part

    def find(self, name: str) -> Any | None:
        home = home_of(name)
        if home is None:
            return self.inner.find(name)
        with self._lock:
            entry = self._home(home)
        return None if entry is None else entry[1].get(name.split(":")[2])

    def names(self, prefix: str) -> list[str]:
        found = self.inner.names(prefix)
        bits = prefix.split(":")
        if len(bits) == 4 and bits[2] in ROLES and bits[3] == "":
            for home in self.inner.names(f"{bits[0]}:{bits[1]}:colocated:"):
                if self.find(home.replace(":colocated:", f":{bits[2]}:")) is not None:
                    found.append(home.replace(":colocated:", f":{bits[2]}:"))
        return sorted(found)

    def call(self, actor: Any, method: str, *args: Any) -> Any:
        if not isinstance(actor, Part):
            return self.inner.call(actor, method, *args)
        group = GROUPS.get(actor.role, {}).get(method)
        return self.inner.call(actor.actor, f"run_{group}" if group else "run", actor.role, method, *args)

    def kill(self, actor: Any) -> None:
        """A part's kill is its process's: both roles (see module doc). If the process was alive
        (it answers), the other role's loss is this kill's (:meth:`lost_with`); a process that
        had died (a crash) or does not answer is a loss of each role."""
        if not isinstance(actor, Part):
            self.inner.kill(actor)
            return
        alive = self._roles_of(actor.actor, timeout=2.0) is not None
        with self._lock:
            for home, (a, parts) in list(self._live.items()):
                if a is actor.actor:
                    del self._live[home]
                    for other in parts.values():
                        if other is not actor and alive:
                            self._ended[other] = actor.role
            while len(self._ended) > 256:
                del self._ended[next(iter(self._ended))]
        self.inner.kill(actor.actor)

    def retire(self, actor: Any) -> None:
        """A drained part leaves its process, which lives on while another role runs in it."""
        if isinstance(actor, Part):
            with self._lock:
                parts = next((ps for a, ps in self._live.values() if a is actor.actor), {})
                shared = parts.get(actor.role) is actor and len(parts) > 1
                if shared:
                    del parts[actor.role]
            if shared:
                self.inner.call(actor.actor, "drop", actor.role)  # queued behind its shutdown
                return
        self.kill(actor)

    def lost_with(self, actor: Any) -> str | None:
        with self._lock:
            return self._ended.pop(actor, None) if isinstance(actor, Part) else None

    # -- the rest as the layer below ---------------------------------------------------

    def wait(
        self, refs: Sequence[Any], *, num_returns: int = 1, timeout: float | None = None
    ) -> tuple[list[Any], list[Any]]:
        return self.inner.wait(refs, num_returns=num_returns, timeout=timeout)

    def get(self, refs: Any, *, timeout: float | None = None) -> Any:
        return self.inner.get(refs, timeout=timeout)

    def task(self, fn: Callable[..., Any], *args: Any, num_cpus: float = 0.1) -> Any:
        return self.inner.task(fn, *args, num_cpus=num_cpus)

    def connect(self, address: str | None) -> None:
        self.inner.connect(address)

    def draining_nodes(self) -> dict[str, float]:
        return self.inner.draining_nodes()
