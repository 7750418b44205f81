"""``placement: colocated`` (resilient_rl/job/colocated.py, resilient_rl/workers/colocated.py):
the actor layer that puts trainer rank i and rollout worker i in one process, alone over the
fake actor layer, then the whole driver over it. The real-process test is
tests/e2e/test_rl_job.py::test_colocated_job_survives_a_kill_of_its_process."""

from __future__ import annotations

import inspect
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from resilient_rl.job.actors import Placement, create_fresh
from resilient_rl.job.colocated import GROUPS, ColocatedActors, Part, colocated_placement, home_of
from resilient_rl.spec import SpecError, load_spec, parse_spec
from resilient_rl.workers.colocated import ColocatedWorker
from tests.helpers.fake_actors import FakeActors
from tests.helpers.fake_workers import Script
from tests.unit.test_driver import Job

pytestmark = pytest.mark.timeout(60)


class Trainer:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def step(self) -> str:
        return f"trainer {self.rank} stepped"

    def adopt(self, token: int) -> str:
        return f"trainer {self.rank} adopted by {token}"


class Rollout:
    def __init__(self, index: int) -> None:
        self.index = index

    def generate(self) -> str:
        return f"rollout {self.index} generated"

    def adopt(self, token: int) -> str:
        return f"rollout {self.index} adopted by {token}"


class Home(ColocatedWorker):
    PARTS = {"trainer": Trainer, "rollout": Rollout}

    def _die(self) -> None:
        pass


def _layer() -> tuple[ColocatedActors, FakeActors]:
    inner = FakeActors(roles={"colocated": Home, "weights": Rollout})
    return ColocatedActors(inner, lambda: Placement(num_cpus=1.0)), inner


def test_home_names() -> None:
    assert home_of("rrl:j:trainer:3") == home_of("rrl:j:rollout:3") == "rrl:j:colocated:3"
    assert home_of("rrl:j:trainer-spare:0") is None and home_of("rrl:j:weights:0") is None


def test_a_rank_and_a_worker_of_one_index_share_one_actor_and_each_gets_its_own_calls() -> None:
    A, inner = _layer()
    t = A.create("trainer", "rrl:j:trainer:0", (0,), Placement())
    r = A.create("rollout", "rrl:j:rollout:0", (0,), Placement())
    other = A.create("rollout", "rrl:j:rollout:1", (1,), Placement())  # an index with no rank: a process alone
    assert isinstance(t, Part) and t.actor is r.actor and other.actor is not t.actor
    assert [n for n, _ in inner.created] == ["rrl:j:colocated:0", "rrl:j:colocated:1"]
    assert A.get(A.call(t, "step")) == "trainer 0 stepped"
    assert A.get(A.call(r, "generate")) == "rollout 0 generated"
    # the same method name reaches each role's own, the trainer's adopt through its concurrency group
    assert A.get(A.call(t, "adopt", 7)) == "trainer 0 adopted by 7"
    assert A.get(A.call(r, "adopt", 7)) == "rollout 0 adopted by 7"
    sent = [(m, a[:2]) for n, m, a in inner.calls if n == "rrl:j:colocated:0" and m.startswith("run")]
    assert ("run_control", ("trainer", "adopt")) in sent and ("run", ("rollout", "adopt")) in sent
    # find and names answer per role, and hand back the part the driver holds
    assert A.find("rrl:j:trainer:0") is t and A.find("rrl:j:trainer:1") is None
    assert A.names("rrl:j:rollout:") == ["rrl:j:rollout:0", "rrl:j:rollout:1"]
    assert A.names("rrl:j:trainer:") == ["rrl:j:trainer:0"] and A.names("rrl:j:trainer-spare:") == []
    with pytest.raises(ValueError, match="taken"):  # a role runs once in its process
        A.create("trainer", "rrl:j:trainer:0", (0,), Placement())


def test_a_kill_of_either_part_ends_both_and_the_index_is_made_again_by_whoever_comes_first() -> None:
    A, inner = _layer()
    t = A.create("trainer", "rrl:j:trainer:0", (0,), Placement())
    r = A.create("rollout", "rrl:j:rollout:0", (0,), Placement())
    A.get(A.call(t, "step"))
    A.kill(r)
    with pytest.raises(ActorDiedError):
        A.get(A.call(t, "step"), timeout=5)
    assert A.find("rrl:j:trainer:0") is None
    r2 = create_fresh(A, "rollout", "rrl:j:rollout:0", (0,), Placement())  # the rollout group first, this time
    A.kill(t)  # the trainer group's kill of its dead rank leaves the new process alone
    t2 = A.create("trainer", "rrl:j:trainer:0", (0,), Placement())
    assert t2.actor is r2.actor is not r.actor
    assert A.get(A.call(t2, "step")) == "trainer 0 stepped" and A.get(A.call(r2, "generate")) == "rollout 0 generated"


