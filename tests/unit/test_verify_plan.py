"""rrl verify's replay plan: the chain of trainer segments that made the final weights, from the
lineage the runner records at every (re)start of the trainer group."""

from __future__ import annotations

from resilient_rl.verify import Part, replay_plan


def seg(at: int, frm: int, world: int, threads: int = 1) -> dict:
    return {"at_step": at, "from_step": frm, "world": world, "threads": threads, "strategy": "ddp"}


def test_no_lineage_is_one_part_at_the_spec_settings() -> None:
    assert replay_plan([], 10, 2, 1) == [Part(0, 10, 2, 1)]


def test_one_segment_from_the_start() -> None:
    assert replay_plan([seg(0, 0, 2)], 10, 1, 1) == [Part(0, 10, 2, 1)]


def test_rescale_after_a_snapshot_replays_each_segment_at_its_world() -> None:
    # world 2 from 0; `rrl scale --trainer 1` at step 6 restored the snapshot of step 5 (written by
    # the world-2 group) and replayed 5..; then world 2 again at 9 from the snapshot of 8 (world 1's)
    lineage = [seg(0, 0, 2), seg(6, 5, 1), seg(9, 8, 2)]
    assert replay_plan(lineage, 12, 2, 1) == [Part(0, 5, 2, 1), Part(5, 8, 1, 1), Part(8, 12, 2, 1)]


def test_a_snapshot_written_just_before_a_restart_belongs_to_the_group_before_it() -> None:
    # snapshot at 6 taken after step 5 committed, then the resize at 6 restored it
    assert replay_plan([seg(0, 0, 1), seg(6, 6, 2)], 9, 1, 1) == [Part(0, 6, 1, 1), Part(6, 9, 2, 1)]


def test_a_restart_without_a_newer_snapshot_skips_the_segment_it_replaced() -> None:
    # world 1 from 0; at 7 a rank loss restarted world 2 from the snapshot of 5; at 8 another
    # restart (world 1) again from 5: the world-2 segment made nothing that reached the end
    lineage = [seg(0, 0, 1), seg(7, 5, 2), seg(8, 5, 1, threads=2)]
    assert replay_plan(lineage, 10, 1, 1) == [Part(0, 5, 1, 1), Part(5, 10, 1, 2)]


def test_restarts_at_the_same_settings_replay_as_one_part_up_to_two_ranks() -> None:
    # three restarts at world 1, one thread: one fresh trainer replays them all
    lineage = [seg(0, 0, 1), seg(4, 3, 1), seg(9, 9, 1), seg(12, 11, 1)]
    assert replay_plan(lineage, 16, 1, 1) == [Part(0, 16, 1, 1)]
    # world 2 as well; a change of world or threads still splits
    lineage = [seg(0, 0, 2), seg(5, 5, 2), seg(8, 7, 1), seg(10, 10, 1, threads=2)]
    assert replay_plan(lineage, 12, 2, 1) == [Part(0, 7, 2, 1), Part(7, 10, 1, 1), Part(10, 12, 1, 2)]
    # beyond two ranks each segment keeps its own process (a ring's sums follow the buckets)
    assert replay_plan([seg(0, 0, 4), seg(5, 4, 4)], 8, 4, 1) == [Part(0, 4, 4, 1), Part(4, 8, 4, 1)]


def test_restart_from_the_initial_weights_drops_everything_before() -> None:
    assert replay_plan([seg(0, 0, 2), seg(4, 0, 1)], 6, 2, 1) == [Part(0, 6, 1, 1)]


def test_segments_after_the_replayed_step_count_are_ignored() -> None:
    assert replay_plan([seg(0, 0, 1), seg(6, 5, 2)], 4, 3, 1) == [Part(0, 4, 1, 1)]
