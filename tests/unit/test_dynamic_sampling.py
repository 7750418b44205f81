"""Dynamic sampling's pure parts (``resilient_rl/algo/dynamic.py``): the extra prompt stream,
round sizes, which groups a batch keeps; and the spec's bounds."""

from __future__ import annotations

from typing import Any

import pytest

from resilient_rl.algo.dynamic import extra_prompt_indices, next_round, round_sample_number, select_groups, varied
from resilient_rl.algo.sampler import prompt_indices, sample_seed
from resilient_rl.spec import SpecError, parse_spec

MINIMAL: dict[str, Any] = {"name": "j", "model": {"init": {}}}


def test_the_extra_stream_is_keyed_by_seed_step_and_round_and_distinct_within_a_round() -> None:
    a = extra_prompt_indices(7, 3, 1, 20, 50)
    assert a == extra_prompt_indices(7, 3, 1, 20, 50)  # a new leader asks for the same prompts
    assert len(set(a)) == 20 and all(0 <= i < 50 for i in a)
    assert a != extra_prompt_indices(7, 3, 2, 20, 50) and a != extra_prompt_indices(7, 4, 1, 20, 50)
    assert a != extra_prompt_indices(8, 3, 1, 20, 50)
    assert extra_prompt_indices(7, 3, 1, 5, 50) == a[:5]  # a smaller round is a prefix of the same stream
    # the step cursor is untouched: later steps' own prompts do not depend on extra rounds
    assert prompt_indices(7, 4, 8, 50) == prompt_indices(7, 4, 8, 50)
    assert len(extra_prompt_indices(7, 3, 1, 70, 50)) == 70  # more than the dataset: with replacement
    with pytest.raises(ValueError, match="round"):
        extra_prompt_indices(7, 3, 0, 5, 50)


def test_a_later_round_samples_a_prompt_with_fresh_seeds() -> None:
    n = 4
    r0 = {sample_seed(1, 5, 9, round_sample_number(0, n, s)) for s in range(n)}
    r1 = {sample_seed(1, 5, 9, round_sample_number(1, n, s)) for s in range(n)}
    assert len(r0) == len(r1) == n and not r0 & r1
    assert [round_sample_number(0, n, s) for s in range(n)] == list(range(n))  # round 0: the seeds as ever


@pytest.mark.parametrize(
    ("kept", "generated", "used", "budget", "want"),
    [
        (8, 8, 0, 64, 0),  # full: done
        (9, 12, 4, 64, 0),  # more than needed: done
        (4, 8, 0, 64, 8),  # half kept: ask for twice the 4 missing
        (6, 8, 0, 64, 3),  # ceil(2 / 0.75)
        (0, 8, 0, 64, 8),  # nothing kept: as many again as generated so far
        (0, 16, 8, 64, 16),
        (4, 8, 0, 5, 5),  # the budget caps a round
        (4, 8, 5, 5, 0),  # budget spent: train on what there is
        (7, 8, 0, 64, 2),  # ceil(1 / (7/8)) = 2
    ],
)
def test_a_round_asks_for_the_missing_groups_at_the_keep_rate_within_the_budget(
    kept: int, generated: int, used: int, budget: int, want: int
) -> None:
    assert next_round(8, kept, generated, used, budget) == want


def _samples(rewards: list[list[float]]) -> list[dict[str, Any]]:
    return [{"prompt_index": p, "sample": s, "reward": r} for p, g in enumerate(rewards) for s, r in enumerate(g)]


def test_the_batch_keeps_the_first_groups_with_a_spread_in_journal_order() -> None:
    batch = _samples([[1, 1], [0, 1], [0, 0], [1, 0], [0.5, 0.25], [0, 1]])
    assert varied([s["reward"] for s in batch], 2) == [False, True, False, True, True, True]
    kept, counts = select_groups(batch, 2, 3)
    assert [s["prompt_index"] for s in kept] == [1, 1, 3, 3, 4, 4]
    assert counts == {"groups": 6, "kept": 3, "dropped": 3}
    few, counts = select_groups(batch, 2, 10)  # fewer than asked: all that have a spread
    assert [s["prompt_index"] for s in few[::2]] == [1, 3, 4, 5] and counts["kept"] == 4


def test_a_batch_with_no_spread_trains_on_its_first_groups_rather_than_none() -> None:
    kept, counts = select_groups(_samples([[1, 1], [0, 0], [1, 1]]), 2, 2)
    assert [s["prompt_index"] for s in kept] == [0, 0, 1, 1] and counts == {"groups": 3, "kept": 2, "dropped": 1}
    with pytest.raises(ValueError, match="groups of 2"):
        varied([1.0, 0.0, 1.0], 2)


def test_the_spec_bounds_and_names_the_fields() -> None:
    spec = parse_spec({**MINIMAL, "algorithm": {"dynamic_sampling": {}, "loss_aggregation": "token_mean"}})
    assert spec.algorithm.dynamic_sampling is not None and spec.algorithm.dynamic_sampling.max_extra_prompts == 64
    assert parse_spec({**MINIMAL}).algorithm.dynamic_sampling is None
    with pytest.raises(SpecError, match=r"algorithm\.dynamic_sampling\.max_extra_prompts"):
        parse_spec({**MINIMAL, "algorithm": {"dynamic_sampling": {"max_extra_prompts": 10**9}}})
    with pytest.raises(SpecError, match=r"algorithm\.dynamic_sampling\.max_extra"):
        parse_spec({**MINIMAL, "algorithm": {"dynamic_sampling": {"max_extra": 3}}})
    with pytest.raises(SpecError, match=r"algorithm\.loss_aggregation"):
        parse_spec({**MINIMAL, "algorithm": {"loss_aggregation": "token_sum"}})


def test_overlong_responses_are_punished_softly_and_truncated_ones_filtered() -> None:
    from resilient_rl.algo.dynamic import overlong_shaping

    rewards, lengths = [1.0, 1.0, 1.0, 1.0, 0.0], [4, 6, 7, 8, 8]
    shaped, trains = overlong_shaping(rewards, lengths, 8, True, 4, 0.5)
    assert shaped == pytest.approx([1.0, 0.75, 0.625, 0.5, -0.5])  # past 8 - 4 tokens: 0.5 x (L - 4) / 4
    assert trains == [True, True, True, False, False]  # 8 tokens: cut at max_tokens
    same, all_train = overlong_shaping(rewards, lengths, 8, False, 0, 1.0)
    assert same == rewards and all(all_train)


def test_overlong_buffer_is_bounded_by_max_tokens() -> None:
    ok = parse_spec({**MINIMAL, "algorithm": {"overlong": {"filter": True, "buffer_tokens": 8}},
                     "rollout": {"sampling": {"max_tokens": 8}}})  # fmt: skip
    assert ok.algorithm.overlong is not None and ok.algorithm.overlong.filter
    with pytest.raises(
        SpecError, match=r"algorithm\.overlong\.buffer_tokens \(9\) is over rollout\.sampling\.max_tokens"
    ):
        parse_spec(
            {**MINIMAL, "algorithm": {"overlong": {"buffer_tokens": 9}}, "rollout": {"sampling": {"max_tokens": 8}}}
        )
