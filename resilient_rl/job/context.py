"""What every part of the driver is handed: one job's :class:`JobContext`.

Groups, the snapshot flow and the restore choice take a context, not the runner: its
fields are exactly what they read, all set before the runner's thread starts.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from controller.election import NotLeader
from controller.events import Kind
from controller.jobs import TERMINAL

from ..errors import JobFailed, is_stale
from ..naming import TRAINER_ENV, actor_name, actor_prefix
from ..spec import JobSpec
from .actors import Actors


class JobRecords(Protocol):
    """The leader controller as a job's driver writes through it (every write fenced):
    :class:`controller.service.Controller` implements it."""

    id: str

    @property
    def leads(self) -> bool: ...

    @property
    def token(self) -> int: ...

    def event(self, job: str, kind: Kind, message: str, **data: Any) -> None: ...

    def read_state(self, job: str) -> dict[str, Any]: ...

    def update_state(
        self, job: str, expect: Callable[[dict[str, Any]], None] | None = None, **changes: Any
    ) -> dict[str, Any]: ...

    def checkpoints(self, job: str) -> list[dict[str, Any]]: ...

    def members(self, job: str, group: str) -> dict[str, dict[str, Any]]: ...

    def record_checkpoint(self, job: str, step: int, info: dict[str, Any]) -> None: ...

    def forget_checkpoint(self, job: str, step: int) -> None: ...

    def record_lineage(self, job: str, step: int, segment: dict[str, Any]) -> None: ...

    def note_etcd_error(self) -> None: ...


@dataclass
class JobContext:
    job: str
    spec: JobSpec
    token: int  # fences the driver's calls on workers (see workers/fencing.py)
    workdir: Path
    etcd: str  # endpoints the workers register with
    records: JobRecords
    actors: Actors
    want: Callable[[str], int]  # desired size of a group, as the runner knows it now
    want_strategy: Callable[[], str] | None = None  # desired trainer strategy (`rrl scale --strategy`)
    stopped: threading.Event = field(default_factory=threading.Event)
    # held by every write and by stop(): once stop() returns no write is under way or can start
    write_lock: threading.RLock = field(default_factory=threading.RLock)

    def strategy(self) -> str:
        """The trainer strategy the job should run now: ``rrl scale --strategy``, else the spec's."""
        return self.want_strategy() if self.want_strategy is not None else self.spec.trainer.strategy

    def stop(self) -> None:
        """No write of this job's driver after this returns (waits for one under way)."""
        with self.write_lock:
            self.stopped.set()

    def _writing(self, what: str) -> None:
        if self.stopped.is_set():
            raise NotLeader(f"the runner of job {self.job} was stopped: {what} not written")

    # -- the record (fenced writes, all through write_lock) ----------------------

    def event(self, kind: Kind, message: str, **data: Any) -> None:
        with self.write_lock:
            self._writing(f"event {kind}")
            self.records.event(self.job, kind, message, **data)

    def read_state(self) -> dict[str, Any]:
        return self.records.read_state(self.job)

    def update_state(self, expect: Callable[[dict[str, Any]], None] | None = None, **changes: Any) -> dict[str, Any]:
        with self.write_lock:
            self._writing("state")
            return self.records.update_state(self.job, expect=expect, **changes)

    def append_metrics(self, row: dict[str, Any]) -> None:
        """Step ``row['step']``'s line of ``metrics.jsonl``: written before its commit, on the
        commit's own path (a stopped runner writes none; see controller/steplog.py)."""
        from controller import steplog

        with self.write_lock:
            self._writing(f"metrics of step {row.get('step')}")
            steplog.append(self.workdir / "metrics.jsonl", row)

    def append_eval(self, row: dict[str, Any]) -> None:
        """An evaluation's line of ``<workdir>/eval.jsonl`` (after its record in the state)."""
        with self.write_lock:
            self._writing(f"eval of version {row.get('version')}")
            with open(self.workdir / "eval.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")

    def members(self, group: str) -> dict[str, dict[str, Any]]:
        """The live membership records of ``group`` (worker -> value): a key is there while its
        worker's lease is (etcd membership, the third detection channel)."""
        return self.records.members(self.job, group)

    def checkpoints(self) -> list[dict[str, Any]]:
        return self.records.checkpoints(self.job)

    def record_checkpoint(self, step: int, info: dict[str, Any]) -> None:
        with self.write_lock:
            self._writing(f"checkpoint {step}")
            self.records.record_checkpoint(self.job, step, info)

    def forget_checkpoint(self, step: int) -> None:
        with self.write_lock:
            self._writing(f"forget checkpoint {step}")
            self.records.forget_checkpoint(self.job, step)

    def record_lineage(self, k: int, segment: dict[str, Any]) -> None:
        """Record that the trainer group (re)started to rejoin live training at step ``k``
        (a later restart at the same step replaces it: only the one that trained on counts)."""
        with self.write_lock:
            self._writing(f"lineage {k}")
            self.records.record_lineage(self.job, k, {**segment, "at_step": k, "time": time.time()})

    # -- leadership ------------------------------------------------------------

    def check_leader(self) -> None:
        """Raise NotLeader unless this controller still certainly leads and the runner runs
        (checked before every action on workers: a deposed leader must not touch them)."""
        if self.stopped.is_set():
            raise NotLeader(f"the runner of job {self.job} was stopped")
        if not self.records.leads:
            raise NotLeader(f"controller {self.records.id} no longer leads job {self.job}")

    def not_leader(self, e: BaseException) -> NotLeader:
        return NotLeader(f"a worker refused our call, a newer leader owns it: {e}")

    def raise_if_stale(self, e: BaseException) -> None:
        """A worker refused our call (a newer leader fenced it): raise NotLeader; else return."""
        if is_stale(e):
            raise self.not_leader(e) from None

    # -- names and placement -----------------------------------------------------

    def actor_name(self, group: str, index: int) -> str:
        return actor_name(self.job, group, index)

    def actor_prefix(self, group: str) -> str:
        return actor_prefix(self.job, group)

    def runtime_env(self) -> dict[str, Any]:
        return job_runtime_env(self.spec)


