"""Worker registration and the controller's live membership view, on a real etcd."""

from __future__ import annotations

import json
import time

from controller import keys
from controller.membership import MembershipView, Registration
from controller.store import Store
from tests.conftest import EtcdServer, proc_state, until_stopped


def test_join_update_leave(store: Store) -> None:
    seen: list[tuple[str, str, str]] = []
    view = MembershipView(
        store,
        "job-a",
        on_join=lambda g, w, i: seen.append(("join", g, w)),
        on_update=lambda g, w, i: seen.append(("update", g, w)),
        on_leave=lambda g, w, i: seen.append(("leave", g, w)),
    )
    reg = Registration(store, "job-a", "rollout", "0", ttl=2, version=0)
    assert view.wait_for(lambda m: ("rollout", "0") in m, 10)
    reg.update(status="ready", version=3)
    assert view.wait_for(lambda m: m.get(("rollout", "0"), {}).get("version") == 3, 10)
    assert view.group("rollout")["0"]["status"] == "ready"
    reg.close()
    assert view.wait_for(lambda m: not m, 10)
    assert seen[0] == ("join", "rollout", "0") and seen[-1] == ("leave", "rollout", "0")
    assert ("update", "rollout", "0") in seen
    view.close()


def test_dead_worker_leaves_on_lease_expiry(store: Store) -> None:
    reg = Registration(store, "job-b", "trainer", "1", ttl=2)
    view = MembershipView(store, "job-b")
    assert ("trainer", "1") in view.members  # present in the initial listing
    # simulate a crash: the worker's threads stop, nothing revokes the lease
    reg._closed.set()
    assert reg._lease is not None
    reg._lease.stop()
    t0 = time.monotonic()
    assert view.wait_for(lambda m: ("trainer", "1") not in m, 2 + 1 + 1)
    assert time.monotonic() - t0 <= 3.5
    view.close()


def test_worker_reregisters_after_etcd_loses_its_lease(etcd: EtcdServer) -> None:
    """etcd down longer than the TTL: the lease is gone when it is back; the worker registers anew."""
    store = etcd.store(timeout=0.5, retry_window=1.0)
    reg = Registration(store, "job-c", "rollout", "0", ttl=2, version=1)
    first_lease = reg.lease_id
    etcd.stop()
    time.sleep(3)  # past the TTL; etcd expires the lease when it restarts
    etcd.start()
    other = etcd.store()
    deadline = time.monotonic() + 20
    while True:
        kv = other.get(keys.member("job-c", "rollout", "0"))
        if kv is not None and kv.lease != first_lease and other.lease_refresh(kv.lease) > 0:
            break
        assert time.monotonic() < deadline, "worker did not re-register after the etcd outage"
        time.sleep(0.2)
    reg.close()


def test_update_never_waits_for_etcd_and_the_newest_value_lands_when_it_is_back(etcd: EtcdServer) -> None:
    """A worker's step calls update(): with etcd frozen (SIGSTOP) it used to block for the store's
    whole retry window (30 s in workers) inside train_step / generate_shard."""
    import os
    import signal

    store = etcd.store(timeout=2.0, retry_window=30.0)  # what workers use
    reg = Registration(store, "job-d", "trainer", "0", ttl=5, step=0)
    assert etcd.proc is not None
    os.kill(etcd.proc.pid, signal.SIGSTOP)
    try:
        until_stopped(etcd.proc.pid)
        t0 = time.monotonic()
        for step in range(1, 51):
            reg.update(status="busy", step=step)
        took = time.monotonic() - t0
        frozen = proc_state(etcd.proc.pid)
        assert not reg.flush(timeout=0.5), f"written while etcd was stopped ({frozen})"
    finally:
        os.kill(etcd.proc.pid, signal.SIGCONT)
    assert took < 1.0, f"50 updates took {took:.1f}s with etcd frozen"  # a hang guard, not a benchmark
    assert reg.flush(timeout=30)
    kv = etcd.store().get(keys.member("job-d", "trainer", "0"))
    assert kv is not None and json.loads(kv.value)["step"] == 50  # coalesced: the newest value won
    reg.close()


def test_a_replaced_worker_that_comes_back_writes_nothing_and_is_told(store: Store) -> None:
    """Issue 16: a worker stopped past its lease, replaced, then resumed (SIGCONT) must not
    overwrite its replacement's record: its writes are compare-and-swaps on what it last wrote."""
    told: list[dict[str, object]] = []
    old = Registration(store, "job-e", "trainer", "1", ttl=2, step=3, on_superseded=told.append)
    assert old.flush(5)
    new = Registration(store, "job-e", "trainer", "1", ttl=2, step=3)  # the replacement: takes the key
    assert new.incarnation != old.incarnation
    old.update(status="busy", step=4)  # the old one wakes up and reports
    deadline = time.monotonic() + 10
    while not told:
        assert time.monotonic() < deadline, "the old registration never found itself replaced"
        time.sleep(0.05)
    assert told[0]["incarnation"] == new.incarnation and old.superseded == told[0]
    assert not old.flush(0.5)  # its update never lands
    kv = store.get(keys.member("job-e", "trainer", "1"))
    assert kv is not None
    held = json.loads(kv.value)
    assert held["incarnation"] == new.incarnation and "busy" not in held.values() and held["step"] == 3
    new.update(status="busy", step=4)  # the holder goes on writing
    assert new.flush(5)
    kv = store.get(keys.member("job-e", "trainer", "1"))
    assert kv is not None and json.loads(kv.value)["status"] == "busy"
    old.close()  # the old one's lease goes; the key stays, on the holder's lease
    time.sleep(0.3)
    kv = store.get(keys.member("job-e", "trainer", "1"))
    assert kv is not None and json.loads(kv.value)["incarnation"] == new.incarnation
    new.close()


