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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from controller.keys import InvalidId, check_job_id

# strict: a YAML ``true`` is not the integer 1, ``"5"`` is not 5 (lax pydantic accepts both)
# and no inf/NaN: `.inf` would pass every `gt=0` check
_CONFIG = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class _Section(BaseModel):
    model_config = _CONFIG

    @field_validator("*", mode="before")
    @classmethod
    def _upper_bound(cls, v: Any, info: ValidationInfo) -> Any:
        """A :func:`Size` field above its bound is refused with the bound's reason (pydantic's own
        ``le`` message says only the number)."""
        f = cls.model_fields[info.field_name or ""]
        why = f.json_schema_extra.get("why") if isinstance(f.json_schema_extra, dict) else None
        if why is None or isinstance(v, bool) or not isinstance(v, int | float):
            return v
        for m in f.metadata:
            le, lt = getattr(m, "le", None), getattr(m, "lt", None)
            if (le is not None and v > le) or (lt is not None and v >= lt):
                op, bound = ("less than or equal to", le) if le is not None else ("less than", lt)
                raise PydanticCustomError("size_bound", "Input should be {op} {bound}: {why}",
                                          {"op": op, "bound": f"{bound:,}", "why": why})  # fmt: skip
        return v


def Size(default: Any = ..., *, why: str, **kw: Any) -> Any:  # noqa: N802 (reads as a Field kind)
    """A bounded size field: ``le`` is required and ``why`` says what the bound protects; the
    message of a value above it carries the reason (see ``_Section._upper_bound``)."""
    assert "le" in kw or "lt" in kw, "a size field needs an upper bound"
    return Field(default, json_schema_extra={"why": why}, **kw)


_SEED_MAX = 2**31 - 1
_STEPS_MAX = 10_000_000
_BATCH_MAX = 1_048_576
_SEED_WHY = "seeds must fit a signed 32-bit integer (torch, numpy and vLLM all take them)"
_WORKERS_WHY = "one job's group beyond 1,024 workers is past what the controller is tested with"
_CPUS_WHY = "more than any single machine has"


class TinyModelInit(_Section):
    """A randomly initialised small Qwen2-architecture model made offline (``rrl init-model``)."""

    hidden_size: int = Size(
        128,
        ge=64,
        le=4096,
        why="a model made offline is for tests and demos; bring a real one through model.path",
        description="Model width.",
    )
    num_layers: int = Size(
        2, ge=1, le=48, why="a model made offline is for tests and demos", description="Transformer blocks."
    )
    num_heads: int = Size(
        2,
        ge=1,
        le=64,
        why="at most hidden_size / 64 heads of dim 64",
        description="Attention heads; hidden_size/num_heads must be 64 or 128.",
    )
    num_kv_heads: int = Size(
        1, ge=1, le=64, why="at most num_heads", description="Key/value heads (grouped-query attention)."
    )
    intermediate_size: int = Size(
        256, ge=16, le=65536, why="a model made offline is for tests and demos", description="MLP inner width."
    )
    seed: int = Size(0, ge=0, le=_SEED_MAX, why=_SEED_WHY, description="Seed of the random initialisation.")

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


class ColumnsSpec(_Section):
    """Which columns of a dataset hold what (``task.kind: dataset``)."""

    prompt: str = Field("prompt", min_length=1, max_length=256, description="The column of the prompt text.")
    answer: str = Field(
        "answer", min_length=1, max_length=256, description="The column of the reference answer (text or a number)."
    )
    messages: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="A column of chat messages ([{role, content}, ...]) to use instead of prompt: rendered "
        "through the model tokenizer's chat template, with the assistant's generation prompt.",
    )


REWARD_BACKOFF_MAX_S = 5.0  # the longest wait between two tries of a reward server


