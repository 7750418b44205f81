"""The controller as a JobRunner's record-keeping sees it (state CAS, checkpoints, events,
the election), in memory: for unit tests of the runner's commit and take-over bookkeeping.
The outer edge faked; the runner's own code stays real (no thread, no Ray)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from resilient_rl.job.reward_guard import RewardErrorWindow
from resilient_rl.job.runner import JobRunner
from resilient_rl.spec import parse_spec


class FakeController:
    def __init__(self) -> None:
        self.id = "c-test"
        self.state: dict[str, Any] = {"phase": "RUNNING", "step": 0}
        self.records: dict[int, dict[str, Any]] = {}
        self.events: list[tuple[str, str, dict[str, Any]]] = []
        self.election = type("Election", (), {"is_leader": True})()

    def checkpoints(self, job: str) -> list[dict[str, Any]]:
        return [self.records[s] for s in sorted(self.records)]

    def record_checkpoint(self, job: str, step: int, info: dict[str, Any]) -> None:
        self.records[step] = {**info, "step": step}

    def forget_checkpoint(self, job: str, step: int) -> None:
        del self.records[step]

    def event(self, job: str, kind: str, message: str, **data: Any) -> None:
        self.events.append((kind, message, data))

    def update_state(self, job: str, expect: Any = None, **changes: Any) -> dict[str, Any]:
        if expect is not None:
            expect(self.state)
        self.state.update(changes)
        return self.state


def bare_runner(c: FakeController, workdir: Path, **spec: Any) -> JobRunner:
    """A JobRunner with the fields its bookkeeping reads, and no thread."""
    r = object.__new__(JobRunner)
    r.c, r.job, r.workdir, r.reward_errors, r.faults = c, "j", workdir, 0, []  # type: ignore[assignment]
    r.spec = parse_spec({"name": "j", "model": {"init": {}}, **spec})
    r.rewards = RewardErrorWindow("task.reward exact", 0.5, 10)
    r._stop = threading.Event()
    return r
