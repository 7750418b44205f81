"""Node-level membership (``fault.membership: node``): a real node agent process on a real etcd,
workers in this process and in subprocesses that the tests stop and kill."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from controller import keys
from controller.membership import Registration
from controller.nodeagent import NodeRegistration, agent_path, register
from controller.store import Store
from tests.conftest import EtcdServer

REPO = Path(__file__).resolve().parents[2]
TTL = 3


def _agent_pid(store: Store, ttl: int = TTL) -> int:
    """The pid at the other end of the agent's socket (SO_PEERCRED)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(agent_path(store.endpoints, ttl, store.tls)))
        pid, _, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return int(pid)


@pytest.fixture
def agents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Agents go under this test's folder; the test lists the ones it saw, killed at the end
    (an agent otherwise leaves by itself a minute after its last worker)."""
    monkeypatch.setenv("RRL_AGENT_DIR", str(tmp_path / "agents"))
    seen: list[int] = []
    yield seen
    for pid in seen:
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _until(what: str, check: Callable[[], bool], within: float) -> float:
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < within, f"{what}: not within {within} s"
        time.sleep(0.05)
    return time.monotonic() - t0


def _value(store: Store, key: str) -> dict | None:
    kv = store.get(key)
    return None if kv is None else json.loads(kv.value)


def test_the_workers_of_a_node_share_one_lease_and_a_burst_of_changes_is_one_transaction(
    store: Store, agents: list[int]
) -> None:
    a = register(store, "job-n", "rollout", "0", node=True, ttl=TTL, status="ready")
    b = register(store, "job-n", "trainer", "0", node=True, ttl=TTL, status="ready")
    assert isinstance(a, NodeRegistration) and isinstance(b, NodeRegistration)
    agents.append(_agent_pid(store))
    ka, kb = store.get(a.key), store.get(b.key)
    assert ka is not None and kb is not None
    assert ka.lease == kb.lease == a.lease_id != 0  # one lease for the node
    for step in range(1, 21):  # a burst: written together, the newest value wins
        a.update(status="busy", step=step)
        b.update(status="busy", step=step)
    assert a.flush(5) and b.flush(5)
    ka, kb = store.get(a.key), store.get(b.key)
    assert ka is not None and kb is not None
    assert json.loads(ka.value)["step"] == json.loads(kb.value)["step"] == 20
    assert ka.mod_revision == kb.mod_revision  # the same transaction
    assert ka.version < 20  # coalesced: far fewer writes than changes
    a.close()  # leaves at once, the other stays
    assert store.get(a.key) is None and store.get(b.key) is not None
    b.close()
    assert store.get(b.key) is None


_WORKER = """
import sys, time
sys.path.insert(0, {repo!r})
from controller.nodeagent import register
from controller.store import Store
reg = register(Store({endpoint!r}), "job-w", "rollout", {worker!r}, node=True, ttl={ttl}, status="ready")
print("registered", flush=True)
step = 0
while True:
    step += 1
    reg.update(step=step)
    time.sleep(0.2)
