"""Leader election and fencing with real controller processes and a real etcd."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from queue import Empty, Queue

import httpx
import pytest

from controller import keys
from controller.election import Election, NotLeader, fenced_txn
from controller.http.api import create_app
from controller.http.server import HttpServer
from controller.liveness import PATH, LeaderWatch, _refused
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


def test_a_killed_leader_is_replaced_through_its_closed_connection_not_its_lease(
    etcd: EtcdServer, procs: list[Proc]
) -> None:
    """With a 30 s lease, a SIGKILLed leader is replaced long before its lease could expire: the
    standby's stream to it ends without a goodbye and the standby revokes the lease. A stopped
    leader (SIGSTOP) proves nothing and keeps leading; its key is the same after SIGCONT."""
    ttl = 30
    store = etcd.store()

    def ctl(cid: str) -> Proc:
        return Proc([sys.executable, "-m", "resilient_rl.cli", "controller", "--etcd", etcd.endpoint,
                     "--id", cid, "--ttl", str(ttl)])  # fmt: skip

    a = ctl("ctl-a")
    procs.append(a)
    _wait_leader(store, lambda lid: lid == "ctl-a", 30)
    b = ctl("ctl-b")
    procs.append(b)
    deadline = time.monotonic() + 30
    while store.get(keys.controller("ctl-b")) is None:
        assert time.monotonic() < deadline, "standby did not register"
        time.sleep(0.1)
    time.sleep(2.0)  # the standby's stream to the leader is open (it connects within a poll)
    leader_kv = store.get(keys.leader())
    assert leader_kv is not None

    os.killpg(a.p.pid, signal.SIGSTOP)  # silence: not a proof of death
    time.sleep(6.0)  # > the stream's read timeout (3 beats + 2 s)
    still = store.get(keys.leader())
    assert still is not None and still.create_revision == leader_kv.create_revision, "a stopped leader was deposed"
    os.killpg(a.p.pid, signal.SIGCONT)
    time.sleep(2.0)  # the standby holds a stream again

    killed = time.time()
    os.killpg(a.p.pid, signal.SIGKILL)
    a.p.wait()
    new = _wait_leader(store, lambda lid: lid == "ctl-b", ttl - 5)  # the lease alone could not have gone yet
    assert new == "ctl-b"
    took = time.time() - killed
    assert took < ttl - 5, f"took {took:.1f}s: the old lease ran out instead"


def test_the_leader_stream_ends_with_bye_and_a_watch_revokes_only_the_lease_of_the_token_it_followed(
    store: Store,
) -> None:
    x = Election(store, "x", ttl=5)
    assert x.try_acquire()
    app = create_app(store, token=None, leadership=lambda: x.token if x.is_leader else 0)
    http = HttpServer(app).start()
    try:
        with httpx.Client(timeout=5) as client:
            assert client.get(http.url + PATH, params={"token": x.token + 1}).status_code == 409
            with client.stream("GET", http.url + PATH, params={"token": x.token}) as resp:
                lines = resp.iter_lines()
                assert next(lines) == "alive"
                old = x.token
                x.resign()  # a clean end: the stream says so
                assert [ln for ln in lines if ln][-1] == "bye"
    finally:
        http.stop()

    y = Election(store, "y", ttl=5)
    assert y.try_acquire()
    kv = store.get(keys.leader())
    assert kv is not None
    watch = LeaderWatch(store, "z")
    watch._vacate("x", old, kv.lease, "connection closed", threading.Event())  # a stale token: y's lease stays
    assert store.get(keys.leader()) == kv and watch.vacancy is None
    watch._vacate("y", kv.create_revision, kv.lease, "connection closed", threading.Event())
    assert store.get(keys.leader()) is None and watch.vacancy is not None and watch.vacancy.leader == "y"

    with socket.socket() as s:  # a port nobody listens on refuses; that is what counts as a refusal
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(httpx.ConnectError) as err:
        httpx.get(f"http://127.0.0.1:{port}{PATH}", timeout=2)
    assert _refused(err.value)
    assert not _refused(httpx.ConnectError("[Errno 113] No route to host"))