class RewardServerSpec(_Section):
    """An HTTP reward service (``task.reward: server``): a reward model or a judge."""

    url: str = Field(
        min_length=8,
        max_length=2048,
        pattern=r"^https?://\S+$",
        description='Where batches are POSTed: {"samples": [{prompt, completion, answer}, ...]} -> '
        '{"rewards": [one number in [0, 1] per sample]}.',
    )
    timeout_s: float = Size(
        30.0, gt=0, le=3600.0, why="a judge that takes an hour per batch is hung", description="Seconds per try."
    )
    retries: int = Size(
        2,
        ge=0,
        le=10,
        why="each retry of a dead server delays the step",
        description="More tries after a timeout, a connection error or a 5xx (jittered backoff); a 4xx is not "
        "retried. A batch that fails them all scores 0 per sample with the error recorded.",
    )
    batch_size: int = Size(
        16, ge=1, le=4096, why="one request's body stays in memory twice", description="Samples per request."
    )

    def batch_deadline_s(self) -> float:
        """The longest one batch may take through all its tries and backoffs (at most
        REWARD_BACKOFF_MAX_S each), plus a margin: its scorer process is killed past it."""
        return (self.retries + 1) * self.timeout_s + self.retries * REWARD_BACKOFF_MAX_S + 5.0


class TaskSpec(_Section):
    """The prompts and the verifiable reward."""

    kind: Literal["copy", "reverse", "arith", "jsonl", "dataset"] = Field(
        "copy",
        description="copy / reverse: repeat a digit string (dense per-character reward); "
        "arith: a+b (exact match); jsonl: your own {prompt, answer} rows; dataset: a Hugging Face "
        "dataset on local disk (a save_to_disk folder, or a .parquet / .arrow / .jsonl / .json / .csv file).",
    )
    min_len: int = Size(
        3,
        ge=1,
        le=64,
        why="the built-in tasks are for a char-level model with short contexts",
        description="copy/reverse/arith: shortest digit string / operand.",
    )
    max_len: int = Size(
        5,
        ge=1,
        le=64,
        why="the built-in tasks are for a char-level model with short contexts",
        description="copy/reverse/arith: longest digit string / operand.",
    )
    num_prompts: int = Size(
        1024,
        ge=1,
        le=10_000_000,
        why="every worker builds the generated prompt set in memory",
        description="Size of the generated prompt set (built-in tasks).",
    )
    path: str | None = Field(None, max_length=4096, description="jsonl / dataset: the dataset file or folder.")
    split: str = Field(
        "train", min_length=1, max_length=256, description="dataset: the split to read (of a DatasetDict folder)."
    )
    columns: ColumnsSpec = Field(default_factory=ColumnsSpec, description="dataset: the prompt and answer columns.")
    max_prompt_chars: int | None = Size(
        None,
        ge=1,
        le=10_000_000,
        why="a prompt that long fills no context window",
        description="dataset: rows whose prompt is longer are left out (quarantined with the reason).",
    )
    chat_template: bool = Field(
        False,
        description="dataset: render each prompt as one user message through the model tokenizer's chat "
        "template (with the assistant's generation prompt). See also columns.messages.",
    )
    reward: Literal["exact", "regex", "function", "partial", "math", "server"] = Field(
        "exact",
        description="jsonl/dataset/arith: exact match, `regex` (answer is a pattern), `function` "
        "(reward_fn), `server` (an HTTP reward service: reward_server), `math` (jsonl/dataset: the completion's final answer, from its last \\boxed{}, "
        "its `####` line or its last number, equals the reference's as a number or as normalised text), "
        "or `partial` (arith: per-digit partial credit).",
    )
    reward_fn: str | None = Field(None, description="`module:function` taking (prompt, completion, answer) -> float.")
    reward_server: RewardServerSpec | None = Field(
        None, description="reward: server: the service, its per-try timeout, retries and batch size."
    )
    reward_timeout_s: float = Size(
        10.0,
        gt=0,
        le=3600.0,
        why="a reward that takes an hour per sample is hung",
        description="reward: function: seconds one call may take; a call past it scores 0 with an error "
        "naming the function, and the process it ran in is killed and replaced (the worker goes on).",
    )
    reward_workers: int = Size(
        2,
        ge=1,
        le=64,
        why="each is a process on the rollout worker's machine",
        description="reward: function / server: processes per rollout worker that run the function or call "
        "the server (killable, so a hung call cannot hang the worker).",
    )
    max_reward_error_rate: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="The job fails when more than this fraction of the samples of the last "
        "reward_error_window steps scored 0 because the reward function raised, timed out or returned "
        "something other than a finite number in [0, 1] (1 = never fail for it).",
    )
    reward_error_window: int = Size(
        10, ge=1, le=10_000, why="the window is kept in the leader's memory", description="Steps of that window."
    )

    @model_validator(mode="after")
    def _check(self) -> TaskSpec:
        if self.min_len > self.max_len:
            raise ValueError("min_len must be <= max_len")
        if self.kind in ("jsonl", "dataset") and not self.path:
            raise ValueError(f"task.path is required when kind is {self.kind}")
        if self.reward == "function":
            if not self.reward_fn or ":" not in self.reward_fn:
                raise ValueError("reward_fn must be given as module:function when reward is `function`")
        if (self.reward == "server") != (self.reward_server is not None):
            raise ValueError("reward_server is required when reward is `server`, and only then")
        if (self.chat_template or self.columns.messages) and self.kind != "dataset":
            raise ValueError("task.chat_template and task.columns.messages need kind dataset")
        return self


