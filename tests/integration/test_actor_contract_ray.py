"""The actor layer's contract (tests/helpers/actor_contract.py) against real Ray, and the
weight store's pull of published buckets (which only real Ray can show: who owns an
object). A local Ray instance of this test module's own (``address="local"``), shut down
afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

from resilient_rl.job.actors import RayActors
from resilient_rl.local import ray_head_env
from tests.conftest import REPO
from tests.helpers.actor_contract import CHECKS, Probe


@pytest.fixture(scope="module")
def ray_actors() -> Iterator[RayActors]:
    import os

    if ray.is_initialized():  # connected to the session platform's Ray: one cluster per process
        ray.shutdown()
    saved = {k: os.environ.get(k) for k in ray_head_env()}
    os.environ.update(ray_head_env())  # every Ray listener on loopback, as `rrl up` does
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="rrl-contract", log_to_driver=False,
             _node_ip_address="127.0.0.1", runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})  # fmt: skip
    try:
        yield RayActors("rrl-contract", classes={"probe": Probe})
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_ray_keeps_the_contract(ray_actors: RayActors, check: Any) -> None:
    check(ray_actors)


def test_the_weight_store_pulls_buckets_it_owns_and_they_outlive_the_publisher(ray_actors: RayActors) -> None:
    """The store pulls each bucket from the publisher's ``export`` (the caller of a method owns
    its result), so a version stays fetchable after the publisher dies: what a rollout worker
    needs while a trainer rank restarts."""
    from resilient_rl.workers.transport import Published, fetch
    from resilient_rl.workers.weights import WeightStore
    from tests.helpers.weight_source import Publisher, weights

    store = ray.remote(WeightStore).options(namespace="rrl-contract", num_cpus=0).remote()
    pub = ray.remote(concurrency_groups={"export": 1})(Publisher).options(num_cpus=0).remote(store)
    try:
        handles = {v: ray.get(pub.publish.remote(v, 5), timeout=60)[0] for v in (1, 2)}
        ray.kill(pub)  # the publisher (a trainer rank) is gone: its own objects would be too
        for v, ref in handles.items():
            handle = ray.get(ref, timeout=60)
            assert isinstance(handle, Published) and handle.version == v
            assert len(handle.buckets) == 4 and handle.tensors == 7  # 7 tensors, 2 per bucket
            got = dict(fetch(handle))
            want = weights(v, 5)
            assert list(got) == list(want)
            for k, t in want.items():
                assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), k
        assert ray.get(store.get.remote(2), timeout=30) is not None
    finally:
        ray.kill(store)


def test_a_pull_of_a_bucket_that_is_not_staged_names_what_is(ray_actors: RayActors) -> None:
    from resilient_rl.workers.weights import WeightStore
    from tests.helpers.weight_source import Publisher

    store = ray.remote(WeightStore).options(namespace="rrl-contract", num_cpus=0).remote()
    pub = ray.remote(concurrency_groups={"export": 1})(Publisher).options(num_cpus=0).remote(store)
    try:
        ray.get(pub.publish.remote(1, 1), timeout=60)  # a transport exists, nothing staged now
        with pytest.raises(ray.exceptions.RayTaskError, match="bucket 0 of version 7 is not staged here"):
            ray.get(store.pull.remote(7, 0, pub), timeout=60)
        with pytest.raises(ray.exceptions.RayTaskError, match="sealed with 3 buckets but 0 arrived"):
            ray.get(store.seal.remote(7, 3, 3, 12), timeout=60)
    finally:
        ray.kill(pub)
        ray.kill(store)


def test_a_trainer_ranks_rejected_step_is_in_its_captured_log(ray_actors: RayActors, etcd: Any, tmp_path: Any) -> None:
    """A rank (a real Ray actor) whose batch gives a non-finite loss rejects the step and says so
    on its stderr, which its process captures into <workdir>/logs: what `rrl logs JOB --group
    trainer` shows (tests/e2e/test_rewards.py reads a rollout worker's the same way)."""
    import time

    from checkpoints.journal import Journal
    from controller import worker_logs
    from resilient_rl.algo.tasks import VOCAB_CHARS
    from resilient_rl.local import free_port
    from resilient_rl.spec import parse_spec
    from resilient_rl.workers.model_init import make_tiny_model
    from resilient_rl.workers.trainer import trainer_actor

    spec = parse_spec({"name": "guard", "model": {"init": {}}, "prompts_per_step": 1, "rollout": {"sampling": {"n": 4}},
                       "trainer": {"spares": 0}})  # fmt: skip
    model_dir = make_tiny_model(tmp_path / "model", spec.model.init, VOCAB_CHARS)
    journal = Journal(tmp_path / "journal")
    samples = [{"prompt_index": 0, "sample": i, "prompt_ids": [3, 4, 5], "token_ids": [6, 7, 1], "reward": r,
                "version": 0} for i, r in enumerate([0.0, 1.0, 0.5, float("nan")])]  # fmt: skip
    journal.commit_batch(0, [journal.write_shard(0, 0, samples, {})])
    rank = trainer_actor().options(namespace="rrl-contract", num_cpus=0).remote(
        "guard", 0, 1, spec.to_json(), str(model_dir), str(tmp_path), etcd.endpoint)  # fmt: skip
    try:
        ray.get(rank.setup.remote(("127.0.0.1", free_port())), timeout=180)
        with pytest.raises(ray.exceptions.RayTaskError, match="non-finite"):
            ray.get(rank.train_step.remote(0, False), timeout=180)
        deadline = time.monotonic() + 30
        while True:
            files = worker_logs.select(worker_logs.list_files(tmp_path / "logs"), "trainer", 0)
            texts = [x.text for x in worker_logs.read(files)]
            if any("rank 0: step 0: non-finite loss or gradient; step rejected" in t for t in texts):
                break
            assert time.monotonic() < deadline, texts
            time.sleep(0.2)
        assert any("trainer rank 0 of 1 (ddp) of job guard: ready at step 0" in t for t in texts), texts
    finally:
        ray.kill(rank)
