"""Sampler: the data cursor is the step; prompt order and per-sample seeds are pure functions."""

from __future__ import annotations

import pytest

from resilient_rl.algo.sampler import prompt_indices, sample_seed


def _epoch(seed: int, size: int, per_step: int) -> list[int]:
    """All indices of epoch 0, read through consecutive steps (size must be a multiple of per_step)."""
    return [i for step in range(size // per_step) for i in prompt_indices(seed, step, per_step, size)]


def test_epoch_has_no_duplicates_and_covers_every_index() -> None:
    seen = _epoch(seed=3, size=60, per_step=6)
    assert len(seen) == len(set(seen)) == 60
    assert sorted(seen) == list(range(60))


def test_epoch_coverage_when_steps_straddle_epochs() -> None:
    size, per_step = 10, 4  # steps 2 and 4 cross epoch boundaries
    flat = [i for step in range(5) for i in prompt_indices(0, step, per_step, size)]
    assert sorted(flat[:10]) == list(range(10))
    assert sorted(flat[10:20]) == list(range(10))


def test_matches_documented_formula() -> None:
    import numpy as np

    seed, size, per_step, step = 5, 7, 3, 4
    expected = []
    for j in range(per_step):
        p = step * per_step + j
        expected.append(int(np.random.default_rng([seed, p // size]).permutation(size)[p % size]))
    assert prompt_indices(seed, step, per_step, size) == expected


def test_stable_across_calls_and_stateless() -> None:
    first = [prompt_indices(1, s, 8, 100) for s in range(30)]
    # Out-of-order and repeated queries give the same answers: no hidden cursor.
    assert prompt_indices(1, 17, 8, 100) == first[17]
    assert [prompt_indices(1, s, 8, 100) for s in reversed(range(30))] == first[::-1]
    assert all(isinstance(i, int) for i in first[0])


def test_epochs_are_reshuffled() -> None:
    assert prompt_indices(0, 0, 50, 50) != prompt_indices(0, 1, 50, 50)


def test_differs_across_seeds() -> None:
    assert _epoch(seed=0, size=64, per_step=8) != _epoch(seed=1, size=64, per_step=8)


def test_per_step_larger_than_dataset() -> None:
    out = prompt_indices(0, 0, 25, 10)
    assert len(out) == 25
    assert sorted(out[:10]) == list(range(10)) and sorted(out[10:20]) == list(range(10))


@pytest.mark.parametrize(
    ("seed", "step", "per_step", "size"), [(-1, 0, 1, 1), (0, -1, 1, 1), (0, 0, 0, 1), (0, 0, 1, 0)]
)
def test_invalid_arguments(seed: int, step: int, per_step: int, size: int) -> None:
    with pytest.raises(ValueError):
        prompt_indices(seed, step, per_step, size)


def test_sample_seed_stable_and_in_range() -> None:
    assert sample_seed(0, 1, 2, 3) == sample_seed(0, 1, 2, 3)
    seeds = {sample_seed(s, st, p, k) for s in range(3) for st in range(5) for p in range(10) for k in range(8)}
    assert all(0 <= x < 2**31 for x in seeds)
    assert len(seeds) == 3 * 5 * 10 * 8  # every argument matters (no collisions in this small grid)
    assert 0 <= sample_seed(2**70, 10**12, 10**9, 10**6) < 2**31  # large ints are fine


def test_sample_seed_known_value() -> None:
    # Pinned: a change here silently changes every job's sampling, breaking resume determinism.
    assert sample_seed(0, 0, 0, 0) == 662139884
    assert sample_seed(1, 2, 3, 4) == 550362104
    assert sample_seed(0, 0, 0, 1) != sample_seed(0, 0, 1, 0)  # argument order matters
