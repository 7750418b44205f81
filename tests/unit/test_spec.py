"""Job spec validation: defaults that work, refusals that name the field and say why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
        ({"trainer": {"replicas": 100}, "prompts_per_step": 4}, "(top level)", "each rank needs a sample"),
        ({"trainer": {"strategy": "fsdp"}, "checkpoint": {"backend": "torchsnapshot"}}, "(top level)", "dcp"),
        ({"trainer": {"mixed_precision": "bf16"}}, "(top level)", "needs trainer.strategy fsdp"),
        ({"trainer": {"publish_bucket_mb": 0}}, "trainer.publish_bucket_mb", "greater than or equal to 1"),
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


def _numeric_fields(model: type = JobSpec, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for name, f in model.model_fields.items():
        path = prefix + (f.alias or name)
        for sub in getattr(f.annotation, "__args__", (f.annotation,)):
            if isinstance(sub, type) and hasattr(sub, "model_fields"):
                out.extend(_numeric_fields(sub, path + "."))
            elif sub in (int, float):
                out.append((path, f))
    return out


def test_every_numeric_field_has_an_upper_bound_and_every_size_a_reason() -> None:
    fields = _numeric_fields()
    assert len(fields) > 30
    for path, f in fields:
        assert any(getattr(m, "le", None) is not None or getattr(m, "lt", None) is not None for m in f.metadata), path
        if int in getattr(f.annotation, "__args__", (f.annotation,)):
            assert isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("why"), path


@pytest.mark.parametrize(
    ("patch", "field", "why"),
    [
        ({"prompts_per_step": 99999999999999999999}, "prompts_per_step", "plans each step's prompts"),
        ({"steps": 99999999999999999999}, "steps", "years of training"),
        ({"rollout": {"sampling": {"n": 5000}}}, "rollout.sampling.n", "GRPO group"),
        ({"rollout": {"sampling": {"max_tokens": 10**9}}}, "rollout.sampling.max_tokens", "context"),
        ({"rollout": {"max_replicas": 5000}}, "rollout.max_replicas", "1,024 workers"),
        ({"trainer": {"replicas": 2048}}, "trainer.replicas", "1,024 workers"),
        ({"task": {"num_prompts": 10**12}}, "task.num_prompts", "in memory"),
        ({"seed": 2**40}, "seed", "32-bit"),
        ({"fault": {"hang_timeout": 1e12}}, "fault.hang_timeout", "hung"),
    ],
)
def test_sizes_above_their_bound_say_why(patch: dict, field: str, why: str) -> None:
    with pytest.raises(SpecError) as exc:
        parse_spec({**MINIMAL, **patch}, "job.yaml")
    line = next(x for x in str(exc.value).splitlines() if x.startswith(f"  {field}:"))
    assert "less than or equal to" in line and why in line, line


def test_global_batch_is_bounded() -> None:
    with pytest.raises(SpecError, match="global batch .* is over 1,048,576 samples"):
        parse_spec({**MINIMAL, "prompts_per_step": 65536, "rollout": {"sampling": {"n": 32}}})


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"steps": True}, "steps"),
        ({"prompts_per_step": False}, "prompts_per_step"),
        ({"rollout": {"replicas": True}}, "rollout.replicas"),
        ({"steps": "10"}, "steps"),
        ({"steps": 10.5}, "steps"),
        ({"trainer": {"lr": float("inf")}}, "trainer.lr"),
        ({"trainer": {"max_grad_norm": float("nan")}}, "trainer.max_grad_norm"),
    ],
)
def test_booleans_strings_and_non_finite_are_not_numbers(patch: dict, field: str) -> None:
    with pytest.raises(SpecError) as exc:
        parse_spec({**MINIMAL, **patch}, "job.yaml")
    assert f"  {field}:" in str(exc.value), str(exc.value)
    if isinstance(next(iter(patch.values())), bool):
        assert "not a boolean" in str(exc.value)


def test_duplicate_keys_are_refused_naming_the_key_and_both_lines(tmp_path: Path) -> None:
    f = tmp_path / "dup.yaml"
    f.write_text("name: first\nmodel: {init: {}}\nsteps: 3\nname: second\n")
    with pytest.raises(SpecError) as exc:
        load_spec(f)
    assert str(exc.value) == f"{f}:4: duplicate key 'name' at line 4 (first given at line 1)"
    f.write_text("name: a\nmodel: {init: {}}\nrollout:\n  replicas: 1\n  engine: hf\n  replicas: 2\n")
    with pytest.raises(SpecError, match=r"duplicate key 'replicas' at line 6 \(first given at line 4\)"):
        load_spec(f)
    f.write_text("name: a\nmodel: {init: {}, init: {}}\n")  # in one flow mapping, on one line
    with pytest.raises(SpecError, match="duplicate key 'init' at line 2"):
        load_spec(f)
    # a YAML merge may still override what it merges
    f.write_text("name: a\nmodel: {init: {}}\nrollout:\n  <<: {replicas: 1, engine: hf}\n  replicas: 2\n")
    assert load_spec(f).rollout.replicas == 2


def test_binary_job_file_is_a_spec_error(tmp_path: Path) -> None:
    f = tmp_path / "job.bin"
    f.write_bytes(b"name: a\n\xff\xfe\x00garbage")
    with pytest.raises(SpecError, match=rf"{f}: not a text job file: byte 0xff at offset 8 is not UTF-8"):
        load_spec(f)
    f.write_bytes(b"name: a\n\x00\x01\x02")  # valid UTF-8, not YAML text
    with pytest.raises(SpecError, match=rf"{f}.*not valid YAML"):
        load_spec(f)


def test_lora_is_bounded_named_and_ddp_only() -> None:
    spec = parse_spec({**MINIMAL, "trainer": {"lora": {"r": 16, "target_modules": ["q_proj", "mlp.up_proj"]}}})
    assert spec.trainer.lora is not None and spec.trainer.lora.alpha == 16.0
    with pytest.raises(SpecError, match=r"trainer\.lora\.r"):
        parse_spec({**MINIMAL, "trainer": {"lora": {"r": 4096}}})
    with pytest.raises(SpecError, match=r"trainer\.lora\.target_modules"):
        parse_spec({**MINIMAL, "trainer": {"lora": {"target_modules": ["q_proj; rm -rf /"]}}})
    with pytest.raises(SpecError, match=r"trainer\.lora\.target_modules"):
        parse_spec({**MINIMAL, "trainer": {"lora": {"target_modules": []}}})
    with pytest.raises(SpecError, match="trainer.lora needs trainer.strategy ddp"):
        parse_spec({**MINIMAL, "trainer": {"lora": {}, "strategy": "fsdp"}})


def test_loggers_and_eval_name_their_fields() -> None:
    spec = parse_spec({**MINIMAL, "logging": {"wandb": {"project": "p"}, "mlflow": {"tracking_uri": "mlruns"}},
                       "eval": {"every": 5}})  # fmt: skip
    assert spec.logging.wandb is not None and spec.logging.wandb.mode == "offline"
    assert spec.eval is not None and spec.eval.task is None and spec.eval.samples == 1
    with pytest.raises(SpecError, match=r"logging\.wandb\.mode"):
        parse_spec({**MINIMAL, "logging": {"wandb": {"project": "p", "mode": "cloud"}}})
    with pytest.raises(SpecError, match=r"logging\.wandb\.project"):
        parse_spec({**MINIMAL, "logging": {"wandb": {"project": "a/b"}}})
    with pytest.raises(SpecError, match=r"logging\.mlflow\.tracking_uri"):
        parse_spec({**MINIMAL, "logging": {"mlflow": {}}})
    with pytest.raises(SpecError, match=r"eval\.samples"):
        parse_spec({**MINIMAL, "eval": {"samples": 1000}})
    with pytest.raises(SpecError, match=r"eval\.pass_threshold"):
        parse_spec({**MINIMAL, "eval": {"pass_threshold": 0}})


@pytest.mark.parametrize("name", ["copy-tiny.yaml", "gsm8k-qwen.yaml", "gsm8k-lora.yaml"])
def test_the_example_job_files_are_valid_specs(name: str) -> None:
    from pathlib import Path

    from resilient_rl.spec import load_spec

    spec = load_spec(Path(__file__).resolve().parents[2] / "examples" / name)
    if name == "gsm8k-lora.yaml":  # the README's GSM8K-style job with LoRA, dynamic sampling, eval, loggers
        assert spec.trainer.lora is not None and spec.algorithm.dynamic_sampling is not None
        assert spec.eval is not None and spec.eval.task is not None and spec.eval.task.split == "test"
        lg = spec.logging
        assert lg.tensorboard and lg.mlflow is not None and lg.wandb is not None
