"""Ray node loss: a job spread over Ray nodes (``ray.cluster_utils.Cluster``, all on
this machine) loses the node that hosts one of its rollout workers and one of its
trainer ranks; both groups are rebuilt on the remaining nodes and the job finishes with
every step committed once and weights equal to a fault-free replay.

The cluster, its own etcd and a controller process belong to this test (the session
platform is not used: its controller would take the job).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from controller import events, jobs
from resilient_rl.local import ManagedProcess, ray_env, ray_head_env
from resilient_rl.spec import JobSpec, parse_spec
from tests.conftest import EtcdServer
from tests.e2e.conftest import metrics
from tests.e2e.test_rl_job import _check_journal, _spec

pytestmark = [pytest.mark.slow, pytest.mark.chaos]


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    import ray
    from ray.cluster_utils import Cluster

    for k, v in ray_head_env().items():  # every Ray listener on loopback, as `rrl up` does
        monkeypatch.setenv(k, v)

    if ray.is_initialized():  # connected to the session platform's Ray: one cluster per process
        ray.shutdown()
    args = {"node_ip_address": "127.0.0.1", "object_store_memory": 100 << 20}
    for attempt in range(3):  # Ray gives a raylet a fixed 30 s to register: a loaded machine can miss it
        c = Cluster(initialize_head=False)
        try:
            c.add_node(**args, num_cpus=0)  # the head: no job workers here
            nodes = [c.add_node(**args, num_cpus=3) for _ in range(2)]  # the job fills both
            c.wait_for_nodes()
            break
        except Exception:
            c.shutdown()
            if attempt == 2:
                raise
    try:
        yield c, nodes, args
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


def _members(store: Any, job: str) -> dict[str, dict[str, Any]]:
    m = jobs.get(store, job).members
    return {f"{g}/{w}": info for g, ws in m.items() for w, info in ws.items()}


@contextmanager
def _controller(c: Any, etcd: EtcdServer, tmp_path: Path) -> Iterator[Any]:
    """This test's own controller on the cluster (the session platform's would take the job);
    yields a store client."""
    store = etcd.store()
    env = {**ray_env(), "RRL_HOME": str(tmp_path / "home")}
    argv = [sys.executable, "-m", "resilient_rl.cli", "controller", "--etcd", etcd.endpoint, "--ray-address", c.address]
    ctl = ManagedProcess.spawn("controller", argv, tmp_path / "controller.log", env=env)
    try:
        yield store
    finally:
        ctl.stop()
        store.close()


def _until(cond: Any, store: Any, job: str, tmp_path: Path, timeout: float, every: float = 0.2) -> None:
    """Wait for ``cond()``; the controller's log on a timeout, the job's state if it ended first."""
    deadline = time.monotonic() + timeout
    while not cond():
        rec = jobs.get(store, job)
        assert rec.phase not in jobs.TERMINAL, rec.state
        assert time.monotonic() < deadline, (tmp_path / "controller.log").read_text()[-3000:]
        time.sleep(every)


def _finish(store: Any, job: str, tmp_path: Path, steps: int) -> Any:
    """Wait for the job's end: SUCCEEDED, every step once in the metrics and the journal."""
    deadline = time.monotonic() + 600
    while (rec := jobs.get(store, job)).phase not in jobs.TERMINAL:
        assert time.monotonic() < deadline, (tmp_path / "controller.log").read_text()[-3000:]
        time.sleep(0.5)
    assert rec.phase == "SUCCEEDED", rec.state.get("reason")
    assert [m["step"] for m in metrics(tmp_path / "job")] == list(range(steps))
    _check_journal(tmp_path / "job", steps, 4, 4, 3)
    return rec


def _check_replay(rec: Any, steps: int, c: Any, etcd: EtcdServer) -> None:
    from resilient_rl.verify import replay_digest

    digest = replay_digest(JobSpec.model_validate(rec.spec), steps, c.address, etcd.endpoint)
    assert digest == rec.state["weights_digest"]


