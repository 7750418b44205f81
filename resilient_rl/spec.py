"""The job spec: what ``rrl submit job.yaml`` accepts.

One pydantic model per section, every field documented, unknown fields refused
(a typo must not silently fall back to a default). Validation errors are
reported as ``file: section.field: reason`` by :func:`load_spec`.

Light module: imports only pydantic and yaml, so the CLI stays fast.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from controller.keys import InvalidId, check_job_id


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TinyModelInit(_Section):
    """A randomly initialised small Qwen2-architecture model made offline (``rrl init-model``)."""

    hidden_size: int = Field(128, ge=64, le=4096, description="Model width.")
    num_layers: int = Field(2, ge=1, le=48, description="Transformer blocks.")
    num_heads: int = Field(2, ge=1, le=64, description="Attention heads; hidden_size/num_heads must be 64 or 128.")
    num_kv_heads: int = Field(1, ge=1, le=64, description="Key/value heads (grouped-query attention).")
    intermediate_size: int = Field(256, ge=16, description="MLP inner width.")
    seed: int = Field(0, description="Seed of the random initialisation.")

    @model_validator(mode="after")
    def _head_dim(self) -> TinyModelInit:
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if self.hidden_size // self.num_heads not in (64, 128):
            raise ValueError(
                "hidden_size / num_heads (the head dim) must be 64 or 128: vLLM's CPU attention "
                "kernels refuse other head sizes"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        return self


class ModelSpec(_Section):
    """Which policy model to train: a local folder / Hugging Face id, or a tiny model made offline."""

    path: str | None = Field(
        None, description="Local folder or Hugging Face model id of a causal LM with its tokenizer."
    )
    init: TinyModelInit | None = Field(
        None, description="Create a tiny random model instead (written under the job's work folder)."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Training dtype (float32 on CPU for determinism)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.path is None) == (self.init is None):
            raise ValueError("give exactly one of model.path or model.init")
        return self


class TaskSpec(_Section):
    """The prompts and the verifiable reward."""

    kind: Literal["copy", "reverse", "arith", "jsonl"] = Field(
        "copy",
        description="copy / reverse: repeat a digit string (dense per-character reward); "
        "arith: a+b (exact match); jsonl: your own {prompt, answer} rows.",
    )
    min_len: int = Field(3, ge=1, le=64, description="copy/reverse/arith: shortest digit string / operand.")
    max_len: int = Field(5, ge=1, le=64, description="copy/reverse/arith: longest digit string / operand.")
    num_prompts: int = Field(1024, ge=1, description="Size of the generated prompt set (built-in tasks).")
    path: str | None = Field(None, description="jsonl: the dataset file.")
    reward: Literal["exact", "regex", "function", "partial"] = Field(
        "exact",
        description="jsonl/arith: exact match, `regex` (answer is a pattern), `function` "
        "(reward_fn), or `partial` (arith: per-digit partial credit).",
    )
    reward_fn: str | None = Field(None, description="`module:function` taking (prompt, completion, answer) -> float.")

    @model_validator(mode="after")
    def _check(self) -> TaskSpec:
        if self.min_len > self.max_len:
            raise ValueError("min_len must be <= max_len")
        if self.kind == "jsonl" and not self.path:
            raise ValueError("task.path is required when kind is jsonl")
        if self.reward == "function":
            if not self.reward_fn or ":" not in self.reward_fn:
                raise ValueError("reward_fn must be given as module:function when reward is `function`")
        return self


class SamplingSpec(_Section):
    """How rollouts are sampled."""

    temperature: float = Field(1.0, ge=0.0, le=5.0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_tokens: int = Field(16, ge=1, le=32768, description="Longest completion in tokens.")
    n: int = Field(8, ge=2, le=1024, description="Samples per prompt (the GRPO group size; at least 2).")


class RolloutSpec(_Section):
    """The rollout worker group (inference engines)."""

    replicas: int = Field(1, ge=1, le=1024, description="Number of rollout workers.")
    min_replicas: int | None = Field(None, ge=1, description="Autoscaler floor (defaults to replicas).")
    max_replicas: int | None = Field(None, ge=1, description="Autoscaler ceiling (defaults to replicas).")
    engine: Literal["vllm", "hf"] = Field("vllm", description="vLLM (CPU build or upstream on GPU) or HF generate.")
    sampling: SamplingSpec = Field(default_factory=SamplingSpec, description="Sampling parameters.")
    shards_per_step: int | None = Field(
        None, ge=1, description="Shards a step's prompts are split into (default: one per replica)."
    )
    num_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves for each rollout worker.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves for each rollout worker.")
    kv_cache_gib: float = Field(1.0, gt=0, description="vLLM CPU KV cache size (GiB); keeps Ray's OOM killer away.")

    @model_validator(mode="after")
    def _bounds(self) -> RolloutSpec:
        lo = self.min_replicas or self.replicas
        hi = self.max_replicas or self.replicas
        if not lo <= self.replicas <= hi:
            raise ValueError("need min_replicas <= replicas <= max_replicas")
        return self


class TrainerSpec(_Section):
    """The trainer group (torch.distributed, DDP)."""

    replicas: int = Field(1, ge=1, le=1024, description="World size.")
    lr: float = Field(1e-3, gt=0, le=1.0, description="Learning rate.")
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="Optimizer.")
    weight_decay: float = Field(0.0, ge=0, description="Weight decay.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping norm (None: off).")
    micro_batch: int = Field(32, ge=1, description="Sequences per forward/backward on one rank.")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="gloo on CPU, nccl on GPU.")
    num_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves for each rank.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves for each rank.")


class AlgorithmSpec(_Section):
    """GRPO: group-normalised advantages, clipped ratio loss, optional KL to the reference."""

    name: Literal["grpo"] = Field("grpo", description="The algorithm.")
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO-style ratio clip.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL penalty to the initial policy (0 = off).")
    normalize_std: bool = Field(
        True,
        description="Divide advantages by the group's std (DeepSeekMath GRPO). False: plain "
        "r - group mean (Dr. GRPO), so a nearly uniform group's tiny reward gap is not blown up "
        "to full-size advantages; steadier for small policies that tend to collapse.",
    )
    off_policy_correction: bool = Field(
        True,
        description="With async.max_staleness > 0: a trajectory made by an older policy version "
        "gets the importance ratio against the engine's logprobs of its tokens (clipped at "
        "clip_eps), so stale samples cannot move the policy past the trust region. On-policy "
        "samples always have ratio 1. False: treat every sample as on-policy.",
    )


class AsyncSpec(_Section):
    """Rollout/training overlap."""

    max_staleness: int = Field(
        0, ge=0, le=64, description="Steps a trajectory's policy may lag the trained step (0 = on-policy)."
    )


class CheckpointSpec(_Section):
    """Async snapshots of the trainer."""

    every: int = Field(10, ge=1, description="Snapshot every N committed steps.")
    keep: int = Field(
        2,
        ge=2,
        description="Committed snapshots kept. At least 2: the newest may be the one being "
        "written when a fault hits, so the one before must still be there.",
    )
    backend: Literal["dcp", "torchsnapshot"] = Field("dcp", description="torch DCP async_save or torchsnapshot.")
    dir: str | None = Field(
        None,
        description="Folder for snapshots and the journal (default $RRL_HOME/jobs/<id>): an absolute path "
        "(`~` expanded; `rrl submit` makes a relative one absolute against the current folder), normalised.",
    )

    @field_validator("dir")
    @classmethod
    def _dir(cls, v: str | None) -> str | None:
        if v is None:
            return None
        if not v.strip() or "\0" in v:
            raise ValueError("must be a folder path (not empty, no NUL character)")
        p = os.path.expanduser(v)
        if not os.path.isabs(p):
            # workers on other nodes (and the controller) have other working folders
            raise ValueError(f"must be an absolute path, got {v!r}: the controller and workers run elsewhere")
        return os.path.normpath(p)


class FaultSpec(_Section):
    """Detection and restart policy."""

    hang_timeout: float = Field(
        60.0,
        gt=0,
        description="Seconds without progress, with work assigned, before a worker is declared hung.",
    )
    lease_ttl: int = Field(5, ge=2, le=60, description="Membership lease TTL in seconds (etcd's minimum is ~2).")
    max_restarts: int = Field(5, ge=0, description="Restarts allowed per group within restart_window.")
    restart_window: float = Field(600.0, gt=0, description="Window (seconds) of the restart budget.")


class JobSpec(_Section):
    """A whole RL post-training job."""

    name: str = Field(description="Job id: lower-case letters, digits and '-', at most 63 characters.")
    model: ModelSpec = Field(description="The policy model.")
    task: TaskSpec = Field(default_factory=TaskSpec, description="Prompts and reward.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Rollout workers.")
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, description="Trainer group.")
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec, description="RL algorithm.")
    async_: AsyncSpec = Field(default_factory=AsyncSpec, alias="async", description="Async pipelining.")
    steps: int = Field(100, ge=1, description="Training steps to run.")
    prompts_per_step: int = Field(16, ge=1, description="Prompts per step (global batch = prompts x samples).")
    seed: int = Field(0, ge=0, description="Seed of the prompt sampler, sampling and initialisation.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Snapshots.")
    fault: FaultSpec = Field(default_factory=FaultSpec, description="Fault detection and restarts.")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        try:
            return check_job_id(v)
        except InvalidId as e:
            raise ValueError(str(e)) from None

    @model_validator(mode="after")
    def _global(self) -> JobSpec:
        global_batch = self.prompts_per_step * self.rollout.sampling.n
        if global_batch % self.trainer.replicas:
            raise ValueError(
                f"the global batch (prompts_per_step x rollout.sampling.n = {global_batch}) must split "
                f"evenly over trainer.replicas ({self.trainer.replicas})"
            )
        return self

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json", by_alias=True), sort_keys=True)

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


class SpecError(ValueError):
    """A job file that cannot be used; ``str()`` names the file and each bad field."""


_PLAIN = re.compile(r"[A-Za-z0-9_-]+")


def _loc(loc: tuple[Any, ...]) -> str:
    """``rollout.sampling.n``; a key that is not a plain word is quoted (``'a: b'``), so a
    stray key with a newline or ``: `` in it cannot garble the error layout."""
    parts = [str(p) if _PLAIN.fullmatch(str(p)) else repr(p) for p in loc if not str(p).startswith("function-")]
    return ".".join(parts) or "(top level)"


def parse_spec(data: Any, source: str = "<spec>", overrides: dict[str, Any] | None = None) -> JobSpec:
    """Validate a spec mapping; raise :class:`SpecError` naming ``source`` and the fields."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: a job spec must be a mapping of sections, got {type(data).__name__}")
    if overrides:
        data = {**data, **overrides}
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        lines = [f"{source}: invalid job spec"]
        for err in e.errors():
            lines.append(f"  {_loc(err['loc'])}: {err['msg']}")
        raise SpecError("\n".join(lines)) from None


def load_spec(path: str | Path, overrides: dict[str, Any] | None = None) -> JobSpec:
    """Read and validate a YAML (or JSON) job file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SpecError(f"{p}: cannot read job file: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise SpecError(f"{p}{where}: not valid YAML: {getattr(e, 'problem', e)}") from None
    except (ValueError, RecursionError) as e:  # e.g. a date that does not exist, absurd nesting
        raise SpecError(f"{p}: not valid YAML: {e}") from None
    data = _absolute_dir(data)
    return parse_spec(data, str(p), overrides)


def _absolute_dir(data: Any) -> Any:
    """A relative ``checkpoint.dir`` in a job file means "under the folder I run rrl from"."""
    if isinstance(data, dict) and isinstance(data.get("checkpoint"), dict):
        d = data["checkpoint"].get("dir")
        if isinstance(d, str) and d.strip() and "\0" not in d and not os.path.isabs(os.path.expanduser(d)):
            data = {**data, "checkpoint": {**data["checkpoint"], "dir": os.path.abspath(os.path.expanduser(d))}}
    return data
