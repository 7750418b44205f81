"""The chaos smoke suite: `rrl chaos run scenarios/smoke.yaml` end to end, as a user runs it.

It starts its own platform (etcd, Ray head, 2 controllers, a tmpfs snapshot disk), runs the
tiny HF-engine job under every fault kind the system survives today, and fails on any
invariant violation or any fault that could not be injected.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from resilient_rl.chaos.scenario import load_scenario
from tests.conftest import REPO, run_rrl

pytestmark = [pytest.mark.slow, pytest.mark.chaos]


def _run_scenario(name: str, out: Path) -> tuple[subprocess.CompletedProcess[str], Path, dict[str, Any]]:
    """`rrl chaos run scenarios/{name}.yaml`; returns the process, its run folder and report,
    after checking that every invariant held."""
    r = run_rrl("chaos", "run", str(REPO / "scenarios" / f"{name}.yaml"), "--out", str(out), timeout=870)
    runs = sorted(out.glob(f"{name}-*"))
    assert runs, r.stdout + r.stderr
    rep = json.loads((runs[-1] / "report.json").read_text())
    failed = [i for i in rep["invariants"] if not i["ok"]]
    assert not failed, json.dumps(failed, indent=1)
    return r, runs[-1], rep


@pytest.mark.timeout(900)
def test_chaos_smoke_scenario_passes_with_every_fault_injected(tmp_path: Path) -> None:
    r, run, rep = _run_scenario("smoke", tmp_path)
    kinds = {f.kind for f in load_scenario(REPO / "scenarios" / "smoke.yaml").schedule()}
    injected = {f["kind"] for f in rep["faults"] if f["status"] == "injected"}
    assert injected == kinds, [(f["kind"], f["status"], f.get("note")) for f in rep["faults"]]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert rep["job"]["phase"] == "SUCCEEDED" and rep["job"]["step"] == rep["job"]["steps"]
    # every fault was seen and recovered from: detection and a later committed step
    for f in rep["faults"]:
        if f["kind"] not in ("scale", "rollout_slow"):  # a slow worker need not be detected
            assert f["figures"]["detection_s"] is not None, f
        assert f["figures"]["next_commit_s"] is not None, f
    assert rep["goodput"]["ettr"] is not None and 0 < rep["goodput"]["ettr"] <= 1
    md = (run / "report.md").read_text()
    assert "## MTTR per fault kind" in md and "ETTR" in md
    assert (run / "progress.svg").read_text().startswith("<svg")
    # `rrl chaos report` re-renders the same run
    again = run_rrl("chaos", "report", str(run))
    assert again.returncode == 0 and "PASS" in again.stdout, again.stdout + again.stderr


@pytest.mark.timeout(900)
def test_three_member_etcd_loses_its_leader_member_twice_and_the_job_is_exact(tmp_path: Path) -> None:
    """Issue 9: stop the etcd leader member mid-job (twice); the job SUCCEEDED with no step
    lost or repeated (invariants 1-7 of the harness, including the replay)."""
    r, _, rep = _run_scenario("etcd-cluster", tmp_path)
    kills = [f for f in rep["faults"] if f["kind"] == "etcd_member_kill"]
    assert [f["status"] for f in kills] == ["injected", "injected"], kills
    assert all(f["target"]["was_leader"] for f in kills), kills  # it was the etcd leader each time
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert rep["job"]["phase"] == "SUCCEEDED" and rep["job"]["step"] == rep["job"]["steps"]


@pytest.mark.timeout(900)
def test_chaos_hardening_scenario_trainer_hang_journal_full_reward_hang_and_a_storm(tmp_path: Path) -> None:
    """The faults of the hardening issue and a storm of four within seconds: each detected and
    recovered from, the job exact (every invariant), never FAILED or QUARANTINED."""
    r, run, rep = _run_scenario("hardening", tmp_path)
    kinds = {f.kind for f in load_scenario(REPO / "scenarios" / "hardening.yaml").schedule()}
    injected = {f["kind"] for f in rep["faults"] if f["status"] == "injected"}
    assert injected == kinds, [(f["kind"], f["status"], f.get("note")) for f in rep["faults"]]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert rep["job"]["phase"] == "SUCCEEDED" and rep["job"]["step"] == rep["job"]["steps"]
    by_kind = {f["kind"]: f for f in rep["faults"]}
    for kind in ("trainer_hang", "journal_full", "reward_hang"):
        assert by_kind[kind]["figures"]["detection_s"] is not None, by_kind[kind]
        assert by_kind[kind]["figures"]["next_commit_s"] is not None, by_kind[kind]
    for kind in ("trainer_hang", "journal_full"):
        assert by_kind[kind]["figures"]["recovered_s"] is not None, by_kind[kind]
    # the storm: four faults in the same second; the figures cannot tell them apart, the events can:
    # each fault and each recovery is recorded, whichever leader saw it
    t_storm = min(f["injected_at"] for f in rep["faults"] if f["at"] == {"step": 28})
    after = [e["kind"] for e in rep["events"] if e["time"] >= t_storm - 0.5]
    for kind in ("leader", "adopted", "trainer_restart", "trainer_recovered", "rollout_joined", "recovered"):
        assert kind in after, after
    assert {"rollout_fault", "rollout_hang"} & set(after), after
    assert "reward_errors" in [e["kind"] for e in rep["events"]]  # the hang's timeouts were counted
    early = [(e["kind"], e.get("message")) for e in rep["events"] if e["time"] < t_storm - 0.5]
    # the SIGSTOPped rank: found by the liveness probe (fault.probe_timeout 1 s), well before hang_timeout
    hangs = [e for e in rep["events"] if e["kind"] == "trainer_hang" and e["time"] < t_storm - 0.5]
    assert hangs and hangs[0].get("channel") == "probe" and hangs[0]["detection_s"] < 5.0, hangs
    assert not [e for e in early if e[0] in ("failed", "rollout_hang")], early  # slow rewards are not a hang


def _cmdline(c: psutil.Process) -> str:
    """The process's command line; "" once it has exited (the harness's children come and go)."""
    try:
        return " ".join(c.cmdline())
    except psutil.Error:
        return ""


@pytest.mark.timeout(400)
def test_sigterm_to_a_chaos_run_stops_the_platform_it_started(tmp_path: Path) -> None:
    """`timeout`, a CI runner or `kill` ends `rrl chaos run` with SIGTERM: it stops its etcd,
    controllers, Ray and the job's workers (which run in sessions of their own) and exits 143.
    Before resilient_rl/signals.py all of them were left running, the job still training."""
    rrl = Path(sys.executable).parent / "rrl"
    p = subprocess.Popen([str(rrl), "chaos", "run", str(REPO / "scenarios" / "smoke.yaml"), "--out", str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(p.stdout or []), daemon=True).start()
    procs: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and p.poll() is None:  # until the job's workers run
            procs = psutil.Process(p.pid).children(recursive=True)
            names = " ".join(_cmdline(c) for c in procs)
            if "ray::TrainerRank" in names and "ray::RolloutWorker" in names and "etcd" in names:
                break
            time.sleep(1.0)
        else:
            pytest.fail(f"the platform and the job's workers did not come up: {''.join(lines)}")
        assert len(procs) >= 6, [_cmdline(c) for c in procs]
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=240)
        _, alive = psutil.wait_procs(procs, timeout=30)
    finally:
        p.kill()
        for c in procs:
            try:
                c.kill()
            except psutil.NoSuchProcess:
                pass
    out = "".join(lines)
    assert rc == 143, out
    assert not alive, [(c.pid, _cmdline(c)) for c in alive]
    assert "terminated (SIGTERM): cleaning up" in out
    assert "Traceback" not in out
