"""The actor layer's contract (tests/helpers/actor_contract.py) against the in-memory fake.
The same checks run against real Ray in tests/integration/test_actor_contract_ray.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.actor_contract import CHECKS, Probe
from tests.helpers.fake_actors import FakeActors


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_the_fake_keeps_the_contract(check: Any) -> None:
    check(FakeActors(roles={"probe": Probe}))


def test_the_suite_covers_each_promise() -> None:
    assert len(CHECKS) == 10