class SamplingSpec(_Section):
    """How rollouts are sampled."""

    temperature: float = Field(1.0, ge=0.0, le=5.0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_tokens: int = Size(
        16,
        ge=1,
        le=131072,
        why="longer than the context of any model rrl is tested with",
        description="Longest completion in tokens.",
    )
    n: int = Size(
        8,
        ge=2,
        le=1024,
        why="a GRPO group of more than 1,024 samples of one prompt adds nothing a larger prompts_per_step does not",
        description="Samples per prompt (the GRPO group size; at least 2).",
    )


class RolloutSpec(_Section):
    """The rollout worker group (inference engines)."""

    replicas: int = Size(1, ge=1, le=1024, why=_WORKERS_WHY, description="Number of rollout workers.")
    min_replicas: int | None = Size(
        None, ge=1, le=1024, why=_WORKERS_WHY, description="Autoscaler floor (defaults to replicas)."
    )
    max_replicas: int | None = Size(
        None, ge=1, le=1024, why=_WORKERS_WHY, description="Autoscaler ceiling (defaults to replicas)."
    )
    engine: Literal["vllm", "hf"] = Field("vllm", description="vLLM (CPU build or upstream on GPU) or HF generate.")
    sampling: SamplingSpec = Field(default_factory=SamplingSpec, description="Sampling parameters.")
    shards_per_step: int | None = Size(
        None,
        ge=1,
        le=4096,
        why="each shard is a journal file and a task in flight; 4,096 per step is far past what load balancing needs",
        description="Shards a step's prompts are split into (default: one per replica).",
    )
    groups_per_pass: int = Size(
        0,
        ge=0,
        le=4096,
        why="a pass is one engine batch of prompt groups; 4,096 groups is past any shard worth splitting",
        description="Prompt groups a worker generates at once within its shard (0: the whole shard in one "
        "pass). With a smaller pass an idle worker steals the unstarted groups of a busy worker's shard "
        "from its end, so a long-tail shard no longer holds the step.",
    )
    longest_first: bool = Field(
        True,
        description="With groups_per_pass > 0: a shard's prompt groups are generated longest expected first "
        "(by the seconds each prompt's group took the last time this leader saw it generated; prompts not "
        "seen yet count as the shard's mean), and a helper takes the longest unstarted one, not the last, so "
        "the step ends on short groups. The order of generation only: the shard, its samples and their "
        "seeds are the same either way.",
    )
    num_cpus: float = Size(1.0, gt=0, le=1024, why=_CPUS_WHY, description="CPUs Ray reserves for each rollout worker.")
    num_gpus: float = Size(0.0, ge=0, le=64, why=_CPUS_WHY, description="GPUs Ray reserves for each rollout worker.")
    kv_cache_gib: float = Size(
        1.0, gt=0, le=4096, why=_CPUS_WHY, description="vLLM CPU KV cache size (GiB); keeps Ray's OOM killer away."
    )
    spares: int = Size(
        1,
        ge=0,
        le=64,
        why="a spare holds a worker's CPUs, GPUs and engine memory while it waits",
        description="Warm spare rollout workers: started beside the group with their engine up, in no "
        "group (membership: `rollout-spare`). A lost or hung worker's place is taken by one at once: it "
        "loads the current weights and takes shards (no process start, no engine start, no backoff; the "
        "fault still counts against fault.max_restarts), and a new spare is started in the background. "
        "Each spare reserves num_cpus / num_gpus like a worker. 0: a replacement is started after the backoff.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> RolloutSpec:
        lo = self.min_replicas or self.replicas
        hi = self.max_replicas or self.replicas
        if not lo <= self.replicas <= hi:
            raise ValueError("need min_replicas <= replicas <= max_replicas")
        return self


_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,127}")


class LoraSpec(_Section):
    """LoRA adapters (through peft): only the adapters train; the base model stays frozen."""

    r: int = Size(8, ge=1, le=1024, why="the adapter's rank; past 1,024 a full fine-tune costs less",
                  description="Adapter rank.")  # fmt: skip
    alpha: float = Field(16.0, gt=0, le=1e4, description="LoRA alpha (the update is scaled by alpha / r).")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        max_length=64,
        description="Names (or name suffixes) of the linear layers that get adapters (peft's target_modules).",
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input (0: none).")

    @field_validator("target_modules")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not _MODULE_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a module name (letters, digits, _ and ., at most 128)")
        return v


class TrainerSpec(_Section):
    """The trainer group (torch.distributed: DDP, or FSDP2 for models one rank cannot hold)."""

    replicas: int = Size(1, ge=1, le=1024, why=_WORKERS_WHY, description="World size.")
    lr: float = Field(1e-3, gt=0, le=1.0, description="Learning rate.")
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="Optimizer.")
    weight_decay: float = Field(0.0, ge=0, le=10.0, description="Weight decay.")
    max_grad_norm: float | None = Field(1.0, gt=0, le=1e6, description="Gradient clipping norm (None: off).")
    micro_batch: int = Size(
        32,
        ge=1,
        le=65536,
        why="at most the global batch bound (prompts_per_step x n)",
        description="Sequences per forward/backward on one rank.",
    )
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="ddp: every rank holds the whole model and optimizer. fsdp: FSDP2 "
        "(`fully_shard` on each decoder layer and the root): parameters, gradients and optimizer "
        "state sharded over the ranks, for models one rank cannot hold. Snapshots are sharded "
        "(checkpoint.backend dcp) and restore at any world size or strategy. A running job "
        "changes it with `rrl scale JOB --strategy`.",
    )
    reshard_after_forward: bool = Field(
        True,
        description="fsdp: free each layer's gathered parameters after its forward (less memory, "
        "one more all-gather in backward). False keeps them until backward (ZeRO-2-like).",
    )
    mixed_precision: Literal["none", "bf16"] = Field(
        "none",
        description="fsdp: bf16 compute with fp32 master weights and fp32 gradient reduction "
        "(`MixedPrecisionPolicy`). none: compute in model.dtype (float32 on CPU, the deterministic default).",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each decoder layer's activations in backward instead of keeping them."
    )
    publish_bucket_mb: int = Size(
        64,
        ge=1,
        le=16384,
        why="a bucket is held whole on rank 0 and in the weight store while it is published",
        description="Weights are gathered from the ranks and published to the rollout engines in "
        "buckets of about this size (MB), never as a second full copy on one rank.",
    )
    shadow_every: int = Size(
        1,
        ge=0,
        le=_STEPS_MAX,
        why="at most steps",
        description="Every N steps each rank copies its part of the trainer state (model, optimizer, "
        "RNG, step) into memory of another process (the job's weight store actor) in the background; "
        "a restarted group restores the newest complete copy instead of a disk snapshot when it is "
        "newer, so it replays at most N steps. Costs one copy of the trainer state in that process "
        "(two while a copy is arriving). 0: off.",
    )
    hot_recovery: bool = Field(
        True,
        description="ddp: a lost rank is replaced while the surviving ranks keep their processes and "
        "state: they re-form the process group with a new rank and send it their state, and the "
        "interrupted step is trained again (no restore, no replay); fsdp: the survivors keep their "
        "processes, and with the new rank every rank loads its part of the shadow copy and replays at "
        "most shadow_every steps; at world 1 a warm spare takes over from the shadow copy. false, or "
        "when it cannot apply (every rank lost, a survivor unaccounted for, no spare at world 1, fsdp "
        "without a shadow copy): the whole group restarts from the newest snapshot or shadow copy (the "
        "cold path). Events say which (`recovery`).",
    )
    spares: int = Size(
        1,
        ge=0,
        le=8,
        why="a spare holds a rank's CPUs and memory while it waits",
        description="Warm spare trainer processes (hot_recovery): started beside the ranks with torch "
        "imported and (ddp) the model and optimizer built, in no process group. A hot recovery "
        "promotes one in the lost rank's place (it receives the state from a survivor, or under fsdp and "
        "at world 1 loads the shadow copy and replays at most shadow_every steps: no process start) "
        "and a new spare is started in the background. Each spare reserves num_cpus / num_gpus like a "
        "rank and shows in membership as `trainer-spare`. 0: a new process is started at the recovery.",
    )
    lora: LoraSpec | None = Field(
        None,
        description="Train LoRA adapters instead of the whole model (needs the lora extra: pip "
        "install 'resilient-rl[lora]'; strategy ddp). Snapshots and shadow copies hold the adapters and "
        "their optimizer state only; the rollout engines get the merged weights.",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="gloo on CPU, nccl on GPU.")
    num_cpus: float = Size(1.0, gt=0, le=1024, why=_CPUS_WHY, description="CPUs Ray reserves for each rank.")
    num_gpus: float = Size(0.0, ge=0, le=64, why=_CPUS_WHY, description="GPUs Ray reserves for each rank.")