def job_runtime_env(spec: JobSpec) -> dict[str, Any]:
    """The environment of every worker process of the job (Ray's ``runtime_env``).

    ``RAY_worker_niceness`` 0: Ray starts worker processes at nice 15 (so that its own
    daemons stay responsive), and the job's workers are its critical path. At nice 15, on a
    2-core machine with 4 busy processes beside the job, a step took 1.51x as long as at nice 0;
    idle, 2-3 % longer (BENCHMARKS.md section 1). Ray gives its own job drivers nice 0 the
    same way (its job supervisor's ``runtime_env``)."""
    return {
        "env_vars": {
            "RAY_worker_niceness": "0",
            "VLLM_CPU_KVCACHE_SPACE": str(max(1, int(spec.rollout.kv_cache_gib))),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    }


def trainer_runtime_env(spec: JobSpec) -> dict[str, Any]:
    """A process that holds a trainer rank: the job's environment over :data:`TRAINER_ENV`."""
    env = job_runtime_env(spec)
    env["env_vars"] = {**TRAINER_ENV, **env["env_vars"]}
    return env


def live(cur: dict[str, Any]) -> None:
    """``expect`` of the runner's phase writes: a job that reached a terminal phase (cancelled by the
    reconcile loop while this thread was busy) is never moved out of it."""
    if cur.get("phase") in TERMINAL:
        raise NotLeader(f"job is {cur['phase']}: the runner does not write its state any more")


def committable(cur: dict[str, Any], k: int) -> None:
    """``expect`` of the commit of step ``k``: the job is RUNNING (not cancelled while the step
    trained) and at step ``k`` (no step applied twice); raises otherwise."""
    if cur.get("phase") != "RUNNING":
        raise NotLeader(f"job is {cur.get('phase')}: step {k} is not committed")
    if cur.get("step") != k:
        raise JobFailed(f"refusing to commit step {k}: etcd says the job is at step {cur.get('step')}")
