"""Prompt sets and verifiable rewards: the ``task`` section of a job spec made concrete.

``make_task(spec, seed)`` is the only constructor callers need; it validates the combination of ``kind`` and
``reward``, loads the dataset and imports the reward function up front, so every configuration error surfaces
as a :class:`TaskError` at submit / start time rather than in the middle of a rollout. No torch import.
"""

from __future__ import annotations

import logging

from resilient_rl.algo.tasks.base import VOCAB_CHARS, Example, QuarantinedRow, RewardResult, Task, TaskError
from resilient_rl.algo.tasks.builtin import ArithTask, CopyTask, ReverseTask
from resilient_rl.algo.tasks.dataset import DatasetTask, chat_renderer
from resilient_rl.algo.tasks.jsonl import JsonlTask
from resilient_rl.algo.tasks.reward_server import ServerScorer
from resilient_rl.algo.tasks.rewards import load_reward_fn
from resilient_rl.spec import TaskSpec

__all__ = [
    "VOCAB_CHARS",
    "ArithTask",
    "CopyTask",
    "DatasetTask",
    "Example",
    "JsonlTask",
    "QuarantinedRow",
    "ReverseTask",
    "RewardResult",
    "Task",
    "TaskError",
    "make_task",
]

log = logging.getLogger(__name__)

# Which ``task.reward`` values each kind understands. copy/reverse are always scored with dense per-character
# credit; "exact" (the spec default) and "partial" both mean that, so a default spec works unchanged.
_REWARDS: dict[str, tuple[str, ...]] = {
    "copy": ("exact", "partial"),
    "reverse": ("exact", "partial"),
    "arith": ("exact", "partial"),
    "jsonl": ("exact", "regex", "math", "function", "server"),
    "dataset": ("exact", "regex", "math", "function", "server"),
}


def make_task(spec: TaskSpec, seed: int, model_dir: str | None = None) -> Task:
    """Build the task described by ``spec``; ``seed`` is the job seed (it fixes built-in prompt sets).
    ``model_dir``: where the tokenizer is, for a dataset whose prompts go through its chat
    template (``task.columns.messages`` / ``task.chat_template``); without it they are counted
    and filtered alike but not rendered (the leader's size count).

    Raises :class:`TaskError` (a ``ValueError``) naming the file or spec field when the reward does not apply
    to the kind, the jsonl file is missing / unreadable / has no valid row, or ``reward_fn`` cannot be imported.
    """
    allowed = _REWARDS[spec.kind]
    if spec.reward not in allowed:
        raise TaskError(
            f"task.reward: {spec.reward!r} is not supported for kind {spec.kind!r} (choose one of {', '.join(allowed)})"
        )
    if spec.reward_fn and spec.reward != "function":
        log.warning("task.reward_fn %r is ignored because task.reward is %r", spec.reward_fn, spec.reward)
    sizes = {"seed": seed, "min_len": spec.min_len, "max_len": spec.max_len, "num_prompts": spec.num_prompts}
    if spec.kind == "copy":
        return CopyTask(**sizes)
    if spec.kind == "reverse":
        return ReverseTask(**sizes)
    if spec.kind == "arith":
        return ArithTask(**sizes, partial=spec.reward == "partial")
    if not spec.path:  # the spec validator already refuses this; kept for TaskSpecs built with model_construct
        raise TaskError(f"task.path: required when kind is {spec.kind!r}")
    # Import the reward function before reading a possibly large file: a typo in reward_fn should fail fast.
    fn = load_reward_fn(spec.reward_fn) if spec.reward == "function" else None
    reward = spec.reward
    if reward == "server":  # in-process, one sample a call, as a reward function (rollout workers use the pool)
        assert spec.reward_server is not None  # the spec's validator
        rs, reward = spec.reward_server, "function"
        fn = ServerScorer(rs.url, rs.timeout_s, rs.retries).one
    if spec.kind == "dataset":
        chat = spec.columns.messages is not None or spec.chat_template
        return DatasetTask(spec.path, split=spec.split, prompt_column=spec.columns.prompt,
                           answer_column=spec.columns.answer, reward=reward, reward_fn=fn,
                           max_prompt_chars=spec.max_prompt_chars, messages_column=spec.columns.messages,
                           chat_template=spec.chat_template,
                           render=chat_renderer(model_dir) if chat and model_dir else None)  # fmt: skip
    return JsonlTask(spec.path, reward=reward, reward_fn=fn)  # type: ignore[arg-type]