def test_a_new_layer_finds_the_roles_of_a_process_started_by_an_earlier_one() -> None:
    """A new leader's actor layer has no record: it asks the process which roles it runs."""
    A, inner = _layer()
    A.create("trainer", "rrl:j:trainer:0", (0,), Placement())
    B = ColocatedActors(inner, lambda: Placement())
    t = B.find("rrl:j:trainer:0")
    assert t is not None and B.get(B.call(t, "step")) == "trainer 0 stepped"
    assert B.find("rrl:j:rollout:0") is None
    r = B.create("rollout", "rrl:j:rollout:0", (0,), Placement())  # joins the running process
    assert r.actor is t.actor and len(inner.created) == 1


@pytest.mark.parametrize("role", ["trainer", "rollout"])
def test_groups_name_every_worker_method_of_a_concurrency_group(role: str) -> None:
    from resilient_rl.workers.rollout import RolloutWorker
    from resilient_rl.workers.trainer import TrainerRank

    cls = {"trainer": TrainerRank, "rollout": RolloutWorker}[role]
    marked = {
        m: getattr(f, "__ray_concurrency_group__", None)
        for m, f in inspect.getmembers(cls, inspect.isfunction)
        if getattr(f, "__ray_concurrency_group__", None)
    }
    assert marked == GROUPS[role]
    assert {g for g in marked.values()} <= {
        getattr(f, "__ray_concurrency_group__", None)
        for _, f in inspect.getmembers(ColocatedWorker, inspect.isfunction)
    }


def test_the_spec_refuses_vllm_and_the_process_reserves_the_larger_share(tmp_path: Path) -> None:
    base: dict[str, Any] = {"name": "c", "model": {"path": "m"}, "placement": "colocated"}
    f = tmp_path / "job.yaml"
    f.write_text("name: c\nmodel: {path: m}\nplacement: colocated\n")  # rollout.engine defaults to vllm
    with pytest.raises(SpecError, match="placement colocated needs rollout.engine hf"):
        load_spec(f)
    f.write_text("name: c\nmodel: {path: m}\nplacement: together\n")
    with pytest.raises(SpecError, match="placement"):
        load_spec(f)
    spec = parse_spec({**base, "rollout": {"engine": "hf", "num_cpus": 2}, "trainer": {"num_cpus": 1, "num_gpus": 1}})
    p = colocated_placement(spec)
    assert (p.num_cpus, p.num_gpus) == (2.0, 1.0) and "MALLOC_MMAP_THRESHOLD_" in p.runtime_env["env_vars"]
    assert parse_spec({"name": "c", "model": {"path": "m"}}).placement == "separate"


def _colocated_job(tmp: Path, script: Script | None = None, **kw: Any) -> Job:
    return Job(tmp, script, placement="colocated", **{"rollout": {"engine": "hf"}, **kw})


def test_a_colocated_job_runs_one_process_an_index(tmp_path: Path) -> None:
    job = _colocated_job(tmp_path, steps=4)
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert job.c.state["weights_digest"] == "0,1,2,3"
    made = sorted(n for n, _ in job.layer.created if ":weights:" not in n)
    # the spares (one each by default) stay processes of their own
    assert made == ["rrl:drv:colocated:0", "rrl:drv:colocated:1", "rrl:drv:rollout-spare:0", "rrl:drv:trainer-spare:0"]
    assert job.steps_trained() == Counter({(s, r): 1 for s in range(4) for r in range(2)})


def test_a_kill_of_a_colocated_process_is_the_loss_of_both_and_each_group_recovers(tmp_path: Path) -> None:
    """Rank 0 dies in step 2's train step, and so does rollout worker 0 (its process). Here
    rank 1 runs ahead (the fake has no collective), so the trainer takes its cold path: a restart
    of both ranks, which ends both processes, so rollout worker 1 ends too: that is the
    restart's doing, not a fault (``rollout_replaced``, no restart spent). Each group recovers as
    it would alone, the rollout workers into the new processes; each step is applied once.
    (With a real collective the survivor keeps its state and its process: the e2e test's hot
    recovery.)"""
    job = _colocated_job(tmp_path, steps=5, rollout={"engine": "hf", "spares": 0}, trainer={"spares": 0})
    job.script.kill_rank_at.add((2, 0))
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert job.c.state["weights_digest"] == "0,1,2,3,4"
    assert len(job.events("trainer_restart")) == 1
    assert [e["worker"] for e in job.events("rollout_fault")] == [0]  # it crashed with its rank
    (replaced,) = job.events("rollout_replaced")  # worker 1 ended with the cold restart
    assert replaced["worker"] == 1 and replaced["cause"] == "trainer", replaced
    assert job.runner is not None and len(job.runner.faults.budgets["rollout"].times) == 1  # worker 0's only
    homes = Counter(n for n, _ in job.layer.created if ":colocated:" in n)
    assert homes == Counter({"rrl:drv:colocated:0": 2, "rrl:drv:colocated:1": 2}), homes
    assert not [n for n, _ in job.layer.created if ":trainer:" in n or ":rollout:" in n]  # no process of its own


