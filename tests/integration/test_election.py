"""Leader election and fencing with real controller processes and a real etcd."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from queue import Empty, Queue

import pytest

from controller import keys
from controller.election import Election, NotLeader, fenced_txn
from controller.store import Put, Store
from tests.conftest import REPO, EtcdServer

TTL = 3


class Proc:
    """A child process whose JSON stdout lines are read into a queue."""

    def __init__(self, argv: list[str]) -> None:
        self.p = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO, start_new_session=True
        )
        self.lines: Queue[dict] = Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                pass

    def next(self, pred, timeout: float = 30):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.lines.get(timeout=0.2)
            except Empty:
                continue
            if pred(msg):
                return msg
        raise AssertionError("expected output did not come")

    def stop(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGCONT)
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()


@pytest.fixture
def procs():  # type: ignore[no-untyped-def]
    started: list[Proc] = []
    yield started
    for p in started:
        p.stop()


def _leader(store: Store) -> str | None:
    kv = store.get(keys.leader())
    return kv.value.decode() if kv else None


def _wait_leader(store: Store, pred, timeout: float) -> str:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lid = _leader(store)
        if pred(lid):
            return lid  # type: ignore[return-value]
        time.sleep(0.05)
    raise AssertionError(f"leader did not change as expected within {timeout}s (leader {_leader(store)})")


def _controller(etcd: EtcdServer, cid: str) -> Proc:
    return Proc([sys.executable, "-m", "resilient_rl.cli", "controller", "--etcd", etcd.endpoint,
                 "--id", cid, "--ttl", str(TTL)])  # fmt: skip


def test_two_controllers_one_leader_sigkill_takeover(etcd: EtcdServer, procs: list[Proc]) -> None:
    store = etcd.store()
    a, b = _controller(etcd, "ctl-a"), _controller(etcd, "ctl-b")
    procs += [a, b]
    first = _wait_leader(store, lambda lid: lid in ("ctl-a", "ctl-b"), 30)
    # both registered, exactly one leader
    deadline = time.monotonic() + 20
    while len(store.range(keys.controllers())[0]) < 2:
        assert time.monotonic() < deadline, "standby did not register"
        time.sleep(0.1)
    roles = {json.loads(kv.value)["id"]: json.loads(kv.value)["role"] for kv in store.range(keys.controllers())[0]}
    assert sorted(roles.values()) == ["leader", "standby"] and roles[first] == "leader"

    victim, other = (a, b) if first == "ctl-a" else (b, a)
    killed = time.monotonic()
    os.killpg(victim.p.pid, signal.SIGKILL)
    new = _wait_leader(store, lambda lid: lid not in (None, first), TTL + 1 + 5)
    took = time.monotonic() - killed
    assert new != first
    assert took <= TTL + 1, f"takeover took {took:.2f}s (TTL {TTL})"


def test_paused_leader_is_fenced_after_takeover(etcd: EtcdServer, procs: list[Proc]) -> None:
    store = etcd.store()
    cand = [sys.executable, "-m", "tests.helpers.candidate", etcd.endpoint]
    a = Proc([*cand, "cand-a", str(TTL)])
    procs.append(a)
    lead_a = a.next(lambda m: m["event"] == "leader")
    a.next(lambda m: m["event"] == "write" and m["ok"])  # writes while leader succeed
    b = Proc([*cand, "cand-b", str(TTL)])
    procs.append(b)

    os.killpg(a.p.pid, signal.SIGSTOP)  # pause the leader past its TTL
    paused = time.monotonic()
    lead_b = b.next(lambda m: m["event"] == "leader", timeout=TTL + 10)
    assert time.monotonic() - paused <= TTL + 1 + 1  # lease expiry + campaign
    assert lead_b["token"] > lead_a["token"]
    b.next(lambda m: m["event"] == "write" and m["ok"])
    probe_b = store.get("/rrl/v1/probe/cand-b")
    assert probe_b is not None

    # drain what A printed before the pause, then wake it up
    while not a.lines.empty():
        a.lines.get()
    before = store.get("/rrl/v1/probe/cand-a")
    os.killpg(a.p.pid, signal.SIGCONT)
    woke = a.next(lambda m: m["event"] == "write")
    assert woke["ok"] is False, "a stale leader's fenced write was accepted"
    assert woke["is_leader"] is False, "the old leader still believes it leads"
    after = store.get("/rrl/v1/probe/cand-a")
    assert after is not None and before is not None and after.mod_revision == before.mod_revision
    assert _leader(store) == "cand-b"


def test_election_in_process_resign_and_local_step_down(store: Store) -> None:
    a = Election(store, "x", ttl=2)
    b = Election(store, "y", ttl=2)
    assert a.try_acquire() and a.is_leader
    assert not b.try_acquire()
    assert a.leader() == "x"
    a.fenced_txn(success=[Put("/rrl/v1/probe", "a")])
    token = a.token
    a.resign()
    assert not a.is_leader
    with pytest.raises(NotLeader):
        a.fenced_txn(success=[Put("/rrl/v1/probe", "a2")])
    assert b.try_acquire()
    # the old token no longer fences anything in
    with pytest.raises(NotLeader):
        fenced_txn(store, token, success=[Put("/rrl/v1/probe", "stale")])
    assert store.get("/rrl/v1/probe").value == b"a"  # type: ignore[union-attr]
    # a leader whose lease stops being refreshed stops acting before the TTL runs out
    assert b.lease is not None
    b.lease.stop()
    deadline = time.monotonic() + 2
    while b.is_leader:
        assert time.monotonic() < deadline, "leader kept acting past its lease"
        time.sleep(0.05)
    b.resign()
