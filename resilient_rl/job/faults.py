"""One fault model for a job: what a fault is, and the one policy that owns its consequences.

* :func:`classify` turns what the driver saw (a Ray error from a call, or an observation:
  a shard or a train step past its deadline, a worker missing at take-over) into a
  :class:`Fault` (kind, group, worker, cause, detection time).
* :class:`FaultPolicy` (one per job's runner) owns everything that follows from faults, for
  both groups: the restart budgets (``fault.max_restarts`` per ``fault.restart_window``),
  the *open* faults awaiting the next committed step (kept in the
  job's state too, ``open_faults``, so a new leader still records their recovery), the rollout
  workers down until their replacement joins (``rollout_down``, for the same reason: a leader
  that takes over while a replacement is still joining adopts it, and its join still ends the
  fault and restores the group), and the recovery timing of each worker and of the job.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from controller.events import Kind

from ..errors import JobFailed
from .actors import actor_died
from .context import JobContext, live

GROUPS = ("rollout", "trainer")


@dataclass(frozen=True)
class Fault:
    kind: str  # rollout_fault | rollout_hang | trainer_fault | trainer_hang
    group: str  # rollout | trainer
    worker: int | None  # a rollout worker's index (None: the whole trainer group)
    cause: str  # lost | hang | take_over | join_failed
    detected_at: float  # wall-clock time


def classify(
    group: str, *, error: BaseException | None = None, hung: bool = False, worker: int | None = None,
    cause: str | None = None,
) -> Fault:  # fmt: skip
    """The fault an error of a call (its actor died) or an observation (``hung``) means."""
    if group not in GROUPS:
        raise ValueError(f"unknown group {group!r}")
    if error is not None and not hung and not actor_died(error) and cause is None:
        raise ValueError(f"{type(error).__name__} is not a fault of the {group} group (its actor lives)")
    kind = f"{group}_{'hang' if hung else 'fault'}"
    return Fault(kind, group, worker, cause or ("hang" if hung else "lost"), time.time())


def backoff_s(failures: int) -> float:
    """How long to wait before replacing a worker that failed ``failures`` times in a row, with no
    work served in between (a rollout worker's shard, a trainer group's start): 0.5 s, doubling,
    at most 10 s. A crash loop's backoff, as Kubernetes' CrashLoopBackOff that resets once a
    container ran: faults the job recovered from, however many in the restart window, do not
    lengthen the next replacement's wait (a burst of them did, 4 s after the third: BENCHMARKS
    section 5); the budget (``fault.max_restarts``) still ends a crash loop."""
    return min(10.0, 0.5 * 2 ** max(0, failures - 1)) if failures > 0 else 0.0


class RestartBudget:
    def __init__(self, group: str, limit: int, window: float) -> None:
        self.group, self.limit, self.window = group, limit, window
        self.times: deque[float] = deque()

    def spend(self) -> int:
        """Record one restart; raise ``JobFailed`` when the budget is exhausted. Returns the
        restarts within the window, this one included."""
        now = time.monotonic()
        self.times.append(now)
        while self.times and now - self.times[0] > self.window:
            self.times.popleft()
        if len(self.times) > self.limit:
            raise JobFailed(
                f"{self.group} group restarted {len(self.times)} times within {self.window:.0f}s "
                f"(fault.max_restarts = {self.limit}): giving up on a crash loop"
            )
        return len(self.times)


class FaultPolicy:
    """Budgets, backoff and recovery timing of one job's faults (see module doc)."""

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        f = ctx.spec.fault
        self.budgets = {g: RestartBudget(g, f.max_restarts, f.restart_window) for g in GROUPS}
        self.open: list[tuple[str, float]] = []  # (kind, detected wall time) until the next commit
        self.worker_down: dict[int, float] = {}  # rollout index -> monotonic time of its fault

    def load(self, state: dict[str, Any]) -> None:
        """The faults a previous leader detected that no commit has followed yet, and the rollout
        workers it saw go down that have not joined again (their times moved to this clock)."""
        self.open = [(str(kind), float(t)) for kind, t in state.get("open_faults") or []]
        ago = time.time() - time.monotonic()
        self.worker_down = {int(i): float(t) - ago for i, t in (state.get("rollout_down") or {}).items()}

    def _down(self) -> dict[str, float] | None:
        """``worker_down`` as the state keeps it: index -> wall time of the fault."""
        ago = time.time() - time.monotonic()
        return {str(i): round(t + ago, 3) for i, t in sorted(self.worker_down.items())} or None

    def detected(self, fault: Fault) -> None:
        """Remember a fault (in etcd too) until the next committed step."""
        self.open.append((fault.kind, fault.detected_at))
        if fault.worker is not None:
            self.worker_down.setdefault(fault.worker, time.monotonic())
        self.ctx.update_state(expect=live, open_faults=[list(f) for f in self.open], rollout_down=self._down())

    def worker_lost(self, i: int) -> None:
        """Rollout worker ``i`` is down (a fault that :meth:`detected` may not have seen: a
        replacement that died joining, a worker gone at take-over) until it joins again."""
        if i not in self.worker_down:
            self.worker_down[i] = time.monotonic()
            self.ctx.update_state(expect=live, rollout_down=self._down())

    def forget_workers(self, keep: int) -> None:
        """The group was resized to ``keep`` workers: those beyond it will not come back."""
        if any(i >= keep for i in self.worker_down):
            self.worker_down = {i: t for i, t in self.worker_down.items() if i < keep}
            self.ctx.update_state(expect=live, rollout_down=self._down())

    def restart(self, group: str) -> None:
        """One restart of ``group`` (raises JobFailed past the budget)."""
        self.budgets[group].spend()

    def survivor_wait_s(self, slowest_step_s: float) -> float:
        """How long to wait for the surviving trainer ranks' calls to end once a peer was lost:
        they end as their collective does, when their step reaches it after the peer was killed
        (up to a whole step: seen at 100M parameters, 11 s), or at the process group's timeout
        when the peer froze; at least 10 s and a lease TTL."""
        return max(10.0, float(self.ctx.spec.fault.lease_ttl), 2.0 * slowest_step_s)

    def worker_back(self, i: int) -> float | None:
        """Rollout worker ``i`` joined: seconds since its fault (None if it had none)."""
        t = self.worker_down.pop(i, None)
        if t is None:
            return None
        self.ctx.update_state(expect=live, rollout_down=self._down())
        return round(time.monotonic() - t, 2)

    def committed(self, step: int) -> None:
        """Step ``step`` committed: every open fault is recovered from, as far as the job goes
        (the commit itself cleared ``open_faults`` in etcd). Records each one's time."""
        now = time.time()
        for kind, t in self.open:
            self.ctx.event(Kind.RECOVERED, f"step {step} committed {now - t:.1f}s after a {kind}",
                           fault=kind, step=step, seconds=round(now - t, 2))  # fmt: skip
        self.open.clear()


