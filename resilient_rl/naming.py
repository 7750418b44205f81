"""Names every process of a job agrees on: the Ray namespace, actor names, the job's
working folder and the marker of a model folder rrl made. Imports nothing heavy, so the
controller, the workers and the CLI all use this one copy."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .spec import JobSpec

NAMESPACE = "rrl"  # the Ray namespace of every rrl actor
MODEL_MARKER = "rrl_model_init.json"  # in a model folder made from model.init: the init it was made from


def actor_name(job: str, group: str, index: int) -> str:
    """``rrl:{job}:{group}:{index}``: detached and named, so a new leader finds it again.
    Groups: ``rollout``, ``trainer``, ``weights`` (the weight store, index 0)."""
    return f"rrl:{job}:{group}:{index}"


def job_workdir(spec: JobSpec) -> Path:
    """The job's folder: ``checkpoint.dir`` if given, else ``$RRL_HOME/jobs/{name}``
    (journal, snapshots, metrics.jsonl, the generated model)."""
    from .local import rrl_home

    return Path(spec.checkpoint.dir) if spec.checkpoint.dir else rrl_home() / "jobs" / spec.name
