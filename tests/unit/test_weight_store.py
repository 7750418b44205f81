"""The weight store's bookkeeping of the trainer's shadow copies (no Ray: plain method calls)."""

from __future__ import annotations

from typing import Any

from resilient_rl.workers.weights import WeightStore


def _meta(rank: int, step: int, world: int = 2, strategy: str = "fsdp") -> dict[str, Any]:
    sources = 1 if strategy == "ddp" else world
    return {"rank": rank, "step": step, "world": world, "strategy": strategy, "spec_digest": "d", "sources": sources}


def test_a_step_is_restorable_once_every_source_rank_has_its_copy_and_the_one_before_is_kept() -> None:
    w = WeightStore()
    w.put_shadow(_meta(0, 3), {"t": 0}, "{}", None)
    assert w.shadow() is None  # rank 1's part of step 3 is missing
    w.put_shadow(_meta(1, 3), {"t": 1}, "{}", None)
    w.put_shadow(_meta(0, 4), {"t": 2}, "{}", None)  # rank 0 is one step ahead
    assert w.shadow() is not None and w.shadow()["step"] == 3  # type: ignore[index]
    w.put_shadow(_meta(1, 4), {"t": 3}, "{}", None)
    assert w.shadow()["step"] == 4  # type: ignore[index]
    assert {r: sorted(p) for r, p in w.shadows.items()} == {0: [3, 4], 1: [3, 4]}  # the one before stays
    assert w.shadow_part(1, 4)[0] == {"t": 3}
    w.put_shadow(_meta(0, 5), {}, "{}", None)
    w.put_shadow(_meta(1, 5), {}, "{}", None)
    assert {r: sorted(p) for r, p in w.shadows.items()} == {0: [4, 5], 1: [4, 5]}  # step 3 dropped


def test_a_copy_newer_than_the_committed_step_leaves_the_one_before_usable() -> None:
    """A rank sends the copy of step k+1 before step k is committed; if it dies in that gap
    the restart (at committed step k) must still find a complete copy at or below k."""
    w = WeightStore()
    for s in (4, 5):
        w.put_shadow(_meta(0, s, world=1, strategy="ddp"), {"s": s}, "{}", None)
    assert w.shadow()["step"] == 5  # type: ignore[index]
    assert w.shadow(4)["step"] == 4  # type: ignore[index]
    assert w.shadow_part(0, 4)[0] == {"s": 4}
    assert w.shadow(3) is None  # nothing at or below step 3 is held any more


def test_copies_of_another_layout_replace_all_and_one_rank_alone_keeps_at_most_three() -> None:
    w = WeightStore()
    for s in range(1, 8):  # rank 1's copies stopped coming: rank 0 does not pile up
        w.put_shadow(_meta(0, s), {}, "{}", None)
    assert sorted(w.shadows[0]) == [5, 6, 7] and w.shadow() is None
    w.put_shadow(_meta(0, 9, world=1, strategy="ddp"), {}, "{}", None)  # restarted under ddp
    assert w.shadow() == {"step": 9, "world": 1, "strategy": "ddp", "spec_digest": "d", "sources": 1}
    assert list(w.shadows) == [0] and sorted(w.shadows[0]) == [9]
