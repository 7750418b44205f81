"""Tasks: deterministic prompt sets, reward values, jsonl quarantine and user reward functions."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from resilient_rl.algo.tasks import VOCAB_CHARS, Example, QuarantinedRow, Task, TaskError, make_task
from resilient_rl.algo.tasks.base import RewardResult
from resilient_rl.spec import TaskSpec


def _task(seed: int = 0, **kw: Any) -> Task:
    return make_task(TaskSpec(**kw), seed=seed)


def _examples(task: Task) -> list[Example]:
    return [task.example(i) for i in range(len(task))]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


# --- built-in prompt sets -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["copy", "reverse", "arith"])
def test_builtin_same_seed_same_examples(kind: str) -> None:
    a = _examples(_task(7, kind=kind, num_prompts=50))
    b = _examples(_task(7, kind=kind, num_prompts=50))
    assert a == b
    assert len(a) == 50 and [e.index for e in a] == list(range(50))


@pytest.mark.parametrize("kind", ["copy", "reverse", "arith"])
def test_builtin_different_seed_different_examples(kind: str) -> None:
    a = [e.prompt for e in _examples(_task(1, kind=kind, num_prompts=50))]
    b = [e.prompt for e in _examples(_task(2, kind=kind, num_prompts=50))]
    assert a != b


def test_builtin_examples_independent_of_num_prompts() -> None:
    small = _examples(_task(3, kind="copy", num_prompts=10))
    large = _examples(_task(3, kind="copy", num_prompts=100))
    assert large[:10] == small


@pytest.mark.parametrize("kind", ["copy", "reverse", "arith"])
def test_builtin_uses_only_vocab_chars(kind: str) -> None:
    vocab = set(VOCAB_CHARS)
    for ex in _examples(_task(0, kind=kind, min_len=1, max_len=12, num_prompts=300)):
        assert set(ex.prompt) <= vocab, ex.prompt
        assert set(ex.answer) <= vocab, ex.answer


def test_vocab_chars_contents() -> None:
    assert VOCAB_CHARS == "0123456789abcdefghijklmnopqrstuvwxyz +-=:?.,"
    assert len(set(VOCAB_CHARS)) == len(VOCAB_CHARS)


def test_copy_and_reverse_formats_and_lengths() -> None:
    for ex in _examples(_task(0, kind="copy", min_len=2, max_len=4, num_prompts=200)):
        assert ex.prompt == f"copy:{ex.answer}="
        assert ex.answer.isdigit() and 2 <= len(ex.answer) <= 4
    lengths = set()
    for ex in _examples(_task(0, kind="reverse", min_len=2, max_len=4, num_prompts=200)):
        digits = ex.prompt.removeprefix("rev:").removesuffix("=")
        assert ex.prompt == f"rev:{digits}=" and ex.answer == digits[::-1]
        lengths.add(len(digits))
    assert lengths == {2, 3, 4}  # every length in [min_len, max_len] is drawn


def test_arith_format_and_operand_lengths() -> None:
    for ex in _examples(_task(0, kind="arith", min_len=2, max_len=3, num_prompts=200)):
        lhs = ex.prompt.removesuffix("=")
        a, b = lhs.split("+")
        assert 2 <= len(a) <= 3 and 2 <= len(b) <= 3 and a[0] != "0" and b[0] != "0"
        assert ex.answer == str(int(a) + int(b))


def test_arith_large_operands_are_exact() -> None:
    ex = _task(0, kind="arith", min_len=40, max_len=40, num_prompts=1).example(0)
    a, b = ex.prompt.removesuffix("=").split("+")
    assert len(a) == 40 and ex.answer == str(int(a) + int(b))


def test_example_index_out_of_range() -> None:
    task = _task(kind="copy", num_prompts=5)
    with pytest.raises(IndexError):
        task.example(5)
    with pytest.raises(IndexError):
        task.example(-1)


# --- rewards ----------------------------------------------------------------------------------------------------


def test_copy_reward_values() -> None:
    task = _task(kind="copy")
    ex = Example(index=0, prompt="copy:1234=", answer="1234")
    assert task.reward(ex, "1234").value == 1.0
    assert task.reward(ex, "1234 \n").value == 1.0  # trailing whitespace is free
    assert task.reward(ex, " 1234").value == 0.0  # leading whitespace shifts every position
    assert task.reward(ex, "1299").value == 0.5
    assert task.reward(ex, "12").value == 0.5  # missing characters cost
    assert task.reward(ex, "12340000").value == 0.5  # extra characters cost
    assert task.reward(ex, "9999").value == 0.0
    assert task.reward(ex, "").value == 0.0


def test_reverse_reward_is_dense() -> None:
    task = _task(kind="reverse")
    ex = task.example(0)
    assert task.reward(ex, ex.answer).value == 1.0
    wrong_last = ex.answer[:-1] + ("0" if ex.answer[-1] != "0" else "1")
    assert task.reward(ex, wrong_last).value == pytest.approx((len(ex.answer) - 1) / len(ex.answer))


def test_arith_exact_reward() -> None:
    task = _task(kind="arith")
    ex = Example(index=0, prompt="12+30=", answer="42")
    assert task.reward(ex, "42").value == 1.0
    assert task.reward(ex, "42\n").value == 1.0
    assert task.reward(ex, "43").value == 0.0
    assert task.reward(ex, "420").value == 0.0


def test_arith_partial_reward() -> None:
    task = _task(kind="arith", reward="partial")
    ex = Example(index=0, prompt="100+23=", answer="123")
    assert task.reward(ex, "123").value == 1.0
    assert task.reward(ex, "124").value == pytest.approx(2 / 3)
    assert task.reward(ex, "1234").value == pytest.approx(3 / 4)
    assert task.reward(ex, "999").value == 0.0


@pytest.mark.parametrize(("kind", "reward"), [("copy", "regex"), ("reverse", "function"), ("arith", "regex")])
def test_unsupported_reward_for_builtin_kind(kind: str, reward: str) -> None:
    with pytest.raises(TaskError, match="task.reward: .* is not supported for kind"):
        _task(kind=kind, reward=reward, reward_fn="tests.unit.reward_fns:length_ratio")


# --- jsonl ------------------------------------------------------------------------------------------------------


def test_jsonl_loads_rows_in_order_and_ignores_blank_lines(tmp_path: Path) -> None:
    f = _write(tmp_path / "d.jsonl", ['{"prompt": "a?", "answer": "b"}', "", "   ", '{"prompt": "c?", "answer": "d"}'])
    task = _task(kind="jsonl", path=str(f), num_prompts=1)  # num_prompts does not truncate jsonl
    assert [(e.index, e.prompt, e.answer) for e in _examples(task)] == [(0, "a?", "b"), (1, "c?", "d")]
    assert task.quarantined == []


def test_jsonl_bad_rows_quarantined(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lines = [
        '{"prompt": "ok1", "answer": "x"}',  # 1
        "{not json",  # 2
        "",  # 3 blank: ignored, not quarantined
        '{"answer": "x"}',  # 4
        '{"prompt": "p", "answer": 5}',  # 5
        '{"prompt": "", "answer": "x"}',  # 6
        '["prompt", "answer"]',  # 7
        '{"prompt": "ok2", "answer": "y", "extra": 1}',  # 8: extra fields are fine
    ]
    f = _write(tmp_path / "d.jsonl", lines)
    with caplog.at_level(logging.WARNING):
        task = _task(kind="jsonl", path=str(f))
    assert [e.prompt for e in _examples(task)] == ["ok1", "ok2"]
    assert [(q.file, q.line) for q in task.quarantined] == [(str(f), n) for n in (2, 4, 5, 6, 7)]
    reasons = [q.reason for q in task.quarantined]
    assert reasons[0].startswith("invalid JSON")
    assert reasons[1] == "missing field 'prompt'"
    assert reasons[2] == "field 'answer' must be a string, got int"
    assert reasons[3] == "empty prompt"
    assert reasons[4].startswith("not a JSON object")
    assert all(isinstance(q, QuarantinedRow) for q in task.quarantined)
    assert "quarantined 5 of 7 rows" in caplog.text and str(f) in caplog.text


def test_jsonl_invalid_utf8_line_quarantined(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"prompt": "\xff", "answer": "x"}\n{"prompt": "p", "answer": "a"}\n')
    task = _task(kind="jsonl", path=str(f))
    assert len(task) == 1 and task.quarantined[0].line == 1 and "UTF-8" in task.quarantined[0].reason


def test_jsonl_missing_file_names_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "data.jsonl"
    with pytest.raises(TaskError, match="not found") as e:
        _task(kind="jsonl", path=str(missing))
    assert str(missing) in str(e.value)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("lines", [[], ["", "{bad", '{"prompt": 1, "answer": "x"}']])
def test_jsonl_no_valid_rows_is_an_error(tmp_path: Path, lines: list[str]) -> None:
    f = _write(tmp_path / "empty.jsonl", lines)
    with pytest.raises(TaskError, match="no valid rows") as e:
        _task(kind="jsonl", path=str(f))
    assert str(f) in str(e.value)


def test_jsonl_exact_reward_strips_both(tmp_path: Path) -> None:
    f = _write(tmp_path / "d.jsonl", [json.dumps({"prompt": "q", "answer": " yes "})])
    task = _task(kind="jsonl", path=str(f))
    ex = task.example(0)
    assert task.reward(ex, "yes").value == 1.0
    assert task.reward(ex, "  yes\n").value == 1.0
    assert task.reward(ex, "yes!").value == 0.0


def test_jsonl_regex_reward(tmp_path: Path) -> None:
    rows = [{"prompt": "num?", "answer": r"\d+"}, {"prompt": "bad", "answer": "(unclosed"}]
    f = _write(tmp_path / "d.jsonl", [json.dumps(r) for r in rows])
    task = _task(kind="jsonl", path=str(f), reward="regex")
    assert len(task) == 1
    assert task.quarantined[0].line == 2 and "regex" in task.quarantined[0].reason
    ex = task.example(0)
    assert task.reward(ex, "123").value == 1.0
    assert task.reward(ex, " 123 \n").value == 1.0  # stripped before matching
    assert task.reward(ex, "123a").value == 0.0  # fullmatch, not search
    assert task.reward(ex, "").value == 0.0


def _fn_task(tmp_path: Path, name: str) -> Task:
    f = _write(tmp_path / "d.jsonl", [json.dumps({"prompt": "p", "answer": "abcd"})])
    return _task(kind="jsonl", path=str(f), reward="function", reward_fn=f"tests.unit.reward_fns:{name}")


def test_function_reward_in_range_is_used_out_of_range_is_an_error(tmp_path: Path) -> None:
    task = _fn_task(tmp_path, "length_ratio")
    ex = task.example(0)
    assert task.reward(ex, "ab") == RewardResult(0.5)
    over = task.reward(ex, "abcdefgh")  # 2.0: a bug in the function, not a high score
    assert over.value == 0.0 and over.error == "ValueError: reward function returned 2.0, outside [0, 1]"
    under = _fn_task(tmp_path, "negative").reward(ex, "x")
    assert under.value == 0.0 and under.error is not None and "-3.0, outside [0, 1]" in under.error


def test_function_reward_raising_is_contained(tmp_path: Path) -> None:
    task = _fn_task(tmp_path, "always_raises")
    result = task.reward(task.example(0), "zz")
    assert result.value == 0.0
    assert result.error == "RuntimeError: boom on 'zz'"


@pytest.mark.parametrize(
    ("name", "err"),
    [("returns_string", "TypeError"), ("returns_nan", "ValueError"), ("returns_inf", "ValueError"),
     ("returns_minus_inf", "ValueError")],
)  # fmt: skip
def test_function_reward_bad_return_is_contained(tmp_path: Path, name: str, err: str) -> None:
    task = _fn_task(tmp_path, name)
    result = task.reward(task.example(0), "x")
    assert result.value == 0.0 and result.error is not None and result.error.startswith(f"{err}: ")


@pytest.mark.parametrize(
    ("ref", "needle"),
    [
        ("tests.unit.no_such_module:f", "cannot import module 'tests.unit.no_such_module'"),
        ("tests.unit.reward_fns:missing", "has no attribute 'missing'"),
        ("tests.unit.reward_fns:NOT_CALLABLE", "not callable"),
    ],
)
def test_function_reward_import_errors(tmp_path: Path, ref: str, needle: str) -> None:
    f = _write(tmp_path / "d.jsonl", [json.dumps({"prompt": "p", "answer": "a"})])
    with pytest.raises(TaskError, match="task.reward_fn") as e:
        _task(kind="jsonl", path=str(f), reward="function", reward_fn=ref)
    assert needle in str(e.value)
