"""The job driver's fault paths over the fake actor layer: no Ray, no etcd, no torch.

The runner (resilient_rl/job/) runs unchanged; under it the fake actor layer
(tests/helpers/fake_actors.py, held to Ray's behaviour by the contract suite) runs the
scriptable fake workers of tests/helpers/fake_workers.py, and the controller's record is
the in-memory one of tests/helpers/fake_controller.py. Each test scripts one fault and
checks what the driver did: what was generated, trained, committed and recorded.
The real-process versions of these paths are the e2e tests (tests/e2e/test_faults.py).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from checkpoints.journal import Journal
from checkpoints.snapshots import snapshot_dir
from controller import steplog
from controller.http import views
from controller.jobs import JobRecord
from resilient_rl.job.runner import JobRunner
from resilient_rl.naming import actor_name
from resilient_rl.spec import parse_spec
from tests.helpers.fake_controller import FakeController, LeaderTerm
from tests.helpers.fake_workers import Script, fake_layer

pytestmark = pytest.mark.timeout(60)


def _spec(tmp: Path, **over: Any) -> dict[str, Any]:
    model = tmp / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text("{}")
    base: dict[str, Any] = {
        "name": "drv", "model": {"path": str(model)}, "steps": 4, "prompts_per_step": 4,
        "rollout": {"replicas": 2, "sampling": {"n": 2}}, "trainer": {"replicas": 2},
        "checkpoint": {"dir": str(tmp / "work"), "every": 2, "keep": 3}, "fault": {"hang_timeout": 30},
    }  # fmt: skip
    for k, v in over.items():
        base[k] = {**base[k], **v} if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return parse_spec(base).model_dump(mode="json", by_alias=True)


class Job:
    """One job, its record and its workers; runners come and go (leaders)."""

    def __init__(self, tmp: Path, script: Script | None = None, **spec: Any) -> None:
        self.spec = _spec(tmp, **spec)
        self.script = script or Script()
        self.layer = fake_layer(self.script)
        self.c = FakeController()
        self.c.state = {"phase": "PENDING", "step": 0, "policy_version": 0}
        self.desired: dict[str, Any] = {}
        self.runner: JobRunner | None = None

    def record(self) -> JobRecord:
        return JobRecord("drv", self.spec, dict(self.desired), dict(self.c.state))

    def lead(self) -> JobRunner:
        """A (new) leader starts the job's runner."""
        self.c.leads = True
        self.c.token += 1
        self.runner = JobRunner(LeaderTerm(self.c, self.c.token), self.record(), None, "", actors=self.layer)  # type: ignore[arg-type]
        return self.runner

    def finish(self, timeout: float = 30) -> str:
        assert self.runner is not None
        self.runner._thread.join(timeout)
        assert not self.runner._thread.is_alive(), "the runner did not finish"
        return str(self.c.state.get("phase"))

    def wait(self, cond: Any, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.01)

    def kinds(self) -> list[str]:
        return [k for k, _, _ in self.c.events]

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [{"message": m, **d} for k, m, d in self.c.events if k == kind]

    def steps_trained(self) -> Counter[tuple[int, int]]:
        """(step, rank) -> how often a rank of the *final* trainer lineage applied it."""
        return Counter((s, r) for s, r, _ in self.script.trained)

    def created(self, group: str) -> list[str]:
        return [n for n, _ in self.layer.created if f":{group}:" in n]


def _digest_of_final_weights(job: Job) -> str:
    return str(job.c.state.get("weights_digest"))