class DynamicSamplingSpec(_Section):
    """DAPO's dynamic sampling: a prompt whose samples all got the same reward has zero
    advantage and teaches nothing; drop such groups and generate more prompts until the
    batch holds ``prompts_per_step`` groups that do teach, or the extra budget is spent."""

    drop_zero_variance: bool = Field(
        True,
        description="Drop the groups whose rewards are all equal from the batch (the trainer "
        "keeps the first prompts_per_step groups with a spread, in journal order). False: "
        "no group is dropped and no extra prompt generated (dynamic sampling off).",
    )
    max_extra_prompts: int = Size(
        64,
        ge=0,
        le=1_048_576,
        why="extra prompts are generated, scored and journaled like the step's own",
        description="Most extra prompts one step may generate (in rounds, each sized by the "
        "step's keep rate so far) before it trains on the groups it has. Extra prompts come "
        "from a stream keyed by (seed, step, round), never from the step cursor, so the "
        "journal and a replay stay exact.",
    )


class OverlongSpec(_Section):
    """DAPO's handling of responses that hit ``rollout.sampling.max_tokens`` (truncated)."""

    filter: bool = Field(
        False, description="Truncated responses (max_tokens long) get advantage 0: they neither push nor pull "
        "(their reward still counts in their group's mean).",
    )  # fmt: skip
    buffer_tokens: int = Size(
        0,
        ge=0,
        le=1_048_576,
        why="at most rollout.sampling.max_tokens",
        description="Soft punishment: a response longer than max_tokens - buffer_tokens loses penalty x "
        "(its length past that) / buffer_tokens of its reward, linearly up to the whole penalty at "
        "max_tokens (0: off). Applied by the trainer; the journal keeps the scored rewards.",
    )
    penalty: float = Field(1.0, gt=0, le=100, description="The soft punishment at max_tokens.")


