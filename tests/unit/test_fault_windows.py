"""bench.fault_windows: the job's rate in windows after each fault against the 15 s before it."""

from __future__ import annotations

import json
from pathlib import Path

from bench import fault_windows


def _report() -> dict:
    # 10 commits/s until the fault at t=100, 5/s for the next 5 s, then 10/s again; a fault never
    # injected (no injected_at) is left out
    times = [i / 10 for i in range(1000)] + [100 + i / 5 for i in range(25)] + [105 + i / 10 for i in range(300)]
    return {"steps": [{"time": t} for t in times],
            "faults": [{"kind": "rollout_kill", "injected_at": 100.0}, {"kind": "trainer_kill"}]}  # fmt: skip


def test_the_rate_after_a_fault_is_a_ratio_to_the_15_s_before_it() -> None:
    (w,) = fault_windows.windows(_report())
    assert w == {"kind": "rollout_kill", "pre_per_s": 10.0, "0-5s": 0.5, "5-10s": 1.0, "10-15s": 1.0, "15-25s": 1.0}


def test_the_command_prints_each_run_and_names_a_folder_without_a_report(tmp_path: Path, capsys) -> None:
    run = tmp_path / "rollout-kills-1"
    run.mkdir()
    (run / "report.json").write_text(json.dumps(_report()))
    assert fault_windows.main([str(run)]) == 0
    assert "0-5s 0.5" in capsys.readouterr().out
    assert fault_windows.main([str(tmp_path / "nope")]) == 2
    assert "nope: no report.json" in capsys.readouterr().err
