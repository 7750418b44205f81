"""Node-level membership: one lease per node, held by a node agent (``fault.membership: node``).

With per-worker membership (:class:`~controller.membership.Registration`, the default) every
worker holds a lease of its own and keeps it alive, and writes its member key whenever its
status changes: keep-alives and puts grow with the workers. With ``fault.membership: node``
the workers of a node hand their member values to one **node agent** process instead:

* The agent holds **one lease** for the node and keeps it alive on one stream; every member
  key of the node hangs on it. It is a process of its own, not the first worker, whose death
  would take every key of the node with it.
* **Progress is batched**: values that change while a write is in flight, or within
  ``batch_s`` of the last one, go together in one transaction per node (a compare-and-swap
  per key, as :func:`~controller.membership.swap` does for one); a lone change is written at
  once.
* **Per-worker liveness** comes from the worker's connection: a worker pings every
  ``min(1, ttl / 3)`` s. A worker silent for ``ttl`` seconds (SIGSTOPped: Ray still sees it
  ALIVE) has its key deleted, as its own lease would have expired; if it speaks again and
  nobody took its place, its key is written again (as a worker with its own lease registers
  again). A worker whose connection ends without a goodbye (killed) has its key deleted at
  once. A deletion compares the key's revision: a replacement's key is never touched.
* The agent's death (or its node's) takes every key of the node with the lease, within
  ``ttl``. Workers whose agent went start another and register again.

The agent listens on a Unix socket named after the etcd endpoints and the TTL
(:func:`agent_path`, under ``$RRL_AGENT_DIR`` or the temp folder), so the jobs of a node that
share them share an agent. A worker that finds no agent starts one (``python -m
controller.nodeagent``, in a session of its own so that it outlives the worker); a lock file
keeps it to one. An agent with no worker left for ``idle_s`` (60 s) revokes its lease and
exits. Protocol: JSON lines; a worker sends ``hello`` (its key and incarnation), then ``put``
(a value and its generation; ``take`` on its first write), ``ping`` and ``bye``; the agent
answers ``written`` (the newest generation in etcd, and its lease), ``superseded`` (the value
of the incarnation that took the key) and ``left``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .etcd_types import EtcdError, EtcdUnavailable
from .membership import Member, Registration, swap
from .store import Compare, Delete, Put, Store

log = logging.getLogger(__name__)

ENV_DIR = "RRL_AGENT_DIR"
IDLE_S = 60.0
BATCH_S = 1.0  # at most one write transaction per node per second (a lone change goes at once)
_TXN_KEYS = 100  # keys per batched transaction (etcd's --max-txn-ops is 128 by default)


def agent_path(endpoints: Sequence[str], ttl: int, tls: bool = False) -> Path:
    """The socket of the node agent for these etcd endpoints and lease TTL."""
    root = Path(os.environ.get(ENV_DIR) or Path(tempfile.gettempdir()) / "rrl-agents")
    tag = hashlib.sha256(f"{','.join(sorted(endpoints))}|{ttl}|{tls}".encode()).hexdigest()[:12]
    return root / f"agent-{tag}.sock"


def _send_line(sock: socket.socket, msg: dict[str, Any]) -> None:
    """One protocol message: a JSON object on a line of its own."""
    sock.sendall((json.dumps(msg) + "\n").encode())


# -- the agent ------------------------------------------------------------------------------


@dataclass
class _Member:
    """One worker's key as the agent keeps it (one per connection)."""

    conn: socket.socket
    key: str = ""
    incarnation: str = ""
    value: str | None = None
    gen: int = 0  # the newest generation the worker sent
    written: int = 0  # the newest generation in etcd (on the current lease)
    take: bool = False  # the next write takes the key (the incarnation's first)
    mod: int = 0  # the key's mod revision as the agent last wrote it (0: not known)
    heard: float = field(default_factory=time.monotonic)
    dropped: bool = False  # deleted for silence; written again when the worker speaks
    superseded: bool = False
    leaving: bool = False  # bye or connection ended: delete the key (if ours), then forget
    said_bye: bool = False
    send_lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, msg: dict[str, Any]) -> None:
        with self.send_lock, contextlib.suppress(OSError):
            _send_line(self.conn, msg)