class LeaseWatch:
    """etcd membership as a detection channel (the third, beside Ray's actor errors and the
    deadlines): a worker whose member key was seen and has been gone for ``fault.lease_ttl``
    since is lost, even if Ray still calls its actor alive (a SIGSTOPped process, a worker cut
    off from etcd). Gone for a TTL *after* the lease expired, not at once: a registration that
    lost its lease to an etcd outage writes its key again within a second of etcd answering.
    Only workers seen since the last :meth:`reset` count (a group just (re)started has not
    registered yet)."""

    def __init__(self, ttl: float, every: float = 1.0) -> None:
        self.ttl, self.every = float(ttl), every
        self.seen: dict[str, float] = {}  # worker -> monotonic time its key was last there
        self._read = 0.0

    def reset(self) -> None:
        self.seen.clear()
        self._read = 0.0

    def due(self, now: float) -> bool:
        """Whether a read of the membership is due (at most one per ``every`` seconds)."""
        if now - self._read < self.every:
            return False
        self._read = now
        return True

    def observe(self, members: dict[str, Any], now: float) -> dict[str, float]:
        """Take in the group's membership read at ``now``; returns the workers gone for at least
        the TTL, with how long since their key was last seen."""
        for w in members:
            self.seen[w] = now
        return {w: round(now - t, 2) for w, t in self.seen.items() if w not in members and now - t >= self.ttl}


