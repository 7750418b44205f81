"""PromptCosts: the per-prompt group seconds behind ``rollout.longest_first`` (resilient_rl/job/scheduler.py)."""

from __future__ import annotations

from resilient_rl.job.scheduler import PromptCosts


def test_a_shard_goes_longest_expected_first_and_an_unseen_prompt_counts_as_the_mean() -> None:
    c = PromptCosts()
    assert c.order((5, 6, 7)) is None  # nothing seen: prompt order (the worker's own default)
    c.learn([[5, 0.1], [6, 2.0], [9, 0.5]])
    # positions of (5, 6, 7, 9): 6 is longest, then 7 (unseen: the mean of 0.1, 2.0, 0.5 = 0.87), 9, 5
    assert c.order((5, 6, 7, 9)) == (1, 2, 3, 0)
    c.learn([[6, 0.05]])  # the last time counts
    assert c.order((5, 6)) == (0, 1)
    assert c.order((5, 5)) == (0, 1)  # ties in position order


def test_costs_are_bounded_and_malformed_ones_ignored() -> None:
    c = PromptCosts(limit=3)
    c.learn([[1, 1.0], [2, 2.0], [3, 3.0], [4, 4.0]])
    assert list(c.seconds) == [2, 3, 4]  # the oldest dropped
    c.learn([[2, 0.5]])  # seen again: the newest now
    c.learn([[5, 5.0]])
    assert list(c.seconds) == [4, 2, 5]
    c.learn([["x", 1.0], [7], None, [8, float("nan")], [9, -1.0], [10, "slow"]])
    c.learn(None)
    c.learn("junk")
    assert list(c.seconds) == [4, 2, 5]