class NodeAgent:
    """The agent's state and threads (see module doc); ``serve()`` runs until idle or stopped."""

    def __init__(self, store: Store, ttl: int, path: Path, *, idle_s: float = IDLE_S, batch_s: float = BATCH_S) -> None:
        self.store, self.ttl, self.path = store, ttl, path
        self.idle_s, self.batch_s = idle_s, batch_s
        self._lock = threading.Lock()
        self._members: list[_Member] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.lease: Any = None  # KeptLease, once granted
        self.txns = 0  # batched write transactions sent (for tests and the bench)

    def serve(self, listener: socket.socket) -> None:
        listener.settimeout(0.5)
        writer = threading.Thread(target=self._writer, name="agent-writer", daemon=True)
        writer.start()
        idle_since = time.monotonic()
        try:
            while not self._stop.is_set():
                with self._lock:
                    busy = bool(self._members)
                if busy:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > self.idle_s:
                    log.info("node agent: no worker for %.0f s; leaving", self.idle_s)
                    break
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                conn.settimeout(None)
                m = _Member(conn)
                with self._lock:
                    self._members.append(m)
                threading.Thread(target=self._reader, args=(m,), name="agent-reader", daemon=True).start()
        finally:
            self._stop.set()
            self._wake.set()
            writer.join(timeout=10)
            with contextlib.suppress(OSError):
                self.path.unlink()
            listener.close()
            if self.lease is not None:
                with contextlib.suppress(Exception):
                    self.lease.revoke()

    def stop(self) -> None:
        self._stop.set()

    def _reader(self, m: _Member) -> None:
        try:
            with m.conn.makefile("rb") as lines:
                for line in lines:
                    try:
                        msg = json.loads(line)
                        if self._on_message(m, msg):
                            return
                    except (ValueError, KeyError, TypeError, AttributeError) as e:  # not our protocol: dropped
                        log.warning("node agent: a message that is not the protocol's (%s): %.200r", e, line)
        except OSError:
            pass
        finally:
            with self._lock:
                m.leaving = True  # killed, or the socket closed: the key goes at once
            self._wake.set()

    def _on_message(self, m: _Member, msg: dict[str, Any]) -> bool:
        """Apply one message; True after a goodbye."""
        op = msg.get("op")
        with self._lock:
            m.heard = time.monotonic()
            if m.dropped and m.value is not None and not m.superseded:
                m.dropped, m.written, m.mod = False, 0, 0  # back from a stop: written again if nobody took it
            if op == "hello":
                m.key, m.incarnation = str(msg["key"]), str(msg["incarnation"])
            elif op == "put":
                m.value, m.gen = str(msg["value"]), int(msg["gen"])
                m.take = m.take or bool(msg.get("take"))
            elif op == "bye":
                m.leaving = m.said_bye = True
        self._wake.set()
        return op == "bye"

    # -- the writer thread: lease, deletions, batched writes --------------------------------

    def _writer(self) -> None:
        last_write = 0.0
        while not self._stop.is_set():
            self._wake.wait(0.1)
            self._wake.clear()
            try:
                self._keep_lease()
                self._drop_silent()
                self._leave()
                now = time.monotonic()  # a change within batch_s of a write waits for the next tick
                if now - last_write >= self.batch_s and self._write_dirty():
                    last_write = now
            except EtcdError as e:
                log.info("node agent: etcd: %s; trying again", e)
                self._stop.wait(0.5)
        with self._lock:
            members = list(self._members)
        for m in members:
            with contextlib.suppress(OSError):
                m.conn.shutdown(socket.SHUT_RDWR)

    def _keep_lease(self) -> None:
        """A lease while the node has workers (a new one once it is lost: every key is written again)."""
        if self.lease is not None and not self.lease.lost:
            return
        if self.lease is not None:
            self.lease.stop()
            log.warning("node agent: lease %x lost; every key is written again on a new one", self.lease.id)
        self.lease = None
        with self._lock:
            if not self._members:
                return
        self.lease = self.store.keep_lease(self.ttl, on_lost=self._wake.set)
        with self._lock:
            for m in self._members:
                m.written, m.mod = 0, 0  # the keys went with the old lease: not taken, written back
        log.info("node agent: lease %x (ttl %d s)", self.lease.id, self.ttl)

    def _drop_silent(self) -> None:
        now = time.monotonic()
        with self._lock:
            silent = [m for m in self._members if not (m.dropped or m.leaving) and m.key and now - m.heard > self.ttl]
        for m in silent:
            log.warning("node agent: %s silent for %.1f s: its key goes", m.key, now - m.heard)
            self._delete(m)
            with self._lock:
                m.dropped = True

    def _leave(self) -> None:
        with self._lock:
            leaving = [m for m in self._members if m.leaving]
        for m in leaving:
            if not (m.dropped or m.superseded):
                self._delete(m)
            if m.said_bye:
                m.send({"left": True})
            with contextlib.suppress(OSError):
                m.conn.close()
            with self._lock:
                self._members.remove(m)

    def _delete(self, m: _Member) -> None:
        if m.key and m.mod:
            self.store.txn([Compare(m.key, "mod", "=", m.mod)], [Delete(m.key)])

    def _dirty(self) -> list[_Member]:
        with self._lock:
            return [
                m
                for m in self._members
                if m.key and m.value is not None and m.gen != m.written
                and not (m.dropped or m.superseded or m.leaving)
            ]  # fmt: skip

    def _write_dirty(self) -> bool:
        """Write every changed value: those whose key the agent knows in one transaction per
        ``_TXN_KEYS``, each compared on its revision; the rest (and a batch that failed) one by one."""
        dirty = self._dirty()
        if not dirty or self.lease is None:
            return False
        lease = self.lease.id
        with self._lock:
            todo = [(m, str(m.value), m.gen, m.take, m.mod) for m in dirty]
        known = [t for t in todo if t[3] or t[4]]
        single = [t for t in todo if not (t[3] or t[4])]
        for i in range(0, len(known), _TXN_KEYS):
            chunk = known[i : i + _TXN_KEYS]
            compares = [Compare(m.key, "mod", "=", mod) for m, _, _, take, mod in chunk if not take]
            res = self.store.txn(compares, [Put(m.key, v, lease) for m, v, *_ in chunk])
            self.txns += 1
            if res.succeeded:
                for m, _, gen, _, _ in chunk:
                    self._written(m, res.revision, gen, lease)
            else:
                single.extend(chunk)
        for m, value, gen, take, known_mod in single:
            mod, held = swap(self.store, m.key, value, lease, None if take else known_mod, m.incarnation)
            if held is None:
                self._written(m, mod, gen, lease)
                continue
            with self._lock:
                m.superseded = True
            log.warning("node agent: %s is held by incarnation %s: pid %s writes no more",
                        m.key, held.get("incarnation"), held.get("pid"))  # fmt: skip
            m.send({"superseded": held})
        return True

    def _written(self, m: _Member, mod: int, gen: int, lease: int) -> None:
        with self._lock:
            m.mod, m.take = mod, False
            if self.lease is not None and self.lease.id == lease:
                m.written = max(m.written, gen)
        m.send({"written": gen, "lease": lease})