def test_a_job_runs_every_step_once_and_commits_them_in_order(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert _digest_of_final_weights(job) == "0,1,2,3"  # each step applied once, in order
    assert job.steps_trained() == Counter({(s, r): 1 for s in range(4) for r in range(2)})
    commits = [w["step"] for w in job.c.writes if "policy_version" in w and "reward" in w]
    assert commits == [1, 2, 3, 4]
    assert sorted(job.c.records) == [2, 4]  # every 2 committed steps
    lines = [json.loads(x)["step"] for x in (tmp_path / "work" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [0, 1, 2, 3]  # the metrics file in commit order


def test_a_fresh_start_creates_the_rollout_workers_while_the_trainer_ranks_start(tmp_path: Path) -> None:
    """The engines come up beside the ranks (one job start's worth of seconds): asked for right
    after the ranks (so Ray places the ranks first, as before) and before the ranks' setup is
    waited for; each worker created once and joined; a new leader's take-over creates none."""
    job = Job(tmp_path, Script(train_delay_s=0.05), steps=6)
    seq: list[tuple[str, str]] = []
    create, call = job.layer.create, job.layer.call
    job.layer.create = lambda role, name, *a: (seq.append(("create", name)), create(role, name, *a))[1]  # type: ignore[method-assign]
    job.layer.call = lambda actor, method, *a: (seq.append((method, actor.name)), call(actor, method, *a))[1]  # type: ignore[method-assign]
    first = job.lead()
    job.wait(lambda: job.c.state.get("step", 0) >= 2)
    rollouts = [n for w, n in seq if w == "create" and ":rollout:" in n]
    assert sorted(rollouts) == [actor_name("drv", "rollout", i) for i in range(2)]  # each once
    at = {x: seq.index(x) for x in seq[::-1]}  # first occurrence of each
    first_rank = min(i for (w, n), i in at.items() if w == "create" and ":trainer:" in n)
    first_setup = min(i for (w, n), i in at.items() if w == "setup")
    assert (
        first_rank < min(at[("create", n)] for n in rollouts) and max(at[("create", n)] for n in rollouts) < first_setup
    ), seq
    job.c.leads = False
    first.stop(final=False)
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert [n for n, _ in job.layer.created if ":rollout:" in n] == rollouts  # adopted, none prestarted
    assert job.events("adopted")[0]["rollouts"] == 2


def test_a_new_leader_adopts_the_running_workers_and_applies_no_step_twice(tmp_path: Path) -> None:
    script = Script(train_delay_s=0.05)
    job = Job(tmp_path, script, steps=6)
    first = job.lead()
    job.wait(lambda: job.c.state.get("step", 0) >= 2)
    job.c.leads = False  # the leader loses its lease mid-run ...
    first.stop(final=False)  # ... and the controller stops its driver
    assert not first._thread.is_alive()  # stop returns once the thread can write no more
    trainers_before = job.created("trainer")
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert job.created("trainer") == trainers_before  # adopted, not restarted
    (adopted,) = job.events("adopted")
    assert adopted["trainers"] == 2 and adopted["rollouts"] == 2
    assert max(job.steps_trained().values()) == 1 and _digest_of_final_weights(job) == "0,1,2,3,4,5"


def test_a_step_trained_but_not_committed_is_committed_once_by_the_next_leader(tmp_path: Path) -> None:
    job = Job(tmp_path, steps=5)

    def lose_lead_during(step: int, rank: int) -> None:
        if step == 2 and job.c.token == 1 + 1:  # the first runner's term
            job.c.leads = False  # the step trains; its commit is refused (fenced)

    job.script.on_train = lose_lead_during
    first = job.lead()
    first._thread.join(20)
    assert not first._thread.is_alive() and job.c.state["step"] == 2  # trained 2, committed only 0, 1
    job.lead()
    assert job.finish() == "SUCCEEDED"
    (rec,) = job.events("commit_recovered")
    assert rec["step"] == 2
    assert max(job.steps_trained().values()) == 1 and _digest_of_final_weights(job) == "0,1,2,3,4"


def test_a_rank_lost_mid_step_restarts_the_group_from_the_snapshot_and_replays(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(kill_rank_at={(3, 0)}), steps=5)  # no collective: rank 1 goes on to step 4
    job.lead()
    assert job.finish() == "SUCCEEDED"
    (restart,) = job.events("trainer_restart")
    assert restart["cause"] == "lost" and restart["resize"] is False and views.is_fault({"kind": "trainer_restart",
                                                                                           **restart})  # fmt: skip
    assert job.c.lineage[3]["from_step"] == 2  # restored from the step-2 snapshot, replayed step 2
    assert job.events("replay")[0]["first"] == 2
    assert _digest_of_final_weights(job) == "0,1,2,3,4"  # the restored lineage applied each step once
    assert "recovered" in job.kinds() and job.c.state["open_faults"] == []


def test_a_rollout_worker_lost_mid_shard_has_its_shard_generated_again_once(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(kill_rollout_at={(1, 0)}), steps=3)
    job.lead()
    assert job.finish() == "SUCCEEDED"
    sends = Counter((a[0], a[1]) for name, m, a in job.layer.calls if m == "generate_shard")
    assert sends[(1, 0)] == 2 and all(n == 1 for key, n in sends.items() if key != (1, 0))
    assert Counter((s, sh) for s, sh, _ in job.script.generated)[(1, 0)] == 1  # journaled once
    (fault,) = job.events("rollout_fault")
    assert fault["worker"] in (0, 1) and "ActorDiedError" in fault["message"]


def test_the_watchdog_replaces_a_hung_rollout_worker(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(hang_rollout_at={(1, 1)}), steps=3, fault={"hang_timeout": 0.5})
    job.lead()
    assert job.finish() == "SUCCEEDED"
    (hang,) = job.events("rollout_hang")
    assert hang["detection_s"] >= 0.5
    assert Counter((s, sh) for s, sh, _ in job.script.generated)[(1, 1)] == 1


def test_a_frozen_rollout_worker_is_found_by_the_probe_long_before_its_shard_limit(tmp_path: Path) -> None:
    """Rollout worker of shard 2/1 freezes (SIGSTOP: its liveness call unanswered too): probed
    once its shard runs 4x the median shard (at least 1 s), silent for ``probe_timeout``, so
    replaced and its shard re-queued, not at the 600 s limit. A worker that answers but does
    not finish (deadlocked) is left to that limit: ``channel: progress``."""
    job = Job(tmp_path / "a", Script(freeze_rollout_at={(2, 1)}), steps=4,
              fault={"hang_timeout": 600, "probe_timeout": 0.5})  # fmt: skip
    job.lead()
    assert job.finish(timeout=60) == "SUCCEEDED"
    (hang,) = job.events("rollout_hang")
    assert hang["channel"] == "probe" and 1.5 <= hang["detection_s"] < 10, hang
    assert Counter((s, sh) for s, sh, _ in job.script.generated)[(2, 1)] == 1
    assert job.events("rollout_fault")

    live = Job(tmp_path / "b", Script(hang_rollout_at={(2, 1)}), steps=4,
               fault={"hang_timeout": 2.5, "probe_timeout": 0.5})  # fmt: skip
    live.lead()
    assert live.finish(timeout=60) == "SUCCEEDED"
    (hang,) = live.events("rollout_hang")
    assert hang["channel"] == "progress" and hang["detection_s"] >= 2.5, hang
    assert live.script.probes >= 1


def test_a_slow_rollout_worker_that_stamps_progress_is_not_called_hung(tmp_path: Path) -> None:
    """A shard past its limit whose worker's membership shows progress on that very shard (a
    loaded machine, reward calls timing out one after another) is waited for; the next worker to
    go quiet on its shard is called hung as before."""
    script = Script(slow_rollout_at={(1, 0): 2.0}, hang_rollout_at={(2, 1)})
    job = Job(tmp_path, script, steps=3, fault={"hang_timeout": 0.5})

    def stamp(worker: int, step: int, shard: int) -> None:
        value = {"status": "busy", "step": step, "shard": shard, "progress_at": time.time()}
        job.c.membership.setdefault("rollout", {})[str(worker)] = value

    script.on_progress = stamp
    job.lead()
    assert job.finish() == "SUCCEEDED"
    (hang,) = job.events("rollout_hang")  # the quiet one only
    assert "shard 2/1" in hang["message"], hang
    sends = Counter((a[0], a[1]) for name, m, a in job.layer.calls if m == "generate_shard")
    assert sends[(1, 0)] == 1 and sends[(2, 1)] == 2  # the slow shard was sent once, the hung one again


def test_a_shard_that_finished_while_the_runner_waited_is_taken_in_not_called_hung(tmp_path: Path) -> None:
    """Seen in the chaos hardening run: the runner waited 20 s on a snapshot's staging (its rank
    frozen) while the step's shards finished; the watchdog's next pass called their workers hung
    (idle, their calls done but not yet taken in). A finished call is never a hang."""
    script = Script(snapshot_delay_s={2: 1.5}, shard_delay_s=0.05)
    job = Job(tmp_path, script, steps=4, fault={"hang_timeout": 0.5})
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert job.events("rollout_hang") == [] and job.events("rollout_fault") == [], job.kinds()
    sends = Counter((a[0], a[1]) for name, m, a in job.layer.calls if m == "generate_shard")
    assert all(n == 1 for n in sends.values()), sends  # every shard generated once


def test_a_hung_trainer_rank_restarts_the_group(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(hang_rank_at={(2, 0)}), steps=3, fault={"hang_timeout": 0.3})
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert job.events("trainer_hang") and job.events("trainer_restart")[0]["cause"] == "hang"
    assert _digest_of_final_weights(job) == "0,1,2"


def test_at_world_one_a_hung_rank_is_killed_and_a_warm_spare_takes_over(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(hang_rank_at={(3, 0)}, train_delay_s=0.02), steps=5, trainer={"replicas": 1},
              fault={"hang_timeout": 0.3})  # fmt: skip
    job.lead()
    assert job.finish() == "SUCCEEDED"
    (hang,) = job.events("trainer_hang")
    assert hang["channel"] == "deadline"
    (restart,) = job.events("trainer_restart")
    assert restart["recovery"] == "hot" and restart["lost"] == [0] and "hung" in restart["message"], restart
    assert job.events("trainer_recovered")[0]["spares_used"] == 1
    assert _digest_of_final_weights(job) == "0,1,2,3,4"


def test_a_crash_loop_spends_the_restart_budget_and_fails_the_job_with_the_reason(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(kill_rank_at={(1, 0)}, fail_start=0), steps=4,
              fault={"max_restarts": 1, "restart_window": 600})  # fmt: skip

    def crash_on_restart(step: int, rank: int) -> None:
        job.script.fail_start = 100  # every later start of a rank dies in setup

    job.script.on_train = lambda s, r: crash_on_restart(s, r) if s == 1 else None
    job.lead()
    assert job.finish() == "FAILED"
    assert "trainer group restarted 2 times within 600s (fault.max_restarts = 1)" in job.c.state["reason"]


def test_a_corrupt_newest_snapshot_falls_back_to_the_one_before(tmp_path: Path) -> None:
    job = Job(tmp_path, steps=6, checkpoint={"every": 2})
    root = tmp_path / "work" / "snapshots"

    def corrupt_then_crash(step: int, rank: int) -> None:
        if step == 5 and rank == 0 and not job.events("trainer_restart"):
            job.wait(lambda: 4 in job.c.records)  # committed beside this step (the io group)
            (snapshot_dir(root, 4) / "rank0.json").write_text('{"step": 4, "applied": [9, 9, 9, 9]}')
            job.script.kill_rank_at.add((5, 0))

    job.script.on_train = corrupt_then_crash
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert [e["step"] for e in job.events("snapshot_corrupt")] == [4]
    assert job.c.lineage[5]["from_step"] == 2  # not the corrupt 4
    assert _digest_of_final_weights(job) == "0,1,2,3,4,5"


def test_a_replacement_starts_only_after_its_backoff_which_grows_with_its_place_failing_in_a_row(
    tmp_path: Path,
) -> None:
    """One worker: it dies in shard 1/0, its replacement dies in the same shard before it finished
    any (a crash loop: 0.5 s, then 1 s), the next one serves; a later fault of the place is backed
    off 0.5 s again (the shard it finished reset the count), however many faults came before in
    the restart window."""
    kills = {(1, 0): 2, (3, 0): 1}  # shard -> how many times its worker dies in it

    def on_shard(worker: int, step: int, shard: int) -> None:
        if kills.get((step, shard), 0) > 0:
            kills[(step, shard)] -= 1
            job.script.kill_rollout_at.add((step, shard))

    job = Job(tmp_path, Script(on_shard=on_shard, train_delay_s=0.15), steps=6, rollout={"replicas": 1, "spares": 0})
    job.lead()
    assert job.finish() == "SUCCEEDED"
    faults = job.events("rollout_fault")
    assert [f["backoff_s"] for f in faults] == [0.5, 1.0, 0.5], faults
    name = "rrl:drv:rollout:0"
    killed = min(t for n, t in job.layer.killed if n == name)
    started = min(t for n, t in job.layer.created if n == name and t > killed)
    assert started - killed >= 0.5 - 0.02


def test_scale_down_drains_a_worker_and_gives_it_no_shard_after(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(shard_delay_s=0.02), steps=6, rollout={"replicas": 3})
    runner = job.lead()
    job.wait(lambda: job.c.state.get("step", 0) >= 1)
    job.desired = {"rollout": 1}
    runner.reconcile(job.record())
    assert job.finish() == "SUCCEEDED"
    drained = [e["worker"] for e in job.events("scale") if "drained" in e["message"]]
    assert sorted(drained) == [1, 2]
    for w in (1, 2):
        name = f"rrl:drv:rollout:{w}"
        at = job.layer.calls.index(next(c for c in job.layer.calls if c[0] == name and c[1] == "shutdown"))
        assert not [c for c in job.layer.calls[at:] if c[0] == name and c[1] == "generate_shard"]
    resize = [e for e in job.c.events if e[0] == "scale"]
    assert not any(views.is_fault({"kind": k, **d}) for k, _, d in resize)


def test_a_trainer_resize_is_no_fault(tmp_path: Path) -> None:
    # and spends no restart: under max_restarts 0 an operator's `rrl scale` failed the job
    job = Job(tmp_path, steps=6, checkpoint={"every": 1}, fault={"max_restarts": 0})
    runner = job.lead()
    job.wait(lambda: job.c.state.get("step", 0) >= 2)
    job.desired = {"trainer": 1}
    runner.reconcile(job.record())
    assert job.finish() == "SUCCEEDED", job.c.state.get("reason")
    (restart,) = job.events("trainer_restart")
    assert restart["resize"] is True and not views.is_fault({"kind": "trainer_restart", **restart})
    assert "recovered" not in job.kinds()  # nothing to recover from
    assert all(not w.get("open_faults") for w in job.c.writes if "open_faults" in w)


def test_a_strategy_change_restarts_the_trainer_under_it_at_a_step_boundary(tmp_path: Path) -> None:
    job = Job(tmp_path, steps=6, checkpoint={"every": 1})
    runner = job.lead()
    job.wait(lambda: job.c.state.get("step", 0) >= 2)
    job.desired = {"strategy": "fsdp"}
    runner.reconcile(job.record())
    assert job.finish() == "SUCCEEDED"
    (restart,) = job.events("trainer_restart")
    assert "strategy ddp -> fsdp" in restart["message"] and restart["resize"] is True
    segments = [job.c.lineage[k] for k in sorted(job.c.lineage)]
    assert [s["strategy"] for s in segments] == ["ddp", "fsdp"]
    assert _digest_of_final_weights(job) == "0,1,2,3,4,5"  # no step lost or applied twice across the switch


def test_fsdp_asked_of_a_job_without_sharded_snapshots_is_refused_with_an_event(tmp_path: Path) -> None:
    job = Job(tmp_path, steps=4, checkpoint={"backend": "torchsnapshot"})
    runner = job.lead()
    job.desired = {"strategy": "fsdp"}
    runner.reconcile(job.record())
    assert job.finish() == "SUCCEEDED"
    (refusal,) = [e for e in job.events("scale") if e.get("refused")]
    assert "fsdp needs checkpoint.backend dcp" in refusal["message"]
    assert {s["strategy"] for s in job.c.lineage.values()} == {"ddp"} and not job.events("trainer_restart")


def test_a_shard_beyond_the_staleness_bound_fails_the_job(tmp_path: Path) -> None:
    job = Job(tmp_path, steps=4, prompts_per_step=2, rollout={"replicas": 1}, **{"async": {"max_staleness": 0}})
    # a complete batch for step 2 made by policy v0 (a journal left from before): never trained
    journal = Journal(tmp_path / "work" / "journal")
    sample = {"prompt_index": 0, "sample": 0, "prompt_ids": [3], "token_ids": [4], "logprobs": [0.0], "text": "x",
              "reward": 0.0, "reward_error": None, "version": 0}  # fmt: skip
    journal.commit_batch(2, [journal.write_shard(2, 0, [sample, {**sample, "sample": 1}], {"version": 0})])
    job.lead()
    assert job.finish() == "FAILED"
    assert "step 2: a shard was generated by policy v0, beyond max_staleness" in job.c.state["reason"]
    assert (2, 0) not in job.steps_trained()


def test_on_policy_every_trained_sample_comes_from_the_policy_of_its_step(tmp_path: Path) -> None:
    job = Job(tmp_path, steps=4, **{"async": {"max_staleness": 0}})
    job.lead()
    assert job.finish() == "SUCCEEDED"
    journal = Journal(tmp_path / "work" / "journal")
    for k in range(4):
        assert {s["version"] for s in journal.read_batch(k)} == {k}


def test_a_leader_that_loses_its_lease_mid_step_writes_nothing_after(tmp_path: Path) -> None:
    job = Job(tmp_path, steps=5)

    def lose(step: int, rank: int) -> None:
        if step == 1 and rank == 0:
            job.c.leads = False

    job.script.on_train = lose
    runner = job.lead()
    runner._thread.join(20)
    assert not runner._thread.is_alive()
    assert job.c.state["step"] == 1 and job.c.state["phase"] == "RUNNING"  # not FAILED: the next leader goes on
    assert not [w for w in job.c.writes if w.get("step") == 2]  # step 1 trained, never committed
    sent = len(job.layer.calls)
    time.sleep(0.3)
    assert len(job.layer.calls) == sent  # nothing is sent to a worker after
    assert not job.layer.killed  # the workers stay for the next leader


def test_a_stopped_runner_touches_no_worker_and_writes_nothing_after_stop(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(train_delay_s=0.05), steps=10)
    runner = job.lead()
    job.wait(lambda: job.c.state.get("step", 0) >= 2)
    runner.stop(final=False)  # the controller replaces this driver (its lease is still valid)
    assert not runner._thread.is_alive()
    at_stop = job.c.state["step"]
    calls, writes = len(job.layer.calls), len(job.c.writes)
    time.sleep(0.3)
    assert (len(job.layer.calls), len(job.c.writes)) == (calls, writes)
    assert at_stop < 10 and job.c.state["phase"] == "RUNNING"  # not finished, not failed: the next runner goes on


def test_each_crash_spends_one_restart_of_the_budget(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(kill_rank_at={(1, 0), (2, 1), (3, 0)}), steps=5, checkpoint={"every": 1},
              fault={"max_restarts": 2, "restart_window": 600})  # fmt: skip
    job.lead()
    assert job.finish() == "FAILED"  # the third crash is one too many, though every restart succeeded
    assert len(job.events("trainer_recovered")) == 2
    assert "trainer group restarted 3 times within 600s (fault.max_restarts = 2)" in job.c.state["reason"]


def test_a_step_committed_meanwhile_by_someone_else_is_never_applied_twice(tmp_path: Path) -> None:
    job = Job(tmp_path, steps=4)

    def other_writer(step: int, rank: int) -> None:
        if step == 2 and rank == 0:
            with job.c.lock:
                job.c.state["step"] = 3  # step 2 committed by another runner while this one trained it

    job.script.on_train = other_writer
    job.lead()
    assert job.finish() == "FAILED"
    assert "refusing to commit step 2: etcd says the job is at step 3" in job.c.state["reason"]
    assert not [w for w in job.c.writes if w.get("step") == 3 and "reward" in w]


def test_stop_waits_for_a_write_under_way_and_refuses_every_later_one(tmp_path: Path) -> None:
    import threading

    from controller.election import NotLeader
    from resilient_rl.job.context import JobContext

    c = FakeController()
    entered, release = threading.Event(), threading.Event()

    def slow(cur: dict[str, Any]) -> None:  # an etcd write that takes its time
        entered.set()
        release.wait(5)

    ctx = JobContext("drv", parse_spec(_spec(tmp_path)), 1, tmp_path, "", c, None, want=lambda g: 1)  # type: ignore[arg-type]
    writer = threading.Thread(target=lambda: ctx.update_state(expect=slow, step=7))
    writer.start()
    entered.wait(5)
    stopper = threading.Thread(target=ctx.stop)
    stopper.start()
    time.sleep(0.2)
    assert stopper.is_alive()  # stop() waits for the write under way ...
    release.set()
    stopper.join(5)
    writer.join(5)
    assert not stopper.is_alive() and c.state["step"] == 7
    for write in (lambda: ctx.update_state(step=8), lambda: ctx.event("snapshot", "x"),
                  lambda: ctx.append_metrics({"step": 8}), lambda: ctx.record_lineage(8, {})):  # fmt: skip
        with pytest.raises(NotLeader):  # ... and nothing is written after it returned
            write()
    assert c.state["step"] == 7 and not (tmp_path / "metrics.jsonl").exists()


def test_a_rank_that_dies_while_starting_is_started_again_after_a_backoff(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(kill_rank_at={(2, 0)}), steps=4)  # rank 0: no result of step 2, so the cold path
    job.script.on_train = lambda s, r: setattr(job.script, "fail_start", 1) if (s, r) == (2, 0) else None
    job.lead()
    assert job.finish() == "SUCCEEDED"
    (failed,) = [e for e in job.events("trainer_restart") if e["cause"] == "start_failed"]
    # the first start that failed (the rank's loss before it, recovered from, does not count)
    assert failed["backoff_s"] == 0.5 and failed["resize"] is False
    starts = [t for n, t in job.layer.created if n == "rrl:drv:trainer:0"]
    assert len(starts) == 3 and starts[2] - starts[1] >= 0.5  # not at once: the backoff passed
    assert _digest_of_final_weights(job) == "0,1,2,3"


def test_a_deposed_runner_fenced_out_by_the_workers_steps_back_without_failing_the_job(tmp_path: Path) -> None:
    """A leader that does not know yet that it lost (its lease looks valid) keeps calling the
    workers; once the new leader adopted them they refuse its calls (fence), and it steps back:
    no FAILED, no step applied twice."""
    job = Job(tmp_path, Script(train_delay_s=0.05), steps=8)
    old = job.lead()
    job.wait(lambda: job.c.state.get("step", 0) >= 2)
    new = job.lead()  # a newer token adopts (fences) every worker; `old` is not told
    old._thread.join(20)
    assert not old._thread.is_alive()
    assert job.finish() == "SUCCEEDED" and new is job.runner, job.c.state.get("reason")
    assert "failed" not in job.kinds()  # (the new leader may have had to restart the ranks: allowed)
    assert _digest_of_final_weights(job) == ",".join(map(str, range(8)))  # each step applied once


def test_starts_that_find_a_rank_unreachable_are_retried_without_spending_the_budget(tmp_path: Path) -> None:
    """After a node loss Ray may report a new rank unreachable (not dead) until its health
    check catches up: those starts back off but count no restart; a real death still does."""
    job = Job(tmp_path, Script(kill_rank_at={(1, 0)}), steps=3, fault={"max_restarts": 1, "restart_window": 600})

    def after_the_loss(step: int, rank: int) -> None:
        if (step, rank) == (1, 0):
            job.script.unreachable_start = 2  # the next two starts find a rank unreachable (0.5 s, 1 s)

    job.script.on_train = after_the_loss
    job.lead()
    assert job.finish() == "SUCCEEDED"  # two failed starts after the restart, yet max_restarts = 1 holds
    failed = [e for e in job.events("trainer_restart") if e["cause"] == "start_failed"]
    assert [e["budgeted"] for e in failed] == [False, False]
    assert [e["backoff_s"] for e in failed] == [0.5, 1.0]


# -- hot recovery of the trainer group ------------------------------------------------------


def _serials(job: Job, step: int) -> dict[int, int]:
    """rank -> the actor (serial) that applied ``step``."""
    return {r: a for s, r, a in job.script.trained if s == step}


def test_a_rank_lost_mid_step_is_replaced_hot_the_survivor_keeps_its_state(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(collective=True, kill_rank_at={(3, 1)}), steps=5)
    job.lead()
    assert job.finish() == "SUCCEEDED"
    (restart,) = job.events("trainer_restart")
    assert restart["recovery"] == "hot" and restart["lost"] == [1] and restart["survivors"] == [0]
    assert views.is_fault({"kind": "trainer_restart", **restart})
    (back,) = job.events("trainer_recovered")
    assert back["recovery"] == "hot" and back["epoch"] == 1 == job.c.state["trainer_epoch"]
    assert "replay" not in job.kinds() and 3 not in job.c.lineage  # no restore, nothing replayed
    assert _serials(job, 4)[0] == _serials(job, 0)[0]  # rank 0 is the same actor throughout
    assert _serials(job, 4)[1] != _serials(job, 0)[1]  # rank 1 is the newcomer
    assert job.steps_trained() == Counter({(s, r): 1 for s in range(5) for r in range(2)})  # step 3 applied once
    assert _digest_of_final_weights(job) == "0,1,2,3,4"
    # the warm spare (trainer.spares: 1, the default) became rank 1; another was started after
    assert back["spares_used"] == 1 and job.script.promoted == [_serials(job, 4)[1]]
    assert len(job.created("trainer")) == 2 and job.created("trainer-spare") == [
        "rrl:drv:trainer-spare:0", "rrl:drv:trainer-spare:1"]  # fmt: skip
    assert job.c.state["trainer_actors"] == {"1": "rrl:drv:trainer-spare:0"}  # for a new leader's adopt
    assert not [n for n in job.layer.names("rrl:drv:") if "trainer" in n]  # all stopped at the end


def test_after_a_hot_recovery_the_group_publishes_the_weights_again(tmp_path: Path) -> None:
    """The handle the rollout workers load may have died with the lost rank (or its node's weight
    store): the recovered group publishes version 3 again before step 3 is trained again."""
    job = Job(tmp_path, Script(collective=True, kill_rank_at={(3, 0)}), steps=5)
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert [e["recovery"] for e in job.events("trainer_restart")] == ["hot"]
    assert sorted(job.script.published) == [(3, 0), (3, 1)]  # every rank takes part, at the committed step
    assert _digest_of_final_weights(job) == "0,1,2,3,4"


def test_after_a_hot_recovery_weights_the_store_still_holds_are_not_published_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weight store owns each version's buckets and handle: when it answers that it still
    holds the current version after a rank was lost, nothing is published again (no pass over
    the weights, no reload in the rollout workers before the step is retrained); exact."""
    from resilient_rl.workers.weights import WeightStore

    asked: list[int] = []

    def holds(self: WeightStore, version: int) -> list[Any]:
        asked.append(version)
        return [("weights", version)]

    monkeypatch.setattr(WeightStore, "get", holds)
    job = Job(tmp_path, Script(collective=True, kill_rank_at={(3, 0)}), steps=5)
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert [e["recovery"] for e in job.events("trainer_restart")] == ["hot"]
    assert asked == [3] and job.script.published == []
    assert _digest_of_final_weights(job) == "0,1,2,3,4"


def test_without_a_spare_the_hot_path_starts_a_new_process_for_the_lost_rank(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(collective=True, kill_rank_at={(3, 1)}), steps=5, trainer={"spares": 0})
    job.lead()
    assert job.finish() == "SUCCEEDED"
    (back,) = job.events("trainer_recovered")
    assert back["recovery"] == "hot" and back["spares_used"] == 0
    assert job.created("trainer") == ["rrl:drv:trainer:0", "rrl:drv:trainer:1", "rrl:drv:trainer:1"]
    assert job.created("trainer-spare") == [] and _digest_of_final_weights(job) == "0,1,2,3,4"


def test_after_a_hot_recovery_the_spare_is_refilled_once_the_retried_step_is_committed(tmp_path: Path) -> None:
    """The promoted spare's replacement starts only after step 3 (the retried one) is committed:
    its start-up would compete with that step for the CPUs (TrainerGroup.fill_spares)."""
    job = Job(tmp_path, Script(collective=True, train_delay_s=0.05, kill_rank_at={(3, 1)}), steps=6)
    committed_at: dict[str, int] = {}
    create = job.layer.create

    def noting_the_committed_step(role: str, name: str, args: Any, placement: Any) -> Any:
        committed_at.setdefault(name, int(job.c.state.get("step") or 0))
        return create(role, name, args, placement)

    job.layer.create = noting_the_committed_step  # type: ignore[method-assign]
    job.lead()
    assert job.finish() == "SUCCEEDED"
    (back,) = job.events("trainer_recovered")
    assert back["recovery"] == "hot" and back["spares_used"] == 1
    assert job.created("trainer-spare") == ["rrl:drv:trainer-spare:0", "rrl:drv:trainer-spare:1"]
    assert committed_at["rrl:drv:trainer-spare:0"] == 0  # beside the ranks at the start
    assert committed_at["rrl:drv:trainer-spare:1"] == 4  # steps 0..3 committed, not before
    assert _digest_of_final_weights(job) == "0,1,2,3,4,5"


def test_at_world_one_a_rank_lost_while_the_refilled_spare_still_warms_waits_for_that_spare(tmp_path: Path) -> None:
    """The only rank dies at step 1 (the warm spare takes over) and again at step 3, while the
    refill started after step 1's commit still warms (1.5 s): that spare is waited for and takes
    over, hot, rather than a cold start of a new process beside it."""
    job = Job(tmp_path, Script(kill_rank_at={(1, 0), (3, 0)}, train_delay_s=0.05), steps=6, trainer={"replicas": 1})
    job.script.on_train = lambda step, rank: setattr(job.script, "spare_warm_s", 1.5)  # the first spare is warm
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert [e["recovery"] for e in job.events("trainer_restart")] == ["hot", "hot"]
    assert job.created("trainer") == ["rrl:drv:trainer:0"]  # no cold start
    assert job.created("trainer-spare")[:2] == ["rrl:drv:trainer-spare:0", "rrl:drv:trainer-spare:1"]
    assert _digest_of_final_weights(job) == "0,1,2,3,4,5"


def test_a_spare_lost_while_idle_is_passed_over_and_refilled(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(collective=True), steps=5)

    def kill_the_spare_then_rank_1(step: int, rank: int) -> None:
        if step == 3 and rank == 1 and not job.script.kill_rank_at and not job.events("trainer_restart"):
            spare = job.layer.find("rrl:drv:trainer-spare:0")
            assert spare is not None, "the spare was not started"
            job.layer.kill(spare)
            job.script.kill_rank_at.add((3, 1))

    job.script.on_train = kill_the_spare_then_rank_1
    job.lead()
    assert job.finish() == "SUCCEEDED"
    (back,) = job.events("trainer_recovered")
    assert back["recovery"] == "hot" and back["spares_used"] == 0  # a new process instead
    assert "rrl:drv:trainer-spare:1" in job.created("trainer-spare")  # the lost spare replaced
    assert _digest_of_final_weights(job) == "0,1,2,3,4"


def test_a_spare_that_dies_while_warming_is_replaced_in_the_background(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(collective=True, spare_dies=1, train_delay_s=0.05), steps=6)
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert job.created("trainer-spare")[:2] == ["rrl:drv:trainer-spare:0", "rrl:drv:trainer-spare:1"]
    assert "trainer_restart" not in job.kinds()  # a spare is not a rank: no fault of the group


def test_hot_recovery_falls_back_to_the_cold_path_when_the_survivor_applied_the_step(tmp_path: Path) -> None:
    """Without a collective the survivor finishes step 3 (it is at 4, not the committed 3): its
    state is not the committed step's, so it is not trusted: the whole group restarts. (The
    lost rank is rank 0: had rank 0 returned the step, it would be committed from its result,
    see test_a_rank_lost_after_the_step_was_whole_on_rank_0_is_committed_then_replaced_hot.)"""
    job = Job(tmp_path, Script(kill_rank_at={(3, 0)}), steps=5)
    job.lead()
    assert job.finish() == "SUCCEEDED"
    (restart,) = job.events("trainer_restart")
    assert restart["recovery"] == "cold" and restart["cause"] == "lost"
    assert restart["hot_refused"] == "surviving trainer ranks at steps [4], committed 3", restart  # why not hot
    assert job.c.lineage[3]["from_step"] == 2 and _digest_of_final_weights(job) == "0,1,2,3,4"


def test_hot_recovery_falls_back_to_the_cold_path_when_a_survivor_state_is_not_the_committed_one(
    tmp_path: Path,
) -> None:
    """The survivor's step counter says 3 (committed), but its state sketch is not the one the
    commit of step 2 recorded: it cannot prove its state, so the whole group restarts."""
    job = Job(tmp_path, Script(collective=True, kill_rank_at={(3, 1)}, drift={0}), steps=5)
    job.lead()
    assert job.finish() == "SUCCEEDED"
    (restart,) = job.events("trainer_restart")
    assert restart["recovery"] == "cold" and restart["cause"] == "lost"
    assert restart["hot_refused"].startswith("surviving trainer rank(s) [0] do not hold the state"), restart
    assert job.c.lineage[3]["from_step"] == 2 and _digest_of_final_weights(job) == "0,1,2,3,4"
    assert job.c.state["state_sketch"] == ["5:" + ",".join(map(str, range(5)))] * 2  # the last commit's


def test_hot_recovery_falls_back_to_the_cold_path_when_a_newcomer_state_differs(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(collective=True, kill_rank_at={(3, 1)}, bad_fingerprint=1), steps=5)
    job.lead()
    assert job.finish() == "SUCCEEDED"
    hot, cold = job.events("trainer_restart")
    assert hot["recovery"] == "hot" and cold["recovery"] == "cold" and cold["cause"] == "hot_failed"
    assert "fingerprints differ" in cold["message"]
    assert job.c.lineage[3]["from_step"] == 2 and _digest_of_final_weights(job) == "0,1,2,3,4"


def test_a_lost_fsdp_rank_is_replaced_hot_and_every_rank_loads_the_shadow_copy(tmp_path: Path) -> None:
    """fsdp, world 2: rank 1 dies in step 3. No rank holds its shards, so the survivor keeps its
    process (no restart, the same actor) but not its state: with the promoted spare it re-forms
    the group and both load their parts of the shadow copy of step 3 (a copy every step): nothing
    replayed, step 3 trained once, exact."""
    job = Job(tmp_path, Script(collective=True, kill_rank_at={(3, 1)}), steps=5, trainer={"strategy": "fsdp"})
    job.lead()
    assert job.finish() == "SUCCEEDED"
    (restart,) = job.events("trainer_restart")
    assert restart["recovery"] == "hot" and restart["lost"] == [1] and restart["survivors"] == [0]
    (back,) = job.events("trainer_recovered")
    assert back["recovery"] == "hot" and back["source"] == "shadow" and back["replayed"] == 0, back
    assert back["spares_used"] == 1 and job.script.promoted == [_serials(job, 4)[1]]
    assert _serials(job, 4)[0] == _serials(job, 0)[0]  # the survivor's process throughout
    assert job.script.reformed == [(_serials(job, 0)[0], "shadow")]  # ... which took the shadow copy
    assert [e["step"] for e in job.events("shadow_restored")] == [3] and job.c.lineage[3]["snapshot"] == "shadow@3"
    assert job.created("trainer") == ["rrl:drv:trainer:0", "rrl:drv:trainer:1"]  # no new rank process
    assert job.steps_trained() == Counter({(s, r): 1 for s in range(5) for r in range(2)})
    assert _digest_of_final_weights(job) == "0,1,2,3,4"


def test_a_lost_fsdp_rank_0_with_an_older_shadow_copy_is_replaced_hot_and_the_group_replays(tmp_path: Path) -> None:
    """shadow_every 2: at the loss of rank 0 in step 3 the newest complete copy is step 2's; both
    ranks load it and replay step 2 from the journal, then train step 3: exact."""
    job = Job(tmp_path, Script(collective=True, kill_rank_at={(3, 0)}), steps=5,
              trainer={"strategy": "fsdp", "shadow_every": 2}, checkpoint={"every": 50})  # fmt: skip
    job.lead()
    assert job.finish() == "SUCCEEDED"
    (back,) = job.events("trainer_recovered")
    assert back["recovery"] == "hot" and back["source"] == "shadow" and back["replayed"] == 1, back
    assert [(e["first"], e["last"]) for e in job.events("replay")] == [(2, 2)]
    assert _serials(job, 4)[1] == _serials(job, 0)[1] and _serials(job, 4)[0] != _serials(job, 0)[0]
    trained = job.steps_trained()
    assert trained[(2, 0)] == trained[(2, 1)] == 2 and trained[(3, 0)] == trained[(3, 1)] == 1, trained
    assert _digest_of_final_weights(job) == "0,1,2,3,4"


def test_at_world_one_under_fsdp_the_warm_spare_takes_over_from_the_shadow_copy(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(collective=True, kill_rank_at={(3, 0)}), steps=5,
              trainer={"replicas": 1, "strategy": "fsdp"}, checkpoint={"every": 50})  # fmt: skip
    job.lead()
    assert job.finish() == "SUCCEEDED"
    (back,) = job.events("trainer_recovered")
    assert back["recovery"] == "hot" and back["source"] == "shadow" and back["replayed"] == 0, back
    assert job.script.promoted == [_serials(job, 4)[0]] and job.created("trainer") == ["rrl:drv:trainer:0"]
    assert job.steps_trained() == Counter({(s, 0): 1 for s in range(5)})
    assert _digest_of_final_weights(job) == "0,1,2,3,4"


def test_a_lost_fsdp_rank_without_a_shadow_copy_or_whose_replay_misses_the_commit_takes_the_cold_path(
    tmp_path: Path,
) -> None:
    off = Job(tmp_path / "off", Script(collective=True, kill_rank_at={(3, 1)}), steps=5,
              trainer={"strategy": "fsdp", "shadow_every": 0})  # fmt: skip
    off.lead()
    assert off.finish() == "SUCCEEDED"
    assert [e["recovery"] for e in off.events("trainer_restart")] == ["cold"]
    assert off.c.lineage[3]["from_step"] == 2 and not off.events("shadow_restored")  # the snapshot of step 2
    bad = Job(tmp_path / "bad", Script(collective=True, kill_rank_at={(3, 1)}, bad_replay=1), steps=5,
              trainer={"strategy": "fsdp"})  # fmt: skip
    bad.lead()
    assert bad.finish() == "SUCCEEDED"
    hot, cold = bad.events("trainer_restart")
    assert hot["recovery"] == "hot" and cold["recovery"] == "cold" and cold["cause"] == "hot_failed"
    assert "not the committed one" in cold["message"], cold["message"]
    assert _digest_of_final_weights(off) == _digest_of_final_weights(bad) == "0,1,2,3,4"


def test_hot_recovery_off_or_world_one_takes_the_cold_path(tmp_path: Path) -> None:
    off = Job(tmp_path / "off", Script(collective=True, kill_rank_at={(3, 1)}), steps=5,
              trainer={"hot_recovery": False})  # fmt: skip
    off.lead()
    assert off.finish() == "SUCCEEDED"
    assert [e["recovery"] for e in off.events("trainer_restart")] == ["cold"]
    one = Job(tmp_path / "one", Script(collective=True, kill_rank_at={(3, 0)}), steps=5,
              trainer={"replicas": 1, "spares": 0})  # fmt: skip
    one.lead()
    assert one.finish() == "SUCCEEDED"
    assert [e["recovery"] for e in one.events("trainer_restart")] == ["cold"]
    assert _digest_of_final_weights(off) == _digest_of_final_weights(one) == "0,1,2,3,4"


def test_at_world_one_a_warm_spare_takes_over_from_the_newest_state_and_replays_to_the_commit(
    tmp_path: Path,
) -> None:
    """No survivor: the spare becomes rank 0, restores the snapshot of step 2 (the fakes keep no
    shadow copy), replays step 2 and trains on; no process is started on the critical path."""
    job = Job(tmp_path, Script(collective=True, kill_rank_at={(3, 0)}), steps=5, trainer={"replicas": 1},
              checkpoint={"every": 2})  # fmt: skip
    job.lead()
    assert job.finish() == "SUCCEEDED"
    (restart,) = job.events("trainer_restart")
    assert restart["recovery"] == "hot" and restart["lost"] == [0] and restart["survivors"] == []
    (back,) = job.events("trainer_recovered")
    assert back["recovery"] == "hot" and back["spares_used"] == 1 and back["source"] == "snapshot"
    assert back["replayed"] == 1 and job.c.lineage[3]["from_step"] == 2
    assert job.script.promoted == [_serials(job, 4)[0]] and _serials(job, 4)[0] != _serials(job, 0)[0]
    assert job.created("trainer") == ["rrl:drv:trainer:0"]  # the spare served: no new rank process
    assert job.steps_trained()[(2, 0)] == 2 and job.steps_trained()[(3, 0)] == 1  # 2 replayed; 3 trained once
    assert _digest_of_final_weights(job) == "0,1,2,3,4"


def test_at_world_one_a_spare_whose_replay_misses_the_committed_sketch_falls_back_to_the_cold_path(
    tmp_path: Path,
) -> None:
    job = Job(tmp_path, Script(collective=True, kill_rank_at={(3, 0)}, bad_replay=1), steps=5,
              trainer={"replicas": 1}, checkpoint={"every": 2})  # fmt: skip
    job.lead()
    assert job.finish() == "SUCCEEDED"
    hot, cold = job.events("trainer_restart")
    assert hot["recovery"] == "hot" and cold["recovery"] == "cold" and cold["cause"] == "hot_failed"
    assert "not the committed one" in cold["message"]
    assert job.c.lineage[3]["from_step"] == 2 and _digest_of_final_weights(job) == "0,1,2,3,4"


def test_both_ranks_lost_at_once_take_the_cold_path(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(collective=True, kill_rank_at={(3, 0), (3, 1)}), steps=5)
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert [e["recovery"] for e in job.events("trainer_restart")] == ["cold"]
    assert _digest_of_final_weights(job) == "0,1,2,3,4"


def test_a_cold_restart_keeps_the_warm_spare_for_the_next_fault(tmp_path: Path) -> None:
    """Both ranks lost at step 2 (cold: the group restarts); rank 1 lost at step 4 is then
    replaced hot by the spare warmed before the cold restart, not by a new process."""
    job = Job(tmp_path, Script(collective=True, train_delay_s=0.05, kill_rank_at={(2, 0), (2, 1), (4, 1)}),
              steps=6)  # fmt: skip
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert [e["recovery"] for e in job.events("trainer_restart")] == ["cold", "hot"]
    hot = job.events("trainer_recovered")[-1]
    assert hot["recovery"] == "hot" and hot["spares_used"] == 1
    assert job.created("trainer-spare") == ["rrl:drv:trainer-spare:0", "rrl:drv:trainer-spare:1"]  # 1: the refill
    assert _digest_of_final_weights(job) == "0,1,2,3,4,5"


def test_a_trainer_rank_whose_lease_expired_is_killed_and_replaced_hot(tmp_path: Path) -> None:
    """The membership channel: rank 1 hangs in step 3 (alive for the actor layer, as a SIGSTOPped
    process is for Ray); its member key vanishes (its lease expired). The runner kills it a
    lease TTL later, and the lost rank takes the hot path; nothing waits for a step deadline."""
    job = Job(tmp_path, Script(collective=True), steps=5, fault={"hang_timeout": 600, "lease_ttl": 2})
    both = {"0": {"pid": 1, "status": "ready"}, "1": {"pid": 2, "status": "ready"}}
    job.c.membership = {"trainer": dict(both)}

    def freeze(step: int, rank: int) -> None:
        if step == 3 and rank == 1 and not job.events("trainer_hang"):
            job.c.membership = {"trainer": {"0": both["0"]}}  # rank 1's lease expired
            job.script.hang_rank_at.add((3, 1))
        elif step == 3 and rank == 1:
            job.c.membership = {"trainer": dict(both)}  # the newcomer registered

    job.script.on_train = freeze
    job.lead()
    assert job.finish(timeout=60) == "SUCCEEDED"
    (hang,) = job.events("trainer_hang")
    assert hang["channel"] == "membership" and hang["worker"] == 1 and 2 <= hang["detection_s"] < 30
    assert [e["recovery"] for e in job.events("trainer_restart")] == ["hot"]
    assert _digest_of_final_weights(job) == "0,1,2,3,4"


def test_a_frozen_trainer_rank_is_found_by_the_probe_and_replaced_hot(tmp_path: Path) -> None:
    """The deadline channel's fast half: rank 1's process freezes in step 3 (SIGSTOP: alive for
    the actor layer, its liveness call unanswered too). Its step runs past 1 s (the floor of 4x
    the median step), both ranks are probed, rank 1 stays silent for ``probe_timeout`` and is
    killed: the hot path replaces it long before the 600 s step deadline."""
    job = Job(tmp_path, Script(collective=True, freeze_rank_at={(3, 1)}), steps=5,
              fault={"hang_timeout": 600, "probe_timeout": 0.5})  # fmt: skip
    job.lead()
    assert job.finish(timeout=60) == "SUCCEEDED"
    (hang,) = job.events("trainer_hang")
    assert hang["channel"] == "probe" and hang["worker"] == 1 and 1.5 <= hang["detection_s"] < 10, hang
    assert [e["recovery"] for e in job.events("trainer_restart")] == ["hot"]
    assert job.script.probes >= 1  # rank 0 answered its call: it was not killed
    assert _digest_of_final_weights(job) == "0,1,2,3,4"


def test_at_world_one_a_frozen_rank_found_by_the_probe_hands_over_to_the_spare(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(freeze_rank_at={(3, 0)}), steps=5, trainer={"replicas": 1},
              fault={"hang_timeout": 600, "probe_timeout": 0.5})  # fmt: skip
    job.lead()
    assert job.finish(timeout=60) == "SUCCEEDED"
    (hang,) = job.events("trainer_hang")
    assert hang["channel"] == "probe" and hang["worker"] == 0, hang
    (restart,) = job.events("trainer_restart")
    assert restart["recovery"] == "hot" and restart["lost"] == [0], restart
    assert _digest_of_final_weights(job) == "0,1,2,3,4"


@pytest.mark.parametrize("world", [1, 2])
def test_a_rank_frozen_between_steps_is_found_by_the_idle_probe_before_its_next_batch(
    tmp_path: Path, world: int
) -> None:
    """A rank stopped right after it returned step 2, while step 3's rollouts take 4 s: no call
    of the leader waits on it, so only its lease would find it (after a TTL without its key) and
    only once step 3 is sent to it. Idle ranks are probed after 1 s: the frozen one is killed and
    replaced hot while the rollouts still run, and step 3 trains on the replacement."""
    job = Job(tmp_path, Script(collective=True, freeze_rank_after={(2, world - 1)},
                               slow_rollout_at={(3, 0): 4.0}), steps=5,
              trainer={"replicas": world}, fault={"hang_timeout": 600, "probe_timeout": 0.5})  # fmt: skip
    job.lead()
    assert job.finish(timeout=60) == "SUCCEEDED"
    (hang,) = job.events("trainer_hang")
    assert hang["channel"] == "probe" and hang["worker"] == world - 1, hang
    assert "the wait for step 3's batch" in hang["message"] and 1.0 <= hang["detection_s"] < 3.5, hang
    (restart,) = job.events("trainer_restart")
    assert restart["recovery"] == "hot" and restart["lost"] == [world - 1], restart
    assert job.script.probes >= world - 1  # the other rank answered its probes: it was not killed
    assert _digest_of_final_weights(job) == "0,1,2,3,4"


def test_a_rank_frozen_while_staging_a_snapshot_is_found_by_the_probe_not_the_staging_deadline(
    tmp_path: Path,
) -> None:
    """Found in the hardening chaos scenario: a rank SIGSTOPped as its snapshot's staging began
    held the step loop for the staging deadline (max(10 s, 4 x hang_timeout)), then the lease.
    The staging wait probes the ranks as a train step does: the frozen one is killed within
    about 1 s + ``probe_timeout``, the snapshot fails, and the lost rank takes the hot path."""
    job = Job(tmp_path, Script(freeze_snapshot_at={(2, 0)}), steps=5, trainer={"replicas": 1},
              fault={"hang_timeout": 600, "probe_timeout": 0.5})  # fmt: skip
    job.lead()
    assert job.finish(timeout=60) == "SUCCEEDED"
    (hang,) = job.events("trainer_hang")
    assert hang["channel"] == "probe" and "snapshot at step 2" in hang["message"] and hang["detection_s"] < 10, hang
    assert [e["step"] for e in job.events("snapshot_failed")] == [2]
    assert [e["recovery"] for e in job.events("trainer_restart")] == ["hot"]
    assert _digest_of_final_weights(job) == "0,1,2,3,4"


def test_a_rank_that_answers_the_probe_is_left_to_the_step_deadline(tmp_path: Path) -> None:
    """A deadlocked rank (its step blocks, its control thread answers) is not frozen: the probe
    leaves it alone, and the step deadline (``hang_timeout``) finds it. With the probe off
    (``probe_timeout: 0``) a frozen rank is found by that deadline too, and nothing is probed."""
    job = Job(tmp_path / "a", Script(hang_rank_at={(2, 0)}, train_delay_s=0.02), steps=4, trainer={"replicas": 1},
              fault={"hang_timeout": 3.5, "probe_timeout": 0.5})  # fmt: skip
    job.lead()
    assert job.finish(timeout=60) == "SUCCEEDED"
    (hang,) = job.events("trainer_hang")
    assert hang["channel"] == "deadline" and hang["detection_s"] >= 3.5, hang
    assert job.script.probes >= 2  # probed at 1 s, and again 1 s after its answer was seen
    assert _digest_of_final_weights(job) == "0,1,2,3"

    off = Job(tmp_path / "b", Script(freeze_rank_at={(2, 0)}, train_delay_s=0.02), steps=4, trainer={"replicas": 1},
              fault={"hang_timeout": 1.5, "probe_timeout": 0})  # fmt: skip
    off.lead()
    assert off.finish(timeout=60) == "SUCCEEDED"
    (hang,) = off.events("trainer_hang")
    assert hang["channel"] == "deadline" and off.script.probes == 0, hang
    assert _digest_of_final_weights(off) == "0,1,2,3"


def test_a_lease_watch_counts_only_workers_it_saw_and_waits_a_ttl() -> None:
    from resilient_rl.job.faults import LeaseWatch

    w = LeaseWatch(ttl=5, every=1)
    assert w.observe({}, 0.0) == {}  # never seen: a group still starting is not lost
    assert w.observe({"0": {}, "1": {}}, 1.0) == {}
    assert w.observe({"0": {}}, 4.0) == {}  # gone 3 s: within the TTL (a re-registration may come)
    assert w.observe({"0": {}}, 6.0) == {"1": 5.0}
    assert w.observe({"0": {}, "1": {}}, 7.0) == {}  # back: not lost
    w.reset()
    assert w.observe({}, 100.0) == {} and w.due(100.0) and not w.due(100.5) and w.due(101.0)


# -- rollout spares ------------------------------------------------------------------


def _promoted_first_shard(job: Job) -> tuple[int, int]:
    """(step, version) of the first shard the promoted rollout spare generated."""
    ((_, serial, _),) = job.script.rollout_promoted
    return next((step, v) for step, _, s, v, _ in job.script.shards_by if s == serial)


def test_a_lost_rollout_worker_is_replaced_by_the_warm_spare_at_once(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(kill_rollout_at={(2, 0)}, shard_delay_s=0.02), steps=5)
    job.lead()
    assert job.finish() == "SUCCEEDED"
    (fault,) = job.events("rollout_fault")
    assert fault["spare"] == "rrl:drv:rollout-spare:0" and fault["backoff_s"] == 0.0  # no backoff
    (joined,) = [e for e in job.events("rollout_joined") if e.get("recovery_s") is not None]
    assert joined["spare"] == "rrl:drv:rollout-spare:0" and joined["worker"] == fault["worker"]
    assert job.created("rollout") == ["rrl:drv:rollout:0", "rrl:drv:rollout:1"]  # no process on the critical path
    assert job.created("rollout-spare")[:2] == ["rrl:drv:rollout-spare:0", "rrl:drv:rollout-spare:1"]  # refilled
    assert job.c.state["rollout_actors"] == {str(fault["worker"]): "rrl:drv:rollout-spare:0"}
    step, version = _promoted_first_shard(job)
    assert version == step  # on-policy: its first shard is generated by the current policy
    assert Counter((s, sh) for s, sh, _ in job.script.generated)[(2, 0)] == 1  # journaled once
    assert _digest_of_final_weights(job) == "0,1,2,3,4" and "group_restored" in job.kinds()


def test_a_rollout_spare_lost_while_idle_is_passed_over_and_refilled(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(shard_delay_s=0.05), steps=12)  # long enough for the backed-off replacement

    def kill_the_spare_then_a_worker(step: int, rank: int) -> None:
        if step == 2 and rank == 0 and not job.events("rollout_fault"):
            spare = job.layer.find("rrl:drv:rollout-spare:0")
            assert spare is not None, "the spare was not started"
            job.layer.kill(spare)
            job.script.kill_rollout_at.add((3, 0))

    job.script.on_train = kill_the_spare_then_a_worker
    job.lead()
    assert job.finish() == "SUCCEEDED"
    (fault,) = job.events("rollout_fault")
    assert "spare" not in fault and fault["backoff_s"] == 0.5  # no warm spare at the fault: backed off
    # the lost spare is replaced at the next pass, and once the backoff passed that one takes the
    # place (ready or still warming), not a new process started then
    assert job.created("rollout").count(f"rrl:drv:rollout:{fault['worker']}") == 1
    assert "rrl:drv:rollout-spare:1" in job.created("rollout-spare")
    assert [i for i, _, _ in job.script.rollout_promoted] == [fault["worker"]]
    assert _digest_of_final_weights(job) == ",".join(map(str, range(12)))


def test_a_rollout_worker_lost_while_the_spare_is_still_warming_takes_that_spare(tmp_path: Path) -> None:
    """Two rollout faults in a row (BENCHMARKS section 5's bursts): the first takes the warm
    spare and the pool starts warming another (1.5 s here); the second fault comes before it is
    ready and takes it anyway: no backoff, no new process started beside it (its first call
    queues behind the warm-up), and the job goes on exact."""
    job = Job(tmp_path, Script(kill_rollout_at={(1, 0), (2, 1)}, shard_delay_s=0.02), steps=6)
    # from step 0 on (the first spare is warm by then), spares warm slowly: the refill after the first fault
    job.script.on_train = lambda step, rank: setattr(job.script, "spare_warm_s", 1.5)
    job.lead()
    assert job.finish() == "SUCCEEDED"
    first, second = job.events("rollout_fault")
    assert first["spare"] == "rrl:drv:rollout-spare:0" and first["spare_ready"] is True, first
    assert second["spare"] == "rrl:drv:rollout-spare:1" and second["spare_ready"] is False, second
    assert second["backoff_s"] == 0.0 and "warming spare" in second["message"]
    assert job.created("rollout") == ["rrl:drv:rollout:0", "rrl:drv:rollout:1"]  # no new process for either
    assert sorted(i for i, _, _ in job.script.rollout_promoted) == sorted([first["worker"], second["worker"]])
    assert _digest_of_final_weights(job) == "0,1,2,3,4,5"


def test_a_rollout_spare_that_dies_while_warming_is_replaced_in_the_background(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(rollout_spare_dies=1, shard_delay_s=0.02), steps=4)
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert job.created("rollout-spare")[:2] == ["rrl:drv:rollout-spare:0", "rrl:drv:rollout-spare:1"]
    assert "rollout_fault" not in job.kinds()  # a spare is not a worker: no fault of the group


def test_a_new_leader_finds_a_promoted_rollout_spare_under_its_recorded_name(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(kill_rollout_at={(1, 1)}, train_delay_s=0.05), steps=12)
    first = job.lead()
    job.wait(lambda: job.c.state.get("step", 0) >= 3 and len(job.created("rollout-spare")) >= 2)
    job.c.leads = False
    first.stop(final=False)
    rollouts_before = job.created("rollout")
    job.lead()
    job.wait(lambda: job.c.state.get("step", 0) >= 6)  # well past the take-over (the job's end kills them all)
    assert not [n for n, _ in job.layer.killed if "rollout-spare" in n]
    assert job.finish() == "SUCCEEDED"
    assert job.created("rollout") == rollouts_before  # the promoted spare was adopted, not replaced
    assert job.events("adopted")[0]["rollouts"] == 2
    # the old leader's idle spare serves the new one (its fence is raised when it is promoted)
    assert job.created("rollout-spare") == ["rrl:drv:rollout-spare:0", "rrl:drv:rollout-spare:1"]
    assert max(job.steps_trained().values()) == 1 and _digest_of_final_weights(job) == ",".join(map(str, range(12)))


def test_a_leader_taking_over_while_a_replacement_rollout_worker_joins_still_ends_its_fault(tmp_path: Path) -> None:
    """A take-over while a lost rollout worker's replacement is still joining (a CI run of the
    node-loss e2e test never saw its group_restored): the new leader adopts the replacement, and
    its join still ends the fault (``rollout_down`` in the job's state) and restores the group."""
    joining, go = threading.Event(), threading.Event()
    job = Job(tmp_path, Script(kill_rollout_at={(2, 0)}, train_delay_s=0.1), steps=12, rollout={"spares": 0})

    def hold_the_replacement(index: int, serial: int) -> None:
        if job.events("rollout_fault") and not joining.is_set():
            joining.set()
            go.wait(10)

    job.script.on_join = hold_the_replacement
    first = job.lead()
    job.wait(joining.is_set)
    (fault,) = job.events("rollout_fault")
    assert job.c.state["rollout_down"] == {str(fault["worker"]): pytest.approx(time.time(), abs=5)}
    job.c.leads = False
    first.stop(final=False)
    go.set()
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert job.created("rollout").count(actor_name("drv", "rollout", fault["worker"])) == 2  # adopted, not restarted
    assert len(job.events("rollout_fault")) == 1  # a fault seen by the first leader is not counted again
    (joined,) = [e for e in job.events("rollout_joined") if e.get("recovery_s") is not None]
    assert joined["worker"] == fault["worker"] and joined["recovery_s"] > 0
    (restored,) = job.events("group_restored")
    assert restored["seconds"] == joined["recovery_s"]
    assert job.c.state["rollout_down"] is None  # nothing left down for a later leader
    assert max(job.steps_trained().values()) == 1 and _digest_of_final_weights(job) == ",".join(map(str, range(12)))


def test_rollouts_keep_going_while_the_trainer_group_restarts(tmp_path: Path) -> None:
    """max_staleness 1: while the group restarts after a rank loss at step 2 (its setup takes
    0.6 s here), the runner keeps dispatching: step 3's shards are generated meanwhile, one
    after the other by the one worker (so more than the one in flight at the fault)."""
    job = Job(tmp_path, Script(kill_rank_at={(2, 0)}, shard_delay_s=0.05), steps=5,
              rollout={"replicas": 1, "shards_per_step": 4, "spares": 0}, trainer={"hot_recovery": False},
              **{"async": {"max_staleness": 1}})  # fmt: skip
    # the restart's setups take 0.6 s, not the first start's
    job.script.on_train = lambda step, rank: setattr(job.script, "setup_delay_s", 0.6) if step == 2 else None
    job.lead()
    assert job.finish() == "SUCCEEDED"
    start, end = job.script.setups[-1]
    during = [(step, shard) for step, shard, _, _, t in job.script.shards_by if start < t < end]
    assert len(during) >= 2 and all(step == 3 for step, _ in during), during
    assert _digest_of_final_weights(job) == "0,1,2,3,4"


def test_a_new_leader_takes_over_the_idle_trainer_spare_and_a_fault_right_after_is_hot(tmp_path: Path) -> None:
    """A fault soon after a take-over found no spare when a new leader killed the previous
    leader's idle spares (seen in the soak: a cold restart 3 s after a take-over); it adopts them."""
    script = Script(collective=True, train_delay_s=0.05)
    job = Job(tmp_path, script, steps=8)
    first = job.lead()
    job.wait(lambda: job.c.state.get("step", 0) >= 2 and job.layer.find("rrl:drv:trainer-spare:0") is not None)
    job.c.leads = False
    first.stop(final=False)
    spare = job.layer.find("rrl:drv:trainer-spare:0")
    assert spare is not None
    script.kill_rank_at.add((5, 1))
    job.lead()
    assert job.finish() == "SUCCEEDED"
    (restart,) = job.events("trainer_restart")
    assert restart["recovery"] == "hot" and job.events("trainer_recovered")[0]["spares_used"] == 1
    assert script.promoted == [spare.obj.serial]  # the previous leader's spare, adopted, then promoted
    assert _digest_of_final_weights(job) == "0,1,2,3,4,5,6,7"


def _leader_and_only_rank_lost(tmp_path: Path, **script: Any) -> tuple[Job, Any, int]:
    """World 1: the leader is lost at a step >= 3 while its idle spare is warm, and its only rank
    is killed with it (the soak's burst: a trainer kill, then a leader kill); a new leader takes
    over. Returns the job, the spare the first leader left and the committed step at the take-over."""
    job = Job(tmp_path, Script(collective=True, train_delay_s=0.05, **script), steps=8, trainer={"replicas": 1},
              checkpoint={"every": 2})  # fmt: skip
    first = job.lead()
    job.wait(lambda: job.c.state.get("step", 0) >= 3 and job.layer.find("rrl:drv:trainer-spare:0") is not None)
    job.c.leads = False
    first.stop(final=False)
    spare, rank = job.layer.find("rrl:drv:trainer-spare:0"), job.layer.find("rrl:drv:trainer:0")
    assert spare is not None and rank is not None
    job.layer.kill(rank)
    k = int(job.c.state["step"])
    job.lead()
    assert job.finish() == "SUCCEEDED"
    return job, spare, k


def test_a_new_leader_finding_the_only_rank_gone_promotes_the_idle_spare_instead_of_a_new_process(
    tmp_path: Path,
) -> None:
    job, spare, k = _leader_and_only_rank_lost(tmp_path)
    (restart,) = job.events("trainer_restart")
    assert restart["recovery"] == "hot" and restart["cause"] == "take_over" and restart["step"] == k
    (back,) = job.events("trainer_recovered")
    assert back["recovery"] == "hot" and back["spares_used"] == 1 and back["replayed"] == k - 2 * (k // 2)
    assert job.script.promoted == [spare.obj.serial]  # the previous leader's spare ...
    assert job.created("trainer") == ["rrl:drv:trainer:0"]  # ... and no new rank process
    by_spare = Counter(s for s, _, a in job.script.trained if a == spare.obj.serial)
    assert all(by_spare[s] == 1 for s in range(k, 8))  # the promoted spare applied each later step once
    assert _digest_of_final_weights(job) == "0,1,2,3,4,5,6,7"


def test_a_take_over_spare_whose_replay_misses_the_commit_falls_back_to_a_cold_start(tmp_path: Path) -> None:
    job, spare, k = _leader_and_only_rank_lost(tmp_path, bad_replay=1)
    hot, cold = job.events("trainer_restart")
    assert hot["recovery"] == "hot" and hot["cause"] == "take_over"
    assert cold["recovery"] == "cold" and cold["cause"] == "hot_failed" and "not the committed one" in cold["message"]
    assert job.script.promoted == [spare.obj.serial] and len(job.created("trainer")) == 2  # the new rank 0
    assert _digest_of_final_weights(job) == "0,1,2,3,4,5,6,7"


def test_a_take_over_without_a_spare_is_cold_and_exact(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(collective=True, train_delay_s=0.05), steps=6, trainer={"replicas": 1, "spares": 0})
    first = job.lead()
    job.wait(lambda: job.c.state.get("step", 0) >= 2)
    job.c.leads = False
    first.stop(final=False)
    rank = job.layer.find("rrl:drv:trainer:0")
    assert rank is not None
    job.layer.kill(rank)
    job.lead()
    assert job.finish() == "SUCCEEDED"
    (cold,) = job.events("trainer_restart")
    assert cold["recovery"] == "cold" and cold["cause"] == "take_over"
    assert _digest_of_final_weights(job) == "0,1,2,3,4,5"


# -- the pipelined hand-offs (runner._committed): what is sent before the commit of step k --


def _commit_hook(job: Job, hook: Any) -> None:
    """Call ``hook(k)`` just before the fenced commit of step k reaches the record."""
    orig = job.c.update_state

    def update_state(jobid: str, expect: Any = None, **changes: Any) -> dict[str, Any]:
        if "policy_version" in changes and "reward" in changes:
            hook(int(changes["step"]) - 1)
        return orig(jobid, expect, **changes)

    job.c.update_state = update_state  # type: ignore[method-assign]


def test_with_staleness_the_next_step_is_sent_before_the_commit_and_commits_stay_in_order(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(train_delay_s=0.05), steps=6, **{"async": {"max_staleness": 1}},
              checkpoint={"every": 100})  # fmt: skip
    seen: list[tuple[int, int]] = []  # (step, committed step) when rank 0 starts training it
    job.script.on_train = lambda step, rank: seen.append((step, int(job.c.state["step"]))) if rank == 0 else None
    _commit_hook(job, lambda k: time.sleep(0.1))  # a slow etcd: the next step need not wait for it
    job.lead()
    assert job.finish() == "SUCCEEDED"
    early = [step for step, committed in seen if committed == step - 1]
    assert early and early == sorted(early)  # steps that started while the one before was still uncommitted
    commits = [w["step"] for w in job.c.writes if "policy_version" in w and "reward" in w]
    assert commits == [1, 2, 3, 4, 5, 6] and _digest_of_final_weights(job) == "0,1,2,3,4,5"
    assert job.steps_trained() == Counter({(s, r): 1 for s in range(6) for r in range(2)})


def test_no_step_is_sent_early_into_a_snapshot_that_is_due(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(train_delay_s=0.05), steps=6, **{"async": {"max_staleness": 1}},
              checkpoint={"every": 2})  # fmt: skip
    seen: list[tuple[int, int]] = []
    job.script.on_train = lambda step, rank: seen.append((step, int(job.c.state["step"]))) if rank == 0 else None
    _commit_hook(job, lambda k: time.sleep(0.1))
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert sorted(job.c.records) == [2, 4, 6]  # each snapshot at its step (the ranks waited there)
    early = {step for step, committed in seen if committed == step - 1}
    assert early and not early & {2, 4}  # sent early only where no snapshot was due
    assert _digest_of_final_weights(job) == "0,1,2,3,4,5"


def test_a_leader_lost_at_a_commit_after_sending_the_next_step_has_both_committed_once_by_the_next(
    tmp_path: Path,
) -> None:
    """The fault after the publish and the hand-off, before the commit: the ranks go on to
    step k+2 with no leader; the next leader finds them there and commits k and k+1 from their
    results, once each; what the workers generated with the uncommitted version is kept."""
    job = Job(tmp_path, Script(train_delay_s=0.1), steps=6, **{"async": {"max_staleness": 1}},
              checkpoint={"every": 100})  # fmt: skip

    def lose_lead(k: int) -> None:
        if k == 2 and job.c.token == 2:  # the first runner's term, at the commit of step 2
            job.c.leads = False

    _commit_hook(job, lose_lead)
    first = job.lead()
    first._thread.join(20)
    assert not first._thread.is_alive() and job.c.state["step"] == 2
    job.wait(lambda: (3, 0) in {(s, r) for s, r, _ in job.script.trained})  # step 3 was sent before the commit
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert [e["step"] for e in job.events("commit_recovered")] == [2, 3]
    assert job.created("trainer") == ["rrl:drv:trainer:0", "rrl:drv:trainer:1"]  # adopted at step 4, not restarted
    assert job.steps_trained() == Counter({(s, r): 1 for s in range(6) for r in range(2)})
    assert _digest_of_final_weights(job) == "0,1,2,3,4,5"
    lines = steplog.read(tmp_path / "work" / "metrics.jsonl", committed=6)
    assert [x["step"] for x in lines] == [0, 1, 2, 3, 4, 5]  # one line per step, as every reader sees it
    journal = Journal(tmp_path / "work" / "journal")
    for k in range(6):
        assert {s["version"] for s in journal.read_batch(k)} <= {k - 1, k}  # the staleness bound held


def test_a_rank_lost_in_a_step_sent_before_the_commit_is_recovered_after_that_commit(tmp_path: Path) -> None:
    """The fault right after rank 0 returns step k: step k+1, already sent, loses a rank.
    Step k is committed first (the outcome of k+1 is only read on a later pass); then the
    group recovers at k+1 and applies it once."""
    job = Job(tmp_path, Script(collective=True, train_delay_s=0.05), steps=6, **{"async": {"max_staleness": 1}},
              checkpoint={"every": 100})  # fmt: skip
    seen: list[tuple[int, int]] = []

    def on_train(step: int, rank: int) -> None:
        if rank == 0:
            seen.append((step, int(job.c.state["step"])))

    job.script.on_train = on_train
    _commit_hook(job, lambda k: time.sleep(0.1))
    job.script.kill_rank_at = {(3, 1)}
    job.lead()
    assert job.finish() == "SUCCEEDED"
    (restart,) = job.events("trainer_restart")
    assert restart["step"] == 3 and restart["recovery"] == "hot"
    assert (3, 2) in seen  # step 3 was sent while step 2 was uncommitted ...
    assert job.c.writes.index(next(w for w in job.c.writes if w.get("step") == 3 and "reward" in w)) < next(
        i for i, w in enumerate(job.c.writes) if "trainer_epoch" in w
    )  # ... and step 2 committed before the recovery
    assert job.steps_trained() == Counter({(s, r): 1 for s in range(6) for r in range(2)})
    assert _digest_of_final_weights(job) == "0,1,2,3,4,5"


def test_a_rank_lost_after_the_step_was_whole_on_rank_0_is_committed_then_replaced_hot(tmp_path: Path) -> None:
    """Rank 1 dies after step 3's collective (it applied the step, rank 0 returned it): the step
    is whole, so it is committed from rank 0's result, once; then the group recovers hot at
    step 4 (rank 0 keeps its process and state, holding what was committed) and goes on.
    Before, the survivor "at step 4, committed 3" sent this down the cold path."""
    job = Job(tmp_path, Script(collective=True, kill_rank_after={(3, 1)}), steps=6)
    job.lead()
    assert job.finish() == "SUCCEEDED"
    (restart,) = job.events("trainer_restart")
    assert restart["recovery"] == "hot" and restart["step"] == 4 and restart["lost"] == [1]
    assert "replay" not in job.kinds()  # no restore: rank 0's state is step 4's
    assert _serials(job, 5)[0] == _serials(job, 0)[0] and _serials(job, 5)[1] != _serials(job, 0)[1]
    commits = [w["step"] for w in job.c.writes if "policy_version" in w and "reward" in w]
    assert commits == [1, 2, 3, 4, 5, 6]  # step 3 committed once, from rank 0's result
    assert job.steps_trained()[(3, 0)] == 1 and _digest_of_final_weights(job) == "0,1,2,3,4,5"
    (rec,) = job.events("recovered")
    assert rec["step"] == 4  # the fault is recovered by the first commit after the re-formed group's step


@pytest.mark.parametrize("world", [1, 2])
def test_a_rank_lost_after_the_last_step_is_replaced_and_the_job_ends_with_the_digest(
    tmp_path: Path, world: int
) -> None:
    """Rank 0 dies in the job's final ``digest`` call, every step committed: its place is filled
    by the lost rank's path (world 2: hot, rank 1's state; world 1: the warm spare, from the shadow
    copy), the digest is asked again and the job SUCCEEDS with the final weights. Before, it ended
    FAILED (ActorDiedError)."""
    job = Job(tmp_path, Script(collective=world > 1, kill_rank_at_digest={(6, 0)}), steps=6,
              trainer={"replicas": world})  # fmt: skip
    job.lead()
    assert job.finish() == "SUCCEEDED", job.c.state.get("reason")
    (restart,) = job.events("trainer_restart")
    assert restart["recovery"] == "hot" and restart["lost"] == [0] and restart["step"] == 6, restart
    assert "after the last step" in restart["message"] and restart["survivors"] == list(range(1, world)), restart
    commits = [w["step"] for w in job.c.writes if "policy_version" in w and "reward" in w]
    assert commits == [1, 2, 3, 4, 5, 6]  # nothing trained or committed again
    assert _digest_of_final_weights(job) == "0,1,2,3,4,5"


def _tb_steps(logdir: Path) -> Counter[int]:
    """How often each step's reward is in the TensorBoard event files under ``logdir`` (read back
    with TensorBoard's own loader: what a TensorBoard server would show)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    seen: Counter[int] = Counter()
    for f in sorted(logdir.glob("events.out.tfevents.*")):
        for ev in EventFileLoader(str(f)).Load():
            if ev.HasField("summary"):
                seen.update(ev.step for v in ev.summary.value if v.tag == "rrl/reward")
    return seen


def test_a_leader_killed_between_a_commit_and_its_tensorboard_write_loses_no_step_and_doubles_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first leader commits step 2 and dies before its TensorBoard write; the next leader
    reads the event files back, writes step 2 from metrics.jsonl, then the rest: every step once."""
    from controller.election import NotLeader
    from resilient_rl.job.explog import ExperimentLog

    job = Job(tmp_path, Script(train_delay_s=0.02), steps=6, logging={"tensorboard": "tb"})
    real = ExperimentLog.committed
    died: list[int] = []

    def dies_at_2(self: ExperimentLog, k: int, line: dict[str, Any]) -> None:
        if k == 2 and not died:
            died.append(k)
            job.c.leads = False  # the step is committed; the leader is gone before its log write
            raise NotLeader("killed between the commit and the log write")
        real(self, k, line)

    monkeypatch.setattr(ExperimentLog, "committed", dies_at_2)
    first = job.lead()
    first._thread.join(20)
    assert died == [2] and job.c.state["step"] == 3 and not first._thread.is_alive()
    logdir = tmp_path / "work" / "tb"
    assert _tb_steps(logdir) == Counter({0: 1, 1: 1})  # step 2 committed, not logged
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert _tb_steps(logdir) == Counter({s: 1 for s in range(6)})
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 2  # one file per leader term
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    tags = set(acc.Tags()["tensors"]) | set(acc.Tags()["scalars"])
    assert {"rrl/reward", "rrl/loss", "rrl/staleness", "rrl/step_seconds"} <= tags, tags


def test_a_job_naming_tensorboard_without_the_package_fails_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed: import raises ImportError
    job = Job(tmp_path, steps=2, logging={"tensorboard": "tb"})
    job.lead()
    assert job.finish() == "FAILED"
    reason = str(job.c.state.get("reason"))
    assert "logging.tensorboard needs the tensorboard package" in reason and "resilient-rl[tensorboard]" in reason


def _dynamic_job(tmp: Path, script: Script, steps: int) -> Job:
    """Dynamic sampling over the fakes: in round 0 only the odd prompts' groups have a reward
    spread (sample j scores j); every extra round's groups have one."""
    script.reward = lambda step, rnd, p, j: float(j) if p % 2 or rnd > 0 else 0.5
    return Job(tmp, script, steps=steps, algorithm={"dynamic_sampling": {"max_extra_prompts": 8}})


def _expected_kept(job: Job, step: int) -> list[int]:
    """The first 4 groups with a spread in journal order: round 0's odd prompts, then extras."""
    from resilient_rl.algo.dynamic import extra_prompt_indices
    from resilient_rl.algo.sampler import prompt_indices

    assert job.runner is not None
    size, seed = job.runner.shards.task_len, job.spec["seed"]
    odd = [p for p in prompt_indices(seed, step, 4, size) if p % 2]
    shards = {sh: ps for s, sh, rnd, ps in job.script.rounds if s == step and rnd == 1}  # each leader's alike
    extra = [p for sh in sorted(shards) for p in shards[sh]]
    if len(odd) < 4:  # the extra round: the (seed, step, 1) stream, as many as the keep rate asks
        assert extra and extra == extra_prompt_indices(seed, step, 1, len(extra), size)
    return (odd + extra)[:4]


def test_dynamic_sampling_refills_a_batch_from_the_extra_stream_and_trains_the_first_groups_that_teach(
    tmp_path: Path,
) -> None:
    script = Script()
    job = _dynamic_job(tmp_path, script, steps=4)
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert _digest_of_final_weights(job) == "0,1,2,3"
    journal = Journal(tmp_path / "work" / "journal")
    extras = 0
    for k in range(4):
        assert script.kept[k] == _expected_kept(job, k), k
        refs = journal.batch(k)
        assert refs is not None and [r.shard for r in refs] == list(range(len(refs)))
        rounds = {rnd for s, _, rnd, _ in script.rounds if s == k}
        assert len(refs) == 2 + 2 * (len(rounds) - 1)  # 2 shards a round (2 workers)
        extras += len(rounds) > 1
    assert extras >= 2, "the seed drew too many odd prompts: no step needed an extra round"
    lines = [json.loads(x) for x in (tmp_path / "work" / "metrics.jsonl").read_text().splitlines()]
    assert all(x["train"]["groups_kept"] == 4 for x in lines), lines
    assert sum(x["train"]["groups_dropped"] for x in lines) > 0


def test_a_leader_lost_during_an_extra_round_leaves_the_next_leader_the_same_rounds(tmp_path: Path) -> None:
    """The first leader is stopped while a step's extra round is being generated; the next
    starts that step again at round 0 and asks for the same extra prompts (the stream and the
    round sizes depend on the journaled rewards only): each step trained once, on the groups
    the first leader would have trained on."""
    script = Script(shard_delay_s=0.05)
    job = _dynamic_job(tmp_path, script, steps=5)
    first = job.lead()
    job.wait(lambda: any(rnd == 1 and s >= 1 for s, _, rnd, _ in script.rounds))
    job.c.leads = False
    first.stop(final=False)
    assert not first._thread.is_alive()
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert _digest_of_final_weights(job) == "0,1,2,3,4" and max(job.steps_trained().values()) == 1
    again = 0
    for k in range(5):
        assert script.kept[k] == _expected_kept(job, k), k
        asked = [ps for s, sh, rnd, ps in script.rounds if s == k and rnd == 1 and sh == 2]
        assert len(set(asked)) <= 1, f"step {k}: the leaders asked for different extra prompts: {asked}"
        again += len(asked) > 1
    assert again == 1, "no extra round was generated by both leaders (the test did not stop the first in one)"


def test_evaluations_run_between_shards_are_recorded_once_per_version_and_never_journaled(tmp_path: Path) -> None:
    """eval.every 2 over 6 steps: versions 2, 4 and 6 (the last drained after the final commit)
    are evaluated by the rollout workers, recorded in the state, eval.jsonl and as events;
    one worker dies during the first eval: its eval shard goes to another, the eval is
    recorded once; the journal holds training shards only."""
    script = Script(shard_delay_s=0.01, kill_eval_at={(2, 0)})
    job = Job(tmp_path, script, steps=6, eval={"every": 2, "prompts": 8, "samples": 2})
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert _digest_of_final_weights(job) == "0,1,2,3,4,5"
    evals = job.c.state["evals"]
    skipped = [e["skipped"] for e in job.events("eval") if "skipped" in e]  # 4, when 2's redone shard ran late
    assert sorted([e["version"] for e in evals] + skipped) == [2, 4, 6] and skipped in ([], [4]), (evals, skipped)
    assert job.c.state["eval"] == evals[-1]
    for e in evals:  # 2 shards of 4 prompts; prompt i passes when (i + version) is odd: half of them
        assert e["prompts"] == 8 and e["k"] == 2 and e["pass_at_k"] == 0.5 and e["reward"] == 0.5, e
        # the policy that made its samples: the version asked, or (a shard redone after the kill) the next
        assert set(e["versions"]) <= {e["version"], e["version"] + 1} and e["step"] == e["version"] - 1
    assert all(e["versions"] == [e["version"]] for e in evals[1:])
    asked = [(v, sh) for v, sh, _, _, _ in script.evaluated]
    assert sorted(set(asked)) == sorted((v, sh) for v in (2, 4, 6) if v not in skipped for sh in (0, 1))
    assert asked.count((2, 0)) == 2  # the killed worker's shard, begun again by another worker
    assert all(asked.count(a) == 1 for a in set(asked) - {(2, 0)})
    assert [e["version"] for e in job.events("eval") if "skipped" not in e] == [e["version"] for e in evals]
    lines = [json.loads(x) for x in (tmp_path / "work" / "eval.jsonl").read_text().splitlines()]
    assert [x["version"] for x in lines] == [e["version"] for e in evals]
    assert "rollout_fault" in job.kinds()
    journal = Journal(tmp_path / "work" / "journal")
    for k in range(6):
        refs = journal.batch(k)
        assert refs is not None and len(refs) == 2  # the step's two shards; nothing of an eval
    assert sorted((s, sh) for s, sh, _ in script.generated) == [(s, sh) for s in range(6) for sh in range(2)]


def test_a_new_leader_evaluates_the_current_version_if_its_eval_was_lost(tmp_path: Path) -> None:
    """The first leader is stopped while the eval of version 2 is in flight, with the job held at
    version 2 (step 2's shards are slow; the third worker took an eval shard); the next leader
    finds version 2 unevaluated and still current, and evaluates it: recorded once."""
    script = Script(slow_rollout_at={(2, 0): 1.0, (2, 1): 1.0}, eval_delay_s=0.3)
    job = Job(tmp_path, script, steps=4, eval={"every": 2, "prompts": 3}, rollout={"replicas": 3, "shards_per_step": 2})
    first = job.lead()
    job.wait(lambda: any(v == 2 for v, *_ in script.evaluated))
    job.c.leads = False
    first.stop(final=False)
    assert "evals" not in job.c.state or not job.c.state["evals"]  # the first leader did not record it
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert [e["version"] for e in job.c.state["evals"]] == [2, 4]
    assert len({(sh, lo) for v, sh, _, lo, _ in script.evaluated if v == 2}) == 3  # every shard, by the new leader too
    assert job.events("adopted")  # the second leader took the workers over


def test_a_new_leader_evaluates_a_due_version_whose_eval_was_lost_after_the_policy_moved_on(tmp_path: Path) -> None:
    """The first leader is stopped with the eval of version 2 in flight and step 2 committed
    (version 3 current; step 3's shards are slow). The next leader starts at version 3, which is
    not due, and still evaluates version 2, on the policy it has: recorded once, its ``versions``
    saying which policy answered. Found in a clean-clone CI run: a leader SIGKILLed there lost
    the eval of version 3."""
    script = Script(slow_rollout_at={(3, 0): 2.0, (3, 1): 2.0}, eval_delay_s=1.5)
    job = Job(tmp_path, script, steps=6, eval={"every": 2, "prompts": 3}, rollout={"replicas": 3, "shards_per_step": 2})
    first = job.lead()
    job.wait(lambda: int(job.c.state.get("step") or 0) >= 3 and any(v == 2 for v, *_ in script.evaluated))
    job.c.leads = False
    first.stop(final=False)
    assert int(job.c.state["step"]) == 3 and not job.c.state.get("evals")  # moved on, eval 2 not recorded
    script.eval_delay_s = 0.0  # from here evaluations keep up with eval.every: none is skipped
    job.lead()
    assert job.finish() == "SUCCEEDED"
    evals = job.c.state["evals"]
    assert [e["version"] for e in evals] == [2, 4, 6], [e["message"] for e in job.events("eval")]
    assert 3 in evals[0]["versions"] or evals[0]["versions"] == [2]  # the policy the new leader's workers had


def test_a_held_out_task_that_cannot_be_read_fails_the_job_at_its_start_naming_eval_task(tmp_path: Path) -> None:
    job = Job(tmp_path, steps=2, eval={"every": 1, "task": {"kind": "jsonl", "path": str(tmp_path / "missing.jsonl")}})
    job.lead()
    assert job.finish() == "FAILED"
    reason = str(job.c.state.get("reason"))
    assert reason.startswith("eval.task: ") and "missing.jsonl" in reason, reason
    assert not job.script.generated  # it failed before any shard


def test_a_leader_killed_between_a_commit_and_its_mlflow_write_loses_no_step_and_doubles_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the TensorBoard test, with MLflow (a tracking folder): the next leader finds the job's
    run by its tag, reads the metric history back and writes only what it lacks; an eval is
    logged too."""
    from mlflow.tracking import MlflowClient

    from controller.election import NotLeader
    from resilient_rl.job.explog import ExperimentLog

    job = Job(tmp_path, Script(train_delay_s=0.02), steps=6, logging={"mlflow": {"tracking_uri": "mlruns"}},
              eval={"every": 3, "prompts": 2})  # fmt: skip
    real = ExperimentLog.committed
    died: list[int] = []

    def dies_at_2(self: ExperimentLog, k: int, line: dict[str, Any]) -> None:
        if k == 2 and not died:
            died.append(k)
            job.c.leads = False
            raise NotLeader("killed between the commit and the log write")
        real(self, k, line)

    monkeypatch.setattr(ExperimentLog, "committed", dies_at_2)
    first = job.lead()
    first._thread.join(20)
    assert died == [2] and not first._thread.is_alive()
    job.lead()
    assert job.finish() == "SUCCEEDED"
    client = MlflowClient(tracking_uri=f"sqlite:///{(tmp_path / 'work' / 'mlruns').resolve() / 'mlflow.db'}")
    (exp,) = [e for e in client.search_experiments() if e.name == "rrl"]
    (run,) = client.search_runs([exp.experiment_id])
    assert run.data.tags["rrl_job"] == "drv" and run.info.run_name == "drv"
    steps = Counter(int(m.step) for m in client.get_metric_history(run.info.run_id, "rrl/reward"))
    assert steps == Counter({s: 1 for s in range(6)})
    evals = Counter(int(m.step) for m in client.get_metric_history(run.info.run_id, "rrl/eval/reward"))
    assert evals == Counter({2: 1, 5: 1})


def _wandb_counts(root: Path, job: str) -> tuple[Counter[int], Counter[int]]:
    """How often each step's reward and each eval version are in the W&B run files under ``root``."""
    import glob

    from wandb.proto import wandb_internal_pb2

    from resilient_rl.job.explog import _leveldb_records

    steps: Counter[int] = Counter()
    evals: Counter[int] = Counter()
    for f in glob.glob(str(root / "*run-*" / f"run-{job}.wandb")):
        for raw in _leveldb_records(Path(f).read_bytes()):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(raw)
            if rec.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
                steps.update([int(rec.history.step.num)] if "rrl/reward" in items else [])
                evals.update([int(float(items["rrl/eval/version"]))] if "rrl/eval/version" in items else [])
    return steps, evals


def test_a_leader_killed_between_a_commit_and_its_wandb_write_loses_no_step_and_doubles_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the TensorBoard test, with W&B offline: both leaders log to the run whose id is the job
    id; the next one reads the run files back and writes only what they lack; evals too."""
    from controller.election import NotLeader
    from resilient_rl.job.explog import ExperimentLog

    job = Job(tmp_path, Script(train_delay_s=0.02), steps=6, logging={"wandb": {"project": "rrl-test"}},
              eval={"every": 3, "prompts": 2})  # fmt: skip
    real = ExperimentLog.committed
    died: list[int] = []

    def dies_at_2(self: ExperimentLog, k: int, line: dict[str, Any]) -> None:
        if k == 2 and not died:
            died.append(k)
            job.c.leads = False
            raise NotLeader("killed between the commit and the log write")
        real(self, k, line)

    monkeypatch.setattr(ExperimentLog, "committed", dies_at_2)
    first = job.lead()
    first._thread.join(30)
    assert died == [2] and not first._thread.is_alive()
    time.sleep(1.1)  # W&B names an offline run's folder by the second it started
    job.lead()
    assert job.finish(timeout=60) == "SUCCEEDED"
    want = (Counter({s: 1 for s in range(6)}), Counter({3: 1, 6: 1}))
    deadline = time.monotonic() + 20  # W&B's service process writes the run file behind finish()
    while (got := _wandb_counts(tmp_path / "work" / "wandb", "drv")) != want and time.monotonic() < deadline:
        time.sleep(0.2)
    assert got == want
    assert len(list((tmp_path / "work" / "wandb").glob("offline-run-*-drv"))) == 2  # one per leader term


@pytest.mark.parametrize(
    ("module", "spec", "field"),
    [("peft", {"trainer": {"lora": {}}}, "trainer.lora"), ("mlflow", {"logging": {"mlflow": {"tracking_uri": "m"}}},
     "logging.mlflow"), ("wandb", {"logging": {"wandb": {"project": "p"}}}, "logging.wandb")],
)  # fmt: skip
def test_a_job_naming_an_extra_that_is_not_installed_fails_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, spec: dict[str, Any], field: str
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: import raises ImportError
    job = Job(tmp_path, steps=2, **spec)
    job.lead()
    assert job.finish() == "FAILED"
    reason = str(job.c.state.get("reason"))
    extra = {"peft": "lora"}.get(module, module)
    assert f"{field} needs the {module} package" in reason and f"resilient-rl[{extra}]" in reason, reason
    assert not job.script.generated


def test_the_commit_after_a_fault_carries_it_as_a_marker_for_the_loggers(tmp_path: Path) -> None:
    job = Job(tmp_path, Script(kill_rollout_at={(1, 0)}), steps=4, logging={"tensorboard": "tb"})
    job.lead()
    assert job.finish() == "SUCCEEDED"
    lines = [json.loads(x) for x in (tmp_path / "work" / "metrics.jsonl").read_text().splitlines()]
    assert all(x["response_length"] == 2.0 for x in lines)  # the fakes' completions are 2 tokens
    marks = {x["step"]: x["faults_recovered"] for x in lines}
    assert sum(marks.values()) == 1 and marks[0] == 0 and marks[1] == 1, marks  # step 1's commit recovers it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "work" / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["tensors"]) | set(acc.Tags()["scalars"])
    assert "rrl/faults_recovered" in tags, tags


def test_an_evaluation_slower_than_eval_every_steps_skips_versions_instead_of_piling_up(tmp_path: Path) -> None:
    """... except the last policy's: it waits for the one running (found flaky under load: the
    last version's eval was skipped when a new leader's eval of an earlier one ran long)."""
    job = Job(tmp_path, Script(eval_delay_s=0.4), steps=6, eval={"every": 1, "prompts": 2})
    job.lead()
    assert job.finish() == "SUCCEEDED"
    done = [e["version"] for e in job.c.state["evals"]]
    skipped = [e["skipped"] for e in job.events("eval") if "skipped" in e]
    assert skipped and sorted(done + skipped) == list(range(1, 7)), (done, skipped)  # each version once, either way
    assert done[-1] == 6 and 6 not in skipped, (done, skipped)
    waited = [e["waiting"] for e in job.events("eval") if "waiting" in e]
    assert waited in ([], [6]), waited  # [6] when an earlier version's eval still ran at the last commit
    assert len({v for v, *_ in job.script.evaluated}) == len(done)  # a skipped version was never sent


def test_a_logger_that_fails_is_rested_then_caught_up_and_an_unreachable_one_never_stalls_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TensorBoard's write of step 2 fails (a full disk, say): the logger rests, then, at a
    later commit, is caught up from metrics.jsonl: every step once. An MLflow server that does
    not answer (a closed port) costs one failed open per rest and the job goes on."""
    from resilient_rl.job import explog

    monkeypatch.setattr(explog, "RETRY_S", 0.3)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    real = explog.TensorBoardLog.write
    failed: list[int] = []

    def flaky(self: Any, line: dict[str, Any]) -> None:
        if line["step"] == 2 and not failed:
            failed.append(2)
            raise OSError("No space left on device")
        real(self, line)

    monkeypatch.setattr(explog.TensorBoardLog, "write", flaky)
    job = Job(tmp_path, Script(train_delay_s=0.15), steps=8,
              logging={"tensorboard": "tb", "mlflow": {"tracking_uri": "http://127.0.0.1:9"}})  # fmt: skip
    job.lead()
    assert job.finish(timeout=60) == "SUCCEEDED"
    assert failed == [2]
    assert _tb_steps(tmp_path / "work" / "tb") == Counter({s: 1 for s in range(8)})


def test_rollouts_keep_going_while_a_rank_is_slow_to_stage_a_snapshot(tmp_path: Path) -> None:
    """The staging of step 2's snapshot takes 1.5 s (a starved or briefly frozen rank). With
    max_staleness 1, later shards wait in the queue behind step 2's: they are sent and journaled
    while the runner waits on the staging (it serves the rollout group, as its trainer waits do),
    not after it."""
    script = Script(snapshot_delay_s={2: 1.5}, shard_delay_s=0.05)
    job = Job(tmp_path, script, steps=5, checkpoint={"every": 2}, rollout={"replicas": 1, "shards_per_step": 2},
              **{"async": {"max_staleness": 1}})  # fmt: skip
    job.lead()
    assert job.finish() == "SUCCEEDED" and _digest_of_final_weights(job) == "0,1,2,3,4"
    spans = [(a, b) for step, a, b in script.staging if step == 2]  # both ranks stage at once
    t0, t1 = max(a for a, _ in spans), min(b for _, b in spans)
    # one worker, two shards a step: the second waits in the queue until the first is taken in
    inside = [(s, sh) for s, sh, _serial, _v, t in script.shards_by if t0 < t < t1]
    assert len(inside) >= 2, (t0, t1, script.shards_by)
    assert [e["step"] for e in job.events("snapshot")] == [2, 4]
