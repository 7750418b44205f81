"""An in-memory actor layer (:class:`resilient_rl.job.actors.Actors`) for the driver's unit tests.

The one fake the driver's tests use, and it stands at the outer edge: the driver's own code
runs unchanged over it. It behaves like Ray where the driver depends on Ray (the contract
suite, ``tests/unit/test_actor_contract.py``, holds it and Ray to the same tests):

* each actor runs its calls one at a time in the order they were sent, on its own thread;
  a method marked ``@ray.method(concurrency_group=...)`` runs on that group's thread instead;
* a call queued or running on an actor that is killed fails with Ray's ``ActorDiedError``,
  as does every later call; a constructor that raises leaves the actor dead;
* a worker's exception arrives as Ray's ``RayTaskError`` (``.cause``, and an instance of the
  worker's type, as Ray's ``as_instanceof_cause`` makes it); ``get`` past its timeout raises
  ``GetTimeoutError``;
* a name is unique among live actors (ValueError) and a killed actor's name stays taken for
  ``name_release_s`` (Ray frees it only once its control store has seen the death);
* with ``kill_delay_s`` a kill takes effect that long after ``kill`` returns: Ray's kill is
  asynchronous (the control store tells the worker to exit), and a call sent in between can still
  reach the live process and answer.

Tests register what each role runs (``FakeActors(roles={"rollout": FakeRollout, ...})``) and
may script faults on the objects (they are plain Python: ``layer.objects(name)``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ray.exceptions import ActorDiedError, GetTimeoutError, RayTaskError


class FakeRef:
    """One call's result (hashable by identity, like an ObjectRef)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def __repr__(self) -> str:
        return f"FakeRef({self.what})"


class _Actor:
    def __init__(self, layer: FakeActors, name: str, cls: Any, args: Sequence[Any]) -> None:
        self.layer, self.name, self.cls = layer, name, cls
        self.alive = True
        self.obj: Any = None
        self.constructed = threading.Event()
        self.queues: dict[str, queue.Queue[tuple[FakeRef, str, tuple[Any, ...]] | None]] = {}
        self.running: dict[str, FakeRef | None] = {}
        self.lock = threading.Lock()
        groups = {"default"} | {
            getattr(getattr(cls, m), "__ray_concurrency_group__", "default")
            for m in dir(cls)
            if not m.startswith("__") and callable(getattr(cls, m, None))
        }
        for g in groups:
            self.queues[g] = queue.Queue()
            self.running[g] = None
            threading.Thread(target=self._serve, args=(g,), name=f"fake:{name}:{g}", daemon=True).start()
        self.init_ref = FakeRef(f"{name}.__init__")
        self.queues["default"].put((self.init_ref, "__init__", tuple(args)))

    def group_of(self, method: str) -> str:
        return getattr(getattr(self.cls, method, None), "__ray_concurrency_group__", "default")

    def submit(self, method: str, args: tuple[Any, ...]) -> FakeRef:
        ref = FakeRef(f"{self.name}.{method}")
        if not hasattr(self.cls, method):
            raise AttributeError(f"'ActorHandle' object has no attribute '{method}'")
        with self.lock:
            if not self.alive:
                self.layer._finish(ref, error=ActorDiedError())
                return ref
            self.queues[self.group_of(method)].put((ref, method, args))
        return ref

    def _serve(self, group: str) -> None:
        if group != "default":
            self.constructed.wait()
        q = self.queues[group]
        while True:
            item = q.get()
            if item is None:
                return
            ref, method, args = item
            with self.lock:
                if not self.alive:
                    self.layer._finish(ref, error=ActorDiedError())
                    continue
                self.running[group] = ref
            value: Any = None
            error: BaseException | None = None
            try:
                if method == "__init__":
                    self.obj = self.cls(*args)
                    self.obj._fake_actor = self  # lets a scripted hang notice its kill
                else:
                    value = getattr(self.obj, method)(*args)
            except BaseException as e:  # noqa: BLE001 - delivered to the caller, as Ray does
                error = e
            finally:
                if method == "__init__":
                    self.constructed.set()
            with self.lock:
                self.running[group] = None
                if not self.alive:
                    self.layer._finish(ref, error=ActorDiedError())
                    continue
                if method == "__init__" and error is not None:  # a failed constructor: the actor is dead
                    self.alive = False
                    self.layer._finish(ref, error=error)
                    self._fail_queued()
                    continue
            if error is not None:
                self.layer._finish(ref, error=_task_error(method, error))
            else:
                self.layer._finish(ref, value=value)

    def _fail_queued(self) -> None:
        for q in self.queues.values():
            while True:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    self.layer._finish(item[0], error=ActorDiedError())
            q.put(None)

    def kill(self) -> None:
        with self.lock:
            if not self.alive:
                return
            self.alive = False
            for ref in self.running.values():
                if ref is not None:
                    self.layer._finish(ref, error=ActorDiedError())
            self._fail_queued()


def _task_error(method: str, cause: BaseException) -> BaseException:
    err = RayTaskError(method, f"Traceback (fake): {type(cause).__name__}: {cause}", cause)
    try:
        return err.as_instanceof_cause()
    except TypeError:  # a cause type Ray cannot subclass: the plain wrapper
        return err


