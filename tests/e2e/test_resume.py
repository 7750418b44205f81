"""Snapshots, full-stop resume, corrupt-snapshot fallback and `rrl verify`, on a real platform
of its own (it is stopped and restarted mid-job)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from controller import events, jobs
from tests.conftest import run_rrl
from tests.e2e.conftest import LivePlatform

pytestmark = pytest.mark.slow


def _spec(name: str) -> dict:
    return {
        "name": name,
        "model": {"init": {}},
        "task": {"kind": "copy", "num_prompts": 64},
        # no warm spares (default 1 each): nothing here is lost hot, and on 2 cores two processes less
        "rollout": {"replicas": 1, "engine": "hf", "sampling": {"max_tokens": 6, "n": 4}, "spares": 0},
        "trainer": {"replicas": 1, "lr": 0.002, "spares": 0},
        "prompts_per_step": 4,
        "steps": 10,
        "seed": 5,
        "checkpoint": {"every": 3, "keep": 2},
    }


def test_full_stop_resume_is_bit_identical_and_falls_back_from_corrupt_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    # set for this test only: the shared platform's tests after it find theirs again (a popped
    # RRL_HOME sent their `rrl verify` to a Ray of its own, started on the spot, slow or timing out)
    monkeypatch.setenv("RRL_HOME", str(home))
    p = LivePlatform(home)
    try:
        ref = p.wait(p.submit(_spec("ref-run")))
        assert ref.phase == "SUCCEEDED", ref.state.get("reason")
        expected = ref.state["weights_digest"]
        steps_ckpt = sorted(c["step"] for c in ref.checkpoints)
        assert steps_ckpt == [6, 9]  # every 3 steps, newest 2 kept (3 was retired)
        snaps = sorted(x.name for x in (home / "jobs" / "ref-run" / "snapshots").iterdir())
        assert snaps == ["step-0000000006", "step-0000000009"]  # retention removed the folder too

        job = p.submit(_spec("cut-run"))
        ctl = p.platform.load()["processes"]["controller-0"]["pid"]
        deadline = time.monotonic() + 300
        while jobs.get(p.store, job).state.get("checkpoint") is None or jobs.get(p.store, job).state["checkpoint"] < 6:
            assert time.monotonic() < deadline and jobs.get(p.store, job).phase not in jobs.TERMINAL
            time.sleep(0.05)
        # freeze the leader so that etcd holds still, read what it committed, then crash it
        os.killpg(ctl, signal.SIGSTOP)
        rec = jobs.get(p.store, job)
        newest, at_step = rec.state["checkpoint"], rec.state["step"]
        assert at_step < 10, "the job finished before it could be cut"
        os.killpg(ctl, signal.SIGKILL)
        p.close()  # and everything else down: Ray (all workers), etcd
    except BaseException:
        p.close()
        raise
    # while it is down, damage the newest committed snapshot: the restore must not trust it
    folder = home / "jobs" / "cut-run" / "snapshots" / f"step-{newest:010d}"
    victim = max(
        (f for f in folder.rglob("*") if f.is_file() and f.name != "MANIFEST.json"), key=lambda f: f.stat().st_size
    )
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))

    p = LivePlatform(home)  # `rrl up` again: etcd kept its data dir
    try:
        rec = p.wait(job)
        assert rec.phase == "SUCCEEDED", rec.state.get("reason")
        assert rec.state["step"] == 10
        assert rec.state["weights_digest"] == expected, "resumed run differs from the uninterrupted one"
        kinds = [e["kind"] for e in events.read(p.store, job, limit=1000)]
        assert "snapshot_corrupt" in kinds and "replay" in kinds
        replay = next(e for e in events.read(p.store, job, limit=1000) if e["kind"] == "replay")
        assert replay["first"] == newest - 3  # fell back to the snapshot before the corrupt one

        env = {"RRL_HOME": str(home)}
        r = run_rrl("checkpoints", job, env=env)
        assert r.returncode == 0 and "committed, latest" in r.stdout
        r = run_rrl("verify", job, env=env, timeout=300)
        assert r.returncode == 0 and "match" in r.stdout and "mismatch" not in r.stdout, r.stdout + r.stderr
        shard = next((home / "jobs" / job / "journal" / "step-00000004").glob("shard-0000-*.json"))
        body = json.loads(shard.read_text())
        body["samples"][0]["reward"] = 1.0 - body["samples"][0]["reward"]
        shard.write_text(json.dumps(body))
        r = run_rrl("verify", job, env=env, timeout=300)
        assert r.returncode == 1 and "mismatch" in r.stdout and "digest mismatch" in r.stdout, r.stdout + r.stderr
    finally:
        p.close()
