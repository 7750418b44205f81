"""Hugging Face datasets on local disk (``task.kind: dataset``), read with the ``datasets`` library.

``task.path`` is a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``
(``task.split`` picks the split of a dict), or one file: ``.parquet``, ``.arrow`` (an Arrow
stream, as ``datasets`` caches), ``.jsonl`` / ``.json`` or ``.csv``. Nothing is fetched from
the hub. ``task.columns`` names the prompt and answer columns. Rows are examples in file order;
a row that cannot be one (a missing or non-text prompt, an empty prompt, a missing answer, a
prompt longer than ``task.max_prompt_chars``) is quarantined with its 1-based row number and
the reason (as the jsonl task does with line numbers): visible, never fatal, unless no row is
left (a :class:`TaskError` naming the file).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from resilient_rl.algo.tasks.base import QuarantinedRow, TaskError
from resilient_rl.algo.tasks.jsonl import RowTask
from resilient_rl.algo.tasks.rewards import RewardFn

log = logging.getLogger(__name__)

FILE_KINDS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json", ".csv": "csv"}


def _load(path: Path, split: str) -> Any:
    """The split of the dataset at ``path`` as a ``datasets.Dataset``; TaskError naming what is wrong."""
    try:
        import datasets
    except ImportError:  # a dependency of the project: only a broken install lacks it
        raise TaskError("task.kind dataset needs the `datasets` package (pip install datasets)") from None
    datasets.disable_progress_bars()
    if not path.exists():
        raise TaskError(f"task.path: dataset not found: {path}")
    try:
        if path.is_dir():
            if not any((path / f).exists() for f in ("dataset_info.json", "dataset_dict.json", "state.json")):
                raise TaskError(f"task.path: folder {path} is not a dataset saved with save_to_disk "
                                "(no dataset_info.json or dataset_dict.json in it)")  # fmt: skip
            ds = datasets.load_from_disk(str(path))
        else:
            kind = FILE_KINDS.get(path.suffix.lower())
            if kind is None:
                raise TaskError(f"task.path: {path}: unknown dataset file type {path.suffix!r} "
                                f"(one of {', '.join(sorted(FILE_KINDS))}, or a save_to_disk folder)")  # fmt: skip
            if kind == "arrow":
                ds = datasets.Dataset.from_file(str(path))
            else:
                ds = datasets.load_dataset(kind, data_files={split: str(path)})
    except TaskError:
        raise
    except Exception as e:  # pyarrow's, datasets' and the OS's errors alike: the file is unreadable
        detail = str(e).splitlines()[0][:300] if str(e) else ""
        raise TaskError(f"task.path: cannot read dataset {path}: {type(e).__name__}: {detail}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise TaskError(f"task.split: {split!r} is not a split of {path} (it has {', '.join(sorted(ds))})")
        ds = ds[split]
    return ds


def _text(value: Any, what: str) -> str:
    """A cell as text, or ValueError with the reason the row is refused."""
    if value is None:
        raise ValueError(f"missing {what}")
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"{what} must be text, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{what} is {value}")
    text = value if isinstance(value, str) else str(value)  # numeric answers (GSM8K-style) as text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid Unicode (lone surrogate)") from None
    return text


Render = Callable[[list[dict[str, str]]], str]  # chat messages -> the prompt text (a tokenizer's chat template)

_ROLES = frozenset({"system", "user", "assistant", "tool"})


def _messages(value: Any, column: str) -> list[dict[str, str]]:
    """A cell of chat messages (``[{role, content}, ...]``), or ValueError with the reason."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"messages ({column}) must be a non-empty list of {{role, content}}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"messages ({column}) item {i}: want {{role: {'|'.join(sorted(_ROLES))}, "
                             "content: text}")  # fmt: skip
        out.append({"role": m["role"], "content": _text(m["content"], f"messages ({column}) item {i} content")})
    return out


def chat_renderer(model_dir: str) -> Render:
    """The chat template of the tokenizer in ``model_dir``, with the assistant's generation prompt;
    a TaskError when the tokenizer has none."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if not getattr(tok, "chat_template", None):
        raise TaskError(f"task.columns.messages / task.chat_template: the tokenizer of {model_dir} has no chat "
                        "template (set one in its tokenizer_config.json)")  # fmt: skip

    def render(messages: list[dict[str, str]]) -> str:
        return str(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    return render


class DatasetTask(RowTask):
    """The valid rows of a local dataset (see module doc); ``index`` counts valid rows only.
    Scored as :class:`RowTask` says."""

    def __init__(self, path: str | Path, *, split: str = "train", prompt_column: str = "prompt",
                 answer_column: str = "answer", reward: str = "exact", reward_fn: RewardFn | None = None,
                 max_prompt_chars: int | None = None, messages_column: str | None = None,
                 chat_template: bool = False, render: Render | None = None) -> None:  # fmt: skip
        self.path = Path(path)
        super().__init__(f"dataset:{self.path.name}", reward, reward_fn)  # type: ignore[arg-type]
        ds = _load(self.path, split)
        source = ("messages", messages_column) if messages_column else ("prompt", prompt_column)
        for field, col in (source, ("answer", answer_column)):
            if col not in ds.column_names:
                raise TaskError(f"task.columns.{field}: no column {col!r} in {self.path} "
                                f"(its columns: {', '.join(ds.column_names)})")  # fmt: skip
        file = str(self.path)
        chat = messages_column is not None or chat_template
        for row, (p, a) in enumerate(zip(ds[source[1]], ds[answer_column], strict=True), start=1):
            try:
                answer = _text(a, f"answer ({answer_column})")
                if messages_column is not None:
                    msgs = _messages(p, messages_column)
                else:
                    prompt = _text(p, f"prompt ({prompt_column})")
                    msgs = [{"role": "user", "content": prompt}]
                size = sum(len(m["content"]) for m in msgs)  # the same with or without a renderer
                if not any(m["content"].strip() for m in msgs):
                    raise ValueError("empty prompt")
                if chat:  # rendered where the tokenizer is (the workers); counted alike where it is not
                    prompt = render(msgs) if render is not None else json.dumps(msgs)
                if max_prompt_chars is not None and size > max_prompt_chars:
                    raise ValueError(f"prompt of {size} characters, over task.max_prompt_chars "
                                     f"({max_prompt_chars})")  # fmt: skip
                pattern = re.compile(answer) if reward == "regex" else None
            except re.error as e:
                self.quarantined.append(QuarantinedRow(file, row, f"answer is not a valid regex: {e}"))
                continue
            except ValueError as e:
                self.quarantined.append(QuarantinedRow(file, row, str(e)))
                continue
            self._prompts.append(prompt)
            self._answers.append(answer)
            self._patterns.append(pattern)
        if self.quarantined:
            first = self.quarantined[0]
            log.warning("%s: quarantined %d of %d rows (first: row %d: %s)", file, len(self.quarantined),
                        len(ds), first.line, first.reason)  # fmt: skip
        if not self._prompts:
            detail = (f"{len(self.quarantined)} bad rows, e.g. row {self.quarantined[0].line}: "
                      f"{self.quarantined[0].reason}") if self.quarantined else "it has no rows"  # fmt: skip
            raise TaskError(f"task.path: dataset {file} (split {split!r}) has no valid rows ({detail})")
