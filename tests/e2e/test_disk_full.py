"""A full journal disk pauses the job (it used to fail it at once with a bare ENOSPC); freeing
space resumes it by itself, and no step is lost or trained twice. The job's folder is on a real
small filesystem (tmpfs) that the test fills. HF engine, one rollout worker, one trainer."""

from __future__ import annotations

import errno
import time
from pathlib import Path

import pytest

from controller import events, jobs
from tests.conftest import run_rrl
from tests.e2e.conftest import LivePlatform, metrics
from tests.e2e.test_rl_job import _check_journal, _spec, _wait_step

pytestmark = pytest.mark.slow


def _fill(disk: Path) -> Path:
    filler = disk / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return filler


def _wait_phase(platform: LivePlatform, job: str, phase: str, timeout: float = 120) -> jobs.JobRecord:
    deadline = time.monotonic() + timeout
    while (rec := jobs.get(platform.store, job)).phase != phase:
        assert rec.phase not in jobs.TERMINAL, rec.state
        assert time.monotonic() < deadline, f"{job} is {rec.phase}, not {phase}"
        time.sleep(0.2)
    return rec


def test_journal_disk_full_pauses_and_resumes_by_itself_losing_nothing(
    platform: LivePlatform, small_disk: Path
) -> None:
    work = small_disk / "job"
    steps = 30
    job = platform.submit(_spec("e2e-diskfull", work, trainer={"replicas": 1}, steps=steps,
                                checkpoint={"dir": str(work), "every": 1000}))  # fmt: skip
    _wait_step(platform, job, 3)
    filler = _fill(small_disk)
    rec = _wait_phase(platform, job, "PAUSED")
    reason = rec.state["reason"]
    assert reason.startswith(f"journal disk full at {work / 'journal'}, ") and "MB free" in reason, reason
    paused_at = rec.state["step"]
    r = run_rrl("status", job, "--etcd", platform.data["etcd"])
    assert "PAUSED" in r.stdout and "journal disk full" in r.stdout, r.stdout
    time.sleep(3)
    assert jobs.get(platform.store, job).state["step"] == paused_at  # nothing moves while paused
    filler.unlink()
    rec = platform.wait(job, timeout=300)
    assert rec.phase == "SUCCEEDED", rec.state
    kinds = [e["kind"] for e in events.read(platform.store, job, limit=1000)]
    assert kinds.count("paused") == 1 and kinds.count("resumed") == 1, kinds
    resumed = next(e for e in events.read(platform.store, job, limit=1000) if e["kind"] == "resumed")
    assert "journal disk has room again" in resumed["message"] and resumed["seconds"] >= 3
    assert "failed" not in kinds and "rollout_fault" not in kinds
    _check_journal(work, steps, 4, 4, 3)  # every prompt of every step exactly once
    assert [m["step"] for m in metrics(work)] == list(range(steps))