def test_with_a_collective_the_survivor_keeps_its_process_and_its_rollout_worker(tmp_path: Path) -> None:
    """As gloo does, rank 1's step fails with rank 0's: the hot path keeps rank 1's state and its
    process, so rollout worker 1 goes on; only index 0's process is made again, once."""
    job = _colocated_job(tmp_path, steps=5, rollout={"engine": "hf", "spares": 0}, trainer={"spares": 0})
    job.script.collective = True
    job.script.kill_rank_at.add((2, 0))
    job.lead()
    assert job.finish() == "SUCCEEDED"
    assert job.c.state["weights_digest"] == "0,1,2,3,4"
    (restart,) = job.events("trainer_restart")
    assert restart["recovery"] == "hot" and restart["survivors"] == [1], restart
    assert [e["worker"] for e in job.events("rollout_fault")] == [0]
    homes = Counter(n for n, _ in job.layer.created if ":colocated:" in n)
    assert homes == Counter({"rrl:drv:colocated:0": 2, "rrl:drv:colocated:1": 1}), homes


def test_a_kill_of_a_live_process_is_the_other_roles_loss_only_if_the_process_was_alive() -> None:
    A, inner = _layer()
    t = A.create("trainer", "rrl:j:trainer:0", (0,), Placement())
    r = A.create("rollout", "rrl:j:rollout:0", (0,), Placement())
    A.get(A.call(r, "generate"))
    A.kill(t)  # the trainer group ends a live process (a cold restart, a resize)
    assert A.lost_with(r) == "trainer" and A.lost_with(r) is None  # asked once
    assert A.lost_with(t) is None
    t = create_fresh(A, "trainer", "rrl:j:trainer:0", (0,), Placement())
    r = A.create("rollout", "rrl:j:rollout:0", (0,), Placement())
    A.get(A.call(r, "generate"))
    inner.kill(t.actor)  # a crash: the process is gone before any kill of the driver's
    A.kill(t)
    assert A.lost_with(r) is None  # a loss of each role: each counts it


def test_a_trainer_resize_ends_the_rollout_workers_in_its_processes_without_a_fault(tmp_path: Path) -> None:
    """Under ``fault.max_restarts: 0`` a rollout fault would fail the job: the rollout workers the
    resize takes down with their processes are replaced as no fault, and the job ends exact."""
    job = _colocated_job(tmp_path, steps=6, checkpoint={"every": 1}, rollout={"engine": "hf", "spares": 0},
                         trainer={"spares": 0}, fault={"max_restarts": 0})  # fmt: skip
    runner = job.lead()
    job.wait(lambda: job.c.state.get("step", 0) >= 2)
    job.desired = {"trainer": 1}
    runner.reconcile(job.record())
    assert job.finish() == "SUCCEEDED", job.c.state.get("reason")
    (restart,) = job.events("trainer_restart")
    assert restart["resize"] is True
    assert not job.events("rollout_fault")
    assert sorted(e["worker"] for e in job.events("rollout_replaced")) == [0, 1]  # each process was ended once
    assert job.c.state["weights_digest"] == "0,1,2,3,4,5"
    assert all(not w.get("open_faults") for w in job.c.writes if "open_faults" in w)


_SIGTERM_CHILD = r"""
import os, signal, sys, threading, time
from resilient_rl.workers.preemption import Preemption, install_dispatcher

class Member:
    def __init__(self, who):
        self.who = who
    def update(self, **fields):
        os.write(1, f"{self.who} marked {sorted(fields)}\n".encode())  # one write: the two threads' lines stay whole
    def close(self):
        pass

install_dispatcher()  # the colocated actor's constructor, on the main thread
made = []
def start(who):  # a role's start: a call of a threaded actor, off the main thread
    made.append(Preemption(lambda: who, 1.0, lambda: Member(who), spare=lambda: False, mark=lambda: {"status": "x"}))
for who in ("trainer", "rollout"):
    t = threading.Thread(target=start, args=(who,))
    t.start()
    t.join()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)  # each worker's grace (1 s) ends the process
"""