class AlgorithmSpec(_Section):
    """GRPO: group-normalised advantages, clipped ratio loss, optional KL to the reference."""

    name: Literal["grpo"] = Field("grpo", description="The algorithm.")
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO-style ratio clip.")
    kl_coef: float = Field(0.0, ge=0, le=100.0, description="Weight of the KL penalty to the initial policy (0 = off).")
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
    loss_aggregation: Literal["seq_mean", "token_mean", "seq_mean_token_sum"] = Field(
        "seq_mean",
        description="How token losses become the batch loss. seq_mean: each sequence's mean "
        "over its tokens, averaged over sequences (GRPO). token_mean: every token of the "
        "batch weighs the same, so long answers weigh more (DAPO). seq_mean_token_sum: each "
        "sequence's sum over its tokens, averaged over sequences (Dr. GRPO). Each is the "
        "same at any world size and micro-batch.",
    )
    dynamic_sampling: DynamicSamplingSpec | None = Field(
        None, description="Drop zero-variance groups and refill the batch (DAPO). Absent: off."
    )
    overlong: OverlongSpec | None = Field(
        None, description="Filter or softly punish responses cut at max_tokens (DAPO). Absent: off."
    )


class AsyncSpec(_Section):
    """Rollout/training overlap."""

    max_staleness: int = Size(
        0,
        ge=0,
        le=64,
        why="each step of staleness keeps a step's rollouts in flight and in the journal",
        description="Steps a trajectory's policy may lag the trained step (0 = on-policy).",
    )


