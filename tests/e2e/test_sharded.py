"""The sharded trainer (FSDP2) in real jobs: vLLM rollouts, resharding resumes, a strategy change.

Shares the session's platform. The arithmetic checks (world sizes, strategies, restores
bit for bit) are in tests/integration/test_sharded_trainer.py; here the job runs through
the driver, the weight store's bucketed publish and ``rrl verify``.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from checkpoints.journal import Journal
from controller import events, jobs
from tests.conftest import run_rrl
from tests.e2e.conftest import LivePlatform
from tests.e2e.test_faults import _wait_spare
from tests.e2e.test_rl_job import _spec, _wait_event, _wait_step


def _segments(platform: LivePlatform, job: str) -> list[dict[str, Any]]:
    return jobs.lineage(platform.store, job)


def _verify(platform: LivePlatform, job: str) -> str:
    r = run_rrl("verify", job, "--etcd", platform.data["etcd"], "--ray-address", platform.data["ray"], timeout=600)
    assert r.returncode == 0 and "match" in r.stdout and "mismatch" not in r.stdout, r.stdout + r.stderr
    v = jobs.get(platform.store, job).verified  # kept with the job for its page and `rrl status`
    assert v is not None and v["match"] is True and v["replayed"] == v["recorded"], v
    return r.stdout


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_fsdp_job_with_vllm_shrinks_2_to_1_and_verifies(platform: LivePlatform, tmp_path: Path) -> None:
    """FSDP world 2 with a vLLM engine (weights published from the shards in buckets small
    enough to need several), resharded 2 -> 1 mid-job from a sharded snapshot; the job
    succeeds and the replay of its two segments gives its weights bit for bit."""
    work = tmp_path / "fsdp"
    steps = 8
    job = platform.submit(_spec("e2e-fsdp", work, steps=steps, rollout={"engine": "vllm"},
                                trainer={"replicas": 2, "strategy": "fsdp", "publish_bucket_mb": 1},
                                checkpoint={"dir": str(work), "every": 2}))  # fmt: skip
    _wait_step(platform, job, 3, timeout=400)
    jobs.scale(platform.store, job, trainer=1)
    rec = platform.wait(job)
    assert rec.phase == "SUCCEEDED", rec.state.get("reason")
    assert rec.state["step"] == steps and rec.state["policy_version"] == steps
    segs = _segments(platform, job)
    assert [(s["world"], s["strategy"]) for s in segs] == [(2, "fsdp"), (1, "fsdp")], segs
    assert segs[1]["from_step"] > 0  # restored from a snapshot the two shards wrote, not from the start
    msgs = [e["message"] for e in events.read(platform.store, job, limit=1000) if e["kind"] == "trainer_restart"]
    assert any("world size 2 -> 1" in m for m in msgs), msgs
    out = _verify(platform, job)
    assert "at world 2" in out and "at world 1" in out and "fsdp" in out, out


@pytest.mark.timeout(600)
def test_ddp_job_switches_to_fsdp_mid_run_within_the_stated_tolerance(platform: LivePlatform, tmp_path: Path) -> None:
    """`rrl scale --strategy fsdp --trainer 2` on a DDP world-1 job: the group restarts sharded
    from the DDP snapshot at a step boundary and the job goes on. The replay follows the
    lineage exactly; against an all-DDP run of the same journal the weights differ only by
    the reduction order (1e-5 relative over the whole model, the bound the arithmetic test states)."""
    from resilient_rl.workers import local_group
    from tests.helpers.sharded_ops import script

    work = tmp_path / "switch"
    steps = 10
    # the liveness probe off: it would find the rollout worker frozen below and replace it in seconds
    job = platform.submit(_spec("e2e-switch", work, steps=steps, trainer={"replicas": 1},
                                checkpoint={"dir": str(work), "every": 2}, fault={"probe_timeout": 0}))  # fmt: skip
    _wait_step(platform, job, 3)
    # The rollout worker is frozen while the CLI starts (seconds under load), so that the job cannot
    # run to its end before the request lands (it did in CI: 7 steps in 2 s, then no restart ever):
    # on-policy, at most the step already generated commits meanwhile. 60 s of hang_timeout is far off,
    # and the probe is off.
    rollout_pid = jobs.get(platform.store, job).members["rollout"]["0"]["pid"]
    os.kill(rollout_pid, signal.SIGSTOP)
    try:
        r = run_rrl(
            "scale",
            job,
            "--strategy",
            "fsdp",
            "--trainer",
            "2",
            "--etcd",
            platform.data["etcd"],
            env={"RRL_HOME": str(platform.home)},
        )  # its token (another module may have moved RRL_HOME)
    finally:
        os.kill(rollout_pid, signal.SIGCONT)
    assert r.returncode == 0 and "strategy fsdp" in r.stdout, r.stdout + r.stderr
    _wait_event(platform, job, "trainer_recovered")
    rec = platform.wait(job)
    assert rec.phase == "SUCCEEDED", rec.state.get("reason")
    segs = _segments(platform, job)
    assert [(s["world"], s["strategy"]) for s in segs] == [(1, "ddp"), (2, "fsdp")], segs
    msgs = [e["message"] for e in events.read(platform.store, job, limit=1000) if e["kind"] == "trainer_restart"]
    assert any("strategy ddp -> fsdp" in m for m in msgs), msgs
    out = _verify(platform, job)
    assert "ddp" in out and "fsdp" in out, out
    r = run_rrl("status", job, "--etcd", platform.data["etcd"], env={"RRL_HOME": str(platform.home)})
    assert f"match, {steps} steps replayed" in r.stdout, r.stdout

    # the job's chain again, outside the job, then all of it under DDP: the tolerance of the switch
    journal = Journal(work / "journal")
    batches = [journal.read_batch(k) for k in range(steps)]
    from resilient_rl.spec import JobSpec

    spec = JobSpec.model_validate(rec.spec)
    model_dir = str(work / "model")  # the job's workdir is checkpoint.dir: its model was made there
    s = int(segs[1]["from_step"])
    snap = str(tmp_path / "handover")
    first = [("build", "ddp"), *[("train", k) for k in range(s)], ("save", snap)]
    local_group.run(1, script, spec.to_json(), model_dir, batches, first)
    chain = local_group.run(2, script, spec.to_json(), model_dir, batches,
                         [("build", "fsdp"), ("load", snap), *[("train", k) for k in range(s, steps)],
                          ("record", "end")])[0]  # fmt: skip
    assert chain["end"]["digest"] == rec.state["weights_digest"]  # the harness reproduces the job
    ddp = local_group.run(1, script, spec.to_json(), model_dir, batches,
                       [("build", "ddp"), *[("train", k) for k in range(steps)], ("record", "end")])[0]  # fmt: skip
    a, b = chain["end"]["weights"], ddp["end"]["weights"]
    diff = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a) ** 0.5
    norm = sum(float(b[k].double().pow(2).sum()) for k in b) ** 0.5
    assert chain["end"]["digest"] != ddp["end"]["digest"]  # the switch is not bit-exact: the check is real
    assert diff / norm <= 1e-5, f"DDP -> FSDP differs from all-DDP by {diff / norm:.3g} relative"


@pytest.mark.timeout(600)
def test_a_lost_fsdp_rank_is_replaced_hot_from_the_shadow_copy_and_replays_at_most_one_step(
    platform: LivePlatform, tmp_path: Path
) -> None:
    """FSDP world 2, snapshots far apart (every 50 steps), a shadow copy every step: SIGKILL rank
    0; the hot path keeps rank 1's process, promotes the warm spare to rank 0 (it joins the
    group rank 1 hosts), and both load their parts of the in-memory copy the ranks left in the
    weight store, not the initial weights; at most one step is replayed and `rrl verify`
    matches."""
    work = tmp_path / "shadow"
    steps = 30  # the spare warms up beside the ranks
    job = platform.submit(_spec("e2e-shadow", work, steps=steps,
                                trainer={"replicas": 2, "strategy": "fsdp", "shadow_every": 1, "spares": 1},
                                checkpoint={"dir": str(work), "every": 50}))  # fmt: skip
    _wait_step(platform, job, 4)
    _wait_spare(platform, job)
    members = jobs.get(platform.store, job).members["trainer"]
    survivor = members["1"]["pid"]
    os.kill(members["0"]["pid"], signal.SIGKILL)
    rec = platform.wait(job)
    assert rec.phase == "SUCCEEDED", rec.state.get("reason")
    evs = events.read(platform.store, job, limit=1000)
    restarts = [e for e in evs if e["kind"] == "trainer_restart"]
    seen = [(e.get("recovery"), e.get("survivors"), e.get("survivor_pids")) for e in restarts]
    assert seen == [("hot", [1], [survivor])], restarts
    (back,) = [e for e in evs if e["kind"] == "trainer_recovered"]
    assert back["recovery"] == "hot" and back["source"] == "shadow" and back["spares_used"] == 1, back
    restored = [e for e in evs if e["kind"] == "shadow_restored"]
    assert restored and restored[0]["step"] >= 3, [e["kind"] for e in evs]
    assert not rec.checkpoints or min(c["step"] for c in rec.checkpoints) >= 50  # no disk snapshot to lean on
    replayed = [e["last"] - e["first"] + 1 for e in evs if e["kind"] == "replay"]
    assert all(n <= 1 for n in replayed), replayed
    segs = _segments(platform, job)
    assert len(segs) == 2 and segs[1]["snapshot"] == f"shadow@{restored[0]['step']}", segs
    _verify(platform, job)