def test_a_write_whose_answer_was_lost_is_swapped_from_the_key_as_it_stands(store: Store) -> None:
    """The registration's own write applied but its answer lost (a deadline): the compare fails on
    a revision it does not know, the key still holds this incarnation, the write goes on from it."""
    told: list[dict[str, object]] = []
    reg = Registration(store, "job-f", "rollout", "0", ttl=2, version=0, on_superseded=told.append)
    assert reg.flush(5)
    store.put(reg.key, json.dumps({**reg.info, "version": 1}), lease=reg.lease_id)  # "our" write, unseen
    reg.update(version=2)
    assert reg.flush(5) and not told
    kv = store.get(reg.key)
    assert kv is not None and json.loads(kv.value)["version"] == 2
    reg.close()


_WORKER = """
import sys, time
from controller.membership import Registration
from controller.store import Store
from resilient_rl.workers.fencing import exit_superseded
reg = Registration(Store(sys.argv[1]), "job-g", "trainer", "1", ttl=2, step=0, on_superseded=exit_superseded)
assert reg.flush(10)
print("registered", flush=True)
step = 0
while True:  # a rank reporting progress, as train_step does
    step += 1
    reg.update(status="busy", step=step)
    time.sleep(0.1)
"""


def test_a_worker_stopped_past_its_lease_and_replaced_exits_when_it_resumes(etcd: EtcdServer) -> None:
    """The real process: SIGSTOP it past its TTL, register its replacement, SIGCONT it: its first
    write finds the other incarnation, it exits with EXIT_SUPERSEDED, the key is the newcomer's."""
    import os
    import signal
    import subprocess
    import sys

    from resilient_rl.workers.fencing import EXIT_SUPERSEDED
    from tests.conftest import REPO

    proc = subprocess.Popen([sys.executable, "-c", _WORKER, etcd.endpoint], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "registered"
        store = etcd.store()
        key = keys.member("job-g", "trainer", "1")
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while store.get(key) is not None:  # its lease expires
            assert time.monotonic() < deadline, "the stopped worker's key outlived its lease"
            time.sleep(0.1)
        new = Registration(store, "job-g", "trainer", "1", ttl=2, step=0)
        assert new.flush(5)
        os.kill(proc.pid, signal.SIGCONT)
        rc = proc.wait(timeout=15)
        assert rc == EXIT_SUPERSEDED, (rc, proc.stderr.read() if proc.stderr else "")
        kv = store.get(key)
        assert kv is not None and json.loads(kv.value)["incarnation"] == new.incarnation
        assert json.loads(kv.value)["pid"] == os.getpid()
        new.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_view_decodes_only_what_is_read(store: Store) -> None:
    """Lazy decoding: updates with no callback set are stored raw; a group is decoded when read,
    once per revision, and handed out as copies; a value that is not JSON reads as {}."""
    for w in range(20):
        store.put(keys.member("job-l", "rollout", str(w)), json.dumps({"status": "ready", "n": 0}))
    store.put(keys.member("job-l", "trainer", "0"), json.dumps({"status": "ready"}))
    view = MembershipView(store, "job-l")
    assert len(view) == 21 and not view._decoded  # the initial listing: nothing decoded yet
    for n in range(1, 6):
        for w in range(20):
            store.put(keys.member("job-l", "rollout", str(w)), json.dumps({"status": "busy", "n": n}))
    store.put(keys.member("job-l", "rollout", "x"), b"not json")
    deadline = time.monotonic() + 10
    while ("rollout", "x") not in view._raw:  # the last put
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not view._decoded  # 100 updates, no callback, no reader: nothing decoded
    assert view.group("trainer") == {"0": {"status": "ready"}}
    assert set(view._decoded) == {("trainer", "0")}  # only the group read
    rollout = view.group("rollout")
    assert rollout["7"] == {"status": "busy", "n": 5} and rollout["x"] == {}  # not JSON: empty, not a crash
    rollout["7"]["n"] = -1  # a copy: the view's value is not changed through it
    assert view.group("rollout")["7"]["n"] == 5
    left: list[dict[str, object]] = []
    view._cb["leave"] = lambda g, w, i: left.append(i)
    store.delete(keys.member("job-l", "rollout", "3"))
    assert view.wait_for(lambda m: ("rollout", "3") not in m, 10)
    assert left == [{"status": "busy", "n": 5}]  # a leave callback gets the last value, decoded
    view.close()


def test_a_noted_status_is_written_at_the_next_period_or_with_the_next_update(store: Store) -> None:
    """A rollout worker notes `loading` around a weight load: a short load costs no put (the
    `ready` after it carries both); a long one shows within the registration's period."""
    reg = Registration(store, "job-n", "rollout", "0", ttl=3, status="ready")  # period 1 s
    assert reg.flush(5)
    key = keys.member("job-n", "rollout", "0")
    before = store.get(key)
    assert before is not None
    reg.note(status="loading")
    reg.update(status="ready", version=1)
    assert reg.flush(5)
    after = store.get(key)
    assert after is not None and json.loads(after.value)["version"] == 1
    assert after.version == before.version + 1  # one write for both
    reg.note(status="loading")  # nothing wakes the writer: its period does
    deadline = time.monotonic() + 3
    while json.loads(store.get(key).value)["status"] != "loading":  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "a noted status was never written"
        time.sleep(0.05)
    reg.close()
