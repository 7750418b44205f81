"""Streaming rollouts over the fake actor layer: a lost worker's finished prompt groups are
kept and only the rest is generated again; a preempted worker (SIGTERM, a node drain) hands
its shard over and is replaced without spending the fault budget.

The fakes journal groups as the real worker does (``Journal.write_group``, first writer
wins, see tests/helpers/fake_workers.py); the real worker's streaming and its SIGTERM
handler are exercised by tests/e2e/test_faults.py.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from checkpoints.journal import Journal
from tests.helpers.fake_workers import Script
from tests.unit.test_driver import Job

pytestmark = pytest.mark.timeout(60)

N = 2  # samples per prompt (the spec's sampling.n in these jobs)


def _job(tmp: Path, script: Script, steps: int = 3, **over: Any) -> Job:
    # 8 prompts, 2 workers: 2 shards of 4 prompt groups per step
    return Job(tmp, script, steps=steps, prompts_per_step=8, **over)


def _groups_written(script: Script, step: int, shard: int) -> Counter[int]:
    return Counter(p for s, sh, p, _, _ in script.group_writes if (s, sh) == (step, shard))


def _check_batches(tmp: Path, steps: int) -> None:
    """Every batch holds each of its shard's prompts exactly n times, nothing else."""
    j = Journal(tmp / "work" / "journal")
    for k in range(steps):
        refs = j.batch(k)
        assert refs is not None
        for r in refs:
            samples = j.read_shard(r)["samples"]
            per_prompt = Counter(x["prompt_index"] for x in samples)
            assert len(per_prompt) == 4 and set(per_prompt.values()) == {N}, (k, r.shard, per_prompt)
        assert not any(p.name.startswith("parts-") for p in j.step_dir(k).iterdir())  # folded into the shards


def test_a_lost_workers_finished_groups_are_kept_and_only_the_rest_is_generated_again(tmp_path: Path) -> None:
    script = Script(kill_rollout_after={(1, 0): 2})  # dies with 2 of its 4 groups journaled
    job = _job(tmp_path, script)
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert len(job.events("rollout_fault")) == 1
    written = _groups_written(script, 1, 0)
    assert written == Counter({0: 1, 1: 1, 2: 1, 3: 1}), written  # each group journaled once
    by = {p: serial for s, sh, p, serial, _ in script.group_writes if (s, sh) == (1, 0)}
    assert by[0] == by[1] != by[2] == by[3]  # the lost worker's two, its successor's two
    (resumed,) = job.events("shard_resumed")
    assert (resumed["step"], resumed["shard"]) == (1, 0)
    assert resumed["kept"] == 2 * N and resumed["regenerated"] == 2 * N  # regenerated == unfinished
    _check_batches(tmp_path, 3)
    assert job.c.state["weights_digest"] == "0,1,2"  # every step applied once


def test_a_preempted_worker_hands_its_shard_over_without_spending_the_fault_budget(tmp_path: Path) -> None:
    script = Script(preempt_rollout_at={(1, 0): 1})  # SIGTERM after its first group
    job = _job(tmp_path, script, fault={"max_restarts": 0})  # a single fault would fail the job
    job.lead()
    assert job.finish() == "SUCCEEDED", job.c.state.get("reason")
    assert job.events("rollout_fault") == [] and job.events("rollout_hang") == []
    (pre,) = job.events("preempted")
    assert pre["worker"] == 0 and "1 of 4 prompt groups of shard 1/0 journaled" in pre["message"], pre
    assert pre["drained_s"] is not None and 0 <= pre["drained_s"] < pre["grace_s"]
    (resumed,) = job.events("shard_resumed")
    assert resumed["kept"] == 1 * N and resumed["regenerated"] == 3 * N
    assert _groups_written(script, 1, 0) == Counter({0: 1, 1: 1, 2: 1, 3: 1})
    (gone,) = {serial for s, sh, p, serial, _ in script.group_writes if (s, sh, p) == (1, 0, 0)}
    after = [(s, sh) for s, sh, serial, _, _ in script.shards_by if serial == gone and (s, sh) >= (1, 0)]
    assert after == [], after  # stopped at its notice: no shard from it after that
    _check_batches(tmp_path, 3)
    assert job.c.state["weights_digest"] == "0,1,2"