class CheckpointSpec(_Section):
    """Async snapshots of the trainer."""

    every: int = Size(10, ge=1, le=_STEPS_MAX, why="at most steps", description="Snapshot every N committed steps.")
    keep: int = Size(
        2,
        ge=2,
        le=1000,
        why="each kept snapshot is a full copy of the trainer state on disk",
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

    hang_timeout: float = Size(
        60.0,
        gt=0,
        le=86400.0,
        why="a worker silent for a day is hung; a longer timeout only delays the fault",
        description="Seconds without progress, with work assigned, before a worker is declared hung.",
    )
    lease_ttl: int = Size(
        5,
        ge=2,
        le=60,
        why="a longer TTL only delays the detection of a lost worker",
        description="Membership lease TTL in seconds (etcd's minimum is ~2).",
    )
    probe_timeout: float = Size(
        5.0,
        ge=0.0,
        le=600.0,
        why="past hang_timeout the step deadline finds the rank anyway; a longer probe only delays it",
        description="Seconds a worker has to answer a liveness call, sent once its train step (a trainer "
        "rank; also a snapshot's staging) or its shard (a rollout worker) runs 4x longer than the recent "
        "median (at least 1 s). The call runs on the worker's control thread, so a live worker answers in "
        "milliseconds even in a deadlocked collective; one that does not is frozen (SIGSTOPped, a paused VM) "
        "and is replaced without waiting for hang_timeout. 0 turns the probe off.",
    )
    membership: Literal["worker", "node"] = Field(
        "worker",
        description="Whose lease a worker's membership key hangs on. worker: a lease of its own, kept alive "
        "by the worker. node: one lease per node, held by a node agent process that the node's workers "
        "share (started by the first; it writes their changes batched, one transaction per node, and "
        "deletes the key of a worker silent for lease_ttl or whose connection ends): keep-alives and "
        "puts fall with the workers per node, for large clusters.",
    )
    max_restarts: int = Size(
        5,
        ge=0,
        le=1000,
        why="a group restarted more often is in a crash loop",
        description="Restarts allowed per group within restart_window.",
    )
    restart_window: float = Size(
        600.0,
        gt=0,
        le=7 * 86400.0,
        why="a week; a longer window never forgets a fault",
        description="Window (seconds) of the restart budget.",
    )
    preempt_grace_s: float = Size(
        30.0,
        ge=1.0,
        le=600.0,
        why="spot and preemptible notices give 30-120 s; a drain longer than ten minutes is no notice",
        description="Seconds a preempted worker (SIGTERM, a node drain) has to hand its finished work over "
        "and leave; it exits by itself at the end. A preemption is not a fault: no restart is spent.",
    )


class EvalSpec(_Section):
    """Evaluation of the current policy on a held-out task at step boundaries, by the rollout
    workers between their shards (training goes on); never written to the training journal."""

    every: int = Size(10, ge=1, le=_STEPS_MAX, why="at most steps", description="Evaluate policy versions "
                      "that are a multiple of this (version v is the policy after step v - 1).")  # fmt: skip
    task: TaskSpec | None = Field(
        None, description="The held-out task (any kind; its reward scores the samples). Absent: the job's task."
    )
    prompts: int = Size(
        64,
        ge=1,
        le=65536,
        why="every evaluation generates every eval prompt",
        description="Evaluate the task's first N prompts (all of them if it has fewer).",
    )
    samples: int = Size(
        1,
        ge=1,
        le=64,
        why="each sample of each eval prompt is generated at each evaluation",
        description="Samples per prompt: the k of pass@k.",
    )
    temperature: float | None = Field(
        None, ge=0, le=10, description="Sampling temperature of the eval (0: greedy). Absent: rollout's."
    )
    pass_threshold: float = Field(
        1.0, gt=0, le=1, description="A sample passes when its reward is at least this (pass@k counts prompts "
        "with a passing sample among their k).",
    )  # fmt: skip


class MLflowSpec(_Section):
    """An MLflow tracking server or folder (one run per job)."""

    tracking_uri: str = Field(
        min_length=1,
        max_length=4096,
        description="http(s)://host:port of a tracking server, any MLflow store URI (sqlite:///...), or a "
        "folder (relative: under the job's workdir) that gets an SQLite store, mlflow.db.",
    )
    experiment: str = Field("rrl", min_length=1, max_length=256, description="The MLflow experiment's name.")


class WandbSpec(_Section):
    """A Weights & Biases run per job (its id is the job id)."""

    project: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$", description="W&B project.")
    entity: str | None = Field(None, min_length=1, max_length=128, description="W&B entity (team); absent: yours.")
    mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: run files under <workdir>/wandb (upload later with `wandb sync`); online: "
        "to the W&B server (needs WANDB_API_KEY or `wandb login` where the controller runs).",
    )


