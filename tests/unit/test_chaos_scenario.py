"""Chaos scenarios: validation names the bad field, random schedules are reproducible,
the shipped scenarios load, durations parse."""

from __future__ import annotations

from pathlib import Path

import pytest

from resilient_rl.chaos.cli import parse_duration
from resilient_rl.chaos.scenario import (
    FAULT_KINDS,
    RandomFaults,
    ScenarioError,
    job_spec_dict,
    load_scenario,
    parse_scenario,
    random_schedule,
)
from resilient_rl.spec import parse_spec
from tests.conftest import REPO

JOB = {"name": "j", "model": {"init": {}}}


def _err(data: dict) -> str:
    with pytest.raises(ScenarioError) as e:
        parse_scenario(data, "s.yaml")
    return str(e.value)


def test_errors_name_the_field() -> None:
    msg = _err({"name": "x", "job": JOB, "faults": [{"kind": "rollout_kil", "at": {"step": 1}}]})
    assert "s.yaml: invalid scenario" in msg and "faults.0.kind" in msg
    assert "faults.0.at" in _err({"name": "x", "job": JOB, "faults": [{"kind": "rollout_kill", "at": {}}]})
    msg = _err({"name": "x", "job": JOB, "faults": [{"kind": "rollout_hang", "at": {"time_s": 3}}]})
    assert "faults.0" in msg and "needs duration_s" in msg
    assert "cluster.etcd_members" in _err({"name": "x", "job": JOB, "cluster": {"etcd_members": 2}})
    assert "exactly one of job" in _err({"name": "x"})
    assert "cluster.bogus" in _err({"name": "x", "job": JOB, "cluster": {"bogus": 1}})


def test_kinds_that_need_a_cluster_shape_say_so() -> None:
    base = {"name": "x", "job": JOB}
    assert "checkpoint_tmpfs_mb" in _err({**base, "faults": [{"kind": "disk_full", "at": {"step": 1}}]})
    f = [{"kind": "etcd_member_kill", "at": {"step": 1}, "duration_s": 2}]
    assert "etcd_members: 3" in _err({**base, "faults": f})
    assert "ray_nodes >= 2" in _err({**base, "faults": [{"kind": "ray_node_remove", "at": {"step": 1}}]})


def test_random_schedule_is_reproducible_and_bounded() -> None:
    r = RandomFaults(mtbf_s=30, seed=4, kinds=["rollout_kill", "rollout_hang", "trainer_kill"], start_s=10, stop_s=1810)
    a, b = random_schedule(r), random_schedule(r)
    assert [(f.kind, f.at.time_s) for f in a] == [(f.kind, f.at.time_s) for f in b]
    times = [f.at.time_s for f in a]
    assert all(t is not None and 10 < t <= 1810 for t in times) and times == sorted(times)
    assert 40 <= len(a) <= 80  # ~60 expected at one per 30 s over 1800 s
    assert {f.kind for f in a} == {"rollout_kill", "rollout_hang", "trainer_kill"}
    assert all(f.duration_s for f in a if f.kind == "rollout_hang")
    other = random_schedule(r.model_copy(update={"seed": 5}))
    assert [f.at.time_s for f in other] != times


def test_shipped_scenarios_load_and_smoke_covers_its_kinds() -> None:
    smoke = load_scenario(REPO / "scenarios" / "smoke.yaml")
    kinds = {f.kind for f in smoke.schedule()}
    assert len(kinds) >= 8 and kinds <= set(FAULT_KINDS)
    assert {"rollout_kill", "rollout_hang", "trainer_kill", "leader_kill", "snapshot_corrupt", "disk_full"} <= kinds
    parse_spec(job_spec_dict(smoke))  # its job is a valid job spec
    soak = load_scenario(REPO / "scenarios" / "soak.yaml")
    assert soak.random is not None and soak.schedule()
    base = parse_spec(job_spec_dict(soak, REPO / "scenarios" / "soak.yaml"))
    two = load_scenario(REPO / "scenarios" / "soak-spares2.yaml")  # the same soak, two spares per group
    spares2 = parse_spec(job_spec_dict(two, REPO / "scenarios" / "soak-spares2.yaml"))
    assert (spares2.trainer.spares, spares2.rollout.spares) == (2, 2) and two.random == soak.random
    assert spares2.fault == base.fault and spares2.steps == base.steps
    tsp = load_scenario(REPO / "scenarios" / "soak-tspares2.yaml")  # the same soak, two trainer spares
    tspares2 = parse_spec(job_spec_dict(tsp, REPO / "scenarios" / "soak-tspares2.yaml"))
    assert (tspares2.trainer.spares, tspares2.rollout.spares) == (2, 1) and tsp.random == soak.random
    assert tspares2.fault == base.fault and tspares2.steps == base.steps
    assert len(FAULT_KINDS) >= 10