@pytest.mark.parametrize("successor_writes", [True, False], ids=["successor_record", "stale_notice_stays"])
def test_an_idle_worker_preempted_between_shards_is_replaced_at_once(tmp_path: Path, successor_writes: bool) -> None:
    """SIGTERM while idle: the worker marks itself ``preempted`` in membership; the driver reads
    it within a second, stops it and starts another, no fault counted. ``stale_notice_stays``:
    the successor's own record never lands (a batched write, a slow etcd), so membership holds
    the predecessor's notice for the whole job; the successor is not retired for it (one
    preemption, one replacement; without the check, 107 preemptions)."""
    script = Script(train_delay_s=0.4)
    job = _job(tmp_path, script, steps=6, fault={"max_restarts": 0})  # long enough for a read a second

    def mark(step: int, rank: int) -> None:
        if step == 1 and rank == 0:  # rollout worker 1 gets its notice while the step trains
            job.c.membership.setdefault("rollout", {})["1"] = {"status": "preempted", "preempted_at": time.time()}

    script.on_train = mark
    if successor_writes:
        script.on_register = lambda i: job.c.membership.get("rollout", {}).pop(str(i), None)  # its successor's key
    job.lead()
    assert job.finish() == "SUCCEEDED", job.c.state.get("reason")
    pres = job.events("preempted")
    assert len(pres) == 1, (pres, script.rollout_promoted, job.created("rollout"))
    (pre,) = pres
    assert pre["worker"] == 1 and "idle" in pre["message"] and pre["drained_s"] < 5
    assert job.events("rollout_fault") == [] and job.events("shard_resumed") == []
    # its place taken: by the warm spare (promoted to index 1), or by a new worker 1
    replaced = [i for i, _, _ in script.rollout_promoted] + [1 for n in job.created("rollout")[2:] if n.endswith(":1")]
    assert replaced == [1], (replaced, pre)
    _check_batches(tmp_path, 6)


def test_a_preempted_worker_that_exits_before_the_driver_asks_is_no_fault(tmp_path: Path) -> None:
    """Its grace ran out mid-shard (the process is gone, as after a crash) but membership still says
    ``preempted``: a preemption, not a fault; its journaled group is kept."""
    script = Script(kill_rollout_after={(1, 1): 1})
    job = _job(tmp_path, script, fault={"max_restarts": 0})

    def notice(worker: int, step: int, shard: int) -> None:
        if (step, shard) == (1, 1):
            job.c.membership.setdefault("rollout", {})[str(worker)] = {"status": "preempted",
                                                                       "preempted_at": time.time()}  # fmt: skip

    script.on_shard = notice
    script.on_register = lambda i: job.c.membership.get("rollout", {}).pop(str(i), None)
    job.lead()
    assert job.finish() == "SUCCEEDED", job.c.state.get("reason")
    assert len(job.events("preempted")) == 1 and job.events("rollout_fault") == []
    (resumed,) = job.events("shard_resumed")
    assert resumed["kept"] == 1 * N and resumed["regenerated"] == 3 * N
    assert _groups_written(script, 1, 1) == Counter({0: 1, 1: 1, 2: 1, 3: 1})


# -- work stealing (rollout.groups_per_pass > 0) ------------------------------------------------


def _steal_job(tmp: Path, script: Script, **over: Any) -> Job:
    # shard 1/0 is the long tail: 0.25 s a group, 1 s alone; shard 1/1 takes no time
    script.group_delay_s = {(1, 0): 0.25}
    return _job(tmp, script, rollout={"groups_per_pass": 1}, **over)


def test_an_idle_worker_helps_with_a_slow_shard_and_no_group_is_trained_twice_or_lost(tmp_path: Path) -> None:
    script = Script()
    job = _steal_job(tmp_path, script)
    job.lead()
    assert job.finish() == "SUCCEEDED", job.c.state.get("reason")
    written = _groups_written(script, 1, 0)
    assert written == Counter({0: 1, 1: 1, 2: 1, 3: 1}), written  # each group journaled once
    writers = {p: serial for s, sh, p, serial, _ in script.group_writes if (s, sh) == (1, 0)}
    helped = [x for x in script.stolen if x[:2] == (1, 0)]
    assert helped and helped[0][3] >= 1, script.stolen  # the helper journaled groups of the slow shard ...
    assert writers[3] == helped[0][2] != writers[0]  # ... from its end, the owner from its start
    sends = Counter((a[0], a[1], a[5] if len(a) > 5 else False) for _, m, a in job.layer.calls if m == "generate_shard")
    assert sends[(1, 0, False)] == 1 and sends[(1, 0, True)] == 1  # sent once to its owner, once to a helper
    _check_batches(tmp_path, 3)  # every prompt of the step in the batch exactly n times
    assert job.events("rollout_fault") == [] and job.c.state["weights_digest"] == "0,1,2"


