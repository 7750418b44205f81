"""Chaos scenarios: what ``rrl chaos run scenario.yaml`` accepts.

A scenario names the cluster shape, the job (inline or a path to a job file)
and a fault schedule: faults at a time (seconds after the job was submitted),
at a committed step, or drawn at random (exponential gaps with a mean time
between faults, from a seed: the same seed gives the same schedule).

Like the job spec: one pydantic model per section, unknown fields refused,
errors reported as ``file: section.field: reason`` by :func:`load_scenario`.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

FaultKind = Literal[
    "rollout_kill",
    "rollout_hang",
    "rollout_slow",
    "rollout_preempt",
    "trainer_kill",
    "trainer_preempt",
    "trainer_hang",
    "journal_full",
    "reward_hang",
    "leader_kill",
    "leader_pause",
    "etcd_restart",
    "etcd_outage",
    "etcd_member_kill",
    "snapshot_corrupt",
    "disk_full",
    "ray_node_remove",
    "scale",
]
FAULT_KINDS: tuple[str, ...] = FaultKind.__args__  # type: ignore[attr-defined]

# kinds that need time to pass before the fault is over (SIGCONT, restart, ballast removed)
_TIMED = {"rollout_hang", "rollout_slow", "trainer_hang", "journal_full", "reward_hang", "leader_pause", "etcd_outage",
          "etcd_member_kill"}  # fmt: skip


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ClusterShape(_Section):
    """The platform the harness starts for the run (all on 127.0.0.1, its own ``$RRL_HOME``)."""

    etcd_members: Literal[1, 3] = Field(1, description="etcd cluster size (3 to survive losing one member).")
    ray_nodes: int = Field(1, ge=1, le=8, description="Ray nodes: the head plus ray_nodes - 1 worker nodes.")
    controllers: int = Field(
        2, ge=1, le=5, description="Controller processes (1 leader + standbys); a killed one is restarted."
    )
    checkpoint_tmpfs_mb: int | None = Field(
        None,
        ge=4,
        description="Mount a tmpfs of this size on the job's snapshot folder (needs root). Required by "
        "disk_full, which fills it during a snapshot.",
    )
    journal_tmpfs_mb: int | None = Field(
        None,
        ge=4,
        le=4096,
        description="Mount a tmpfs of this size on the job's journal folder (needs root). Required by "
        "journal_full, which fills it: the job must pause, then resume once it is freed.",
    )
    leader_ttl: int = Field(5, ge=2, le=60, description="Leader lease TTL (s) of the controllers.")


class At(_Section):
    """When a fault fires: exactly one of ``time_s`` (after submit) or ``step`` (once committed)."""

    time_s: float | None = Field(None, ge=0, description="Seconds after the job was submitted.")
    step: int | None = Field(None, ge=0, description="Fire once the job has committed this many steps.")

    @model_validator(mode="after")
    def _one(self) -> At:
        if (self.time_s is None) == (self.step is None):
            raise ValueError("give exactly one of at.time_s or at.step")
        return self


class Fault(_Section):
    """One fault to inject."""

    kind: FaultKind = Field(description="What to break (see docs/chaos.md for each kind).")
    at: At = Field(description="When to inject it.")
    duration_s: float | None = Field(
        None,
        gt=0,
        description="How long the fault lasts: hang / pause / slow / outage / member down. "
        "Required for those kinds; a leader pause must outlast the leader TTL to matter.",
    )
    target: int | None = Field(None, ge=0, description="Worker index / etcd member / Ray node (default: chosen).")
    duty: float = Field(0.5, gt=0, lt=1, description="rollout_slow: fraction of each period the worker is stopped.")
    period_s: float = Field(1.0, gt=0, description="rollout_slow: SIGSTOP/SIGCONT cycle length.")
    kill_trainer: bool = Field(
        True,
        description="snapshot_corrupt: also kill a trainer rank afterwards, so that the restore must "
        "detect the damage and fall back (otherwise nothing reads the snapshot).",
    )
    rollout: int | None = Field(None, ge=1, description="scale: new rollout worker count.")
    trainer: int | None = Field(None, ge=1, description="scale: new trainer world size.")
    wait_s: float = Field(120.0, gt=0, description="How long to wait for the fault's target to exist.")

    @model_validator(mode="after")
    def _check(self) -> Fault:
        if self.kind in _TIMED and self.duration_s is None:
            raise ValueError(f"{self.kind} needs duration_s (how long the fault lasts)")
        if self.kind == "scale" and self.rollout is None and self.trainer is None:
            raise ValueError("scale needs rollout and/or trainer")
        return self


MAX_RANDOM_FAULTS = 10_000


class RandomFaults(_Section):
    """Faults at random times: exponential gaps of mean ``mtbf_s``, kinds drawn uniformly."""

    mtbf_s: float = Field(gt=0, description="Mean time between faults (seconds).")
    seed: int = Field(0, description="Seed of the schedule (same seed, same schedule).")
    kinds: list[FaultKind] = Field(
        default_factory=lambda: ["rollout_kill", "rollout_hang", "trainer_kill"],
        min_length=1,
        description="Kinds to draw from.",
    )
    start_s: float = Field(20.0, ge=0, description="No fault before this many seconds after submit.")
    stop_s: float = Field(600.0, gt=0, description="No fault after this many seconds after submit.")
    duration_s: float = Field(6.0, gt=0, description="duration_s of the timed kinds drawn.")

    @model_validator(mode="after")
    def _window(self) -> RandomFaults:
        if self.stop_s <= self.start_s:
            raise ValueError("stop_s must be after start_s")
        expected = (self.stop_s - self.start_s) / self.mtbf_s
        if expected > MAX_RANDOM_FAULTS:
            raise ValueError(f"(stop_s - start_s) / mtbf_s: {expected:.3g} faults expected, at most "
                             f"{MAX_RANDOM_FAULTS:,} (the schedule is drawn in full before the run)")  # fmt: skip
        return self


class Scenario(_Section):
    """A whole chaos run."""

    name: str = Field(description="Scenario name (used in the run folder and the report).")
    cluster: ClusterShape = Field(default_factory=ClusterShape, description="Platform shape.")
    job: dict[str, Any] | None = Field(None, description="The job spec, inline (as in a job file).")
    job_file: str | None = Field(None, description="Or: path to a job file (relative to the scenario file).")
    faults: list[Fault] = Field(default_factory=list, description="Scheduled faults.")
    random: RandomFaults | None = Field(None, description="Random faults, on top of the scheduled ones.")
    settle_timeout_s: float = Field(
        300.0, gt=0, description="Invariant 7: the job must finish within this long after the last fault ended."
    )
    timeout_s: float = Field(1800.0, gt=0, description="Hard limit of the whole run (then it fails).")
    verify: bool = Field(True, description="Invariants 3-4: replay the journal (and a restore) in a fresh trainer.")

    @model_validator(mode="after")
    def _job(self) -> Scenario:
        if (self.job is None) == (self.job_file is None):
            raise ValueError("give exactly one of job (inline) or job_file")
        kinds = {f.kind for f in self.faults} | set(self.random.kinds if self.random else [])
        if "disk_full" in kinds and self.cluster.checkpoint_tmpfs_mb is None:
            raise ValueError("disk_full needs cluster.checkpoint_tmpfs_mb (the disk it fills)")
        if "etcd_member_kill" in kinds and self.cluster.etcd_members < 3:
            raise ValueError("etcd_member_kill needs cluster.etcd_members: 3 (with 1 it is an outage)")
        if "ray_node_remove" in kinds and self.cluster.ray_nodes < 2:
            raise ValueError("ray_node_remove needs cluster.ray_nodes >= 2 (the head is never removed)")
        return self

    def schedule(self) -> list[Fault]:
        """Scheduled faults plus the random ones, in firing order (time faults by time; step
        faults keep their relative order)."""
        out = list(self.faults)
        if self.random is not None:
            out += random_schedule(self.random)
        return out


def random_schedule(r: RandomFaults) -> list[Fault]:
    """The random faults of ``r``: a pure function of its fields (reproducible)."""
    rng = random.Random(r.seed)
    out, t = [], r.start_s
    while True:
        t += rng.expovariate(1.0 / r.mtbf_s)
        if t > r.stop_s:
            return out
        kind = rng.choice(r.kinds)
        extra: dict[str, Any] = {"duration_s": r.duration_s} if kind in _TIMED else {}
        if kind == "scale":
            extra["rollout"] = rng.choice([1, 2])
        out.append(Fault(kind=kind, at=At(time_s=round(t, 3)), **extra))


class ScenarioError(ValueError):
    """A scenario that cannot be used; ``str()`` names the file and each bad field."""


def _loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if not str(p).startswith("function-")) or "(top level)"


def parse_scenario(data: Any, source: str = "<scenario>") -> Scenario:
    if not isinstance(data, dict):
        raise ScenarioError(f"{source}: a scenario must be a mapping, got {type(data).__name__}")
    try:
        return Scenario.model_validate(data)
    except ValidationError as e:
        lines = [f"{source}: invalid scenario"]
        for err in e.errors():
            lines.append(f"  {_loc(err['loc'])}: {err['msg']}")
        raise ScenarioError("\n".join(lines)) from None


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise ScenarioError(f"{p}: cannot read scenario: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ScenarioError(f"{p}: not valid YAML: {getattr(e, 'problem', e)}") from None
    return parse_scenario(data, str(p))


def job_spec_dict(sc: Scenario, scenario_path: str | Path | None = None) -> dict[str, Any]:
    """The scenario's job spec as a mapping (job_file, and a relative task.path, read relative
    to the scenario file)."""
    here = Path(scenario_path).parent if scenario_path is not None else None
    if sc.job is not None:
        data: Any = dict(sc.job)
    else:
        assert sc.job_file is not None
        p = Path(sc.job_file)
        if not p.is_absolute() and here is not None:
            p = here / p
        try:
            data = yaml.safe_load(p.read_text())
        except OSError as e:
            raise ScenarioError(f"job_file: cannot read {p}: {e.strerror}") from None
        if not isinstance(data, dict):
            raise ScenarioError(f"job_file: {p} is not a mapping")
    task = data.get("task")
    if isinstance(task, dict) and isinstance(task.get("path"), str) and here is not None:
        if not Path(task["path"]).is_absolute():
            data["task"] = {**task, "path": str((here / task["path"]).resolve())}
    return data
