"""The contract of the actor layer (resilient_rl/job/actors.py): what the driver depends on.

Each ``check_*`` takes an :class:`~resilient_rl.job.actors.Actors` that knows the role
``probe`` (:class:`Probe`) and must pass on both the in-memory fake
(``tests/unit/test_actor_contract.py``) and real Ray (``tests/integration/test_actor_contract_ray.py``).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
import ray

from resilient_rl.errors import worker_cause
from resilient_rl.job.actors import Placement, actor_died, timed_out

_names = itertools.count()


class ProbeError(Exception):
    pass


class Probe:
    def __init__(self, tag: str, fail: bool = False) -> None:
        if fail:
            raise ProbeError(f"{tag} refuses to start")
        self.tag = tag
        self.log: list[int] = []

    def record(self, x: int, delay: float = 0.0) -> int:
        time.sleep(delay)
        self.log.append(x)
        return x

    def seen(self) -> list[int]:
        return list(self.log)

    def sleep(self, s: float) -> float:
        time.sleep(s)
        return s

    def fail(self, msg: str) -> None:
        raise ProbeError(msg)

    @ray.method(concurrency_group="control")
    def ping(self) -> str:
        return self.tag


def _square(x: int) -> int:
    return x * x


def _new(actors: Any, tag: str = "p", fail: bool = False) -> tuple[str, Any]:
    name = f"rrl:contract:probe:{next(_names)}-{time.monotonic_ns()}"
    return name, actors.create("probe", name, (tag, fail), Placement(num_cpus=0))


def check_calls_on_one_actor_run_in_order(actors: Any) -> None:
    _, a = _new(actors)
    refs = [actors.call(a, "record", i, 0.02 * (i % 3)) for i in range(8)]
    assert actors.get(refs, timeout=30) == list(range(8))
    assert actors.get(actors.call(a, "seen"), timeout=30) == list(range(8))
    actors.kill(a)


def check_a_concurrency_group_answers_beside_a_busy_actor(actors: Any) -> None:
    _, a = _new(actors, "busy")
    actors.get(actors.call(a, "seen"), timeout=30)  # constructed
    slow = actors.call(a, "sleep", 3.0)
    t0 = time.monotonic()
    assert actors.get(actors.call(a, "ping"), timeout=30) == "busy"
    assert time.monotonic() - t0 < 2.5 and not actors.wait([slow], timeout=0)[0]
    actors.kill(a)


def check_calls_of_a_killed_actor_fail_as_actor_died(actors: Any) -> None:
    _, a = _new(actors)
    actors.get(actors.call(a, "seen"), timeout=30)
    running = actors.call(a, "sleep", 5.0)
    queued = actors.call(a, "record", 1)
    time.sleep(0.3)
    actors.kill(a)
    for ref in (running, queued):
        with pytest.raises(Exception) as e:
            actors.get(ref, timeout=30)
        assert actor_died(e.value), repr(e.value)
    with pytest.raises(Exception) as e:  # and a call made after the kill
        actors.get(actors.call(a, "seen"), timeout=30)
    assert actor_died(e.value)


def check_a_worker_error_arrives_wrapped_with_its_cause(actors: Any) -> None:
    _, a = _new(actors)
    with pytest.raises(ProbeError) as e:  # Ray's wrapper is also an instance of the worker's type
        actors.get(actors.call(a, "fail", "bad input"), timeout=30)
    assert isinstance(e.value, ray.exceptions.RayTaskError) and not actor_died(e.value)
    cause = worker_cause(e.value)
    assert type(cause) is ProbeError and str(cause) == "bad input"
    assert actors.get(actors.call(a, "record", 7), timeout=30) == 7  # the actor lives on
    actors.kill(a)


def check_a_get_past_its_timeout_raises_get_timeout(actors: Any) -> None:
    _, a = _new(actors)
    ref = actors.call(a, "sleep", 0.6)
    with pytest.raises(Exception) as e:
        actors.get(ref, timeout=0.2)
    assert timed_out(e.value) and not actor_died(e.value)
    ready, pending = actors.wait([ref], timeout=0)
    assert ready == [] and pending == [ref]
    assert actors.get(ref, timeout=30) == 0.6  # still delivered afterwards
    ready, pending = actors.wait([ref], timeout=0)
    assert ready == [ref] and pending == []
    actors.kill(a)


def check_a_failed_constructor_leaves_a_dead_actor(actors: Any) -> None:
    _, a = _new(actors, "x", fail=True)
    with pytest.raises(Exception) as e:
        actors.get(actors.call(a, "seen"), timeout=30)
    assert actor_died(e.value), repr(e.value)


def check_names_are_unique_among_live_actors_and_freed_by_death(actors: Any) -> None:
    name, a = _new(actors)
    actors.get(actors.call(a, "seen"), timeout=30)
    assert actors.find(name) is not None
    with pytest.raises(ValueError):
        actors.create("probe", name, ("again", False), Placement(num_cpus=0))
    same = actors.create("probe", name, ("again", False), Placement(num_cpus=0, get_if_exists=True))
    assert actors.get(actors.call(same, "ping"), timeout=30) == "p"  # the live one, handed back
    actors.kill(a)
    deadline = time.monotonic() + 20
    while True:  # free again once the death is seen (not necessarily at once)
        try:
            b = actors.create("probe", name, ("new", False), Placement(num_cpus=0))
            break
        except ValueError:
            assert time.monotonic() < deadline, "a killed actor's name was never freed"
            time.sleep(0.1)
    assert actors.get(actors.call(b, "ping"), timeout=30) == "new"
    assert actors.get(actors.call(actors.find(name), "ping"), timeout=30) == "new"
    actors.kill(b)


def check_names_lists_the_live_actors_of_a_prefix(actors: Any) -> None:
    name, a = _new(actors)
    actors.get(actors.call(a, "seen"), timeout=30)
    prefix = name.rsplit(":", 1)[0] + ":"
    assert name in actors.names(prefix) and actors.names(name + "-nothing") == []
    actors.kill(a)
    deadline = time.monotonic() + 20
    while name in actors.names(prefix):  # gone once the death is seen
        assert time.monotonic() < deadline, "a killed actor is still listed"
        time.sleep(0.1)


def check_a_task_runs_a_function_elsewhere(actors: Any) -> None:
    assert actors.get(actors.task(_square, 7), timeout=60) == 49


def check_no_node_drains_in_a_cluster_left_alone(actors: Any) -> None:
    assert actors.draining_nodes() == {}


CHECKS = [v for k, v in sorted(globals().items()) if k.startswith("check_")]