def test_a_lost_helper_costs_nothing_but_itself(tmp_path: Path) -> None:
    """The helper dies holding a claim on a group: the leader releases it, the owner generates it
    (without the release the owner would wait for it forever)."""
    script = Script(kill_helper_at={(1, 0)})
    job = _steal_job(tmp_path, script)
    job.lead()
    assert job.finish() == "SUCCEEDED", job.c.state.get("reason")
    assert len(job.events("rollout_fault")) == 1 and job.events("shard_resumed") == []  # nothing re-queued
    sends = Counter((a[0], a[1], a[5] if len(a) > 5 else False) for _, m, a in job.layer.calls if m == "generate_shard")
    assert sends[(1, 0, False)] == 1  # the owner kept its shard
    assert _groups_written(script, 1, 0) == Counter({0: 1, 1: 1, 2: 1, 3: 1})
    _check_batches(tmp_path, 3)


def test_a_lost_owner_whose_shard_has_a_helper_is_sent_again_and_keeps_both_workers_groups(tmp_path: Path) -> None:
    script = Script(kill_rollout_after={(1, 0): 1})  # the owner dies holding its claim on its second group
    job = _steal_job(tmp_path, script)
    job.lead()
    assert job.finish() == "SUCCEEDED", job.c.state.get("reason")
    assert len(job.events("rollout_fault")) == 1
    (resumed,) = job.events("shard_resumed")
    # the lost owner's group is kept; the one it had claimed is released and generated by another
    assert resumed["kept"] + resumed["regenerated"] == 4 * N and resumed["kept"] >= N and resumed["regenerated"] >= N
    assert any(x[:2] == (1, 0) and x[3] >= 1 for x in script.stolen), script.stolen  # the helper did its part
    assert _groups_written(script, 1, 0) == Counter({0: 1, 1: 1, 2: 1, 3: 1})  # nothing journaled twice
    _check_batches(tmp_path, 3)
    assert job.c.state["weights_digest"] == "0,1,2"


# -- a trainer rank preempted (SIGTERM: TrainerRank marks preempted_at in membership) ------------


def _preempt_rank(job: Job, rank: int, at_step: int) -> None:
    """Rank ``rank`` gets its notice during step ``at_step``; its successor's registration replaces the record."""
    both = {"0": {"status": "training"}, "1": {"status": "training"}}
    job.c.membership["trainer"] = {w: dict(v) for w, v in both.items()}

    sent: list[int] = []

    def notice(step: int, r: int) -> None:
        if step == at_step and r == rank and not sent:  # once (a replay trains the step again)
            sent.append(step)
            job.c.membership["trainer"][str(rank)] = {"status": "training", "preempted_at": time.time()}

    def registered(r: int) -> None:
        job.c.membership.setdefault("trainer", {})[str(r)] = {"status": "ready"}

    job.script.on_train = notice
    job.script.on_rank = registered


