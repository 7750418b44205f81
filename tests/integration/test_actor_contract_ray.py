"""The actor layer's contract (tests/helpers/actor_contract.py) against real Ray: a local
Ray instance of this test module's own (``address="local"``), shut down afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray

from resilient_rl.job.actors import RayActors
from tests.conftest import REPO
from tests.helpers.actor_contract import CHECKS, Probe


@pytest.fixture(scope="module")
def ray_actors() -> Iterator[RayActors]:
    assert not ray.is_initialized()
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="rrl-contract", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})  # fmt: skip
    try:
        yield RayActors("rrl-contract", classes={"probe": Probe})
    finally:
        ray.shutdown()


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_ray_keeps_the_contract(ray_actors: RayActors, check: Any) -> None:
    check(ray_actors)
