"""Fuzzing jsonl dataset rows: any bytes give valid rows or quarantined ones (file:line), never a crash.

The only exception a dataset may raise is :class:`TaskError` (no valid row at all, or
an unreadable file), and its message names ``task.path``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient_rl.algo.tasks.base import TaskError
from resilient_rl.algo.tasks.jsonl import JsonlTask

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_leaf = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
json_value = st.recursive(
    json_leaf,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
    max_leaves=8,
)
good_row = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=20), "answer": st.text(max_size=10)},
    optional={"extra": json_value},
)
near_row = st.dictionaries(
    st.sampled_from(["prompt", "answer", "Prompt", ""]) | st.text(max_size=6), json_value, max_size=3
)
hostile = st.sampled_from(
    [
        b"[" * 5_000,  # deeper than the JSON parser's recursion limit
        b'{"prompt": "p", "answer": ' + b"1" * 5000 + b"}",  # over Python's int digit limit
        b'{"prompt": "\\ud800", "answer": "a"}',  # a lone surrogate escape
        b'{"prompt": "p", "answer": "(a"}',  # an invalid regex
        b'{"prompt": "p", "answer": "a", "prompt": 3}',  # duplicate key: the last one wins
        b"\xff\xfe\x00",  # not UTF-8
        b'"just a string"',
        b"NaN",
        b"\x00",
    ]
)


def _line(draw_obj: object) -> bytes:
    return json.dumps(draw_obj, ensure_ascii=False, allow_nan=True).encode("utf-8", "surrogatepass")


line = (
    good_row.map(_line)
    | near_row.map(_line)
    | json_value.map(_line)
    | st.binary(max_size=40)
    | st.text(max_size=30).map(lambda t: t.encode("utf-8", "surrogatepass"))
    | hostile
)


def _check(data: bytes, reward: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "data.jsonl"
        path.write_bytes(data)
        nonblank = [i for i, raw in enumerate(data.splitlines(), start=1) if raw.strip()]
        try:
            task = JsonlTask(path, reward=reward)  # type: ignore[arg-type]
        except TaskError as e:
            assert "task.path" in str(e) and str(path) in str(e)
            return
        assert len(task) + len(task.quarantined) == len(nonblank)
        for q in task.quarantined:
            assert q.file == str(path) and q.line in nonblank and q.reason
        for i in range(len(task)):
            ex = task.example(i)
            assert isinstance(ex.prompt, str) and ex.prompt
            ex.prompt.encode("utf-8")  # every kept row can be tokenised
            r = task.reward(ex, ex.answer if reward == "exact" else "x")
            assert 0.0 <= r.value <= 1.0


@FUZZ
@given(st.lists(line, max_size=8), st.sampled_from(["\n", "\r\n"]), st.sampled_from(["exact", "regex"]))
def test_any_lines_give_rows_or_quarantined_rows(lines: list[bytes], sep: str, reward: str) -> None:
    _check(sep.encode().join(lines), reward)


@FUZZ
@given(st.binary(max_size=300), st.sampled_from(["exact", "regex"]))
def test_any_bytes_give_rows_or_quarantined_rows(data: bytes, reward: str) -> None:
    _check(data, reward)


def test_hostile_rows_are_quarantined_with_their_line(tmp_path: Path) -> None:
    rows = [
        b'\xef\xbb\xbf{"prompt": "bom", "answer": "1"}',  # BOM before the first row: kept
        b"[" * 5_000,
        b'{"prompt": "p", "answer": ' + b"1" * 5000 + b"}",
        b'{"prompt": "\\ud800", "answer": "a"}',
        b"",
        b'{"prompt": "ok", "answer": "2"}',
    ]
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(rows))
    task = JsonlTask(path)
    assert len(task) == 2
    got = {q.line: q.reason for q in task.quarantined}
    assert sorted(got) == [2, 3, 4]
    assert "invalid JSON" in got[2] and "invalid JSON" in got[3] and "surrogate" in got[4]
