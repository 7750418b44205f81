"""How a batch is split over ranks and micro-batches (the trainer core's bookkeeping)."""

from __future__ import annotations

import pytest

from resilient_rl.workers.train_core import micro_batches, rank_slice

# every (batch, world, micro-batch) the spec allows among these: a batch of at least one sample per rank
CASES = [(t, w, m) for t in (1, 2, 7, 9, 16, 33) for w in (1, 2, 3, 4) for m in (1, 2, 5, 64) if t >= w]


@pytest.mark.parametrize(("total", "world", "micro"), CASES)
def test_every_sample_is_trained_once_and_every_rank_runs_as_many_micro_batches(
    total: int, world: int, micro: int
) -> None:
    seen: list[int] = []
    counts = set()
    for r in range(world):
        lo, hi = rank_slice(total, world, r)
        chunks = micro_batches(total, world, r, micro)
        counts.add(len(chunks))
        assert all(0 <= b - a <= micro for a, b in chunks)
        covered = [i for a, b in chunks for i in range(a, b)]
        assert covered == list(range(lo, hi))  # contiguous, in order, nothing left out
        seen += covered
    assert seen == list(range(total))  # none dropped (9 over 2 ranks was 8 with `total // world`), none twice
    assert len(counts) == 1  # FSDP's forward/backward are collectives: every rank runs as many


def test_a_slice_is_never_more_than_one_sample_longer_than_another() -> None:
    sizes = [b - a for a, b in (rank_slice(10, 4, r) for r in range(4))]
    assert sorted(sizes) == [2, 2, 3, 3]