def run_agent(endpoints: str, ttl: int, path: Path, idle_s: float = IDLE_S) -> int:
    """Be the node's agent for ``path`` unless another one is (its lock is held): 0 either way."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = open(str(path) + ".lock", "a")  # noqa: SIM115 - held for the process's life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return 0  # another agent serves this node
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a dead agent's socket
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(256)
    store = Store(endpoints, timeout=2.0, retry_window=2.0)
    log.info("node agent pid %d on %s (etcd %s, ttl %d s)", os.getpid(), path, endpoints, ttl)
    try:
        NodeAgent(store, ttl, path, idle_s=idle_s).serve(listener)
    finally:
        store.close()
    return 0


# -- the worker's side ----------------------------------------------------------------------


class NodeRegistration(Member):
    """A worker's membership key kept by its node's agent: a
    :class:`~controller.membership.Member` as :class:`~controller.membership.Registration` is,
    with node-level leases (see module doc)."""

    def __init__(
        self,
        store: Store,
        job: str,
        group: str,
        worker: str,
        *,
        ttl: int = 5,
        on_superseded: Callable[[dict[str, Any]], None] | None = None,
        **fields: Any,
    ) -> None:
        super().__init__(job, group, worker, ttl=ttl, on_superseded=on_superseded, fields=fields)
        eps = [("https://" if store.tls else "") + e for e in store.endpoints]
        self._endpoints = ",".join(eps)
        self.path = agent_path(store.endpoints, ttl, store.tls)
        self._sent = 0  # the newest generation sent to the agent
        self._took = False  # the first write (which takes the key) was sent
        self._lease = 0
        self._sock: socket.socket | None = None
        self._left = threading.Event()
        self._connect(deadline=time.monotonic() + 30)
        self._start(worker)
        if not self.flush(timeout=store.retry_window):
            self.close()
            raise EtcdUnavailable(f"member {self.key}: the node agent ({self.path}) did not write it")

    @property
    def lease_id(self) -> int:
        return self._lease

    def close(self) -> None:
        """Leave: the agent deletes the key (if still this incarnation's) before answering."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake.set()
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                _send_line(sock, {"op": "bye"})
                self._left.wait(5.0)
            with contextlib.suppress(OSError):
                sock.close()

    # -- connection -----------------------------------------------------------------------

    def _connect(self, deadline: float) -> None:
        """Connect to the node's agent (starting one if there is none) and register."""
        started = 0.0
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(str(self.path))
                break
            except OSError:
                sock.close()
            if time.monotonic() > deadline:
                raise EtcdUnavailable(f"member {self.key}: no node agent answers on {self.path}")
            if time.monotonic() - started > 2.0:
                self._start_agent()
                started = time.monotonic()
            time.sleep(0.05)
        with self._lock:
            value, gen, take = json.dumps(self.info), self._gen, not self._took
            self._took, self._sent = True, gen
        _send_line(sock, {"op": "hello", "key": self.key, "incarnation": self.incarnation})
        _send_line(sock, {"op": "put", "value": value, "gen": gen, "take": take})
        self._sock = sock
        threading.Thread(target=self._reader, args=(sock,), name="member-agent", daemon=True).start()

    def _start_agent(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        argv = [sys.executable, "-m", "controller.nodeagent", "--etcd", self._endpoints, "--ttl", str(self.ttl),
                "--socket", str(self.path)]  # fmt: skip
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        with open(self.path.with_suffix(".log"), "ab") as out:
            subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True, close_fds=True)  # fmt: skip

    def _reader(self, sock: socket.socket) -> None:
        try:
            with sock.makefile("rb") as lines:
                for line in lines:
                    msg = json.loads(line)
                    if "written" in msg:
                        with self._lock:
                            self._written = max(self._written, int(msg["written"]))
                            self._lease = int(msg.get("lease", self._lease))
                    elif "superseded" in msg:
                        self._superseded_by(msg["superseded"] if isinstance(msg["superseded"], dict) else {})
                    elif msg.get("left"):
                        self._left.set()
        except (OSError, ValueError):
            pass
        with self._lock:
            if self._sock is sock:
                self._sock = None  # the agent went: the writer connects again
        self._wake.set()

    def _run(self) -> None:
        period = min(1.0, self.ttl / 3.0)
        while not self._closed.is_set():
            self._wake.wait(period)
            self._wake.clear()
            if self._closed.is_set() or self.superseded is not None:
                return
            try:
                if self._sock is None:
                    with self._lock:
                        self._written = 0  # a new agent (or lease): written again
                    self._connect(deadline=time.monotonic() + 30)
                    continue
                with self._lock:
                    value, gen = json.dumps(self.info), self._gen
                    fresh = gen != self._sent
                    self._sent = gen
                sock = self._sock
                if sock is not None:
                    _send_line(sock, {"op": "put", "value": value, "gen": gen} if fresh else {"op": "ping"})
            except (OSError, EtcdError) as e:
                log.info("member %s: node agent unreachable: %s", self.key, e)
                with self._lock:
                    self._sock = None


def register(store: Store, job: str, group: str, worker: str, *, node: bool = False, **kw: Any) -> Member:
    """A worker's membership: on a lease of its own (:class:`Registration`), or with ``node``
    kept by its node's agent on the node's lease (:class:`NodeRegistration`, the same interface)."""
    if node:
        return NodeRegistration(store, job, group, worker, **kw)
    return Registration(store, job, group, worker, **kw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m controller.nodeagent", description=__doc__.split("\n\n")[0])
    p.add_argument("--etcd", required=True, help="etcd endpoints, host:port[,host:port...]")
    p.add_argument("--ttl", type=int, required=True, help="the node lease's TTL (s): a worker silent this long leaves")
    p.add_argument("--socket", required=True, type=Path, help="the Unix socket to serve")
    p.add_argument("--idle-s", type=float, default=IDLE_S, help="exit after this long with no worker (default 60)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    return run_agent(a.etcd, a.ttl, a.socket, a.idle_s)


if __name__ == "__main__":
    sys.exit(main())