class LivenessProbe:
    """The deadline channel's fast half (``fault.probe_timeout``), over one wait on workers (a
    train step, a snapshot's staging or manifest, a rollout shard): once the wait has run
    ``suspect_s`` (four times what it usually takes, at least 1 s), each worker is sent a liveness
    call (``alive``, on its control thread: a live worker answers in milliseconds, also while it
    computes or blocks in a collective), and again ``suspect_s`` after the last answers. One that
    has not answered within ``timeout`` is frozen (SIGSTOPped, a paused VM: Ray still calls it
    ALIVE, and its peers would wait in their collective for ``hang_timeout``). A worker that
    answers but does not finish is left to the wait's own deadline. Once one is found frozen the
    probe stops: its owner recovers. ``usual_s`` None or ``timeout`` 0: off."""

    def __init__(
        self, actors: Any, targets: dict[int, Any], timeout: float, usual_s: float | None, started: float | None = None
    ) -> None:
        self.actors, self.targets = actors, dict(targets)
        self.timeout = float(timeout) if usual_s is not None else 0.0
        self.suspect_s = max(1.0, 4.0 * (usual_s or 0.0))
        self.started = self.probed = time.monotonic() if started is None else started
        self.out: dict[int, tuple[Any, float]] = {}  # worker -> its liveness call, when sent
        self.wake_at = self.started + self.suspect_s if self.timeout else float("inf")

    def check(self) -> dict[int, float]:
        """Send the probes or judge them, as due (call on every pass of the wait; the next is due
        by :attr:`wake_at`): the workers found frozen now -> how long each was silent."""
        if not self.timeout:
            return {}
        A, now = self.actors, time.monotonic()
        if self.out:
            refs = [ref for ref, _ in self.out.values()]
            ready = A.wait(refs, num_returns=len(refs), timeout=0)[0]
            late = {i: now - at for i, (ref, at) in self.out.items() if ref not in ready and now - at >= self.timeout}
            if late:
                self.out, self.timeout, self.wake_at = {}, 0.0, float("inf")
                return late
            if len(ready) == len(refs):
                self.out, self.probed = {}, now
                self.wake_at = now + self.suspect_s
            else:
                self.wake_at = min(at for _, at in self.out.values()) + self.timeout
            return {}
        if now < self.probed + self.suspect_s:
            self.wake_at = self.probed + self.suspect_s
            return {}
        self.out = {i: (A.call(w, "alive"), now) for i, w in self.targets.items()}
        self.wake_at = now + self.timeout
        return {}


class TrainerProbe(LivenessProbe):
    """:class:`LivenessProbe` over the trainer ranks in one wait of the leader (``what``): a rank
    found frozen is killed, with a ``trainer_hang`` event of channel ``probe``, so that its calls
    fail (and its peers' collective with it) and the wait's owner sees a lost rank. The event's
    ``detection_s`` runs from the last time the ranks were known alive (their last answers, else
    the wait's start): between steps the wait may have begun long before the rank froze."""

    def __init__(self, ctx: JobContext, ranks: list[Any], what: str, usual_s: float | None) -> None:
        super().__init__(ctx.actors, dict(enumerate(ranks)), ctx.spec.fault.probe_timeout, usual_s)
        self.ctx, self.what = ctx, what

    def check(self) -> dict[int, float]:
        timeout, frozen = self.timeout, super().check()
        now = time.monotonic()
        took, known = round(now - self.started, 2), round(now - self.probed, 2)
        for i, silent in sorted(frozen.items()):
            self.ctx.event(Kind.TRAINER_HANG, f"trainer rank {i} did not answer a liveness call in {silent:.1f}s "
                           f"(fault.probe_timeout {timeout:g}s), {took:.1f}s into {self.what}: frozen; killing it",
                           group="trainer", worker=i, channel="probe", detection_s=known)  # fmt: skip
            self.actors.kill(self.targets[i])
        return frozen