@pytest.mark.parametrize(("spares", "kill_delay_s"), [(1, 0.0), (0, 0.0), (0, 0.5)])
def test_a_preempted_trainer_rank_is_handed_over_at_the_step_boundary_without_a_fault(
    tmp_path: Path, spares: int, kill_delay_s: float
) -> None:
    """World 2: the rank's place goes to a warm spare (or a new process) with a survivor's state, hot,
    before the next step trains; nothing spent from the budget (max_restarts 0), every step once.
    With ``kill_delay_s`` the driver's kill of the leaving rank takes effect late, as Ray's can
    (asynchronous): the rank still answers the boundary's first call; the hot path must not take it
    for a survivor (it did once in CI: a cold restart)."""
    script = Script(train_delay_s=0.3)
    job = Job(tmp_path, script, steps=7, trainer={"spares": spares}, fault={"max_restarts": 0})
    job.layer.kill_delay_s = kill_delay_s
    _preempt_rank(job, 1, 2)
    job.lead()
    assert job.finish() == "SUCCEEDED", job.c.state.get("reason")
    (pre,) = job.events("preempted")
    assert pre["group"] == "trainer" and pre["lost"] == [1] and pre["recovery"] == "hot", pre
    assert job.events("trainer_restart") == [] and job.events("trainer_hang") == []
    (back,) = job.events("trainer_recovered")
    assert back["preempted"] is True and back["spares_used"] == spares
    assert job.c.state["weights_digest"] == "0,1,2,3,4,5,6"  # every step applied once, in order
    handed = pre["step"]
    assert 3 <= handed <= 5, pre  # at a boundary soon after the notice (membership is read once a second)
    trained_by = {serial for s, r, serial in script.trained if r == 1 and s >= handed}
    assert len(trained_by) == 1 and trained_by.isdisjoint({serial for s, r, serial in script.trained
                                                           if r == 1 and s < handed})  # fmt: skip


# -- a Ray node drained (the notice reaches the cluster: Actors.draining_nodes) ------------------


def test_a_drained_nodes_rollout_worker_and_trainer_rank_leave_without_a_fault(tmp_path: Path) -> None:
    """Node "b" holds rollout worker 1 and trainer rank 1 and is drained during step 2: the worker
    takes no more work and leaves once idle, the rank is handed over at the next step boundary;
    their successors land elsewhere (node "c"). Nothing spent from the budget, every step once."""
    script = Script(train_delay_s=0.3)
    job = Job(tmp_path, script, steps=8, fault={"max_restarts": 0})
    job.c.membership = {"rollout": {}, "trainer": {}}

    def drain(step: int, rank: int) -> None:
        if step == 2 and rank == 0:
            job.layer.draining = {"b": time.time() + 60}

    def registered(group: str, i: int) -> None:  # the first of each index on "a" or "b", successors on "c"
        members = job.c.membership[group]
        members[str(i)] = {"ray_node": "c" if str(i) in members else "ab"[i]}

    script.on_train = drain
    script.on_register = lambda i: registered("rollout", i)
    script.on_rank = lambda r: registered("trainer", r)
    job.lead()
    assert job.finish() == "SUCCEEDED", job.c.state.get("reason")
    pre = job.events("preempted")
    assert sorted(e["group"] for e in pre) == ["rollout", "trainer"], pre
    (w,) = [e for e in pre if e["group"] == "rollout"]
    assert w["worker"] == 1 and "draining" in w["message"], w
    (r,) = [e for e in pre if e["group"] == "trainer"]
    assert r["lost"] == [1] and r["recovery"] == "hot", r
    assert not [k for k in job.kinds() if k in ("rollout_fault", "rollout_hang", "trainer_restart", "trainer_hang")]
    assert job.c.state["weights_digest"] == "0,1,2,3,4,5,6,7"


def test_a_worker_on_a_draining_node_that_hangs_is_a_fault_and_its_successor_elsewhere_is_not_drained(
    tmp_path: Path,
) -> None:
    """Node "b" is drained while rollout worker 1, on it, is stuck in a shard: it cannot leave
    (its shard never comes in), so the watchdog finds it hung, a fault. Its successor starts on
    node "c": nothing of the drain may stick to index 1 (it was once kept, and the successor's
    first answer made it leave as "preempted", then the next one, ...)."""
    script = Script(hang_rollout_at={(2, 1)})
    job = Job(tmp_path, script, steps=6, fault={"hang_timeout": 3.0})
    job.c.membership = {"rollout": {}, "trainer": {}}

    def drain(worker: int, step: int, shard: int) -> None:
        if (step, shard) == (2, 1):  # the shard its worker hangs in: the node's notice comes now
            job.layer.draining = {"b": time.time() + 600}

    def registered(i: int) -> None:  # the first of each index on "a" or "b", successors on "c"
        members = job.c.membership["rollout"]
        members[str(i)] = {"ray_node": "c" if str(i) in members else "ab"[i]}

    script.on_shard = drain
    script.on_register = registered
    job.lead()
    assert job.finish() == "SUCCEEDED", job.c.state.get("reason")
    (hang,) = job.events("rollout_hang")
    assert hang["worker"] == 1, hang
    assert job.events("preempted") == [], job.events("preempted")  # the successor on "c" was never drained
    assert job.c.membership["rollout"]["1"]["ray_node"] == "c"
    assert job.c.state["weights_digest"] == "0,1,2,3,4,5"