@pytest.mark.timeout(900)
def test_ray_node_hosting_a_rollout_worker_and_a_trainer_rank_is_removed(
    cluster: Any, etcd: EtcdServer, tmp_path: Path
) -> None:
    c, nodes, args = cluster
    with _controller(c, etcd, tmp_path) as store:
        work = tmp_path / "job"
        steps = 80  # long enough after the loss for every lost worker to be asked for work
        # 3 CPUs per node: a rank takes 2 and a rollout worker 1, so each of the two nodes gets one of
        # each (Ray would spread onto an empty third node: it joins only before the loss, as a spare)
        spec = parse_spec(
            _spec("e2e-nodes", work, rollout={"replicas": 2, "num_cpus": 1}, trainer={"replicas": 2, "num_cpus": 2},
                  steps=steps, checkpoint={"dir": str(work), "every": 5})
        )  # fmt: skip
        job = spec.name
        jobs.submit(store, job, spec.to_json(), {"rollout": 2, "trainer": 2})
        _until(lambda: jobs.get(store, job).state.get("step", 0) >= 4, store, job, tmp_path, 300)

        members = _members(store, job)
        by_node: dict[str, set[str]] = {}
        for name, info in members.items():
            by_node.setdefault(info["ray_node"], set()).add(name.split("/")[0])
        # not the node of the job's weight store: the store is meant for the head (the stable node),
        # but a driver attached to a same-IP cluster can leave it on a worker node, and its loss is
        # another fault (every published version goes with it), not this test's
        import ray

        from resilient_rl.naming import NAMESPACE, actor_name

        ray.init(address=c.address, namespace=NAMESPACE, log_to_driver=False)
        weights_node = ray.get(ray.get_actor(actor_name(job, "weights", 0)).node.remote(), timeout=60)
        # rank 0's node: the published weights' first copies are there (the store keeps a copy on its
        # own node: without it every version's buckets died with this node, and the rollout workers'
        # loads failed until their restart budget ran out: a crash loop, seen in CI)
        # (unless the store is on that node too: then rank 1's, which still holds a rollout worker)
        target = members["trainer/0"]["ray_node"]
        if target == weights_node:
            target = members["trainer/1"]["ray_node"]
        assert by_node.get(target) == {"rollout", "trainer"} and target != weights_node, (by_node, weights_node)
        victim = next(n for n in nodes if n.node_id == target)
        c.add_node(**args, num_cpus=3)  # the third node: where the lost workers can go
        c.wait_for_nodes()
        c.remove_node(victim, allow_graceful=False)

        rec = _finish(store, job, tmp_path, steps)
        kinds = [e["kind"] for e in events.read(store, job, limit=2000)]
        missing = {"trainer_restart", "rollout_fault", "group_restored"} - set(kinds)
        assert not missing, (
            missing,
            [(e["kind"], e.get("message", "")[:160]) for e in events.read(store, job, limit=2000)],
        )
        _check_replay(rec, steps, c, etcd)


@pytest.mark.timeout(900)
def test_a_drained_ray_node_hands_its_rollout_worker_and_trainer_rank_over_without_a_fault(
    cluster: Any, etcd: EtcdServer, tmp_path: Path
) -> None:
    """A preemption notice that reaches the cluster, not the process: the node hosting a rollout
    worker and a trainer rank is drained (``DrainNode``, reason preemption, a 60 s deadline, as
    ``ray drain-node`` and the autoscaler send it). The leader sees it within a second: the
    worker takes no more work and leaves once its shard is in, the rank is handed over hot at
    the next step boundary; their successors start on a third node. Then the node goes. No
    fault is counted (``max_restarts: 0``), every step once, weights equal to a replay."""
    import ray
    from ray.core.generated import autoscaler_pb2

    from resilient_rl.naming import NAMESPACE, actor_name

    c, nodes, args = cluster
    with _controller(c, etcd, tmp_path) as store:
        work = tmp_path / "job"
        steps = 40
        spec = parse_spec(
            _spec("e2e-drain", work, rollout={"replicas": 2, "num_cpus": 1}, trainer={"replicas": 2, "num_cpus": 2},
                  steps=steps, checkpoint={"dir": str(work), "every": 50}, fault={"max_restarts": 0})
        )  # fmt: skip
        job = spec.name
        jobs.submit(store, job, spec.to_json(), {"rollout": 2, "trainer": 2})
        _until(lambda: jobs.get(store, job).state.get("step", 0) >= 3, store, job, tmp_path, 300)
        members = _members(store, job)
        ray.init(address=c.address, namespace=NAMESPACE, log_to_driver=False)
        weights_node = ray.get(ray.get_actor(actor_name(job, "weights", 0)).node.remote(), timeout=60)
        target = next(members[f"trainer/{r}"]["ray_node"] for r in (1, 0)
                      if members[f"trainer/{r}"]["ray_node"] != weights_node)  # fmt: skip
        on_target = sorted(n for n, info in members.items() if info["ray_node"] == target)
        assert {n.split("/")[0] for n in on_target} == {"rollout", "trainer"}, members
        c.add_node(**args, num_cpus=3)  # where their successors go
        c.wait_for_nodes()
        gcs = ray._raylet.GcsClient(address=c.address)
        accepted, why = gcs.drain_node(target, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                       "e2e: spot notice", int(time.time() * 1000) + 60_000)  # fmt: skip
        assert accepted, why
        t_drain = time.time()
        _until(lambda: len([e for e in events.read(store, job, limit=2000) if e["kind"] == "preempted"]) >= 2,
               store, job, tmp_path, 60)  # fmt: skip
        took = time.time() - t_drain
        c.remove_node(next(n for n in nodes if n.node_id == target), allow_graceful=True)  # the deadline's end

        rec = _finish(store, job, tmp_path, steps)
        evs = events.read(store, job, limit=2000)
        pre = [e for e in evs if e["kind"] == "preempted"]
        assert sorted(e["group"] for e in pre) == ["rollout", "trainer"], pre
        assert not [e for e in evs if e["kind"] in ("rollout_fault", "rollout_hang", "trainer_restart", "trainer_hang")]
        assert took < 60, took  # both handed over inside the drain's deadline
        after = _members(store, job)
        assert all(info["ray_node"] != target for info in after.values()), after
        print(f"\ndrain to both hand-overs: {took:.1f}s; {[e['message'] for e in pre]}")
        _check_replay(rec, steps, c, etcd)
