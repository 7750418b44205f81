"""The actor layer's contract (tests/helpers/actor_contract.py) against real Ray: a local
Ray instance of this test module's own (``address="local"``), shut down afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray

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
