"""Job spec validation: defaults that work, refusals that name the field and say why."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.keys import InvalidId, check_job_id
from resilient_rl.spec import JobSpec, SpecError, load_spec, parse_spec
from tests.conftest import REPO

MINIMAL = {"name": "j", "model": {"init": {}}}


def test_minimal_spec_gets_working_defaults() -> None:
    spec = parse_spec(MINIMAL)
    assert spec.rollout.sampling.n >= 2 and spec.checkpoint.keep >= 2
    assert spec.async_.max_staleness == 0
    assert spec.model.init is not None and spec.model.init.hidden_size // spec.model.init.num_heads in (64, 128)


def test_examples_validate() -> None:
    for f in sorted((REPO / "examples").glob("*.yaml")):
        assert isinstance(load_spec(f), JobSpec)


@pytest.mark.parametrize(
    ("patch", "field", "why"),
    [
        ({"rollout": {"replicas": 0}}, "rollout.replicas", "greater than or equal to 1"),
        ({"trainer": {"lr": "fast"}}, "trainer.lr", "valid number"),
        ({"checkpoint": {"keep": 1}}, "checkpoint.keep", "greater than or equal to 2"),
        ({"model": {"init": {"hidden_size": 96, "num_heads": 6}}}, "model.init", "head dim"),
        ({"model": {}}, "model", "exactly one of model.path or model.init"),
        ({"task": {"kind": "jsonl"}}, "task", "task.path is required"),
        ({"task": {"kind": "poetry"}}, "task.kind", "copy"),
        ({"rollout": {"sampling": {"n": 1}}}, "rollout.sampling.n", "greater than or equal to 2"),
        ({"name": "Bad/Name"}, "name", "invalid job id"),
        ({"stepz": 3}, "stepz", "Extra inputs are not permitted"),
        ({"trainer": {"replicas": 3}}, "(top level)", "split evenly"),
    ],
)
def test_bad_fields_are_named(patch: dict, field: str, why: str) -> None:
    data = {**MINIMAL, **patch}
    with pytest.raises(SpecError) as exc:
        parse_spec(data, "job.yaml")
    msg = str(exc.value)
    assert msg.startswith("job.yaml: invalid job spec")
    assert f"  {field}:" in msg and why in msg, msg


def test_load_spec_reports_yaml_position_and_missing_file(tmp_path: Path) -> None:
    f = tmp_path / "j.yaml"
    f.write_text("name: x\nmodel:\n  init: {hidden_size: [\n")
    with pytest.raises(SpecError, match=rf"{f}:\d+:\d+: not valid YAML"):
        load_spec(f)
    with pytest.raises(SpecError, match="cannot read job file"):
        load_spec(tmp_path / "nope.yaml")
    f.write_text("- a list\n")
    with pytest.raises(SpecError, match="must be a mapping"):
        load_spec(f)


def test_spec_roundtrip_and_digest() -> None:
    spec = parse_spec({**MINIMAL, "async": {"max_staleness": 2}})
    again = parse_spec(__import__("json").loads(spec.to_json()))
    assert again == spec and again.digest() == spec.digest()
    assert again.async_.max_staleness == 2
    assert parse_spec({**MINIMAL, "seed": 1}).digest() != spec.digest()


@pytest.mark.parametrize("bad", ["", "-a", "a-", "A", "a/b", "..", "a" * 64, "a_b", "a.b"])
def test_job_ids_refused(bad: str) -> None:
    with pytest.raises(InvalidId):
        check_job_id(bad)


def test_job_ids_accepted() -> None:
    for ok in ["a", "copy-tiny", "j1", "a" * 63]:
        assert check_job_id(ok) == ok