class FakeActors:
    """:class:`resilient_rl.job.actors.Actors` in memory (see module doc)."""

    def __init__(
        self, roles: dict[str, Any] | None = None, *, name_release_s: float = 0.05, kill_delay_s: float = 0.0
    ) -> None:
        self.roles = dict(roles or {})
        self.name_release_s = name_release_s
        self.kill_delay_s = kill_delay_s
        self.tasks: dict[str, Callable[..., Any]] = {}  # a task function's name -> what runs instead
        self._live: dict[str, _Actor] = {}
        self._released_at: dict[str, float] = {}  # killed names -> when they are free again
        self._cond = threading.Condition()
        self.created: list[tuple[str, float]] = []  # (name, monotonic time) of every create, in order
        self.killed: list[tuple[str, float]] = []
        self.calls: list[tuple[str, str, tuple[Any, ...]]] = []  # (actor, method, args) in send order
        self.draining: dict[str, float] = {}  # node id -> deadline: what draining_nodes says (tests set it)

    # -- the protocol --------------------------------------------------------------

    def connect(self, address: str | None) -> None:
        pass

    def retire(self, actor: _Actor) -> None:
        self.kill(actor)

    def lost_with(self, actor: Any) -> str | None:
        return None  # one actor, one process (job/colocated.py layers the shared ones over this)

    def draining_nodes(self) -> dict[str, float]:
        return dict(self.draining)

    def create(self, role: str, name: str, args: Sequence[Any], placement: Any) -> _Actor:
        with self._cond:
            live = self._live.get(name)
            if live is not None and live.alive:
                if getattr(placement, "get_if_exists", False):
                    return live
                raise ValueError(f"The name {name} (namespace=rrl) is already taken.")
            if time.monotonic() < self._released_at.get(name, 0.0):
                raise ValueError(f"The name {name} (namespace=rrl) is already taken.")
            if role not in self.roles:
                raise ValueError(f"no fake registered for role {role!r}")
            actor = _Actor(self, name, self.roles[role], args)
            self._live[name] = actor
            self.created.append((name, time.monotonic()))
            return actor

    def find(self, name: str) -> _Actor | None:
        with self._cond:
            a = self._live.get(name)
            return a if a is not None and a.alive else None

    def names(self, prefix: str) -> list[str]:
        with self._cond:
            return sorted(n for n, a in self._live.items() if a.alive and n.startswith(prefix))

    def call(self, actor: _Actor, method: str, *args: Any) -> FakeRef:
        self.calls.append((actor.name, method, args))
        return actor.submit(method, args)

    def wait(
        self, refs: Sequence[FakeRef], *, num_returns: int = 1, timeout: float | None = None
    ) -> tuple[list[FakeRef], list[FakeRef]]:
        refs = list(refs)
        want = min(num_returns, len(refs))
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                ready = [r for r in refs if r.done.is_set()]
                if len(ready) >= want:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(timeout=left if left is not None else 1.0)
        ready_set = set(ready)
        return ready, [r for r in refs if r not in ready_set]

    def get(self, refs: Any, *, timeout: float | None = None) -> Any:
        many = isinstance(refs, list)
        items = refs if many else [refs]
        _, pending = self.wait(items, num_returns=len(items), timeout=timeout)
        if pending:
            raise GetTimeoutError(f"Get timed out: some object(s) not ready: {pending}")
        for r in items:
            if r.error is not None:
                raise r.error
        values = [r.value for r in items]
        return values if many else values[0]

    def kill(self, actor: _Actor) -> None:
        if self.kill_delay_s > 0:
            timer = threading.Timer(self.kill_delay_s, self._kill_now, args=(actor,))
            timer.daemon = True  # never outlives the test run
            timer.start()
        else:
            self._kill_now(actor)

    def _kill_now(self, actor: _Actor) -> None:
        actor.kill()
        with self._cond:
            if self._live.get(actor.name) is actor:
                del self._live[actor.name]
                self._released_at[actor.name] = time.monotonic() + self.name_release_s
            self.killed.append((actor.name, time.monotonic()))
            self._cond.notify_all()

    def task(self, fn: Callable[..., Any], *args: Any, num_cpus: float = 0.1) -> FakeRef:
        run = self.tasks.get(fn.__name__, fn)
        ref = FakeRef(f"task:{fn.__name__}")

        def go() -> None:
            try:
                self._finish(ref, value=run(*args))
            except BaseException as e:  # noqa: BLE001
                self._finish(ref, error=_task_error(fn.__name__, e))

        threading.Thread(target=go, daemon=True).start()
        return ref

    # -- for tests -----------------------------------------------------------------

    def obj(self, name: str) -> Any:
        """The Python object behind a live actor (to script its faults)."""
        a = self._live[name]
        a.constructed.wait(5)
        return a.obj

    def _finish(self, ref: FakeRef, *, value: Any = None, error: BaseException | None = None) -> None:
        with self._cond:
            if ref.done.is_set():
                return
            ref.value, ref.error = value, error
            ref.done.set()
            self._cond.notify_all()