def test_job_file_is_read_relative_to_the_scenario(tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text("name: from-file\nmodel: {init: {}}\n")
    sc = tmp_path / "sc.yaml"
    sc.write_text("name: x\njob_file: job.yaml\n")
    assert job_spec_dict(load_scenario(sc), sc)["name"] == "from-file"
    (tmp_path / "bad.yaml").write_text("name: x\njob_file: job.yaml\nfaults: [{kind: scale, at: {step: 1}}]\n")
    with pytest.raises(ScenarioError, match="scale needs rollout"):
        load_scenario(tmp_path / "bad.yaml")


def test_durations() -> None:
    assert parse_duration("90") == 90 and parse_duration("30s") == 30
    assert parse_duration("1h") == 3600 and parse_duration("1h30m") == 5400
    with pytest.raises(ValueError):
        parse_duration("soon")


def test_every_fault_kind_has_an_injector_and_its_detection_and_recovery_events() -> None:
    from resilient_rl.chaos.faults import INJECTORS
    from resilient_rl.chaos.measure import DETECT, RECOVER

    assert set(INJECTORS) == set(FAULT_KINDS) == set(DETECT) == set(RECOVER)
    assert DETECT["rollout_preempt"] == DETECT["trainer_preempt"] == ("preempted",)  # a drain, not a fault


def test_a_random_schedule_too_long_to_draw_is_refused_naming_its_fields() -> None:
    with pytest.raises(ScenarioError, match=r"\(stop_s - start_s\) / mtbf_s: 1e\+06 faults expected, at most 10,000"):
        parse_scenario({"name": "x", "job": {"name": "j"}, "random": {"mtbf_s": 0.001, "stop_s": 1020}})
    parse_scenario({"name": "x", "job": {"name": "j"}, "random": {"mtbf_s": 1, "stop_s": 10_020}})  # 10,000: taken


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--duration", "0"], "--duration: '0' must be more than 0 seconds"),
        (["--mtbf", "0"], "--mtbf: '0' must be more than 0 seconds"),  # was a ZeroDivisionError traceback
        (["--mtbf", "1ms"], "--mtbf: '1ms' is not a duration"),
        (["--duration", "99999h"], "1.2e+07 faults expected, at most 10,000"),  # was drawn for minutes, unbounded
        (["--steps", "0"], "job (steps from --steps 0): invalid job spec\n  steps: Input should be greater than"),
    ],
)
def test_rrl_chaos_soak_refuses_bad_options_with_exit_2_before_any_platform_starts(
    tmp_path: Path, args: list[str], says: str
) -> None:
    from typer.testing import CliRunner

    from resilient_rl.cli import app

    out = tmp_path / "runs"
    r = CliRunner().invoke(app, ["chaos", "soak", *args, "--scenario", str(REPO / "scenarios" / "soak.yaml"),
                                 "--out", str(out)], terminal_width=400)  # fmt: skip
    assert r.exit_code == 2 and says in r.output, (r.exit_code, r.output, r.exception)
    assert not out.exists()  # nothing started, no run folder


def test_rrl_chaos_run_refuses_a_scenario_whose_job_is_bad_with_exit_2(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from resilient_rl.cli import app

    sc = tmp_path / "s.yaml"
    sc.write_text("name: s\njob: {name: x, model: {init: {}}, steps: 0}\n")
    r = CliRunner().invoke(app, ["chaos", "run", str(sc), "--out", str(tmp_path / "runs")], terminal_width=400)
    assert r.exit_code == 2 and f"{sc}: job: invalid job spec\n  steps: Input should be greater" in r.output, r.output
    assert not (tmp_path / "runs").exists()
