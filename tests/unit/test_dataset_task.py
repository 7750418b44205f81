"""`task.kind: dataset` over real `datasets` files the test writes (no hub): every format, the
column mapping, splits, quarantined rows and the length filter, the errors that name the bad
field or file, and the math reward (final-answer extraction and equivalence)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pytest

from resilient_rl.algo.tasks import DatasetTask, TaskError, make_task
from resilient_rl.algo.tasks.math_answer import equivalent, extract_answer, math_reward
from resilient_rl.spec import TaskSpec, parse_spec

ROWS = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
     "solution": "She sold 48/2 = 24 in May.\n#### 72"},
    {"question": "What is 1/2 + 1/4?", "solution": "\\boxed{\\frac{3}{4}}"},
    {"question": "Name the number after 9.", "solution": 10},
]  # fmt: skip


def _task(path: Path, **kw: Any) -> Any:
    spec = TaskSpec(kind="dataset", path=str(path), columns={"prompt": "question", "answer": "solution"}, **kw)
    return make_task(spec, seed=0)


def _rows(rows: list[dict[str, Any]]) -> datasets.Dataset:
    return datasets.Dataset.from_list([{k: (None if v is None else str(v)) for k, v in r.items()} for r in rows])


@pytest.mark.parametrize("fmt", ["save_to_disk", "dict_folder", "parquet", "arrow", "jsonl", "csv"])
def test_every_format_gives_the_same_examples_in_file_order(tmp_path: Path, fmt: str) -> None:
    ds = _rows(ROWS)
    if fmt == "save_to_disk":
        path = tmp_path / "ds"
        ds.save_to_disk(str(path))
    elif fmt == "dict_folder":
        path = tmp_path / "dd"
        datasets.DatasetDict({"train": _rows(ROWS[:1]), "test": ds}).save_to_disk(str(path))
    elif fmt == "parquet":
        ds.to_parquet(str(path := tmp_path / "d.parquet"))
    elif fmt == "arrow":
        ds.save_to_disk(str(tmp_path / "a"))
        (path,) = (tmp_path / "a").glob("*.arrow")
    elif fmt == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    else:
        ds.to_csv(str(path := tmp_path / "d.csv"), index=False)
    task = _task(path, split="test") if fmt == "dict_folder" else _task(path)
    assert isinstance(task, DatasetTask) and len(task) == 3 and not task.quarantined
    ex = [task.example(i) for i in range(3)]
    assert [e.prompt for e in ex] == [r["question"] for r in ROWS]
    assert [e.answer for e in ex] == [str(r["solution"]) for r in ROWS]  # a numeric answer as text


def test_bad_rows_are_quarantined_with_their_row_number_and_the_length_filter_applies(tmp_path: Path) -> None:
    rows = [*ROWS, {"question": "", "solution": "1"}, {"question": "q?", "solution": None},
            {"question": "x" * 500, "solution": "2"}]  # fmt: skip
    _rows(rows).to_parquet(str(path := tmp_path / "d.parquet"))
    task = _task(path, max_prompt_chars=200)
    assert len(task) == 3
    assert [(q.line, q.reason) for q in task.quarantined] == [
        (4, "empty prompt"),
        (5, "missing answer (solution)"),
        (6, "prompt of 500 characters, over task.max_prompt_chars (200)"),
    ]
    assert all(q.file == str(path) for q in task.quarantined)


def test_errors_name_the_field_or_the_file(tmp_path: Path) -> None:
    _rows(ROWS).to_parquet(str(path := tmp_path / "d.parquet"))
    with pytest.raises(TaskError, match=r"task.columns.prompt: no column 'prompt' in .*d.parquet.*question"):
        make_task(TaskSpec(kind="dataset", path=str(path)), seed=0)
    with pytest.raises(TaskError, match=r"task.path: dataset not found: .*nope"):
        _task(tmp_path / "nope")
    (bad := tmp_path / "d.xlsx").write_text("x")
    with pytest.raises(TaskError, match=r"unknown dataset file type '.xlsx'"):
        _task(bad)
    (corrupt := tmp_path / "c.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(TaskError, match=r"task.path: cannot read dataset .*c.parquet"):
        _task(corrupt)
    (tmp_path / "plain").mkdir()
    with pytest.raises(TaskError, match=r"not a dataset saved with save_to_disk"):
        _task(tmp_path / "plain")
    datasets.DatasetDict({"train": _rows(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(TaskError, match=r"task.split: 'validation' is not a split of .* \(it has train\)"):
        _task(tmp_path / "dd", split="validation")
    _rows([{"question": "", "solution": "1"}]).to_parquet(str(empty := tmp_path / "e.parquet"))
    with pytest.raises(TaskError, match=r"has no valid rows \(1 bad rows, e.g. row 1: empty prompt\)"):
        _task(empty)


def test_the_spec_refuses_a_dataset_without_a_path_and_bounds_its_fields() -> None:
    base: dict[str, Any] = {"name": "j", "model": {"init": {}}}
    with pytest.raises(ValueError, match="task.path is required when kind is dataset"):
        parse_spec({**base, "task": {"kind": "dataset"}})
    with pytest.raises(ValueError, match="max_prompt_chars"):
        parse_spec({**base, "task": {"kind": "dataset", "path": "x", "max_prompt_chars": 10**9}})
    with pytest.raises(ValueError, match="columns"):
        parse_spec({**base, "task": {"kind": "dataset", "path": "x", "columns": {"prompt": ""}}})


def test_the_math_reward_scores_dataset_rows(tmp_path: Path) -> None:
    _rows(ROWS).to_parquet(str(path := tmp_path / "d.parquet"))
    task = _task(path, reward="math")
    e0, e1, e2 = (task.example(i) for i in range(3))
    assert task.reward(e0, "24 + 48 = 72").value == 1.0
    assert task.reward(e0, "The answer is \\boxed{72}.").value == 1.0
    assert task.reward(e0, "#### 71").value == 0.0
    assert task.reward(e1, "so \\boxed{0.75}").value == 1.0
    assert task.reward(e2, "ten").value == 0.0 and task.reward(e2, "it is 10").value == 1.0


@pytest.mark.parametrize(
    ("reference", "completion", "score"),
    [
        ("72", "so the answer is 72.", 1.0),
        ("1,000", "I get 1000", 1.0),
        ("1/2", "\\boxed{\\frac{1}{2}}", 1.0),
        ("x+1", "\\boxed{x + 1}", 1.0),  # a reference without box or #### is the whole text, not its last number
        ("x+1", "1", 0.0),
        ("$5", "The price is $5.00", 1.0),
        ("5", "no answer here", 0.0),
        ("5", "\\boxed{}", 0.0),
        ("", "", 0.0),
        # math-verify's symbolic equivalence, for what the rules above do not settle
        ("\\frac{\\sqrt{2}}{2}", "\\boxed{\\frac{1}{\\sqrt{2}}}", 1.0),
        ("\\frac{\\pi}{2}", "\\boxed{\\pi/2}", 1.0),
        ("\\{1, 2\\}", "\\boxed{\\{2, 1\\}}", 1.0),
        ("\\frac{\\pi}{3}", "\\boxed{\\pi/2}", 0.0),
        ("9^{9^{9}}", "\\boxed{9^{9^{9}}}", 1.0),  # equal as text; a power never reaches sympy
        ("9^{9^{9}}", "\\boxed{9^{729}}", 0.0),  # ... which would compute it for ever
    ],
)
def test_math_answers(reference: str, completion: str, score: float) -> None:
    assert math_reward(reference, completion) == score


def test_math_extraction_order_and_equivalence() -> None:
    assert extract_answer("first \\boxed{1} then \\boxed{a{b}c} and 7") == "a{b}c"  # the last box, braces balanced
    assert extract_answer("12 then\n#### 42\nextra 9") == "42"
    assert extract_answer("no number", last_number=True) is None
    assert equivalent("0.333", "1/3") is False and equivalent("0.3333333", "1/3") is True  # 1e-6 relative


TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")  # fmt: skip


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with a chat template in its tokenizer_config.json (the real Qwen2 tokenizer
    class; the template's text is characters of its vocabulary)."""
    from resilient_rl.algo.tasks import VOCAB_CHARS
    from resilient_rl.workers.model_init import make_tiny_model

    spec = parse_spec({"name": "chat", "model": {"init": {}}})
    assert spec.model.init is not None
    out = make_tiny_model(tmp_path_factory.mktemp("chat") / "model", spec.model.init, VOCAB_CHARS)
    cfg = json.loads((Path(out) / "tokenizer_config.json").read_text())
    (Path(out) / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return str(out)


def test_chat_messages_and_plain_prompts_go_through_the_tokenizers_chat_template(
    tmp_path: Path, chat_model: str
) -> None:
    rows = [
        {"messages": [{"role": "system", "content": "add"}, {"role": "user", "content": "1+2"}], "answer": "3"},
        {"messages": [{"role": "robot", "content": "x"}], "answer": "1"},  # quarantined: not a role
        {"messages": [], "answer": "1"},  # quarantined: no message
        {"messages": [{"role": "user", "content": "4+4"}], "answer": "8"},
    ]
    datasets.Dataset.from_list(rows).to_parquet(str(path := tmp_path / "chat.parquet"))
    spec = TaskSpec(kind="dataset", path=str(path), columns={"messages": "messages"}, max_prompt_chars=6)
    task = make_task(spec, seed=0, model_dir=chat_model)
    assert [task.example(i).prompt for i in range(len(task))] == ["s:add;u:1+2;a:", "u:4+4;a:"]
    assert [q.line for q in task.quarantined] == [2, 3] and "item 0" in task.quarantined[0].reason
    # the leader counts without rendering (no tokenizer there): the same rows, the same filter
    unrendered = make_task(spec, seed=0)
    assert len(unrendered) == 2 and [q.line for q in unrendered.quarantined] == [2, 3]
    plain = tmp_path / "plain.parquet"
    datasets.Dataset.from_list([{"prompt": "2+2", "answer": "4"}]).to_parquet(str(plain))
    task = make_task(TaskSpec(kind="dataset", path=str(plain), chat_template=True), seed=0, model_dir=chat_model)
    assert task.example(0).prompt == "u:2+2;a:"


def test_a_tokenizer_without_a_chat_template_is_named(tmp_path: Path) -> None:
    from resilient_rl.algo.tasks import VOCAB_CHARS
    from resilient_rl.workers.model_init import make_tiny_model

    spec = parse_spec({"name": "chat", "model": {"init": {}}})
    assert spec.model.init is not None
    model = make_tiny_model(tmp_path / "model", spec.model.init, VOCAB_CHARS)
    datasets.Dataset.from_list([{"prompt": "2+2", "answer": "4"}]).to_parquet(str(path := tmp_path / "p.parquet"))
    with pytest.raises(TaskError, match="has no chat template"):
        make_task(TaskSpec(kind="dataset", path=str(path), chat_template=True), seed=0, model_dir=str(model))
    with pytest.raises(ValueError, match="need kind dataset"):
        TaskSpec(kind="jsonl", path="x.jsonl", chat_template=True)
