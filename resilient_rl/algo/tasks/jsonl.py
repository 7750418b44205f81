"""User datasets: one JSON object ``{"prompt": str, "answer": str}`` per line.

Bad rows are quarantined (skipped and recorded with file, 1-based line and reason) rather than failing the job:
one malformed line in a million-row file should not stop training, but it must be visible. A file with no valid
row at all is a configuration error (:class:`TaskError`).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Literal

from resilient_rl.algo.tasks.base import Example, QuarantinedRow, RewardResult, Task, TaskError
from resilient_rl.algo.tasks.math_answer import math_reward
from resilient_rl.algo.tasks.rewards import RewardFn, call_reward_fn, exact_match, regex_match

log = logging.getLogger(__name__)

JsonlReward = Literal["exact", "regex", "math", "function"]


def _check_row(obj: object, *, compile_regex: bool) -> tuple[str, str, re.Pattern[str] | None] | str:
    """Validate one decoded row: ``(prompt, answer, pattern)`` or the reason it is refused."""
    if not isinstance(obj, dict):
        return f"not a JSON object (got {type(obj).__name__})"
    for key in ("prompt", "answer"):
        if key not in obj:
            return f"missing field {key!r}"
        if not isinstance(obj[key], str):
            return f"field {key!r} must be a string, got {type(obj[key]).__name__}"
    prompt, answer = obj["prompt"], obj["answer"]
    if not prompt:
        return "empty prompt"
    for key, text in (("prompt", prompt), ("answer", answer)):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate from a "\ud800" escape: no tokenizer can take it
            return f"field {key!r} is not valid Unicode (lone surrogate escape)"
    pattern = None
    if compile_regex:
        # Compile once at load time: a bad pattern is a bad row, found before training rather than mid-step.
        try:
            pattern = re.compile(answer)
        except re.error as e:
            return f"answer is not a valid regex: {e}"
    return prompt, answer, pattern


class RowTask(Task):
    """A task whose examples are rows of prompt and answer a subclass loads (a jsonl file, a
    dataset), with the scorers such rows take: ``exact`` (both sides stripped), ``regex`` (the
    row's answer, compiled at load time, must ``fullmatch`` the stripped completion), ``math``
    (final-answer equivalence, see ``math_answer``) or ``function`` (``reward_fn(prompt,
    completion, answer)``, see :func:`call_reward_fn`)."""

    def __init__(self, name: str, reward: JsonlReward, reward_fn: RewardFn | None) -> None:
        if reward == "function" and reward_fn is None:
            raise TaskError("task.reward_fn: required when reward is 'function'")
        super().__init__(name)
        self.reward_kind: JsonlReward = reward
        self.reward_fn = reward_fn
        self._prompts: list[str] = []
        self._answers: list[str] = []
        self._patterns: list[re.Pattern[str] | None] = []

    def __len__(self) -> int:
        return len(self._prompts)

    def _make_example(self, index: int) -> Example:
        return Example(index=index, prompt=self._prompts[index], answer=self._answers[index])

    def reward(self, example: Example, completion: str) -> RewardResult:
        if self.reward_kind == "exact":
            return RewardResult(exact_match(example.answer, completion))
        if self.reward_kind == "math":
            return RewardResult(math_reward(example.answer, completion))
        if self.reward_kind == "regex":
            try:
                pattern = self._pattern_for(example)
            except re.error as e:  # only reachable for an Example not built by this task
                return RewardResult(0.0, error=f"{type(e).__name__}: invalid regex answer: {e}")
            return RewardResult(regex_match(pattern, completion))
        assert self.reward_fn is not None  # enforced in __init__
        return call_reward_fn(self.reward_fn, example.prompt, completion, example.answer)

    def _pattern_for(self, example: Example) -> re.Pattern[str]:
        """The pattern precompiled at load time for this row, or (for an Example not built by this task)
        ``re.compile(example.answer)``, which may raise ``re.error``."""
        idx = example.index
        if 0 <= idx < len(self._patterns) and self._answers[idx] == example.answer:
            cached = self._patterns[idx]
            if cached is not None:
                return cached
        return re.compile(example.answer)


class JsonlTask(RowTask):
    """Examples are the valid rows of a jsonl file, in file order (``index`` counts valid rows only)."""

    def __init__(self, path: str | Path, reward: JsonlReward = "exact", reward_fn: RewardFn | None = None) -> None:
        self.path = Path(path)
        super().__init__(f"jsonl:{self.path.name}", reward, reward_fn)
        self._load()

    def _load(self) -> None:
        file = str(self.path)
        try:
            # Binary read, decoded per line: an undecodable line is quarantined instead of failing the file.
            with self.path.open("rb") as f:
                raw_lines = f.read().splitlines()
        except FileNotFoundError:
            raise TaskError(f"task.path: jsonl file not found: {file}") from None
        except OSError as e:
            raise TaskError(f"task.path: cannot read jsonl file {file}: {e.strerror or e}") from None
        total = 0
        for lineno, raw in enumerate(raw_lines, start=1):
            if not raw.strip():
                continue  # blank lines (incl. a trailing newline) are formatting, not data
            total += 1
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # a UTF-8 byte order mark, as some editors write
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                self.quarantined.append(QuarantinedRow(file, lineno, f"not valid UTF-8: {e.reason}"))
                continue
            except json.JSONDecodeError as e:
                self.quarantined.append(QuarantinedRow(file, lineno, f"invalid JSON: {e.msg}"))
                continue
            except (ValueError, RecursionError) as e:  # a number over int's digit limit, absurd nesting
                self.quarantined.append(QuarantinedRow(file, lineno, f"invalid JSON: {str(e)[:200]}"))
                continue
            checked = _check_row(obj, compile_regex=self.reward_kind == "regex")
            if isinstance(checked, str):
                self.quarantined.append(QuarantinedRow(file, lineno, checked))
                continue
            prompt, answer, pattern = checked
            self._prompts.append(prompt)
            self._answers.append(answer)
            self._patterns.append(pattern)
        if self.quarantined:
            first = self.quarantined[0]
            log.warning(
                "%s: quarantined %d of %d rows (first: line %d: %s)",
                file,
                len(self.quarantined),
                total,
                first.line,
                first.reason,
            )
        if not self._prompts:
            if self.quarantined:
                first = self.quarantined[0]
                detail = f"{len(self.quarantined)} bad rows, e.g. line {first.line}: {first.reason}"
            else:
                detail = "the file is empty"
            raise TaskError(f"task.path: jsonl file {file} has no valid rows ({detail})")
