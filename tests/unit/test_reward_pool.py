"""User reward functions in killable processes: a hung or crashing call scores 0 with an error
naming the function, its process is replaced, the rest of the batch is scored. Real child
processes (the pool's own), no Ray."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from resilient_rl.algo.tasks.base import RewardResult, TaskError
from resilient_rl.algo.tasks.reward_pool import RewardPool

FNS = "tests.unit.reward_fns"


@pytest.fixture
def hanging() -> Iterator[RewardPool]:
    pool = RewardPool(f"{FNS}:hangs_on_x", timeout_s=1.0, size=2)
    yield pool
    pool.close()


def test_results_in_order_and_validated_as_in_process() -> None:
    pool = RewardPool(f"{FNS}:length_ratio", timeout_s=5.0, size=2)
    try:
        got = pool.score([("p", "ab", "abcd"), ("p", "abcd", "abcd"), ("p", "abcdefgh", "abcd")])
    finally:
        pool.close()
    assert got[:2] == [RewardResult(0.5), RewardResult(1.0)]
    assert got[2].value == 0.0 and got[2].error is not None and "outside [0, 1]" in got[2].error


def test_a_hung_call_times_out_names_the_function_and_the_batch_goes_on(hanging: RewardPool) -> None:
    pids = {c.proc.pid for c in hanging._children}
    ended: list[int] = []  # progress: one call per call that ended, timed out ones included
    got = hanging.score([("p", "a", "a"), ("p", "x", "a"), ("p", "b", "a"), ("p", "x", "a"), ("p", "c", "a")],
                        progress=lambda: ended.append(1))  # fmt: skip
    assert len(ended) == 5
    assert [r.value for r in got] == [0.25, 0.0, 0.25, 0.0, 0.25]
    for r in (got[1], got[3]):
        assert r.error is not None and r.error.startswith(f"TimeoutError: reward function {FNS}:hangs_on_x did not")
        assert "task.reward_timeout_s" in r.error
    assert all(r.error is None for r in (got[0], got[2], got[4]))  # the user's print did not garble a reply
    assert hanging.restarts == 2
    assert not pids & {c.proc.pid for c in hanging._children}  # both hung ones were replaced
    for pid in pids:  # and are gone, not left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert hanging.score([("p", "d", "a")]) == [RewardResult(0.25)]  # the pool still works


def test_a_child_that_dies_scores_0_and_is_replaced() -> None:
    pool = RewardPool(f"{FNS}:dies_on_x", timeout_s=5.0, size=1)
    try:
        got = pool.score([("p", "x", "a"), ("p", "y", "a")])
        assert got[1] == RewardResult(0.75)
        assert (
            got[0].value == 0.0
            and got[0].error == f"ChildProcessError: reward function {FNS}:dies_on_x died (exit code 3)"
        )
        assert pool.restarts == 1
    finally:
        pool.close()


def test_a_function_that_cannot_be_imported_is_a_task_error() -> None:
    with pytest.raises(TaskError, match="task.reward_fn: .* has no attribute 'nope'"):
        RewardPool(f"{FNS}:nope", timeout_s=1.0)
