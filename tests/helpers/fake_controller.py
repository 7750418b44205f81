"""The controller as a JobRunner's record-keeping sees it (state CAS, checkpoints, events,
the election), in memory: for unit tests of the runner's commit and take-over bookkeeping.
The outer edge faked; the runner's own code stays real (no thread, no Ray)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from controller.election import NotLeader
from controller.events import Kind
from resilient_rl.job.committer import StepCommitter
from resilient_rl.job.context import JobContext
from resilient_rl.job.faults import FaultPolicy
from resilient_rl.job.runner import JobRunner
from resilient_rl.spec import parse_spec


class FakeController:
    def __init__(self) -> None:
        self.id = "c-test"
        self.state: dict[str, Any] = {"phase": "RUNNING", "step": 0}
        self.records: dict[int, dict[str, Any]] = {}
        self.events: list[tuple[str, str, dict[str, Any]]] = []
        self.leads = True
        self.token = 1
        self.refused: list[str] = []  # writes attempted while not leading
        self.writes: list[dict[str, Any]] = []  # every state update, in order
        self.lock = threading.Lock()
        self.lineage: dict[int, dict[str, Any]] = {}
        self.membership: dict[str, dict[str, dict[str, Any]]] = {}  # group -> worker -> value (tests set it)

    def read_state(self, job: str) -> dict[str, Any]:
        return dict(self.state)

    def record_lineage(self, job: str, step: int, segment: dict[str, Any]) -> None:
        self._fenced(f"lineage {step}")
        self.lineage[step] = segment

    def note_etcd_error(self) -> None:
        pass

    def checkpoints(self, job: str) -> list[dict[str, Any]]:
        return [self.records[s] for s in sorted(self.records)]

    def members(self, job: str, group: str) -> dict[str, dict[str, Any]]:
        return {w: dict(v) for w, v in self.membership.get(group, {}).items()}

    def record_checkpoint(self, job: str, step: int, info: dict[str, Any]) -> None:
        self._fenced(f"checkpoint {step}")
        self.records[step] = {**info, "step": step}

    def forget_checkpoint(self, job: str, step: int) -> None:
        self._fenced(f"forget checkpoint {step}")
        del self.records[step]

    def _fenced(self, what: str) -> None:
        """As the election's fence: a controller that no longer leads writes nothing."""
        if not self.leads:
            self.refused.append(what)
            raise NotLeader(f"{self.id} is not the leader ({what} refused)")

    def event(self, job: str, kind: str, message: str, **data: Any) -> None:
        self._fenced(f"event {kind}")
        Kind(kind)  # as EventLog.append: an unknown kind is an error
        with self.lock:
            self.events.append((kind, message, data))

    def update_state(self, job: str, expect: Any = None, **changes: Any) -> dict[str, Any]:
        self._fenced(f"state {sorted(changes)}")
        with self.lock:
            if expect is not None:
                expect(self.state)
            self.state.update(changes)
            self.writes.append(dict(changes))
            return self.state


def bare_runner(c: FakeController, workdir: Path, **spec: Any) -> JobRunner:
    """A JobRunner with the fields its bookkeeping reads, and no thread."""
    r = object.__new__(JobRunner)
    r.c, r.job, r.workdir = c, "j", workdir  # type: ignore[assignment]
    r.spec = parse_spec({"name": "j", "model": {"init": {}}, **spec})
    r._stop = threading.Event()
    r.ctx = JobContext(r.job, r.spec, 1, workdir, "", c, None, want=lambda g: 1, stopped=r._stop)  # type: ignore[arg-type]
    r.faults, r.committer = FaultPolicy(r.ctx), StepCommitter(r.ctx)
    return r


class LeaderTerm:
    """One leader's view of the record: what a runner gets from its controller. Like the
    election's fenced writes, a term whose token is no longer the newest writes nothing (NotLeader),
    even while it still believes it leads (``leads`` is the controller's, as a lease looks locally)."""

    def __init__(self, c: FakeController, token: int) -> None:
        self.c, self.token, self.id = c, token, c.id

    @property
    def leads(self) -> bool:
        return self.c.leads

    def _fence(self, what: str) -> None:
        if self.token != self.c.token:
            self.c.refused.append(f"stale term {self.token}: {what}")
            raise NotLeader(f"fenced write rejected: token {self.token} is stale ({what})")

    def event(self, job: str, kind: str, message: str, **data: Any) -> None:
        self._fence(f"event {kind}")
        self.c.event(job, kind, message, **data)

    def update_state(self, job: str, expect: Any = None, **changes: Any) -> dict[str, Any]:
        self._fence("state")
        return self.c.update_state(job, expect, **changes)

    def record_checkpoint(self, job: str, step: int, info: dict[str, Any]) -> None:
        self._fence("checkpoint")
        self.c.record_checkpoint(job, step, info)

    def forget_checkpoint(self, job: str, step: int) -> None:
        self._fence("forget checkpoint")
        self.c.forget_checkpoint(job, step)

    def record_lineage(self, job: str, step: int, segment: dict[str, Any]) -> None:
        self._fence("lineage")
        self.c.record_lineage(job, step, segment)

    def read_state(self, job: str) -> dict[str, Any]:
        return self.c.read_state(job)

    def checkpoints(self, job: str) -> list[dict[str, Any]]:
        return self.c.checkpoints(job)

    def members(self, job: str, group: str) -> dict[str, dict[str, Any]]:
        return self.c.members(job, group)

    def note_etcd_error(self) -> None:
        self.c.note_etcd_error()
