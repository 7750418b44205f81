"""The worker timeline (controller/http/timeline.py): runs of one state per worker from samples
of membership, a gone worker, gaps when nothing sampled, the window, the bound on strips."""

from __future__ import annotations

from controller.http import timeline as tl


def _m(**workers: str) -> dict[str, dict[str, dict[str, str]]]:
    out: dict[str, dict[str, dict[str, str]]] = {}
    for key, status in workers.items():
        g, w = key.rsplit("_", 1)
        out.setdefault(g, {})[w] = {"status": status}
    return out


def test_runs_states_gone_and_gaps() -> None:
    t = tl.Timeline(window_s=100)
    t.observe("j", _m(rollout_0="busy", trainer_0="training"), 0.0)
    t.observe("j", _m(rollout_0="busy", trainer_0="ready"), 2.0)
    t.observe("j", _m(rollout_0="loading", trainer_0="training"), 4.0)
    t.observe("j", _m(trainer_0="training"), 6.0)  # rollout 0 lost
    t.observe("j", _m(trainer_0="training"), 30.0)  # no sample for 24 s: a gap, not a long run
    rows = {r["worker"]: r["runs"] for r in t.get("j", 30.0)["rows"]}
    assert rows["rollout/0"] == [["busy", 0.0, 4.0], ["loading", 4.0, 6.0], ["gone", 6.0, 6.0], ["gone", 30.0, 30.0]]
    assert rows["trainer/0"] == [["training", 0.0, 2.0], ["ready", 2.0, 4.0], ["training", 4.0, 6.0],
                                 ["training", 30.0, 30.0]]  # fmt: skip


def test_window_and_bounds() -> None:
    t = tl.Timeline(window_s=10)
    t.observe("j", _m(rollout_0="busy"), 0.0)
    for s in range(2, 30, 2):
        t.observe("j", _m(rollout_1="busy"), float(s))  # rollout 0 gone from 2 s on
    got = t.get("j", 28.0)
    assert got["from"] == 18.0 and [r["worker"] for r in got["rows"]] == ["rollout/1"]  # gone since before the window
    assert got["rows"][0]["runs"] == [["busy", 18.0, 28.0]]
    big = _m(**{f"rollout_{i}": "busy" for i in range(tl.MAX_WORKERS + 10)})
    t.observe("k", big, 0.0)
    assert len(t.get("k", 0.0)["rows"]) == tl.MAX_WORKERS
    t.keep({"j"})
    assert t.get("k", 0.0)["rows"] == [] and t.get("j", 28.0)["rows"]
