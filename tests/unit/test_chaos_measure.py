"""Recovery figures, ETTR, lost work and the report, from hand-made run records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from resilient_rl.chaos import measure, report

T0 = 1_800_000_000.0


def _timeline() -> list[dict]:
    # rollout worker pid 11 is killed at T0+10; its key lingers until T0+13; pid 21 joins at T0+15
    out = []
    for i in range(0, 30):
        t = T0 + i
        pids = [11, 12] if i < 13 else [12] if i < 15 else [12, 21]
        out.append({"t": t, "step": i // 2, "members": {"rollout": pids, "trainer": [30]},
                    "desired": {"rollout": 2, "trainer": 1}})  # fmt: skip
    return out


def test_event_time_reads_any_timestamp_field() -> None:
    assert measure.event_time({"time": T0}) == T0
    assert measure.event_time({"ts": str(T0)}) == T0
    assert measure.event_time({"at": "2027-01-15T08:00:00+00:00"}) == 1800000000.0
    assert measure.event_time({"timestamp": "2027-01-15T08:00:00Z"}) == 1800000000.0
    assert measure.event_time({"kind": "x"}) is None


def test_fault_figures_of_a_rollout_kill() -> None:
    events = [
        {"kind": "rollout_fault", "time": T0 + 11.5, "worker": 0},
        {"kind": "rollout_joined", "time": T0 + 15.2, "worker": 0},
        {"kind": "rollout_fault", "time": T0 + 2, "worker": 1},  # an earlier fault: not this one's
    ]
    fault = {"kind": "rollout_kill", "injected_at": T0 + 10, "target": {"pid": 11}}
    commits = [(T0 + i, i) for i in range(0, 30, 3)]
    fig = measure.fault_figures(fault, events, _timeline(), commits)
    assert fig["detection_s"] == 1.5 and fig["detected_by"] == "rollout_fault"
    assert fig["recovered_s"] == 5.2 and fig["recovered_by"] == "rollout_joined"
    assert fig["next_commit_s"] == 2.0
    assert fig["group_restored_s"] == 5.0  # pid 11 gone and 2 members again at T0+15


def test_an_idle_worker_stopped_and_continued_is_back_when_its_own_process_is_a_member_again() -> None:
    """A rollout_hang on an idle worker is detected by nothing (it held no work) and never
    replaced: its lease expires while it is stopped, and it registers again after the SIGCONT.
    The group is back then, not when the same process later leaves for another fault (a
    soak reported 87 s for 8 s of SIGSTOP that way)."""
    timeline = []
    for i in range(0, 40):
        pids = [11, 12] if i < 15 else [12] if i < 19 else [11, 12] if i < 35 else [12, 21]
        timeline.append({"t": T0 + i, "members": {"rollout": pids}, "desired": {"rollout": 2}})
    fault = {"kind": "rollout_hang", "injected_at": T0 + 10, "ended_at": T0 + 18, "target": {"pid": 11}}
    fig = measure.fault_figures(fault, [], timeline, [])
    assert fig["detection_s"] is None
    assert fig["group_restored_s"] == 9.0  # pid 11 a member of a whole group again at T0+19
    detected = measure.fault_figures(fault, [{"kind": "rollout_hang", "time": T0 + 15}], timeline, [])
    assert detected["group_restored_s"] == 25.0  # detected: restored once it is replaced (pid 21 at T0+35)


def test_fault_figures_accept_new_recovery_event_kinds_and_missing_ones() -> None:
    events = [{"kind": "leader", "time": T0 + 4, "detection_s": 3.1}, {"kind": "workers_recovered", "time": T0 + 9}]
    fig = measure.fault_figures({"kind": "leader_kill", "injected_at": T0}, events, [], [])
    assert fig["detection_s"] == 4 and fig["detection_reported_s"] == 3.1
    assert fig["recovered_s"] == 9 and fig["recovered_by"] == "workers_recovered"
    assert fig["next_commit_s"] is None and fig["group_restored_s"] is None
    assert measure.fault_figures({"kind": "scale"}, events, [], [])["detection_s"] is None  # never injected


def test_a_rollout_fault_is_not_recovered_by_the_trainers_recovery() -> None:
    """A soak paired a rollout hang with a trainer_recovered of the same interval."""
    hang = {"kind": "rollout_hang", "injected_at": T0}
    events = [{"kind": "rollout_hang", "time": T0 + 5}, {"kind": "trainer_recovered", "time": T0 + 7}]
    fig = measure.fault_figures(hang, events, [], [])
    assert fig["detection_s"] == 5 and fig["recovered_s"] is None
    events.append({"kind": "rollout_recovered", "time": T0 + 9})  # a newer kind of its own group counts
    fig = measure.fault_figures(hang, events, [], [])
    assert fig["recovered_s"] == 9 and fig["recovered_by"] == "rollout_recovered"
    kill = measure.fault_figures({"kind": "trainer_kill", "injected_at": T0}, events, [], [])
    assert kill["recovered_by"] == "trainer_recovered"


def test_goodput_and_lost_work() -> None:
    metrics = [{"step": k, "time": T0 + 1 + k, "step_seconds": 1.0} for k in range(10)]
    metrics[5] = {"step": 5, "time": T0 + 1 + 5 + 10, "step_seconds": 11.0}  # a fault cost 10 s
    for m in metrics[6:]:
        m["time"] += 10
    g = measure.goodput({"started_at": T0 - 10, "finished_at": T0 + 21}, metrics)
    assert g["fault_free_step_s"] == 1.0 and g["wall_s"] == 20.0 and g["ettr"] == 0.5
    assert g["ettr_total"] == round(10 / 31, 4)
    # faults injected at T0+2 and T0+17: steps 1..5 commit at T0+2..T0+16 inside that window
    g = measure.goodput({}, metrics, injections=[T0 + 17, T0 + 2])
    assert g["window_s"] == 15.0 and g["window_faults"] == 1 and g["ettr_window"] == round(5 * 1.0 / 15, 4)
    assert "ettr_window" not in measure.goodput({}, metrics, injections=[T0 + 2])  # one fault: no interval
    lw = measure.lost_work(
        [{"kind": "replay", "first": 4, "last": 6}, {"kind": "rollout_hang"}, {"kind": "rollout_fault"},
         {"kind": "trainer_restart"}, {"kind": "leader"}], 8, rewritten_shards=1,
    )  # fmt: skip
    assert lw == {"steps_replayed": 3, "samples_regenerated_est": 16, "trainer_restarts": 1, "leader_changes": 1,
                  "shards_rewritten_seen": 1, "samples_rewritten_seen": 8}  # fmt: skip


def test_mttr_summary_per_kind() -> None:
    fs = [
        {"kind": "trainer_kill", "figures": {"detection_s": 1.0, "next_commit_s": 4.0}},
        {"kind": "trainer_kill", "figures": {"detection_s": 3.0, "next_commit_s": None}},
    ]
    s = measure.summarize(fs)["trainer_kill"]
    assert s["count"] == 2 and s["mean_detection_s"] == 2.0 and s["mean_next_commit_s"] == 4.0


def test_report_files(tmp_path: Path) -> None:
    rep = {
        "scenario": "t", "ok": False, "run_dir": str(tmp_path),
        "job": {"id": "j", "phase": "SUCCEEDED", "step": 10, "steps": 10, "started_at": T0},
        "faults": [{"id": 0, "kind": "trainer_kill", "at": {"step": 3}, "status": "injected", "injected_at": T0 + 5,
                    "ended_at": T0 + 5, "target": {"pid": 1}, "figures": {"detection_s": 0.5}}],
        "mttr": measure.summarize([{"kind": "trainer_kill", "figures": {"detection_s": 0.5}}]),
        "goodput": {"ettr": 0.8}, "lost_work": {"steps_replayed": 2},
        "invariants": [{"number": 3, "name": "replay", "ok": False, "details": ["replay gives a|b"]}],
        "events": [{"kind": "trainer_restart", "time": T0 + 5.5, "message": "rank lost"}],
        "timeline": [], "steps": [{"step": k, "time": T0 + k} for k in range(10)],
    }  # fmt: skip
    paths = report.write(rep, tmp_path)
    md = paths["md"].read_text()
    assert "**FAIL**" in md and "| 3 | replay | **FAIL** | replay gives a\\|b |" in md
    assert "### 0. trainer_kill (injected)" in md and "t+5.5s | trainer_restart: rank lost" in md
    svg = paths["svg"].read_text()
    assert svg.startswith("<svg") and "<polyline" in svg and ">trainer_kill</text>" in svg
    assert json.loads(paths["json"].read_text())["scenario"] == "t"
    assert report.load(tmp_path)["job"]["id"] == "j"


def _sample_report() -> dict[str, Any]:
    return {
        "scenario": "t", "ok": True, "run_dir": "/nowhere",
        "job": {"id": "j", "phase": "SUCCEEDED", "step": 10, "steps": 10, "started_at": T0},
        "faults": [{"id": 0, "kind": "trainer_kill", "at": {"step": 3}, "status": "injected", "injected_at": T0 + 5,
                    "ended_at": T0 + 5, "target": {"pid": 1}, "note": "n",
                    "figures": {"detection_s": 0.5, "detected_by": "trainer_restart"}}],
        "mttr": measure.summarize([{"kind": "trainer_kill", "figures": {"detection_s": 0.5}}]),
        "goodput": {"ettr": 0.8, "ettr_window": 0.5}, "lost_work": {"steps_replayed": 2},
        "invariants": [{"number": 3, "name": "replay", "ok": True, "details": ["match"]}],
        "events": [{"kind": "trainer_restart", "time": T0 + 5.5, "message": "rank lost"}],
        "timeline": [{"t": T0, "step": 0}], "steps": [{"step": k, "time": T0 + k} for k in range(10)],
    }  # fmt: skip


def test_rrl_chaos_report_on_a_file_that_is_not_a_report_exits_2_naming_the_field(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from resilient_rl.cli import app

    def run(body: Any) -> tuple[int, str]:
        (tmp_path / "report.json").write_text(json.dumps(body))
        r = CliRunner().invoke(app, ["chaos", "report", str(tmp_path)], terminal_width=400)
        assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
        return r.exit_code, r.output

    assert run([]) == (2, f"error: cannot read a report from {tmp_path}: {tmp_path / 'report.json'} is not a chaos "
                          "report: the file: Input should be a valid dictionary or instance of _Report\n")  # fmt: skip
    code, text = run({})
    assert code == 2 and "is not a chaos report: scenario: Field required" in text, text
    bad = _sample_report()
    bad["faults"][0]["injected_at"] = "soon"
    code, text = run(bad)
    assert code == 2 and "faults.0.injected_at: Input should be a valid number" in text, text
    code, text = run(_sample_report())
    assert code == 0 and "PASS" in text and (tmp_path / "report.md").is_file(), text


def test_a_report_with_any_one_field_changed_or_removed_is_refused_or_rendered_never_a_crash(tmp_path: Path) -> None:
    """Every field of a report, in turn, set to values of other types or removed: ``load`` refuses
    it (ValueError naming the field) or the report renders (markdown, plot, the CLI's summary)."""
    import contextlib
    import copy
    import io

    from resilient_rl.chaos.cli import _summary

    def paths(o: Any, pre: tuple[Any, ...] = ()) -> Any:
        yield pre
        for k, v in o.items() if isinstance(o, dict) else enumerate(o) if isinstance(o, list) else ():
            yield from paths(v, (*pre, k))

    base, rendered, refused = _sample_report(), 0, 0
    for p in [p for p in paths(base) if p]:
        for v in (None, "x", -1, [], {}, True, 1e308, "DEL"):
            rep = copy.deepcopy(base)
            parent = rep
            for k in p[:-1]:
                parent = parent[k]
            if v == "DEL":
                del parent[p[-1]]
            else:
                parent[p[-1]] = v
            (tmp_path / "report.json").write_text(json.dumps(rep))
            try:
                loaded = report.load(tmp_path)
            except ValueError as e:
                assert "is not a chaos report: " in str(e), e
                refused += 1
                continue
            report.write(loaded, tmp_path)
            with contextlib.redirect_stdout(io.StringIO()):
                _summary(loaded)
            rendered += 1
    assert refused > 50 and rendered > 200, (refused, rendered)  # both sides exercised
