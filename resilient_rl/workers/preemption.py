"""SIGTERM as a preemption notice, shared by rollout workers and trainer ranks (light: imported
by every worker).

A spot node's notice, a drain, or a plain ``kill`` sends SIGTERM. Ray's default is to exit at
once, which the leader would count as a fault. A worker that installs :class:`Preemption`
instead records the moment, marks ``preempted_at`` and ``preempt_deadline`` in its membership
record, and leaves by itself ``fault.preempt_grace_s`` after the signal if the leader has not
stopped it by then. Its record still says preempted for a lease TTL after it exits, so the
leader counts its death as the preemption it is. A spare holds nothing the job needs: it
leaves at once.

What a worker does meanwhile differs, and stays with the worker: a rollout worker stops its
shard after the groups it finished (``RolloutWorker._preempted_answer``), a trainer rank is
handed over at the next step boundary (``JobRunner._hand_over``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

# the handlers of the workers of a process that hosts several (``workers/colocated.py``): one
# SIGTERM handler, installed on the main thread, hands the notice to each; None: one worker
_handlers: list[Callable[[int, Any], None]] | None = None


def install_dispatcher() -> None:
    """Make this process's SIGTERM handler one that calls every :class:`Preemption` made after
    (from any thread: a role started by a call of a threaded actor runs off the main thread,
    where ``signal.signal`` refuses). Off the main thread (a test's in-process actor) it does nothing."""
    global _handlers
    if _handlers is None and threading.current_thread() is threading.main_thread():
        handlers: list[Callable[[int, Any], None]] = []
        signal.signal(signal.SIGTERM, lambda signum, frame: [h(signum, frame) for h in list(handlers)])
        _handlers = handlers


class Preemption:
    """The SIGTERM handler of one worker process.

    ``who`` names the worker in log lines; ``member`` returns its current membership
    registration (a promoted spare registers again, so it is read when needed); ``mark``
    returns the fields to write now, or None when the worker marks itself later (a rollout
    worker busy with a shard marks itself when the shard stops)."""

    def __init__(
        self,
        who: Callable[[], str],
        grace_s: float,
        member: Callable[[], Any],
        *,
        spare: Callable[[], bool],
        mark: Callable[[], dict[str, Any] | None],
    ) -> None:
        self.at: float | None = None  # wall time of the SIGTERM, once one came
        self.grace_s = grace_s
        self._who, self._member, self._spare, self._mark = who, member, spare, mark
        if _handlers is not None:
            _handlers.append(self._on_sigterm)
            return
        try:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread (a threaded actor): Ray's default, exit at once
            log.warning("%s: SIGTERM handler not installed (not the main thread)", who())

    def fields(self) -> dict[str, Any]:
        """The membership fields that say this worker is leaving, and by when."""
        at = self.at if self.at is not None else time.time()
        return {"preempted_at": at, "preempt_deadline": at + self.grace_s}

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """Only a flag and a thread here: the main thread may hold a lock a handler must not
        wait on."""
        if self.at is not None:
            return
        self.at = time.time()
        threading.Thread(target=self._drain, name="rrl-preempt", daemon=True).start()

    def _drain(self) -> None:
        print(f"{self._who()} (pid {os.getpid()}): SIGTERM, leaving within {self.grace_s:g}s",
              file=sys.stderr, flush=True)  # fmt: skip
        if self._spare():  # a spare holds no work: leave at once
            self._member().close()
            os._exit(0)
        fields = self._mark()
        if fields is not None:
            self._member().update(**fields)
        assert self.at is not None
        time.sleep(max(0.0, self.at + self.grace_s - time.time()))
        # the leader did not stop it in time: leave anyway; the key says preempted until its lease
        # expires, so the leader counts the actor's death as the preemption it is, not a fault
        os._exit(0)
