"""The process of ``placement: colocated``: trainer rank ``i`` and rollout worker ``i`` in one actor.

The driver's side is ``job/colocated.py`` (its module doc says how the roles get here). This
actor holds the two workers as they are, :class:`~resilient_rl.workers.trainer.TrainerRank`
and :class:`~resilient_rl.workers.rollout.RolloutWorker`, each started by :meth:`start`, and
runs each call on the role it names. What the two share in one process, and how:

* SIGTERM: one handler (installed here, on the actor's main thread) hands the notice to both
  (``preemption.install_dispatcher``): each drains as it would alone.
* torch's thread count: the trainer's. A rollout worker started beside a trainer would set its
  own, and ``rrl verify`` replays the trainer's steps with the count its lineage recorded.
* The output capture (``rrl logs``): one per process; the file takes the newest role's name.
* The weights: a rollout worker asked to load the version its trainer rank holds (ddp: every
  rank holds the whole model) copies them from the rank's own tensors, in this process, rather
  than fetching the published copy through the object store (:meth:`_local_weights`). Calls on
  the default thread take turns, so the rank's weights do not change during the copy.
* A role whose start fails takes the process down with it, as a failing constructor does an
  actor of its own: the driver sees the actor die (both roles).
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import Any

import ray

from .preemption import install_dispatcher


class ColocatedWorker:
    PARTS: dict[str, Any] | None = None  # role -> class; None: the real ones (imported on the first start)

    def __init__(self) -> None:
        self.parts: dict[str, Any] = {}
        self._started = threading.Condition()
        install_dispatcher()

    def _cls(self, role: str) -> Any:
        if self.PARTS is not None:
            return self.PARTS[role]
        if role == "rollout":
            from .rollout import RolloutWorker

            return RolloutWorker
        if role == "trainer":
            from .trainer import TrainerRank

            return TrainerRank
        raise ValueError(f"no role {role!r} in a colocated process (rollout or trainer)")

    def _die(self) -> None:
        os._exit(1)

    def start(self, role: str, args: tuple[Any, ...]) -> int:
        """Start ``role`` in this process with its constructor's ``args``; returns the pid."""
        if role in self.parts:
            raise ValueError(f"the {role} already runs in this process")
        import torch

        threads = torch.get_num_threads()
        try:
            part = self._cls(role)(*args)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            self._die()
            raise
        if role == "rollout" and "trainer" in self.parts:
            torch.set_num_threads(threads)  # the trainer's (see module doc)
        with self._started:
            self.parts[role] = part
            self._started.notify_all()
        return os.getpid()

    def drop(self, role: str) -> None:
        """The role has left (its ``shutdown`` ran: a drain on scale-down); the process goes on
        with the other. The role may be started here again later."""
        with self._started:
            self.parts.pop(role, None)

    @ray.method(concurrency_group="control")
    def roles(self) -> list[str]:
        """The roles started here (on the control thread: answers while a step or a shard runs)."""
        return sorted(self.parts)

    def _part(self, role: str) -> Any:
        """The role's worker. A call of a concurrency group may come while the role's start (on
        the default thread) still runs: the driver sends every role's start before its calls,
        so it waits for that start, as Ray holds a call until its actor's constructor is done."""
        with self._started:
            if not self._started.wait_for(lambda: role in self.parts, timeout=3600.0):
                raise RuntimeError(f"no {role} runs in this process (pid {os.getpid()})")
            return self.parts[role]

    def run(self, role: str, method: str, *args: Any) -> Any:
        if role == "rollout" and method == "load_weights":
            version, weights = args
            args = (version, self._local_weights(version) or weights)
        return getattr(self._part(role), method)(*args)

    def _local_weights(self, version: int) -> dict[str, Any] | None:
        """The trainer rank's own weights if they are exactly policy ``version`` and whole (ddp:
        on every rank), by the names it publishes (``TrainCore.policy_state``; LoRA: merged);
        else None (fetch the published copy). Live tensors: the engine copies them into its own
        model."""
        t = self.parts.get("trainer")
        if t is None or getattr(t, "core", None) is None or t.strategy != "ddp" or t.step != version:
            return None
        return {name: tensor.detach() for name, tensor in t.core.policy_state()}

    # the trainer's methods of a concurrency group run on that group's thread, as in a rank of its
    # own (job/colocated.GROUPS names them)
    @ray.method(concurrency_group="control")
    def run_control(self, role: str, method: str, *args: Any) -> Any:
        return self.run(role, method, *args)

    @ray.method(concurrency_group="io")
    def run_io(self, role: str, method: str, *args: Any) -> Any:
        return self.run(role, method, *args)

    @ray.method(concurrency_group="export")
    def run_export(self, role: str, method: str, *args: Any) -> Any:
        return self.run(role, method, *args)