"""


def _worker(etcd: EtcdServer, worker: str) -> subprocess.Popen[str]:
    code = _WORKER.format(repo=str(REPO), endpoint=etcd.endpoint, worker=worker, ttl=TTL)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    assert p.stdout is not None and p.stdout.readline().strip() == "registered"
    return p


def test_a_stopped_worker_leaves_after_the_ttl_and_comes_back_a_killed_one_leaves_at_once(
    etcd: EtcdServer, store: Store, agents: list[int]
) -> None:
    stopped, killed = _worker(etcd, "0"), _worker(etcd, "1")
    try:
        agents.append(_agent_pid(store))
        k0, k1 = keys.member("job-w", "rollout", "0"), keys.member("job-w", "rollout", "1")
        incarnation = (_value(store, k0) or {})["incarnation"]
        os.kill(stopped.pid, signal.SIGSTOP)  # Ray would still call it ALIVE
        took = _until("a stopped worker's key goes", lambda: store.get(k0) is None, TTL + 3)
        assert took <= TTL + 1.5, took  # detection within TTL + 1 s (a 0.1 s tick, a <=1 s ping period)
        assert store.get(k1) is not None  # its neighbour stays
        os.kill(stopped.pid, signal.SIGCONT)  # nobody took its place: it is back, the same incarnation
        _until("a resumed worker's key is back", lambda: (_value(store, k0) or {}).get("incarnation") == incarnation, 5)
        killed.kill()
        took = _until("a killed worker's key goes", lambda: store.get(k1) is None, 3)
        assert took < 1.5, took  # its connection ended: no TTL to wait
        assert store.get(k0) is not None
    finally:
        for p in (stopped, killed):
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait()


def test_a_killed_agent_is_replaced_and_a_stopped_one_loses_the_nodes_keys_within_the_ttl(
    etcd: EtcdServer, store: Store, agents: list[int]
) -> None:
    w = _worker(etcd, "0")
    try:
        key = keys.member("job-w", "rollout", "0")
        first = _agent_pid(store)
        agents.append(first)
        lease = store.get(key).lease  # type: ignore[union-attr]
        os.kill(first, signal.SIGSTOP)  # the whole node silent: the lease expires, every key goes
        took = _until("the node's keys go with its lease", lambda: store.get(key) is None, TTL + 3)
        assert took <= TTL + 1.5, took
        os.kill(first, signal.SIGKILL)  # the worker starts another agent and registers again
        kv = None

        def back() -> bool:
            nonlocal kv
            kv = store.get(key)
            return kv is not None

        _until("the worker registered again through a new agent", back, 15)
        second = _agent_pid(store)
        agents.append(second)
        assert second != first and kv is not None and kv.lease != lease
        assert json.loads(kv.value)["pid"] == w.pid
    finally:
        w.kill()
        w.wait()


def test_a_replaced_worker_is_told_and_its_agent_never_deletes_the_replacements_key(
    store: Store, agents: list[int]
) -> None:
    told: list[dict] = []
    old = register(store, "job-r", "trainer", "1", node=True, ttl=TTL, step=3, on_superseded=told.append)
    agents.append(_agent_pid(store))
    new = Registration(store, "job-r", "trainer", "1", ttl=TTL, step=3)  # takes the key
    old.update(status="busy", step=4)
    _until("the old registration is told", lambda: bool(told), 5)
    assert told[0]["incarnation"] == new.incarnation and not old.flush(0.3)
    old.close()  # its goodbye deletes nothing: the key is the replacement's
    held = _value(store, old.key)
    assert held is not None and held["incarnation"] == new.incarnation and held["step"] == 3
    new.close()


def test_the_node_keys_come_back_on_a_new_lease_after_etcd_was_down_past_the_ttl(
    etcd: EtcdServer, agents: list[int]
) -> None:
    store = etcd.store(timeout=1.0, retry_window=5.0)
    reg = register(store, "job-e", "rollout", "0", node=True, ttl=TTL, status="ready")
    agents.append(_agent_pid(store))
    lease = reg.lease_id
    etcd.stop()
    time.sleep(TTL + 1)
    etcd.start()
    other = etcd.store()

    def rewritten() -> bool:
        kv = other.get(reg.key)
        return kv is not None and kv.lease != lease

    _until("the key written again on a new lease", rewritten, 20)
    reg.update(status="busy")
    assert reg.flush(10) and (_value(other, reg.key) or {})["status"] == "busy"
    reg.close()


def test_garbage_on_the_agents_socket_is_dropped_and_the_agent_serves_on(store: Store, agents: list[int]) -> None:
    reg = register(store, "job-g", "rollout", "0", node=True, ttl=TTL, status="ready")
    pid = _agent_pid(store)
    agents.append(pid)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(agent_path(store.endpoints, TTL, store.tls)))
        s.sendall(b'not json\n{"op": "put"}\n[1, 2]\n{"op": "put", "value": 1, "gen": "x"}\n\xff\xfe\n')
    reg.update(status="busy", step=1)
    assert reg.flush(5) and (_value(store, reg.key) or {})["step"] == 1
    os.kill(pid, 0)  # still the same agent
    reg.close()