def test_one_sigterm_reaches_both_workers_of_a_colocated_process() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _SIGTERM_CHILD], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr  # left by itself after the grace, not killed by the signal
    assert "trainer marked ['status']" in out.stdout and "rollout marked ['status']" in out.stdout, out.stdout
    assert "not installed" not in out.stderr, out.stderr


class _Tensor(str):
    def detach(self) -> str:
        return str(self)


class _Core:
    def __init__(self, step: int) -> None:
        self.step = step

    def policy_state(self) -> Any:
        yield "w", _Tensor(f"live weights of step {self.step}")


class _Rank:
    strategy = "ddp"

    def __init__(self, step: int) -> None:
        self.core = _Core(step)

    @property
    def step(self) -> int:
        return self.core.step


class _Worker:
    def __init__(self) -> None:
        self.loaded: list[tuple[int, Any]] = []

    def load_weights(self, version: int, weights: Any) -> int:
        self.loaded.append((version, weights))
        return version


def _home(parts: dict[str, Any]) -> ColocatedWorker:
    """One without its constructor: that installs a SIGTERM handler, not for this test process."""
    import threading

    home = ColocatedWorker.__new__(ColocatedWorker)
    home.parts, home._started = parts, threading.Condition()
    return home


def test_a_rollout_worker_loads_the_version_its_rank_holds_from_the_ranks_own_tensors() -> None:
    rank, worker = _Rank(3), _Worker()
    home = _home({"trainer": rank, "rollout": worker})
    home.run("rollout", "load_weights", 3, "handle of v3")
    assert worker.loaded[-1] == (3, {"w": "live weights of step 3"})  # no fetch through the object store
    home.run("rollout", "load_weights", 2, "handle of v2")  # the rank is past it: the published copy
    assert worker.loaded[-1] == (2, "handle of v2")
    rank.strategy = "fsdp"  # a shard is not the whole model
    home.run("rollout", "load_weights", 3, "handle of v3")
    assert worker.loaded[-1] == (3, "handle of v3")
    alone = _home({"rollout": worker})  # an index with no rank in its process
    alone.run("rollout", "load_weights", 3, "handle of v3")
    assert worker.loaded[-1] == (3, "handle of v3")


def test_a_rollout_scale_down_leaves_the_trainer_rank_in_the_drained_workers_process(tmp_path: Path) -> None:
    """Worker 1 shares its process with rank 1: drained, it leaves the process and rank 1 trains
    on in it (no trainer restart); scaled up again, the new worker 1 joins that process."""
    job = _colocated_job(tmp_path, Script(shard_delay_s=0.02), steps=8, rollout={"engine": "hf", "spares": 0},
                         trainer={"spares": 0}, fault={"max_restarts": 0})  # fmt: skip
    runner = job.lead()
    job.wait(lambda: job.c.state.get("step", 0) >= 2)
    job.desired = {"rollout": 1}
    runner.reconcile(job.record())
    job.wait(lambda: any("drained" in e["message"] for e in job.events("scale")))
    job.wait(lambda: job.c.state.get("step", 0) >= 5)
    job.desired = {"rollout": 2}
    runner.reconcile(job.record())
    assert job.finish() == "SUCCEEDED", job.c.state.get("reason")
    assert not job.events("trainer_restart") and not job.events("rollout_fault")
    assert [n for n, _ in job.layer.created if ":colocated:" in n] == ["rrl:drv:colocated:0", "rrl:drv:colocated:1"]
    sent = [(m, a[:2]) for n, m, a in job.layer.calls if n == "rrl:drv:colocated:1"]
    assert ("drop", ("rollout",)) in sent
    starts = [a for m, a in sent if m == "start"]
    assert [a[0] for a in starts] == ["trainer", "rollout", "rollout"]  # the worker started again in the same process
    assert job.steps_trained() == Counter({(s, r): 1 for s in range(8) for r in range(2)})


def test_a_new_leader_adopts_the_colocated_processes_it_finds(tmp_path: Path) -> None:
    """The next leader's actor layer knows nothing of the processes: it asks them which roles
    run in them, adopts both groups and starts no process."""
    job = _colocated_job(tmp_path, steps=5, rollout={"engine": "hf", "spares": 0}, trainer={"spares": 0})

    def lose(step: int, rank: int) -> None:
        if step == 1 and rank == 0:
            job.c.leads = False

    job.script.on_train = lose
    first = job.lead()
    first._thread.join(20)
    assert not first._thread.is_alive() and not job.layer.killed
    job.script.on_train = None
    made = len(job.layer.created)
    job.lead()
    assert job.finish() == "SUCCEEDED", job.c.state.get("reason")
    assert len(job.layer.created) == made  # adopted: no process made again
    assert not job.events("rollout_fault") and not job.events("trainer_restart")
    assert job.c.state["weights_digest"] == "0,1,2,3,4"