def test_the_only_rank_preempted_without_a_spare_goes_the_cold_way_without_a_fault(tmp_path: Path) -> None:
    """World 1, no spare: nobody holds the state in a process, so the group restarts from the
    newest snapshot (+ replay) at the boundary, still as a preemption: nothing spent, exact. The
    event says why the hot path did not serve (``hot_refused``)."""
    script = Script(train_delay_s=0.3)
    job = Job(tmp_path, script, steps=6, trainer={"replicas": 1, "spares": 0}, fault={"max_restarts": 0})
    job.c.membership["trainer"] = {"0": {"status": "training"}}

    sent: list[int] = []

    def notice(step: int, r: int) -> None:
        if step == 2 and not sent:  # once: the cold path's replay trains step 2 again
            sent.append(step)
            job.c.membership["trainer"]["0"] = {"status": "training", "preempted_at": time.time()}

    script.on_train = notice
    script.on_rank = lambda r: job.c.membership["trainer"].__setitem__(str(r), {"status": "ready"})
    job.lead()
    assert job.finish() == "SUCCEEDED", job.c.state.get("reason")
    (pre,) = job.events("preempted")
    assert pre["group"] == "trainer" and pre["recovery"] == "cold", pre
    assert pre["hot_refused"] == "no warm trainer spare answers" and "; not hot: no warm" in pre["message"], pre
    assert job.events("trainer_restart") == []
    assert job.c.state["weights_digest"] == "0,1,2,3,4,5"


# -- longest expected first (rollout.longest_first) ---------------------------------------------


@pytest.mark.parametrize("longest_first", [True, False])
def test_a_helper_takes_the_longest_unstarted_group_once_the_prompts_costs_are_known(
    tmp_path: Path, longest_first: bool
) -> None:
    """8 prompts, all of them each step (one epoch a step), 2 shards of 4. The two slow prompts
    (0.4 s) are at positions 0 and 1 of step 1's shard 0, the rest take 0.02 s. Step 0 teaches
    the runner each prompt's cost; in step 1 the owner starts on position 0 and the worker whose
    shard is done helps with the longest unstarted group, position 1, where a helper taking from
    the end (``longest_first: false``) starts on position 3."""
    from resilient_rl.algo.sampler import prompt_indices

    spec = {"rollout": {"groups_per_pass": 1, "longest_first": longest_first}, "task": {"num_prompts": 8}}
    job = _job(tmp_path, Script(), steps=3, **spec)
    shard0 = prompt_indices(int(job.spec["seed"]), 1, 8, 8)[:4]
    job.script.prompt_delay_s = {i: 0.02 for i in range(8)} | {shard0[0]: 0.4, shard0[1]: 0.4}
    job.lead()
    assert job.finish() == "SUCCEEDED", job.c.state.get("reason")
    helper = [x[2] for x in job.script.stolen if x[:2] == (1, 0)]
    assert helper, job.script.stolen  # the worker done with shard 1/1 helped with 1/0
    by_helper = [i for s, sh, i, serial in job.script.group_order if (s, sh, serial) == (1, 0, helper[0])]
    by_owner = [i for s, sh, i, serial in job.script.group_order if (s, sh) == (1, 0) and serial != helper[0]]
    assert by_owner[0] == shard0[0]  # either way the owner starts on position 0
    if longest_first:
        assert by_helper[0] == shard0[1]  # the second slow group went to the helper at once
        costs = job.runner.shards.costs.seconds  # type: ignore[union-attr]
        assert costs == {i: job.script.prompt_delay_s[i] for i in range(8)}  # learned from the answers
    else:
        assert by_helper[0] == shard0[3]  # from the end
    for step in range(3):  # each group journaled once
        for sh in range(2):
            assert _groups_written(job.script, step, sh) == Counter({0: 1, 1: 1, 2: 1, 3: 1})
    _check_batches(tmp_path, 3)
