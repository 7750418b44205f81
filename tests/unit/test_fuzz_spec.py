"""Fuzzing the job spec: any mapping or YAML text either validates or raises SpecError
naming a field; never another exception. A spec that validates round-trips through
its JSON form (what the controller stores) unchanged.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from resilient_rl.spec import JobSpec, SpecError, _loc, load_spec, parse_spec

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _fields(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every field path of the spec, sections included (by their YAML names)."""
    out = []
    for name, f in model.model_fields.items():
        path = (*prefix, f.alias or name)
        out.append(path)
        ann = f.annotation
        for sub in getattr(ann, "__args__", (ann,)):
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                out.extend(_fields(sub, path))
    return out


PATHS = _fields(JobSpec)
TOP = {p[0] for p in PATHS}
VALID = {"name": "fz", "model": {"init": {}}, "steps": 3}

leaf = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-3, 130)
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(
        ["copy", "jsonl", "regex", "function", "m:f", "hf", "vllm", "dcp", "grpo", "adamw", "/tmp/x", "../../etc",
         "~/ck", "rel/dir", "a\x00b", "Bad/Name", "..", "x" * 70, "1e3", "inf", "nan", "-1", "0"]
    )
)  # fmt: skip
value = st.recursive(
    leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=6
)


@st.composite
def mutated_spec(draw: st.DrawFn) -> dict[str, Any]:
    """A valid spec with a few fields (known, unknown, sections) set to anything."""
    data: dict[str, Any] = json.loads(json.dumps(VALID))
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(PATHS) | st.lists(st.text(max_size=5), min_size=1, max_size=2).map(tuple))
        node = data
        for part in path[:-1]:
            nxt = node.get(part)
            if not isinstance(nxt, dict):
                nxt = node[part] = {}
            node = nxt
        node[path[-1]] = draw(value)
    if draw(st.booleans()):
        data.pop(draw(st.sampled_from(sorted(data))), None)
    return data


def _names_a_field(msg: str, data: Any, source: str) -> None:
    lines = msg.splitlines()
    assert lines[0].startswith(source), msg
    if not isinstance(data, dict):
        assert "must be a mapping" in lines[0], msg
        return
    assert lines[0] == f"{source}: invalid job spec" and len(lines) > 1, msg
    for ln in lines[1:]:
        assert ln.startswith("  ") and ": " in ln, msg
        field = ln[2:]
        names = {"(top level)"} | TOP | {_loc((k,)) for k in data}
        assert any(field.startswith(n + sep) for n in names for sep in (":", ".")), msg


def _check(data: Any) -> None:
    try:
        spec = parse_spec(data, "fuzz.yaml")
    except SpecError as e:
        _names_a_field(str(e), data, "fuzz.yaml")
        return
    # what the controller stores and workers read back is the same spec
    assert parse_spec(json.loads(spec.to_json())) == spec
    if spec.checkpoint.dir is not None:
        d = spec.checkpoint.dir
        assert os.path.isabs(d) and os.path.normpath(d) == d and ".." not in Path(d).parts


@FUZZ
@given(mutated_spec())
def test_mutated_specs_validate_or_name_the_field(data: dict[str, Any]) -> None:
    _check(data)


@FUZZ
@given(value | st.dictionaries(st.sampled_from(sorted(TOP)) | st.text(max_size=6), value, max_size=5))
def test_any_value_validates_or_names_the_field(data: Any) -> None:
    _check(data)


yaml_text = (
    st.text(max_size=80)
    | mutated_spec().map(lambda d: yaml.safe_dump(d, allow_unicode=True))
    | st.sampled_from(
        ["name: x\nmodel: {init: {}}\nsteps: 2001-02-30\n", "[" * 700, "a: !!python/name:os.system\n",
         "name: x\nmodel: &a {init: {}}\ntask: *a\n", "? [1, 2]\n: 3\n", "name: !!binary aGk=\n", "\x00", "---\n---\n"]
    )
)  # fmt: skip


@settings(FUZZ, max_examples=120)
@given(yaml_text)
def test_any_yaml_text_validates_or_names_the_field(text: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "job.yaml"
        f.write_text(text, encoding="utf-8", errors="surrogatepass")
        try:
            spec = load_spec(f)
        except SpecError as e:
            msg = str(e)
            assert msg.startswith(str(f)), msg
            if "invalid job spec" in msg:
                assert len(msg.splitlines()) > 1, msg
            return
        assert isinstance(spec, JobSpec)
