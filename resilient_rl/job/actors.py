"""The actor layer: the only way the driver reaches its workers.

The driver (this package) starts, finds, calls, waits on and kills the job's Ray
actors through :class:`Actors`, a small protocol with one implementation over Ray
(:class:`RayActors`) and an in-memory fake for the driver's unit tests
(``tests/helpers/fake_actors.py``). One contract suite (``tests/unit/test_actor_contract.py``
against the fake, ``tests/integration/test_actor_contract_ray.py`` against Ray) holds
both to what the driver depends on:

* calls on one actor run one at a time, in the order they were made (FIFO), except
  methods of a concurrency group (the trainer's ``adopt``, its snapshot waits);
* a call queued on an actor that dies fails with Ray's ``ActorDiedError`` (a
  ``RayActorError``); a ``get`` past its timeout raises ``GetTimeoutError``; an
  exception raised by the worker arrives as ``RayTaskError`` wrapping it (``.cause``;
  see :func:`resilient_rl.errors.worker_cause`), which is also an instance of the
  worker's exception type;
* a name is unique among live actors (a second ``create`` of it raises ValueError)
  and a killed actor's name is free again only once Ray has seen it die.

Actors are created by *role* (``rollout``, ``trainer``, ``weights``) rather than by
class, so this package never imports the worker modules (torch, vLLM) itself.
Ray itself is imported on first use, never at module level.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..naming import NAMESPACE

log = logging.getLogger(__name__)

ROLES = ("rollout", "trainer", "weights", "colocated")


@dataclass(frozen=True)
class Placement:
    """Where and with what an actor runs (Ray's ``.options``)."""

    num_cpus: float = 0.0
    num_gpus: float = 0.0
    runtime_env: dict[str, Any] = field(default_factory=dict)
    on_this_node: bool = (
        False  # soft affinity to the stable node, the Ray head (the weight store: its objects die with it)
    )
    get_if_exists: bool = False  # hand back the live actor of that name instead of failing


class Actors(Protocol):
    def create(self, role: str, name: str, args: Sequence[Any], placement: Placement) -> Any:
        """Start a detached actor of ``role`` named ``name`` (ValueError if the name is taken)."""

    def find(self, name: str) -> Any | None:
        """The live actor of that name, or None."""

    def names(self, prefix: str) -> list[str]:
        """The names of the live actors (of this namespace) that start with ``prefix``, sorted."""

    def call(self, actor: Any, method: str, *args: Any) -> Any:
        """Send one call; returns its reference at once."""

    def wait(
        self, refs: Sequence[Any], *, num_returns: int = 1, timeout: float | None = None
    ) -> tuple[list[Any], list[Any]]:
        """``(ready, pending)`` once ``num_returns`` are ready or ``timeout`` passed."""

    def get(self, refs: Any, *, timeout: float | None = None) -> Any:
        """The result of one reference, or of a list of them (raises the call's error)."""

    def kill(self, actor: Any) -> None:
        """Kill the actor; its queued and running calls fail with ``ActorDiedError``."""

    def retire(self, actor: Any) -> None:
        """End a worker that has left (its ``shutdown`` answered: a drain on scale-down). As
        :meth:`kill`, except that a process it shares with another role lives on
        (``placement: colocated``)."""

    def task(self, fn: Callable[..., Any], *args: Any, num_cpus: float = 0.1) -> Any:
        """Run ``fn(*args)`` in a worker process (a Ray task); returns its reference."""

    def connect(self, address: str | None) -> None:
        """Join the cluster at ``address`` once (None: start a local one)."""

    def draining_nodes(self) -> dict[str, float]:
        """Nodes being drained (a spot or preemptible node's notice through ``ray drain-node`` or the
        autoscaler): node id (hex) -> the drain's deadline (epoch seconds, 0 for none)."""

    def lost_with(self, actor: Any) -> str | None:
        """The role whose :meth:`kill` ended ``actor`` too, because the two share a process
        (``placement: colocated``, ``job/colocated.py``); None when it was not so (always here).
        Asked once per loss: the answer is forgotten."""


def create_fresh(
    actors: Actors, role: str, name: str, args: Sequence[Any], placement: Placement, *, within_s: float = 30.0
) -> Any:
    """:meth:`Actors.create`, waiting out the name of an actor just killed: Ray frees a name
    only once its control store has seen the death, so a replacement created at once can be
    refused (ValueError "already taken"). Raises that ValueError after ``within_s``."""
    import time

    deadline = time.monotonic() + within_s
    delay = 0.02
    while True:
        try:
            return actors.create(role, name, args, placement)
        except ValueError as e:
            if "taken" not in str(e) or time.monotonic() > deadline:
                raise
        time.sleep(delay)
        delay = min(0.5, delay * 2)


def actor_died(e: BaseException) -> bool:
    """True if ``e`` means the called actor is dead or unreachable (``RayActorError`` and its
    subclasses ``ActorDiedError`` / ``ActorUnavailableError``)."""
    from ray.exceptions import RayActorError

    return isinstance(e, RayActorError)


def unreachable(e: BaseException) -> bool:
    """True if the actor could not be reached but Ray has not confirmed its death
    (``ActorUnavailableError``: e.g. its node is gone and Ray's health check has not caught up)."""
    from ray.exceptions import ActorUnavailableError

    return isinstance(e, ActorUnavailableError)


def timed_out(e: BaseException) -> bool:
    from ray.exceptions import GetTimeoutError

    return isinstance(e, GetTimeoutError)


def _role_class(role: str) -> Any:
    """The Ray actor class of a role (imports the worker module: only on first creation)."""
    import ray

    if role == "rollout":
        from ..workers.rollout import RolloutWorker

        return _remote_class(RolloutWorker)
    if role == "trainer":
        from ..workers.trainer import trainer_actor

        return trainer_actor()
    if role == "weights":
        from ..workers.weights import WeightStore

        return ray.remote(WeightStore)
    if role == "colocated":
        from ..workers.colocated import ColocatedWorker

        return _remote_class(ColocatedWorker)
    raise ValueError(f"unknown actor role {role!r} (one of {', '.join(ROLES)})")


_ray_lock = threading.Lock()


def connect_ray(address: str | None, attempts: int = 3) -> None:
    """Connect this process to Ray once (thread-safe). A connect that times out while the
    cluster is overloaded ("The current node timed out during startup", "Timed out waiting
    for file .../gcs_server_port_...", both seen from `rrl verify` in loaded CI runs) is tried
    again, ``attempts`` times in all."""
    with _ray_lock:
        import ray

        for attempt in range(attempts):
            if ray.is_initialized():
                return
            try:
                ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
                return
            except Exception as e:
                if "timed out" not in str(e).lower() or attempt == attempts - 1:
                    raise
                log.warning("connecting to Ray timed out (%s); trying again", e)
                with contextlib.suppress(Exception):
                    ray.shutdown()
                time.sleep(2.0 * (attempt + 1))


def _remote_class(cls: Any) -> Any:
    import ray

    groups = {
        getattr(getattr(cls, m), "__ray_concurrency_group__", None)
        for m in dir(cls)
        if not m.startswith("__") and callable(getattr(cls, m, None))
    } - {None}
    return ray.remote(concurrency_groups={g: 1 for g in groups})(cls) if groups else ray.remote(cls)  # type: ignore[call-overload]


def _stable_node() -> str:
    """The node whose loss ends the cluster anyway: the Ray head (its GCS), else this process's.

    The caller's own node is not enough: a driver attaches to *a* raylet of its IP, so where
    several nodes share one (``ray.cluster_utils.Cluster``, containers behind one address) it
    may sit on any of them. Seen: the weight store followed the controller onto a worker node
    that was then lost, and every published version died with it."""
    import ray

    for n in ray.nodes():
        if n.get("Alive") and any(k.startswith("node:__internal_head__") for k in n.get("Resources", {})):
            return str(n["NodeID"])
    return str(ray.get_runtime_context().get_node_id())


class RayActors:
    """:class:`Actors` over Ray: detached named actors in the ``rrl`` namespace."""

    def __init__(self, namespace: str = NAMESPACE, *, classes: dict[str, Any] | None = None) -> None:
        """``classes``: more roles (role -> plain class), e.g. the contract suite's probe; a
        method marked ``@ray.method(concurrency_group=...)`` gets its group declared."""
        self.namespace = namespace
        self._classes: dict[str, Any] = {role: _remote_class(c) for role, c in (classes or {}).items()}

    def create(self, role: str, name: str, args: Sequence[Any], placement: Placement) -> Any:
        cls = self._classes.get(role)
        if cls is None:
            cls = self._classes[role] = _role_class(role)
        opts: dict[str, Any] = {
            "name": name,
            "namespace": self.namespace,
            "lifetime": "detached",
            "num_cpus": placement.num_cpus,
            "num_gpus": placement.num_gpus,
            "get_if_exists": placement.get_if_exists,
        }
        if placement.runtime_env:
            opts["runtime_env"] = placement.runtime_env
        if placement.on_this_node:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(_stable_node(), soft=True)
        return cls.options(**opts).remote(*args)

    def find(self, name: str) -> Any | None:
        import ray

        try:
            return ray.get_actor(name, namespace=self.namespace)
        except ValueError:
            return None

    def names(self, prefix: str) -> list[str]:
        import ray

        found = ray.util.list_named_actors(all_namespaces=True)
        return sorted(a["name"] for a in found if a.get("namespace") == self.namespace and a["name"].startswith(prefix))

    def call(self, actor: Any, method: str, *args: Any) -> Any:
        return getattr(actor, method).remote(*args)

    def wait(
        self, refs: Sequence[Any], *, num_returns: int = 1, timeout: float | None = None
    ) -> tuple[list[Any], list[Any]]:
        import ray

        if not refs:
            return [], []
        ready, pending = ray.wait(list(refs), num_returns=min(num_returns, len(refs)), timeout=timeout)
        return list(ready), list(pending)

    def get(self, refs: Any, *, timeout: float | None = None) -> Any:
        import ray

        return ray.get(refs, timeout=timeout)

    def kill(self, actor: Any) -> None:
        import ray

        ray.kill(actor)

    def retire(self, actor: Any) -> None:
        self.kill(actor)

    def task(self, fn: Callable[..., Any], *args: Any, num_cpus: float = 0.1) -> Any:
        import ray

        return ray.remote(num_cpus=num_cpus)(fn).remote(*args)

    def connect(self, address: str | None) -> None:
        connect_ray(address)

    def draining_nodes(self) -> dict[str, float]:
        # Ray has no public call for it (2.60): the global state's, which Ray Serve's node
        # cache also reads (ray/serve/_private/cluster_node_info_cache.py)
        from ray._private.state import state

        return {str(n): ms / 1000.0 for n, ms in state.get_draining_nodes().items()}

    def lost_with(self, actor: Any) -> str | None:
        return None  # one actor, one process