class LoggingSpec(_Section):
    """Experiment loggers: every committed step's metrics, each step once (through faults and
    leader changes: a new leader reads the log back and writes the committed steps it lacks)."""

    wandb: WandbSpec | None = Field(
        None,
        description="Log every committed step (and evaluation) to Weights & Biases: run id = job id, resumed "
        "by every leader (needs the wandb extra: pip install 'resilient-rl[wandb]').",
    )
    mlflow: MLflowSpec | None = Field(
        None,
        description="Log every committed step (and evaluation) to MLflow: one run per job, tagged rrl_job "
        "(needs the mlflow extra: pip install 'resilient-rl[mlflow]').",
    )

    tensorboard: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="A directory for TensorBoard event files (relative: under the job's workdir): reward, loss, "
        "tokens, step seconds, tokens/s, reward errors, staleness and the trainer's statistics per step. "
        "Needs the tensorboard extra (pip install 'resilient-rl[tensorboard]').",
    )


class JobSpec(_Section):
    """A whole RL post-training job."""

    name: str = Field(description="Job id: lower-case letters, digits and '-', at most 63 characters.")
    model: ModelSpec = Field(description="The policy model.")
    task: TaskSpec = Field(default_factory=TaskSpec, description="Prompts and reward.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Rollout workers.")
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, description="Trainer group.")
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec, description="RL algorithm.")
    async_: AsyncSpec = Field(default_factory=AsyncSpec, alias="async", description="Async pipelining.")
    steps: int = Size(
        100,
        ge=1,
        le=_STEPS_MAX,
        why="10 million steps is years of training at one step a second; the record of every step is kept",
        description="Training steps to run.",
    )
    prompts_per_step: int = Size(
        16,
        ge=1,
        le=65536,
        why="the controller plans each step's prompts and shards in memory; 65,536 prompts "
        "a step is past any published RL batch",
        description="Prompts per step (global batch = prompts x samples).",
    )
    seed: int = Size(
        0, ge=0, le=_SEED_MAX, why=_SEED_WHY, description="Seed of the prompt sampler, sampling and initialisation."
    )
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Snapshots.")
    logging: LoggingSpec = Field(default_factory=LoggingSpec, description="Experiment loggers.")
    eval: EvalSpec | None = Field(None, description="Evaluation on a held-out task (absent: none).")
    fault: FaultSpec = Field(default_factory=FaultSpec, description="Fault detection and restarts.")
    placement: Literal["separate", "colocated"] = Field(
        "separate",
        description="separate: every rollout worker and trainer rank is a process of its own. colocated: "
        "rollout worker i runs in the process of trainer rank i and the two take turns (a hybrid engine, "
        "for a small job on one machine or few accelerators): a process fewer per index, each new version "
        "loaded from the rank's own tensors, "
        "and a kill of that process is a loss of both, each recovered as usual. Needs rollout.engine hf. "
        "Spares stay processes of their own. The process reserves the larger of rollout.num_cpus and "
        "trainer.num_cpus (and of num_gpus).",
    )

    model_config = ConfigDict(**_CONFIG, populate_by_name=True)

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
        if global_batch > _BATCH_MAX:
            raise ValueError(
                f"the global batch (prompts_per_step x rollout.sampling.n = {global_batch}) is over {_BATCH_MAX:,} "
                "samples: every sample of a step is held by the trainer at once"
            )
        if global_batch < self.trainer.replicas:
            raise ValueError(
                f"the global batch (prompts_per_step x rollout.sampling.n = {global_batch}) is smaller than "
                f"trainer.replicas ({self.trainer.replicas}): each rank needs a sample to train on"
            )
        t = self.trainer
        if t.strategy == "fsdp" and self.checkpoint.backend != "dcp":
            raise ValueError("trainer.strategy fsdp needs checkpoint.backend dcp (sharded snapshots that reshard)")
        ol = self.algorithm.overlong
        if ol is not None and ol.buffer_tokens > self.rollout.sampling.max_tokens:
            raise ValueError(f"algorithm.overlong.buffer_tokens ({ol.buffer_tokens}) is over "
                             f"rollout.sampling.max_tokens ({self.rollout.sampling.max_tokens})")  # fmt: skip
        if t.lora is not None and t.strategy != "ddp":
            raise ValueError("trainer.lora needs trainer.strategy ddp (adapters are not sharded)")
        if self.placement == "colocated" and self.rollout.engine == "vllm":
            raise ValueError("placement colocated needs rollout.engine hf: vLLM's in-process engine makes torch's "
                             "default process group itself, the one the trainer ranks need")  # fmt: skip
        if t.mixed_precision != "none" and t.strategy != "fsdp":
            raise ValueError("trainer.mixed_precision needs trainer.strategy fsdp (its MixedPrecisionPolicy)")
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
            msg = err["msg"]
            if err["type"] == "int_type" and isinstance(err.get("input"), bool):
                msg += ", not a boolean (true/false)"
            lines.append(f"  {_loc(err['loc'])}: {msg}")
        raise SpecError("\n".join(lines)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last
    silently, so a second ``name:`` would win unseen). A ``<<`` merge may still override."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise _DuplicateKey(key, seen[key], line)
                seen[key] = line
            except TypeError:  # an unhashable key: the base loader reports it
                continue
        return super().construct_mapping(node, deep=deep)


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first: int, again: int) -> None:
        super().__init__(f"duplicate key {key!r} at line {again} (first given at line {first})")
        self.line = again


def load_spec(path: str | Path, overrides: dict[str, Any] | None = None) -> JobSpec:
    """Read and validate a YAML (or JSON) job file."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise SpecError(f"{p}: cannot read job file: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(
            f"{p}: not a text job file: byte 0x{raw[e.start]:02x} at offset {e.start} is not UTF-8 "
            "(a job file is YAML or JSON text)"
        ) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except _DuplicateKey as e:
        raise SpecError(f"{p}:{e.line}: {e}") from None
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
